"""The regression test that proves the trainer learns: the real packaged SmolLM2-135M and the
trainer's own loop functions (train.run_episodes -> tigpo.compute_advantages -> each env step's
advantage attached -> train.update_policy) on a one-step task whose right answer is known.
Two admissible actions; one pays 10, the other 0. The rewarded action's frequency must rise from
about chance (or below) to >= 0.9.

Run twice: HF generate training the top 8 blocks (as the cpu preset), and, with the LoRA extra,
rank-8 LoRA adapters on them (train.add_lora) sampled by the colocated vLLM engine in fp32 (when
the vLLM extra is installed; else by HF generate), which gets the merged weights after every
update, with the truncated importance weight on.

Checked by hand (README, "The learning test"): with the advantage's sign flipped in update_policy,
or with every sample given its neighbour's advantage, the frequency does not
rise and this test fails."""

import copy
import random

import pytest
import torch

import envs
import tigpo
import train

pytestmark = pytest.mark.slow

ACTIONS = ["press red button", "press blue button"]
PAYS = "press blue button"
K = 12  # rollouts per update, one group
UPDATES = 8


class ButtonTask:
    """A one-step text task with the EnvPool interface run_episodes plays: reset(tasks),
    step(actions). Any reply ends the episode; only PAYS wins."""

    def reset(self, tasks):
        self.n = len(tasks)
        info = {
            "admissible": ACTIONS,
            "state": "door",
            "goal": "press the button that opens the door.",
            "task_type": "button",
        }
        return ["You stand at a locked door with a red button and a blue button."] * self.n, [
            info
        ] * self.n

    def step(self, actions):
        infos, rewards = [], []
        for a in actions:
            a = envs.normalize_action(a or "")
            infos.append({"valid": a in ACTIONS, "won": a == PAYS, "state": f"after {a}"})
            rewards.append(envs.SUCCESS_REWARD if a == PAYS else 0.0)
        return ["The door answers."] * self.n, rewards, [True] * self.n, infos


@pytest.fixture
def fresh_smollm(smollm):
    """A fresh copy of the packaged model (conftest's, read from its GGUF file once a session) for
    each variant: the test trains it."""
    model, tok = smollm
    model = copy.deepcopy(model).train()
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def sampler_of(engine, model, tok, precision):
    """(sample(prompts), after_update(model), close()) for the engine under test."""
    if engine == "hf":
        return (
            lambda prompts: train.generate(model, tok, prompts, 1.0, 16, precision=precision),
            lambda m: None,
            lambda: None,
        )
    from extras import vllm_engine

    if not vllm_engine.available():
        pytest.skip("vLLM is not installed (pip install --no-deps -r extras/requirements-vllm.txt)")
    llm = vllm_engine.VLLMSampler(model, tok, dtype="float32", max_model_len=2048, seed=0)

    def sample(prompts):
        responses, logprobs = llm.generate(prompts, 1.0, 16, envs.ACTION_END)
        return [tok.decode(r, skip_special_tokens=True) for r in responses], responses, logprobs

    return sample, llm.sync, llm.close


def vllm_installed():
    from extras import vllm_engine

    return vllm_engine.available()


def frequency(trajs):
    return sum(t["success"] for t in trajs) / len(trajs)


# Two of the four engine x parameters pairs: each engine and each kind of trained parameters learns
# once. The other two add no path of their own: HF generate samples a LoRA model in
# test_lora.py's --lora-rank run, and the vLLM sync of plain weights is proven by
# test_vllm_train.py (update 2's gap) and test_vllm_rollout.py.
@pytest.mark.parametrize("engine,lora", [("hf", False), ("vllm", True)], ids=["hf-top8", "lora"])
def test_the_rewarded_action_becomes_the_policy(fresh_smollm, engine, lora):
    model, tok = fresh_smollm
    if engine == "vllm" and not vllm_installed():  # LoRA still learns, with HF generate
        engine = "hf"
    env, precision = ButtonTask(), "fp32"
    is_cap = 2.0 if engine == "vllm" else 0.0  # train.py's default for each engine
    random.seed(0)
    torch.manual_seed(0)
    lr = 1e-4
    if lora:
        pytest.importorskip("peft", reason="needs the LoRA extra: extras/requirements-lora.txt")
        model = train.add_lora(model, 8, 0, 8)  # rank 8 on the top 8 blocks
        lr = 1e-3  # adapters start at zero: LoRA wants a larger step
    else:  # train the top 8 blocks and the final norm, as the cpu preset
        train.train_top_layers(model, 8)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0
    )
    sample, after_update, close = sampler_of(engine, model, tok, precision)

    def prompt(*step):
        return envs.fit_prompt(tok, *step, "alfworld", "action", None)

    history, gaps = [], []
    for update in range(1, UPDATES + 1):
        trajs, samples, _ = train.run_episodes(
            env, ["door"] * K, sample, prompt, 1, prefill=envs.ACTION_PREFILL, show=False
        )
        history.append(frequency(trajs))
        advantages = tigpo.compute_advantages([{"task": "door", "trajs": trajs}], "grpo")
        for s in samples:  # each env step gets its [group][traj][step] advantage
            g, j = divmod(s["traj"], K)
            s["advantage"] = advantages[g][j][s["step"]]
        plan = train.minibatch_plan(
            samples, 0, 4096, torch.Generator().manual_seed(update), skip_zero=True
        )
        totals = train.update_policy(
            model, optimizer, samples, plan, temperature=1.0, precision=precision, is_cap=is_cap
        )
        gaps.append(totals["gap"] / max(totals["sampled_tokens"], 1))
        after_update(model)
    trajs, _, _ = train.run_episodes(
        env, ["door"] * 48, sample, prompt, 1, prefill=envs.ACTION_PREFILL, show=False
    )
    close()
    final = frequency(trajs)
    print(
        f"{engine}{' LoRA' if lora else ''}: rewarded-action frequency per update: {history}, "
        f"final {final}; "
        f"rollout_logprob_gap per update: {[f'{g:.1e}' for g in gaps]}"
    )
    assert max(gaps) < 1e-3, f"the sampler drew from other weights than the trained ones: {gaps}"
    assert history[0] <= 0.6, f"the untrained model should be near chance or below, got {history}"
    assert final >= 0.9, f"frequency of the rewarded action per update: {history}, final {final}"
