"""What the update and the configuration do that a copier relies on: every minibatch takes its AdamW
step (no signal still moves momentum and weight decay), sampling ignores the model's
generation_config and its log-probs are the trainer's, the CPU preset is per environment, and the
eval subset is stratified by task type."""

import math

import pytest
import torch

import envs
import train
from train import UsageError


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
        )
    )
    model.generation_config.pad_token_id = 0
    return model


def samples_of(advantages):
    return [
        {"traj": i, "step": 0, "prompt_ids": [3, 4, 5 + i], "response_ids": [6, 7], "advantage": a}
        for i, a in enumerate(advantages)
    ]


def test_a_minibatch_without_signal_still_takes_its_optimizer_step():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    samples = samples_of([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    plan = train.minibatch_plan(samples, 2, 4096, torch.Generator().manual_seed(0), skip_zero=True)
    assert (
        len(plan) == 3 and sum(not micros for micros, _ in plan) >= 1
    )  # a minibatch of zeros only
    totals = train.update_policy(model, optimizer, samples, plan)
    assert (
        optimizer.state[next(model.parameters())]["step"].item() == 3
    )  # one AdamW step per minibatch
    assert math.isfinite(totals["grad_norm"])
    # skipping a zero sample's forward and backward is exact: the same step as training on it
    a, b = tiny_llama(), tiny_llama()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    train.update_policy(a, opt_a, samples, [(train.micro_batches([0, 1, 2], samples, 4096), 6)])
    train.update_policy(b, opt_b, samples, [(train.micro_batches([0, 1], samples, 4096), 6)])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7)


def test_sampling_ignores_the_models_generation_config_and_reports_the_trainers_logprobs(
    tiny_model,
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = (
        AutoModelForCausalLM.from_pretrained(tiny_model),
        AutoTokenizer.from_pretrained(tiny_model),
    )
    gc = (
        model.generation_config
    )  # a generation_config that would change the distribution if it applied
    gc.top_k, gc.top_p, gc.min_p, gc.repetition_penalty, gc.no_repeat_ngram_size = (
        2,
        0.5,
        0.3,
        3.0,
        1,
    )
    prompt = tok("\n", add_special_tokens=False).input_ids
    gc.suppress_tokens = tok("<action>look</action>", add_special_tokens=False).input_ids[:2]
    torch.manual_seed(0)
    prompts = [prompt] * 16
    texts, responses, logprobs = train.generate(model, tok, prompts, 0.7, 12, batch_size=8)
    assert any(t.startswith("<action>") for t in texts), texts  # suppress_tokens did not apply
    assert model.generation_config is gc and gc.top_k == 2  # left as it was
    samples = [
        {"prompt_ids": p, "response_ids": r, "sampler_logprobs": lp}
        for p, r, lp in zip(prompts, responses, logprobs)
    ]
    batch = train.collate(samples, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        trainer = train.response_logprobs(model, batch, 0.7)
    gap = ((trainer - batch["sampler_logp"]).abs() * batch["sampled_mask"]).max().item()
    assert gap < 1e-3, gap  # fp32: the same distribution


def test_the_cpu_preset_is_per_environment(tmp_path):
    web, _ = train.parse_args(["--env", "webshop", "--run-dir", str(tmp_path / "w")], cuda=False)
    assert (web.preset, web.warmup_epochs, web.max_steps, web.graph_gamma, web.eval_splits) == (
        "cpu",
        0,
        15,
        0.2,
        "test",
    )
    alf, _ = train.parse_args(["--env", "alfworld", "--run-dir", str(tmp_path / "a")], cuda=False)
    assert (alf.warmup_epochs, alf.max_steps, alf.graph_gamma, alf.temperature) == (2, 9, 0.1, 1.0)
    assert (alf.invalid_penalty, web.invalid_penalty) == (0.0, 0.1)  # issue 37's fourteenth step
    assert (alf.warmup_floor, alf.warmup_max_epochs, web.warmup_floor) == (0.03, 6, 0.0)  # 15th
    assert (alf.warmup_floor_per_kind, web.warmup_floor_per_kind) == (True, False)  # 16th step
    assert (alf.bc_coef, web.bc_coef) == (0.0, 0.0)  # 17th step: the rise was the cloning's
    # issue 20: the eval that can tell: the training games, >= 32 episodes, before and after RL only
    assert alf.eval_splits == "train" and alf.eval_repeats * int(alf.num_games.split(",")[0]) >= 32
    assert alf.eval_every == alf.updates
    paper, _ = train.parse_args(
        ["--env", "alfworld", "--preset", "paper", "--run-dir", str(tmp_path / "p")], cuda=False
    )
    assert (paper.lr, paper.max_steps, paper.num_groups, paper.revisit_delay) == (1e-6, 50, 16, 10)
    with pytest.raises(UsageError, match="--warmup-epochs"):
        train.parse_args(
            ["--env", "webshop", "--warmup-epochs", "1", "--run-dir", str(tmp_path / "x")],
            cuda=False,
        )
    with pytest.raises(UsageError, match="--warmup-minibatch-size"):
        train.parse_args(
            ["--warmup-minibatch-size", "0", "--run-dir", str(tmp_path / "z")], cuda=False
        )
    with pytest.raises(UsageError, match="--warmup-floor reads the eval on the training games"):
        train.parse_args(
            ["--warmup-floor", "0.1", "--eval-every", "0", "--run-dir", str(tmp_path / "f")],
            cuda=False,
        )
    # the preset's floor is inert without the eval it reads; given explicitly, it is refused
    quiet, _ = train.parse_args(
        ["--env", "alfworld", "--eval-every", "0", "--run-dir", str(tmp_path / "q")], cuda=False
    )
    assert quiet.warmup_floor == 0.03 and quiet.warmup_floor_per_kind and quiet.eval_every == 0
    with pytest.raises(UsageError, match="--revisit-delay"):
        train.parse_args(["--revisit-delay", "0", "--run-dir", str(tmp_path / "y")], cuda=False)
    # refused before the model loads: given games have no warm-up split to generate into
    given = ["--data-dir", str(tmp_path), "--warmup-games", "2", "--run-dir", str(tmp_path / "g")]
    with pytest.raises(UsageError, match="--warmup-games 2 generates its games"):
        train.parse_args(["--env", "alfworld", *given], cuda=False)


def test_the_eval_subset_is_stratified_by_task_type_and_stable():
    tasks = [
        f"valid_seen/{t}-Obj-{i}/trial_0/game.tw-pddl"
        for t in ("look_at_obj_in_light", "pick_and_place_simple", "pick_clean_then_place_in_recep")
        for i in range(5)
    ]
    subset = envs.eval_subset(list(reversed(tasks)), 6)
    assert subset == envs.eval_subset(tasks, 6)
    assert sorted(envs.task_type_of(t) for t in subset) == [
        "clean",
        "clean",
        "look",
        "look",
        "pick",
        "pick",
    ]
    assert envs.eval_subset(tasks, 0) == tasks


def test_a_resumed_run_still_prints_before_and_after(tmp_path, capsys):
    import json
    from types import SimpleNamespace

    from train import RunLog

    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"update": 0, "eval/train/success_rate": 0.25, "eval/train/episodes": 32}) + "\n"
    )
    args = SimpleNamespace(
        run_dir=str(tmp_path),
        updates=8,
        track=False,
        eval_temperature=0.4,
        group_size=2,
        log_trajectories=0,
    )
    log = RunLog(args, resuming=True, start=6)
    metrics = {
        "update": 8,
        "success_rate": 0.5,
        "mean_score": 5.0,
        "valid_action_ratio": 0.9,
        "distinct_actions": 3,
        "kl": None,
        "revisits": 0,
        "rollout_s": 1.0,
        "adv_s": 0.0,
        "update_s": 1.0,
        "eval/train/success_rate": 0.5,
        "eval/train/episodes": 32,
    }
    log.write(metrics, [{"kind": "explore"}], [], [])
    out = capsys.readouterr().out + capsys.readouterr().err
    assert "train 0.25 [0.13, 0.42] (n=32) -> 0.50 [0.34, 0.66] (n=32)" in out, out


def test_summarize_counts_the_games_won_at_least_once():
    """A success rate of 0.5 over four episodes is one game won twice or two games won once: the
    games counts tell them apart, and a game played twice (exploration and revisit) counts once."""

    def ep(task, kind, success):
        return {"task": task, "task_type": kind, "success": success, "score": 0.0, "valid": [1]}

    one_game = [ep("a", "pick", True), ep("a", "pick", True), ep("b", "look", False)]
    one_game.append(ep("b", "look", False))
    two_games = [ep("a", "pick", True), ep("a", "pick", False), ep("b", "look", True)]
    two_games.append(ep("b", "look", False))
    m1, m2 = train.summarize(one_game, prefix="eval/train/"), train.summarize(two_games)
    assert m1["eval/train/success_rate"] == m2["success_rate"] == 0.5
    assert (m1["eval/train/games"], m1["eval/train/games_won"]) == (2, 1)
    assert (m2["games"], m2["games_won"]) == (2, 2)
    assert (m1["eval/train/games_won/pick"], m1["eval/train/games_won/look"]) == (1, 0)
    assert (m2["games_won/pick"], m2["games_won/look"]) == (1, 1)
    assert train.summarize([])["games"] == 0


def test_the_floor_per_kind_reads_each_task_type(tmp_path):
    """--warmup-floor reads the training games' success before RL; --warmup-floor-per-kind reads
    each task type's from the same eval (summarize's keys), so 0.38 overall with no look game won
    still asks for another epoch (issue 37's sixteenth step)."""

    def ep(kind, success):
        return {"task": kind, "task_type": kind, "success": success, "score": 0.0, "valid": [1]}

    before = train.summarize([ep("pick", True), ep("pick", True), ep("look", False)], "eval/train/")
    assert train.below_floor(before, 0.03) == []
    assert train.below_floor(before, 0.03, per_kind=True) == ["look 0.00"]
    assert train.below_floor(before, 0.9) == ["train 0.67"]
    assert train.below_floor(before, 0.9, per_kind=True) == ["look 0.00"]
    alf, _ = train.parse_args(
        ["--warmup-floor-per-kind", "--run-dir", str(tmp_path / "a")], cuda=False
    )
    assert (alf.warmup_floor, alf.warmup_floor_per_kind) == (0.03, True)  # the preset's floor
    off, _ = train.parse_args(["--warmup-floor", "0", "--run-dir", str(tmp_path / "o")], cuda=False)
    assert off.warmup_floor == 0 and off.warmup_floor_per_kind  # the preset's per type: off too
    with pytest.raises(UsageError, match="give --warmup-floor > 0"):
        train.parse_args(
            ["--warmup-floor-per-kind", "--warmup-floor", "0", "--run-dir", str(tmp_path / "b")],
            cuda=False,
        )
    with pytest.raises(UsageError, match="--warmup-floor-per-kind reads the eval"):
        train.parse_args(
            ["--warmup-floor-per-kind", "--eval-every", "0", "--run-dir", str(tmp_path / "c")],
            cuda=False,
        )


def test_cloning_during_rl_is_alfworlds_and_non_negative(tmp_path):
    """--bc-coef clones ALFWorld's expert walkthroughs: WebShop has none, and a negative weight
    would push the expert's actions down; both refused in one line before anything runs."""
    on, _ = train.parse_args(["--bc-coef", "0.5", "--run-dir", str(tmp_path / "a")], cuda=False)
    assert on.bc_coef == 0.5
    with pytest.raises(UsageError, match="WebShop has none: use --bc-coef 0"):
        train.parse_args(
            ["--env", "webshop", "--bc-coef", "1", "--run-dir", str(tmp_path / "w")], cuda=False
        )
    with pytest.raises(UsageError, match="--bc-coef must be >= 0"):
        train.parse_args(["--bc-coef", "-1", "--run-dir", str(tmp_path / "n")], cuda=False)


def test_bf16_without_bf16_units_says_it_is_slow(monkeypatch, capsys, tmp_path):
    """A config.json made on a CPU with bf16 units, re-run on one without, asks for bf16: it
    runs (the run is the user's to make) and says fp32 would be faster; the machine's own
    choice says nothing."""
    monkeypatch.setattr(train, "bf16_is_fast", lambda cuda: False)
    args, _ = train.parse_args(
        ["--env", "alfworld", "--precision", "bf16", "--run-dir", str(tmp_path)], cuda=False
    )
    assert args.precision == "bf16" and "several times slower" in capsys.readouterr().out
    args, _ = train.parse_args(["--env", "alfworld", "--run-dir", str(tmp_path)], cuda=False)
    assert args.precision == "fp32" and "slower" not in capsys.readouterr().out
    monkeypatch.setattr(train, "bf16_is_fast", lambda cuda: True)
    train.parse_args(
        ["--env", "alfworld", "--precision", "bf16", "--run-dir", str(tmp_path)], cuda=False
    )
    assert "slower" not in capsys.readouterr().out
