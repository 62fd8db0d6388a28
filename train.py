"""train.py: train an LLM agent with TIGPO (or GRPO, GiGPO, GraphGPO) on ALFWorld or WebShop.

A single-process program, top to bottom: arguments, rollout, update (E12), warm start, eval, and
the loop in run(): plan (E11) -> rollout -> advantage (tigpo.compute_advantages, E1-E9) -> update ->
memory (E10) -> eval -> log -> checkpoint. Equations: docs/ALGORITHM.md. Under torchrun the same loop
runs on every rank and trainer/distributed.py does all that crosses ranks; setup is trainer/build.py.

    python train.py --env alfworld                   # CPU demo (--preset auto picks cpu)
    python train.py --env alfworld --preset paper    # the paper's setting on one GPU
    torchrun --nproc_per_node 8 train.py --env alfworld --preset paper
"""
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as recompute
from tqdm import tqdm
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import envs
import tigpo
from environments import textenv
from trainer import build, models
from trainer.config import UsageError, arg, parse
from trainer.distributed import Dist
from trainer.runlog import RunLog, behaviour, graph_metrics, summarize, throughput, update_metrics, zero_advantage


# ================================================================================================
# Arguments: the defaults are the paper's setting on ALFWorld; SETTINGS holds what differs
# ================================================================================================

@dataclass
class Args:
    # what to train
    env: str = arg("alfworld", "environment", ("alfworld", "webshop"))
    algo: str = arg("tigpo", "advantage estimator (table in docs/ALGORITHM.md)", tigpo.ALGOS)
    model: str = arg("Qwen/Qwen2.5-1.5B-Instruct", "HF model name or local directory")
    preset: str = arg("auto", "auto = paper on CUDA, cpu otherwise; flags given override it", ("auto", "paper", "cpu"))
    response_format: str = arg("think", "think = <think>..</think><action>..</action> (the paper's); action = "
                               "reply prefilled with <action> (small models)", textenv.RESPONSE_FORMATS)
    # games (ALFWorld)
    data_dir: Optional[str] = arg(None, "ALFWorld json_2.1.1's parent ($ALFWORLD_DATA, else generated)", type=str)
    task_types: str = arg("all", "comma-separated ALFWorld task types (pick,look,clean,heat,cool,pick2) or all")
    max_receptacles: int = arg(0, "only games whose scene has at most this many receptacles; 0 = any")
    num_games: str = arg("24,6", "generated games (no data given): TRAIN,EVAL = train games, games per eval split")
    webshop_url: str = arg("http://127.0.0.1:3000", "WebShop Flask server")
    webshop_goals: int = arg(12087, "fixed goals the WebShop server has (the first 500 are the test split)")
    # batch and schedule (E11)
    num_groups: int = arg(16, "B: groups per update, revisit slots included")
    group_size: int = arg(4, "K: rollouts per group")
    revisit_groups: int = arg(8, "B_R: at most this many of the B slots are revisits (0 for the baselines)")
    revisit_delay: int = arg(10, "Delta: updates between exploring a task and revisiting it")
    cross_temporal: bool = arg(True, "E8: revisit groups normalise against Z_E u Z_now")
    updates: int = arg(250, "total policy updates; --resume continues up to this")
    # episodes and prompts
    max_steps: int = arg(50, "episode step limit (the papers: 50 alfworld, 15 webshop)")
    max_new_tokens: int = arg(512, "generation limit per step")
    history_length: int = arg(2, "H: earlier (observation, action) pairs in the prompt")
    state_key: str = arg("facts", "state identity in the graph (ALFWorld): PDDL facts or observation", ("facts", "obs"))
    num_env_workers: int = arg(16, "env worker processes (per rank)")
    # advantage (E1-E9)
    norm: str = arg("mean_std", "E1/E3 normalisation; mean = GiGPO 'w/o std'", tigpo.NORMS)
    graph_gamma: float = arg(0.10, "gamma_g of E6")
    step_gamma: float = arg(0.95, "gamma_s of E2 (gigpo)")
    invalid_penalty: float = arg(0.1, "p of E2/E6: penalty of an invalid action")
    lambda_step: float = arg(1.0, "E9 weight of the step advantage")
    lambda_ep: float = arg(1.0, "E9 weight of the episode advantage")
    max_edges_per_task: Optional[int] = arg(None, "edges kept per task in the graph memory (default: all)", type=int)
    # rollout engine and update (E12)
    rollout_engine: str = arg("hf", "hf = transformers generate (exact --resume, torchrun); vllm = vLLM in this "
                              "process, faster (requirements-vllm.txt)", ("hf", "vllm"))
    temperature: float = arg(1.0, "sampling temperature of training rollouts (plain: no top-p/top-k)")
    gen_batch_size: int = arg(64, "prompts per generate call (hf)")
    lr: float = arg(1e-6, "AdamW learning rate")
    weight_decay: float = arg(0.01, "AdamW weight decay")
    kl_coef: float = arg(0.01, "beta: weight of the k3 KL to the frozen initial model (0 = no reference model)")
    clip_eps: float = arg(0.2, "epsilon_c of the clipped surrogate")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    minibatch_size: int = arg(256, "samples (env steps) per optimizer step, one epoch; 0 = all in one step")
    token_budget: int = arg(16384, "padded tokens per micro-batch; micro-batches accumulate gradients")
    logit_chunk: int = arg(1024, "response tokens whose vocab-size logits exist at once in the update")
    rollout_is_cap: Optional[float] = arg(None, "cap C of the truncated importance weight min(pi_old/pi_sampler, C) "
                                          "on each token's loss; 0 = off (default: 2 with vllm, 0 with hf)", type=float)
    precision: Optional[str] = arg(None, "fp32, or bf16 autocast over fp32 master weights (default: bf16 on CUDA "
                                   "and on CPUs with AVX-512 BF16 or AMX, fp32 elsewhere)", ("fp32", "bf16"), str)
    trainable_layers: int = arg(0, "train only the top N transformer blocks and the final norm; 0 = every weight")
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    # supervised warm start (ALFWorld, before update 1)
    warmup_epochs: int = arg(0, "epochs of supervised learning on the training games' expert walkthroughs")
    warmup_lr: float = arg(1e-4, "AdamW learning rate of the warm start")
    warmup_minibatch_size: int = arg(8, "expert steps per optimizer step of the warm start")
    # eval, logging, checkpoints
    eval_temperature: float = arg(0.4, "sampling temperature of evaluation")
    eval_every: int = arg(25, "evaluate before training, every N updates and at the end; 0 = never")
    eval_tasks: int = arg(0, "games per eval split, the same subset stratified by task type every time; 0 = all")
    eval_repeats: int = arg(1, "episodes per eval game, each with its own sampling")
    eval_splits: str = arg("valid_seen,valid_unseen", "splits to evaluate (ALFWorld: train, valid_seen, "
                           "valid_unseen; WebShop: test)")
    seed: int = arg(0, "seeds python, numpy, torch, the envs, the games and the schedule")
    run_dir: Optional[str] = arg(None, "output folder (default runs/<env>-<algo>-seed<seed>)", type=str)
    resume: bool = arg(False, "continue the run in --run-dir from its last checkpoint")
    save_every: int = arg(25, "checkpoint every N updates and at the end")
    keep_checkpoints: int = arg(2, "newest checkpoints to keep; 0 = all")
    log_trajectories: int = arg(2, "trajectories per update written to trajectories.txt (one of each kind first)")
    dump_advantages: bool = arg(False, "debug: write advantages.jsonl (compute_advantages' input and output)")
    track: bool = arg(False, "log to Weights & Biases (needs `pip install wandb`)")
    device: str = arg("auto", "auto = cuda when available", ("auto", "cpu", "cuda"))
    fsdp: bool = arg(False, "under torchrun: shard weights, gradients, optimizer state (FSDP2) instead of replicas")


WEBSHOP = dict(max_steps=15, graph_gamma=0.20, eval_splits="test")   # the papers' WebShop settings
# The CPU setting: SmolLM2-135M on 2 cores in minutes (docs/RESULTS.md). Every value is our choice, not the paper's.
CPU = dict(model=models.DEFAULT_MODEL, response_format="action", num_groups=4, group_size=2, revisit_groups=2,
           revisit_delay=1, updates=6, max_new_tokens=16, history_length=1, num_env_workers=2, lr=2e-5,
           kl_coef=0.0, temperature=0.4, minibatch_size=0, token_budget=4096, gen_batch_size=32, eval_every=6,
           save_every=6, keep_checkpoints=1, trainable_layers=8)
SETTINGS = {  # (preset, env): the values that differ from Args' defaults; flags given override them
    ("paper", "webshop"): WEBSHOP,
    # ALFWorld: RL on 4 easy games after a brief cloning of them; eval on them, 8 episodes each (docs/ALGORITHM.md)
    ("cpu", "alfworld"): {**CPU, "task_types": "pick,look", "max_receptacles": 9, "num_games": "4,6", "max_steps": 7,
                          "warmup_epochs": 2, "group_size": 4, "temperature": 0.7, "lr": 5e-5, "minibatch_size": 16,
                          "eval_splits": "train", "eval_repeats": 8, "updates": 10, "eval_every": 10, "save_every": 10},
    ("cpu", "webshop"): {**CPU, **WEBSHOP},
}


def parse_args(argv, cuda=None):
    """(args, resuming) from the command line, checked, every value resolved."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    args, resuming = parse(Args, SETTINGS, argv, cuda, __doc__.split("\n")[0])
    if args.precision is None:
        args.precision = "bf16" if models.bf16_is_fast(cuda and args.device != "cpu") else "fp32"
    if args.rollout_is_cap is None:
        args.rollout_is_cap = 2.0 if args.rollout_engine == "vllm" else 0.0
    return args, resuming


# ================================================================================================
# Rollout: one prompt per active env per step, one batched generate call for all of them
# ================================================================================================

NO_ACTION = "<no action>"    # sent to the env when a reply has no <action> tag: the env counts the step
CRASH_STATE = "<env crash>"  # state key after a crashed game (the episode ends as a failure)


def autocast(device, precision):
    """bf16 autocast over fp32 weights (on CUDA or CPU), or nothing for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


class SampledLogprobs(LogitsProcessor):
    """The sampling distribution, owned: divides the logits by the temperature (generate is called
    with temperature 1 and nothing else, so it samples from softmax of what this returns) and keeps
    log pi(token) of each sampled token, the sampler's side of rollout_logprob_gap."""

    def __init__(self, temperature):
        self.temperature, self.last, self.picked = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:               # the token sampled from the previous step's scores
            self.picked.append(self.last.gather(1, input_ids[:, -1:]))
        scores = scores.float() / self.temperature
        self.last = scores.log_softmax(-1)
        return scores


@torch.no_grad()
def generate(model, tok, prompt_ids, temperature, max_new_tokens, batch_size=64, precision="fp32"):
    """Sample one reply per prompt (token ids) in batched, left-padded generate calls (KV cache) up to
    '</action>' or eos. Plain temperature sampling, configured from scratch: E12's ratio assumes it,
    so the model's generation_config (Qwen's top_p/top_k/repetition_penalty) never applies.
    Returns (texts, response ids, their log-probs)."""
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    end_ids = {tok.pad_token_id, tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                              pad_token_id=tok.pad_token_id, eos_token_id=sorted(end_ids - {tok.pad_token_id})
                              or tok.eos_token_id, stop_strings=[textenv.ACTION_END])
    saved, model.generation_config = model.generation_config, GenerationConfig()   # no model defaults
    texts, responses, logprobs = [], [], []
    try:
        for lo in range(0, len(prompt_ids), batch_size):
            rows = prompt_ids[lo:lo + batch_size]
            width = max(map(len, rows))
            ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            sampler = SampledLogprobs(temperature)
            with autocast(device, precision):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tok,
                                     logits_processor=LogitsProcessorList([sampler]))
            lps = torch.cat(sampler.picked + [sampler.last.gather(1, out[:, -1:])], dim=1).tolist()   # (n, new)
            for row, lp in zip(out[:, width:].tolist(), lps):
                resp = textenv.trim_response(row, tok, end_ids)
                responses.append(resp)
                logprobs.append(lp[:len(resp)])
                texts.append(tok.decode(resp, skip_special_tokens=True))
    finally:
        model.generation_config = saved
    return texts, responses, logprobs


def run_episodes(pool, tasks, sample, prompt, max_steps, history_length=0, prefill="", desc="rollout", show=True):
    """One episode per task in the pool, one batched sample() call per step for every active env.
    sample(prompt ids) -> (texts, response ids, log-probs); prompt(goal, history, obs, admissible) ->
    (ids, truncated). Returns (trajs, samples, stats): a traj holds what compute_advantages reads
    (states, valid, score, success) plus text for the log; a sample is one env step (prompt and
    response ids, the sampler's log-probs, traj, step), trained on once its advantage is known."""
    obs, infos = pool.reset(tasks)
    n = len(tasks)
    # A crashed game (info["crash"]) fails; its states get the key CRASH_STATE, never merged with a real state
    trajs = [{"states": [info.get("state", CRASH_STATE)], "valid": [], "score": 0.0, "success": False,
              "task": task, "task_type": info.get("task_type", "all"), "goal": info.get("goal", ""),
              "steps": []} for task, info in zip(tasks, infos)]
    history = [[] for _ in range(n)]        # (observation, action) pairs for the prompt
    done = [bool(info.get("crash")) for info in infos]
    samples, stats = [], {"gen_tokens": 0, "gen_s": 0.0, "truncated_prompts": 0}
    for step in tqdm(range(max_steps), desc=desc, unit="step", leave=False, dynamic_ncols=True, disable=not show):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        prompts = []
        for i in active:
            recent = history[i][len(history[i]) - history_length:] if history_length else []
            ids, cut = prompt(trajs[i]["goal"], recent, obs[i], infos[i]["admissible"])
            prompts.append(ids)
            stats["truncated_prompts"] += cut
        t0 = time.time()
        texts, responses, logprobs = sample(prompts)
        stats["gen_s"] += time.time() - t0
        stats["gen_tokens"] += sum(map(len, responses))
        actions, parsed = [None] * n, {}    # None = leave that env alone (finished)
        for j, i in enumerate(active):
            parsed[i] = textenv.parse_action(prefill + texts[j])
            actions[i] = parsed[i] if parsed[i] is not None else NO_ACTION
        next_obs, rewards, dones, next_infos = pool.step(actions)
        for j, i in enumerate(active):
            info, traj = next_infos[i], trajs[i]
            valid = parsed[i] is not None and bool(info.get("valid", False))
            traj["states"].append(info.get("state", CRASH_STATE))
            traj["valid"].append(valid)
            traj["score"] += float(rewards[i])
            traj["steps"].append({"obs": obs[i], "admissible": infos[i]["admissible"], "reply": prefill + texts[j],
                                  "action": parsed[i], "valid": valid})
            samples.append({"traj": i, "step": step, "prompt_ids": prompts[j], "response_ids": responses[j],
                            "sampler_logprobs": logprobs[j]})
            history[i].append((obs[i], parsed[i] if parsed[i] is not None else NO_ACTION))
            if dones[i]:
                done[i] = True
                traj["success"] = bool(info.get("won", False))
            else:
                obs[i], infos[i] = next_obs[i], info
    return trajs, samples, stats


def attach_advantages(samples, advantages, group_size):
    """Each sample (traj index in the whole batch, step) gets its [group][traj][step] value, unchanged."""
    for s in samples:
        g, j = divmod(s["traj"], group_size)
        s["advantage"] = advantages[g][j][s["step"]]


def policy(args, model, tok, engine=None):
    """sample(prompt ids, temperature) -> (texts, response ids, log-probs): generate, or the vLLM engine."""
    def sample(prompts, temperature):
        if engine is None:
            return generate(model, tok, prompts, temperature, args.max_new_tokens, args.gen_batch_size, args.precision)
        responses, logprobs = engine.generate(prompts, temperature, args.max_new_tokens, textenv.ACTION_END)
        return [tok.decode(r, skip_special_tokens=True) for r in responses], responses, logprobs
    return sample


def play(args, pool, tasks, sample, prompt, dist, temperature, desc, show):
    """run_episodes in the run's format; then (FSDP) join the other ranks' generate calls until all end."""
    prefill = textenv.ACTION_PREFILL if args.response_format == "action" else ""
    out = run_episodes(pool, tasks, lambda prompts: sample(prompts, temperature), prompt, args.max_steps,
                       args.history_length, prefill, desc, show)
    dist.finish_sampling(sample)
    return out


# ================================================================================================
# Update (E12): log-probs of response tokens, the clipped surrogate + k3 KL, the optimizer steps
# ================================================================================================

def collate(batch_samples, pad_id, device):
    """Left-pad prompt+response so every response ends at the last column; the response of row i is
    then the last len(response_i) columns. Returns input_ids, attention_mask (n, L), resp_mask and
    the sampler's log-probs with their mask (n, R). A sample marked "padding" (an FSDP filler) gets
    a zero mask: it runs through the model and adds nothing."""
    L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch_samples)
    R = max(len(s["response_ids"]) for s in batch_samples)
    ids = torch.full((len(batch_samples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch_samples), L), dtype=torch.long)
    resp_mask, sampled, sampler = (torch.zeros((len(batch_samples), R)) for _ in range(3))
    for i, s in enumerate(batch_samples):
        seq, r = s["prompt_ids"] + s["response_ids"], len(s["response_ids"])
        ids[i, L - len(seq):] = torch.tensor(seq)
        attn[i, L - len(seq):] = 1
        resp_mask[i, R - r:] = 0.0 if s.get("padding") else 1.0
        if s.get("sampler_logprobs") is not None and not s.get("padding"):
            sampled[i, R - r:] = 1.0
            sampler[i, R - r:] = torch.tensor(s["sampler_logprobs"], dtype=torch.float32)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "resp_mask": resp_mask.to(device),
            "sampled_mask": sampled.to(device), "sampler_logp": sampler.to(device)}


def _token_logprobs(hidden, weight, bias, targets, temperature):
    """log softmax(W h / T)[target] in fp32 for a chunk of positions: (n, c, H) -> (n, c)."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float()) / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def response_logprobs(model, batch, temperature, precision="fp32", chunk_tokens=1024):
    """log pi(token) of every response column, (n, R) fp32 (meaningless where resp_mask is 0). The
    transformer runs under `precision`; head, temperature and log-softmax in fp32 (a bf16 head moves
    a log-prob by up to ~0.06), over chunks of ~chunk_tokens positions recomputed in backward: the
    full (n, R, vocab) logits kept for backward would take tens of GB with Qwen2.5's 151936 tokens."""
    device = batch["input_ids"].device
    n, R = batch["resp_mask"].shape
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)   # left padding keeps RoPE right
    with autocast(device, precision):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids,
                    use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, -R - 1:-1]  # (n, R, H) after the final norm: column j predicts token L-R+j
    targets = batch["input_ids"][:, -R:]
    head = model.get_output_embeddings()
    step = max(1, chunk_tokens // n)
    chunks = []
    with torch.autocast(device.type, enabled=False):
        for lo in range(0, R, step):
            part = (hidden[:, lo:lo + step], head.weight, head.bias, targets[:, lo:lo + step], temperature)
            grad = torch.is_grad_enabled()
            chunks.append(recompute(_token_logprobs, *part, use_reentrant=False) if grad else _token_logprobs(*part))
    return torch.cat(chunks, dim=1)


def policy_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, kl_coef, num_tokens, is_weight=None):
    """E12. logp, old_logp, ref_logp (or None), mask, is_weight (or None): (n, R); adv: (n, 1) or
    (n, R); num_tokens: response tokens of the whole minibatch, so micro-batch losses add up to its
    token-mean. is_weight: the detached truncated importance weight pi_old / pi_sampler of each
    token. Padded columns (mask 0) never enter the arithmetic (exp of their log-ratio could
    overflow: inf * 0 = NaN). Returns (loss, token sums of pg_loss, kl, clip_frac)."""
    real = mask > 0
    log_ratio = torch.where(real, logp - old_logp, 0.0).clamp(-20.0, 20.0)   # bounded as verl bounds it
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)              # = -min(rho*A, clip(rho)*A)
    if is_weight is not None:
        pg = pg * is_weight
    if ref_logp is not None:
        r = torch.where(real, ref_logp - logp, 0.0).clamp(-20.0, 20.0)
        # k3 = exp(r) - r - 1 >= 0, unbiased for KL(pi||ref); expm1 because exp(r) - 1 in fp32 rounds
        # a KL of ~1e-12 (lr 1e-6) to 0; capped at 10 as verl caps it
        kl = (torch.expm1(r) - r).clamp(max=10.0)
    else:
        kl = torch.zeros_like(logp)
    loss = torch.where(real, pg + kl_coef * kl, 0.0).sum() / num_tokens      # token-mean over the minibatch
    stats = {"pg_loss": (pg * mask).sum().item(), "kl": (kl * mask).sum().item(),
             "clip_frac": ((pg_clipped > pg_unclipped).float() * mask).sum().item()}
    return loss, stats


def micro_batches(indices, samples, token_budget):
    """Split sample indices into micro-batches of at most token_budget padded tokens (at least one
    sample each), sorted by length so padding is small."""
    length = lambda i: len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"])  # noqa: E731
    batches, current, longest = [], [], 0
    for i in sorted(indices, key=length):
        if current and max(longest, length(i)) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length(i))
    return batches + [current] if current else batches


def minibatch_plan(samples, minibatch_size, token_budget, generator, skip_zero):
    """One epoch: [(micro-batches of sample indices, response tokens of the minibatch)], one entry
    per optimizer step, drawn in a seeded permutation of the samples in (traj, step) order.
    skip_zero (no KL term): a sample whose advantage is exactly 0 adds exactly 0 to the loss and its
    gradient, so its forward and backward are skipped; its tokens still count in the mean, and the
    minibatch's optimizer step is still taken (AdamW's momentum and weight decay move the weights)."""
    canonical = sorted(range(len(samples)), key=lambda i: (samples[i]["traj"], samples[i]["step"]))
    order = [canonical[g] for g in torch.randperm(len(samples), generator=generator).tolist()]
    size = minibatch_size or max(len(order), 1)
    plan = []
    for lo in range(0, len(order), size):
        members = order[lo:lo + size]
        tokens = sum(len(samples[i]["response_ids"]) for i in members)
        trained = [i for i in members if not (skip_zero and samples[i]["advantage"] == 0.0)]
        plan.append((micro_batches(trained, samples, token_budget), tokens))
    return plan


def update_policy(model, optimizer, samples, plan, ref_model=None, *, temperature=1.0, clip_eps=0.2, kl_coef=0.0,
                  max_grad_norm=1.0, precision="fp32", logit_chunk=1024, is_cap=0.0, before_step=None, show=False):
    """E12 over one update's samples (each one env step with prompt_ids, response_ids, advantage and
    optionally sampler_logprobs): for each (micro-batches, tokens) of `plan` (minibatch_plan), one
    AdamW step whose loss is the token-mean over the minibatch, accumulated over its micro-batches.
    pi_old: with one step, the step's own forward, detached; with several, one no-grad pass before
    the first step over exactly the same micro-batches (under bf16 a log-prob moves by up to ~0.1
    between batch shapes: noise the clip would act on). before_step(model), if given, runs between
    backward and the gradient clip (torchrun: the gradient sum). Returns the update's statistics."""
    pad = model.generation_config.pad_token_id
    device = next(model.parameters()).device
    batches = [[collate([samples[i] for i in micro], pad, device) for micro in micros] for micros, _ in plan]
    logprobs = lambda net, batch: response_logprobs(net, batch, temperature, precision, logit_chunk)  # noqa: E731
    with torch.no_grad():
        old = [[logprobs(model, b) for b in step] for step in batches] if len(plan) > 1 else None
        ref = [[logprobs(ref_model, b) for b in step] for step in batches] if ref_model is not None else None
    totals = dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "grad_norm", "logp", "gap", "gap_max",
                            "is_weight", "is_clipped", "sampled_tokens"), 0.0)
    model.train()                               # HF checkpoints only in train mode; no dropout either way
    bar = tqdm(total=sum(map(len, batches)), desc="update", unit="micro-batch", leave=False, dynamic_ncols=True,
               disable=not show)
    for s, (_, num_tokens) in enumerate(plan):
        optimizer.zero_grad(set_to_none=True)
        for m, batch in enumerate(batches[s]):
            logp = logprobs(model, batch)                                          # (n, R)
            mask = batch["resp_mask"]
            adv = torch.tensor([[samples[i]["advantage"]] for i in plan[s][0][m]], device=device)   # (n, 1)
            old_logp = old[s][m] if old else logp.detach()
            # log pi_old - log pi_sampler on the sampled tokens, before any step: rollout_logprob_gap
            sampled, diff = batch["sampled_mask"], old_logp - batch["sampler_logp"]
            totals["gap"] += (diff.abs() * sampled).sum().item()
            totals["gap_max"] = max(totals["gap_max"], (diff.abs() * sampled).max().item())
            totals["sampled_tokens"] += sampled.sum().item()
            weight = None
            if is_cap > 0:          # truncated importance sampling (docs/ALGORITHM.md E12)
                raw = torch.exp(diff.clamp(-20.0, 20.0))
                weight = torch.where(sampled > 0, raw.clamp(max=is_cap), 1.0)
                totals["is_weight"] += (weight * sampled).sum().item()
                totals["is_clipped"] += ((raw > is_cap).float() * sampled).sum().item()
            loss, st = policy_loss(logp, old_logp, ref[s][m] if ref else None, adv, mask, clip_eps, kl_coef,
                                   num_tokens, weight)
            loss.backward()
            totals["loss"] += loss.item()
            totals["logp"] += (logp.detach() * mask).sum().item()
            for k in ("pg_loss", "kl", "clip_frac"):
                totals[k] += st[k]
            bar.update()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:            # a minibatch without signal still steps (AdamW skips a None grad)
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        if before_step is not None:
            before_step(model)
        totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        optimizer.step()
    bar.close()
    model.eval()
    return totals


# ================================================================================================
# Supervised warm start (its own AdamW): behaviour cloning of the expert walkthroughs, as an update
# ================================================================================================

def warm_start(args, model, tok, dist):
    """Behaviour cloning of the expert walkthroughs as E12 with advantage 1, one step per minibatch:
    then pi_old is the step's own forward, rho = 1, and the gradient is the token-mean cross-entropy's."""
    t0 = time.time()
    samples = build.walkthrough_samples(args, build.prompt_fn(args, tok, model), tok)   # advantage 1 each
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.warmup_lr,
                                  weight_decay=args.weight_decay)
    for epoch in range(args.warmup_epochs):
        plan, padded = dist.plan(minibatch_plan, samples, args.warmup_minibatch_size, args.token_budget,
                                 torch.Generator().manual_seed(args.seed + epoch), False, micro_batches, shared=True)
        logp = tokens = 0.0                   # the last epoch's loss is the one reported
        for step in tqdm(plan, desc=f"warm start {epoch + 1}/{args.warmup_epochs}", unit="step", leave=False,
                         dynamic_ncols=True, disable=not dist.main):
            logp += update_policy(model, optimizer, padded, [step], max_grad_norm=args.max_grad_norm,
                                  precision=args.precision, logit_chunk=args.logit_chunk,
                                  before_step=dist.sum_gradients)["logp"]
            tokens += step[1]
    logp, = dist.sum([logp])
    dist.say(f"warm start: {args.warmup_epochs} epoch(s) on {len(samples)} expert steps of the training games, "
             f"loss {-logp / max(tokens, 1):.3f}, {time.time() - t0:.0f}s")


# ================================================================================================
# Evaluation: the eval splits at eval temperature, from an RNG stream of its own
# ================================================================================================

def evaluate(args, sample, prompt, dist, seed, show=True):
    """Success (overall, per task type, episode count) and mean score on every eval split, each game
    played --eval-repeats times, from an RNG of its own: evaluating never changes the training stream.
    A number depends on the seed, the games and (batched sampling) the batch composition: the ranks."""
    metrics = {}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and args.device != "cpu" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + 7919 * dist.rank)
        for split in args.eval_splits.split(","):
            pool, tasks = build.make_pool(args, split)
            tasks = [t for t in envs.eval_subset(tasks, args.eval_tasks) for _ in range(args.eval_repeats)]
            trajs, _, _ = play(args, pool, [tasks[i] for i in dist.share(len(tasks))], sample, prompt, dist,
                               args.eval_temperature, f"eval {split}", show)
            pool.close()
            trajs = dist.gather([{k: t[k] for k in ("success", "score", "valid", "task_type")} for t in trajs])
            metrics.update(summarize(trajs, prefix=f"eval/{split}/"))
    return metrics


# ================================================================================================
# The training loop
# ================================================================================================

def main(argv=None):
    try:
        run(*parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args, resuming):
    dist = Dist()
    start, ckpt = build.resume_point(args, resuming, dist)
    if start is None:                           # a finished run, resumed: nothing to do
        return
    device = dist.start(args.device, dist.main and build.describe(args, resuming, dist))
    pool, train_tasks = build.open_env(args, "train", dist)    # bad data fails before minutes of model loading
    model, tok, optimizer = build.policy(args, ckpt, device, dist)
    log = RunLog(args, resuming, start) if dist.main else None      # the run folder starts here
    if args.warmup_epochs and start == 0:       # behaviour cloning before RL (the cpu preset)
        warm_start(args, model, tok, dist)
    ref_model = build.reference_model(args, model, tok, start, dist)
    memory, scheduler = tigpo.GraphMemory(args.max_edges_per_task), tigpo.RevisitScheduler(
        train_tasks, args.num_groups, args.revisit_groups, args.revisit_delay, seed=args.seed)
    if ckpt:                                    # graph memory, queue, optimizer and RNG states
        build.load_state(ckpt, memory, scheduler, model, optimizer, device, dist)
    engine = build.engine(args, model, tok)    # vLLM, or None: generate with the trainer's own model
    sample = dist.lockstep(policy(args, model, tok, engine), args.gen_batch_size)
    prompt = build.prompt_fn(args, tok, model)
    if start == 0 and args.eval_every:          # "before": the policy before RL
        log and log.write({"update": 0, **evaluate(args, sample, prompt, dist, args.seed, dist.main)}, None, [], [])

    K = args.group_size
    for update in tqdm(range(start + 1, args.updates + 1), desc="updates", initial=start, total=args.updates,
                       dynamic_ncols=True, disable=not dist.main):
        # ------------------------------------------------------------------------ rollout (E11 plan)
        t0 = time.time()
        plan = scheduler.plan(update)                         # B slots, explore + revisit
        tasks = [slot["task"] for slot in plan for _ in range(K)]
        mine = dist.share(len(tasks))                         # this rank's episodes (all of them alone)
        trajs, samples, gen = play(args, pool, [tasks[i] for i in mine], sample, prompt, dist, args.temperature,
                                   f"rollout {update}", dist.main)
        for s in samples:
            s["traj"] += mine.start                           # index into the whole batch
        trajs = dist.gather(trajs)
        groups = [{"task": slot["task"], "kind": slot["kind"], "ref_scores": slot["ref_scores"],
                   "trajs": trajs[g * K:(g + 1) * K]} for g, slot in enumerate(plan)]
        rollout_s = time.time() - t0
        # ------------------------------------------------------------------------ advantage (E1-E9)
        t0 = time.time()
        graph_stats = memory.stats(groups)                    # before add: hit rates of this batch
        advantages = tigpo.compute_advantages(groups, args.algo, memory, **build.advantage_settings(args))
        attach_advantages(samples, advantages, K)             # [group][traj][step] -> each sample
        adv_s = time.time() - t0
        # ------------------------------------------------------------------------ update (E12)
        t0 = time.time()
        order = torch.Generator().manual_seed(args.seed * 1000003 + update)   # the same on every rank
        steps, padded = dist.plan(minibatch_plan, samples, args.minibatch_size, args.token_budget, order,
                                  ref_model is None, micro_batches)
        totals = update_policy(model, optimizer, padded, steps, ref_model, temperature=args.temperature,
                               clip_eps=args.clip_eps, kl_coef=args.kl_coef, max_grad_norm=args.max_grad_norm,
                               precision=args.precision, logit_chunk=args.logit_chunk, is_cap=args.rollout_is_cap,
                               before_step=dist.sum_gradients, show=dist.main)
        stats = update_metrics(dist.sum_totals(totals), steps, ref_model is not None)
        build.check_sampler(stats, args)
        synced = engine.sync(model) if engine else {}         # the engine samples from the new weights
        update_s = time.time() - t0
        # ------------------------------------------------------------------------ memory (E10), schedule
        if args.dump_advantages:                              # debug: the advantage each sample trained with
            seen = dist.gather([[s["traj"] // K, s["traj"] % K, s["step"], s["advantage"]] for s in samples])
            log and log.dump_advantages(update, groups, memory, seen)
        memory.add(groups)                                    # after the update
        scheduler.record(update, groups)                      # queue this update's exploration groups
        # ------------------------------------------------------------------------ eval, log, checkpoint
        metrics = {"update": update, **summarize(trajs)}
        if args.eval_every and (update % args.eval_every == 0 or update == args.updates):
            metrics.update(evaluate(args, sample, prompt, dist, args.seed + 1000003 * update, dist.main))
        metrics.update(behaviour(trajs), **stats, **graph_metrics(graph_stats, memory), **zero_advantage(advantages),
                       **throughput(gen, samples, rollout_s, adv_s, update_s, dist), **dist.metrics(model), **synced,
                       revisits=sum(slot["kind"] == "revisit" for slot in plan), revisits_dropped=scheduler.dropped)
        log and log.write(metrics, plan, trajs, advantages)
        if update % args.save_every == 0 or update == args.updates:
            build.save(args, update, model, tok, optimizer, memory, scheduler, dist)
    pool.close()
    engine and engine.close()
    log and log.close()
    dist.stop()


if __name__ == "__main__":
    main()
