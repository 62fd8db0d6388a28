"""train.py: train an LLM agent with TIGPO (or GRPO, GiGPO, GraphGPO) on ALFWorld or WebShop.

One policy update, read top to bottom in run(): rollout (E11 plan, B*K episodes with batched
generation) -> advantage (tigpo.compute_advantages, E1-E9) -> update (update_policy: clipped
surrogate + k3 KL, token-mean, E12) -> memory (E10) -> eval -> log -> checkpoint. The equations
are in docs/ALGORITHM.md; the algorithm core is tigpo.py. Scaffolding lives elsewhere: model
loading and checkpoints in checkpoint.py, the torchrun collectives in distributed.py.

    python train.py --env alfworld                   # CPU demo (--preset auto picks cpu)
    python train.py --env alfworld --preset paper    # the paper's setting on one GPU
    torchrun --nproc_per_node 8 train.py --env alfworld --preset paper
"""
import argparse
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from environments import textenv
import tigpo
from environments import webshop
from trainer.checkpoint import DEFAULT_MODEL, UsageError


def arg(default, help, type=None, choices=None):
    """A dataclass field that is also a command-line flag (--field-name) with its help text."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass
class Args:
    # what to train
    env: str = arg("alfworld", "environment", choices=("alfworld", "webshop"))
    algo: str = arg("tigpo", "advantage estimator (table in docs/ALGORITHM.md)", choices=tigpo.ALGOS)
    model: Optional[str] = arg(None, "HF model name or local directory", str)
    preset: str = arg("auto", "auto = paper on CUDA, cpu otherwise; explicit flags override it",
                      choices=("auto", "paper", "cpu"))
    response_format: Optional[str] = arg(None, "think = <think>..</think><action>..</action> (the "
                                         "paper's); action = reply prefilled with <action>, for small "
                                         "models", str, choices=textenv.RESPONSE_FORMATS)
    # games (ALFWorld)
    data_dir: Optional[str] = arg(None, "ALFWorld data (folder holding json_2.1.1); default "
                                  "$ALFWORLD_DATA, else generated games", str)
    task_types: Optional[str] = arg(None, "comma-separated ALFWorld task types to train and evaluate "
                                    "on (pick,look,clean,heat,cool,pick2); all = all six", str)
    max_receptacles: Optional[int] = arg(None, "only games whose scene has at most this many "
                                         "receptacles; 0 = any", int)
    num_games: Optional[str] = arg(None, "generated games (no data given): TRAIN,EVAL = train games, "
                                   "games per eval split", str)
    webshop_url: str = arg("http://127.0.0.1:3000", "WebShop Flask server")
    webshop_goals: int = arg(webshop.NUM_GOALS, "fixed goals the WebShop server has (the first "
                             f"{webshop.TEST_GOALS} are the test split)")
    # batch and schedule (E11)
    num_groups: Optional[int] = arg(None, "B: groups per update, revisit slots included", int)
    group_size: Optional[int] = arg(None, "K: rollouts per group", int)
    revisit_groups: Optional[int] = arg(None, "B_R: at most this many of the B slots are revisits "
                                        "(0 for the baselines)", int)
    revisit_delay: Optional[int] = arg(None, "Delta: updates between exploring a task and revisiting it",
                                       int)
    cross_temporal: bool = arg(True, "E8: revisit groups normalise against Z_E u Z_now")
    updates: Optional[int] = arg(None, "total policy updates; --resume continues up to this", int)
    # episodes and prompts
    max_steps: Optional[int] = arg(None, "episode step limit (the papers: 50 alfworld, 15 webshop)", int)
    max_new_tokens: Optional[int] = arg(None, "generation limit per step", int)
    history_length: Optional[int] = arg(None, "H: earlier (observation, action) pairs in the prompt", int)
    state_key: str = arg("facts", "state identity for the graph (ALFWorld): exact PDDL facts or "
                         "observation text", choices=("facts", "obs"))
    num_env_workers: Optional[int] = arg(None, "env worker processes (per rank)", int)
    # advantage (E1-E9)
    norm: str = arg("mean_std", "E1/E3 normalisation; mean = GiGPO 'w/o std'", choices=tigpo.NORMS)
    graph_gamma: Optional[float] = arg(None, "gamma_g of E6", float)
    step_gamma: float = arg(0.95, "gamma_s of E2 (gigpo)")
    invalid_penalty: float = arg(0.1, "p of E2/E6: penalty of an invalid action")
    lambda_step: float = arg(1.0, "E9 weight of the step advantage")
    lambda_ep: float = arg(1.0, "E9 weight of the episode advantage")
    max_edges_per_task: Optional[int] = arg(None, "edges kept per task in the graph memory "
                                            "(default: all)", int)
    # update (E12)
    lr: Optional[float] = arg(None, "AdamW learning rate", float)
    weight_decay: Optional[float] = arg(None, "AdamW weight decay", float)
    kl_coef: Optional[float] = arg(None, "beta: weight of the k3 KL to the frozen initial model "
                                   "(0 = no reference model)", float)
    clip_eps: float = arg(0.2, "epsilon_c of the clipped surrogate")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    minibatch_size: Optional[int] = arg(None, "samples (env steps) per optimizer step, one epoch; "
                                        "0 = the whole batch in one step", int)
    token_budget: Optional[int] = arg(None, "padded tokens per micro-batch; micro-batches accumulate "
                                      "gradients", int)
    logit_chunk: int = arg(1024, "response tokens whose vocab-size logits exist at once in the update")
    precision: Optional[str] = arg(None, "fp32, or bf16 autocast over fp32 master weights (default: "
                                   "bf16 on CUDA, fp32 on CPU)", str, choices=("fp32", "bf16"))
    trainable_layers: Optional[int] = arg(None, "train only the top N transformer blocks (and the final "
                                          "norm); 0 = every weight", int)
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    temperature: Optional[float] = arg(None, "sampling temperature of training rollouts", float)
    gen_batch_size: Optional[int] = arg(None, "prompts per generate call", int)
    # supervised warm start (optional, before update 1)
    warmup_epochs: Optional[int] = arg(None, "epochs of supervised learning on the training games' "
                                       "expert walkthroughs before RL (ALFWorld; 0 = none)", int)
    warmup_lr: float = arg(1e-4, "AdamW learning rate of the warm start")
    # eval, logging, checkpoints
    eval_temperature: float = arg(0.4, "sampling temperature of evaluation")
    eval_every: Optional[int] = arg(None, "evaluate before training, every N updates and at the end; "
                                    "0 = never", int)
    eval_tasks: Optional[int] = arg(None, "games per eval split; 0 = all", int)
    eval_splits: Optional[str] = arg(None, "comma-separated splits to evaluate on (ALFWorld: train, "
                                     "valid_seen, valid_unseen; WebShop: test)", str)
    seed: int = arg(0, "seeds python, numpy, torch, the envs, the games and the schedule")
    run_dir: Optional[str] = arg(None, "output folder (default runs/<env>-<algo>-seed<seed>)", str)
    resume: bool = arg(False, "continue the run in --run-dir from its last checkpoint")
    save_every: Optional[int] = arg(None, "checkpoint every N updates and at the end", int)
    keep_checkpoints: Optional[int] = arg(None, "newest checkpoints to keep; 0 = all", int)
    log_trajectories: int = arg(2, "trajectories per update written to trajectories.txt (one of "
                                "each kind first)")
    dump_advantages: bool = arg(False, "debug: write advantages.jsonl with compute_advantages' input "
                                "and the advantages the loss saw")
    track: bool = arg(False, "log to Weights & Biases (needs `pip install wandb`)")
    device: str = arg("auto", "auto = cuda when available", choices=("auto", "cpu", "cuda"))
    fsdp: bool = arg(False, "under torchrun: shard parameters, gradients and optimizer state over the "
                     "ranks (FSDP2 fully_shard) instead of a replica per rank")


# The two settings of docs/ALGORITHM.md "Trainer defaults". cpu: SmolLM2-135M learns, visibly, on
# 2 CPU cores in about 12 minutes (measured in README "CPU results"): easy games (pick and look, small
# scenes, 4-5 step walkthroughs), the action response format, a horizon with room to spare.
PRESETS = {
    "paper": dict(model="Qwen/Qwen2.5-1.5B-Instruct", response_format="think", task_types="all",
                  max_receptacles=0, num_games="%d,%d" % textenv.ALFWORLD_DEFAULT_GAMES, num_groups=16, group_size=4,
                  revisit_groups=8, revisit_delay=10, updates=250, max_new_tokens=512,
                  history_length=2, num_env_workers=16, lr=1e-6, weight_decay=0.01, kl_coef=0.01,
                  temperature=1.0, minibatch_size=256, token_budget=16384, gen_batch_size=64,
                  eval_every=25, eval_tasks=0, save_every=25, keep_checkpoints=2, trainable_layers=0,
                  warmup_epochs=0),
    "cpu": dict(model=DEFAULT_MODEL, response_format="action", task_types="pick,look",
                max_receptacles=9, num_games="4,6", num_groups=4, group_size=2, revisit_groups=2,
                revisit_delay=1, updates=6, max_steps=7, max_new_tokens=16, history_length=1,
                num_env_workers=2, lr=2e-5, weight_decay=0.01, kl_coef=0.0, temperature=0.4,
                minibatch_size=0, token_budget=4096, gen_batch_size=32, eval_every=6, eval_tasks=0,
                save_every=6, keep_checkpoints=1, trainable_layers=8, warmup_epochs=2),
}
ENV_DEFAULTS = {"alfworld": dict(max_steps=50, graph_gamma=0.10, eval_splits="valid_seen,valid_unseen"),
                "webshop": dict(max_steps=15, graph_gamma=0.20, eval_splits="test")}
# The cpu preset on ALFWorld also evaluates on its (few) training games: the clearest before/after.
PRESET_ENV_DEFAULTS = {("cpu", "alfworld"): dict(eval_splits="train,valid_seen,valid_unseen")}
# Flags that may change when a run is resumed; every other field must match the saved run.
RESUMABLE = {"eval_splits", "updates", "resume", "save_every", "eval_every", "eval_tasks", "num_env_workers",
             "keep_checkpoints", "log_trajectories", "dump_advantages", "track", "device",
             "token_budget", "logit_chunk", "gen_batch_size", "data_dir", "webshop_url"}


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line naming the fix, instead of argparse's usage dump
        raise UsageError(f"{message} (see python train.py --help)")


def _shown_default(name, default):
    values = [f"{p} {PRESETS[p][name]}" for p in PRESETS if name in PRESETS[p]]
    values += [f"{env} {d[name]}" for env, d in ENV_DEFAULTS.items()
               if name in d and not all(name in p for p in PRESETS.values())]
    return ", ".join(values) if values else default


def parse_args(argv):
    """(args, resuming) from the command line, checked; standard library only, so that --help and
    a bad flag answer before torch is imported. Preset values are filled in by resolve_presets."""
    parser = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Args):
        shown = _shown_default(f.name, f.default)
        kw = dict(help=f.metadata["help"] + (f" [default: {shown}]" if shown is not None else ""),
                  default=argparse.SUPPRESS)
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = f.metadata["type"] or type(f.default)
            kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    explicit = vars(parser.parse_args(argv))          # only the flags the user gave
    args = Args(**explicit)
    args.run_dir = args.run_dir or os.path.join("runs", f"{args.env}-{args.algo}-seed{args.seed}")
    if args.resume:
        saved_path = os.path.join(args.run_dir, "config.json")
        if not os.path.exists(saved_path):
            raise UsageError(f"--resume: {args.run_dir} holds no run (no config.json); drop --resume "
                             f"to start one")
        with open(saved_path) as fh:
            saved = json.load(fh)
        for k, v in explicit.items():
            if k not in RESUMABLE and k != "run_dir" and saved.get(k) != v:
                raise UsageError(f"--resume: --{k.replace('_', '-')} {v} differs from the saved run "
                                 f"({saved.get(k)}); drop the flag or start a new --run-dir")
        known = {f.name for f in dataclasses.fields(Args)}
        saved = {k: v for k, v in saved.items() if k in known}
        args = Args(**{**saved, **{k: v for k, v in explicit.items() if k in RESUMABLE},
                       "run_dir": args.run_dir})
    elif os.path.exists(args.run_dir) and os.listdir(args.run_dir):
        raise UsageError(f"{args.run_dir} already holds a run; pass --resume to continue it, or "
                         f"another --run-dir")
    if args.algo != "tigpo" and explicit.get("revisit_groups"):
        raise UsageError(f"--revisit-groups needs --algo tigpo ({args.algo} explores only); drop it")
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise UsageError("--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)")
    if args.track and __import__("importlib").util.find_spec("wandb") is None:
        raise UsageError("--track needs Weights & Biases: pip install wandb (or drop --track)")
    if args.data_dir and not os.path.isdir(os.path.expanduser(args.data_dir)):
        raise UsageError(f"--data-dir {args.data_dir} is not a folder; point it at the folder holding "
                         f"json_2.1.1 or drop it to use generated games")
    check_values(args)
    return args, args.resume


def check_values(args):
    """Range checks of every value that is set (before and after the preset fills the rest)."""
    types = [t.strip() for t in (args.task_types or "all").split(",")]
    checks = [
        (args.num_groups, lambda v: v >= 1, "--num-groups must be >= 1"),
        (args.group_size, lambda v: v >= 1, "--group-size must be >= 1"),
        (args.revisit_groups, lambda v: v >= 0, "--revisit-groups must be >= 0"),
        (args.revisit_delay, lambda v: v >= 0, "--revisit-delay must be >= 0"),
        (args.updates, lambda v: v >= 1, "--updates must be >= 1"),
        (args.max_steps, lambda v: v >= 1, "--max-steps must be >= 1"),
        (args.max_new_tokens, lambda v: v >= 1, "--max-new-tokens must be >= 1"),
        (args.history_length, lambda v: v >= 0, "--history-length must be >= 0"),
        (args.temperature, lambda v: v > 0, "--temperature must be > 0 (E12's ratio needs a "
                                            "sampling distribution)"),
        (args.eval_temperature, lambda v: v > 0, "--eval-temperature must be > 0"),
        (args.logit_chunk, lambda v: v >= 1, "--logit-chunk must be >= 1"),
        (args.num_games, lambda v: len(v.split(",")) == 2 and all(x.strip().isdigit() for x in v.split(","))
         and int(v.split(",")[0]) >= 1, "--num-games must be TRAIN,EVAL, e.g. 24,6"),
        (args.task_types, lambda v: types == ["all"] or set(types) <= set(textenv.ALFWORLD_TASK_TYPES),
         f"--task-types must be 'all' or some of {','.join(textenv.ALFWORLD_TASK_TYPES)}"),
    ]
    for value, ok, message in checks:
        if value is not None and not ok(value):
            raise UsageError(message)
    if None not in (args.revisit_groups, args.num_groups) and args.revisit_groups > args.num_groups:
        raise UsageError("--revisit-groups must be in [0, --num-groups]")


def resolve_presets(args, cuda_available):
    """Fill every unset field from the preset, then the environment's defaults: each value is set
    once, explicit flags win. Returns a line saying what was chosen."""
    if args.device == "cuda" and not cuda_available:
        raise UsageError("--device cuda but no CUDA device is visible; use --device auto or cpu")
    cuda = cuda_available and args.device != "cpu"
    preset = args.preset if args.preset != "auto" else ("paper" if cuda else "cpu")
    defaults = {**ENV_DEFAULTS[args.env], **PRESETS[preset], **PRESET_ENV_DEFAULTS.get((preset, args.env), {})}
    for k, v in defaults.items():   # the preset beats the env
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.precision is None:
        args.precision = "bf16" if cuda else "fp32"
    if args.algo != "tigpo":      # baselines explore only (docs/ALGORITHM.md table)
        args.revisit_groups = 0
    why = f" (auto: {'a' if cuda else 'no'} CUDA device)" if args.preset == "auto" else ""
    args.preset = preset
    check_values(args)
    known = {"alfworld": ("train", "valid_seen", "valid_unseen"), "webshop": ("train", "test")}[args.env]
    if not set(args.eval_splits.split(",")) <= set(known):
        raise UsageError(f"--eval-splits {args.eval_splits}: {args.env} has the splits {','.join(known)}")
    return f"preset {preset}{why}; explicit flags override it"


if __name__ == "__main__":
    # Parse and check the flags before the heavy imports below, so that --help and a bad flag
    # answer in about a second instead of after torch and transformers have loaded.
    try:
        PARSED = parse_args(sys.argv[1:])
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint as recompute  # noqa: E402
from tqdm import tqdm  # noqa: E402

from trainer import checkpoint  # noqa: E402
import envs  # noqa: E402
from trainer.runlog import RunLog, behaviour, graph_metrics, summarize, zero_advantage  # noqa: E402
from trainer.distributed import Dist  # noqa: E402

NO_ACTION = "<no action>"    # sent to the env when a reply has no <action> tag: the env counts the step
CRASH_STATE = "<env crash>"  # state key after a crashed game (the episode ends as a failure)


# ================================================================================================
# Rollout: one prompt per active env per step, one batched generate call for all of them
# ================================================================================================

def autocast(device, precision):
    """bf16 autocast over fp32 weights (on CUDA or CPU), or nothing for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def chat_ids(tok, text, args):
    """Token ids of one step prompt in the chat template, plus the "action" format's prefill."""
    prefill = textenv.ACTION_PREFILL if args.response_format == "action" else ""
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True) + prefill
    return tok(chat, add_special_tokens=False).input_ids


def fit_prompt(tok, goal, history, obs, admissible, args, limit):
    """(prompt ids, truncated) for one step, at most `limit` tokens (the model's context minus
    --max-new-tokens). Policy when too long: drop the oldest history pairs, then shorten the
    observation's middle, then drop admissible actions from the end (each kept whole), then, as a
    last resort, keep the prompt's last `limit` tokens. Never a crash inside the model."""
    def ids(hist, text, actions):
        return chat_ids(tok, textenv.build_prompt(goal, hist, text, actions, args.env,
                                                  args.response_format), args)
    out = ids(history, obs, admissible)
    if limit is None or len(out) <= limit:
        return out, False
    history = list(history)
    while history and len(out) > limit:
        history.pop(0)
        out = ids(history, obs, admissible)
    if len(out) > limit:   # keep the observation's head and tail, the longest that fits
        lo, hi = 0, len(obs)
        while lo < hi:
            keep = (lo + hi + 1) // 2
            text = obs[:keep // 2] + " [...] " + obs[len(obs) - keep // 2:]
            lo, hi = (keep, hi) if len(ids(history, text, admissible)) <= limit else (lo, keep - 1)
        obs = obs[:lo // 2] + " [...] " + obs[len(obs) - lo // 2:]
        out = ids(history, obs, admissible)
    admissible = list(admissible)
    while len(out) > limit and len(admissible) > 1:
        admissible.pop()
        out = ids(history, obs, admissible)
    return out[-limit:], True


def trim_response(ids, tok, end_ids):
    """The sampled tokens of one generated row. A finished row is filled with pad (= eos for many
    models). It ends at its first end token (eos or pad), which was sampled unless the row had
    already stopped at '</action>' (then it is padding and must not be trained on)."""
    end = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    if end == len(ids) or textenv.ACTION_END in tok.decode(ids[:end]):
        return ids[:end]
    return ids[:end + 1]


@torch.no_grad()
def generate(model, tok, prompt_ids, args, temperature, device, dist=None):
    """Sample one reply per prompt in batched, left-padded generate calls (KV cache).
    Returns (reply texts, response ids); a reply of the "action" format starts with the prefill.
    Under FSDP every rank makes as many calls (dummy prompts fill in) and they run in step."""
    lockstep = dist is not None and dist.fsdp
    prefill = textenv.ACTION_PREFILL if args.response_format == "action" else ""
    eos = model.generation_config.eos_token_id
    end_ids = {tok.pad_token_id, tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    texts, responses = [], []
    chunks = [prompt_ids[lo:lo + args.gen_batch_size] for lo in range(0, len(prompt_ids), args.gen_batch_size)]
    real = len(chunks)
    if lockstep:
        chunks += [[[tok.eos_token_id]]] * (dist.max(real) - real)
    for c, rows in enumerate(chunks):
        width = max(map(len, rows))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with autocast(device, args.precision):
            # Trap: a model's generation_config may set top_p/top_k/repetition_penalty (Qwen does);
            # the policy ratio of E12 assumes plain temperature sampling, so override them.
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=temperature, top_p=1.0, top_k=0, repetition_penalty=1.0,
                                 max_new_tokens=args.max_new_tokens, stop_strings=[textenv.ACTION_END],
                                 tokenizer=tok, pad_token_id=tok.pad_token_id, synced_gpus=lockstep)
        if c >= real:
            continue                                            # a dummy call: nothing to keep
        for row in out[:, width:].tolist():                     # (n, <= max_new_tokens)
            resp = trim_response(row, tok, end_ids)
            responses.append(resp)
            texts.append(prefill + tok.decode(resp, skip_special_tokens=True))
    return texts, responses


def run_episodes(pool, tasks, model, tok, args, temperature, device, desc, show=True, dist=None):
    """Play one episode per task in the pool, generating for every active env at every step.
    Returns (trajs, samples, stats): a traj holds what compute_advantages reads (states, valid,
    score, success) plus text for the log; a sample is one env step (prompt ids, response ids,
    traj index, step), trained on once its advantage is known."""
    limit = getattr(model.config, "max_position_embeddings", None)
    limit = limit - args.max_new_tokens if limit else None
    obs, infos = pool.reset(tasks)
    n = len(tasks)
    # A crashed game (info["crash"]) ends as a failed episode; its states get the key CRASH_STATE
    # so the graph never merges it with a real state.
    trajs = [{"states": [info.get("state", CRASH_STATE)], "valid": [], "score": 0.0, "success": False,
              "task": task, "task_type": info.get("task_type", "all"), "goal": info.get("goal", ""),
              "steps": []} for task, info in zip(tasks, infos)]
    history = [[] for _ in range(n)]        # (observation, action) pairs for the prompt
    done = [bool(info.get("crash")) for info in infos]
    samples, stats = [], {"gen_tokens": 0, "gen_s": 0.0, "truncated_prompts": 0}
    for step in tqdm(range(args.max_steps), desc=desc, leave=False, dynamic_ncols=True, disable=not show):
        active = [i for i in range(n) if not done[i]]
        if dist is not None and dist.fsdp:     # generate in step with the ranks still playing
            if dist.max(len(active)) == 0:
                break
        elif not active:
            break
        prompts = []
        for i in active:
            recent = history[i][len(history[i]) - args.history_length:] if args.history_length else []
            ids, cut = fit_prompt(tok, trajs[i]["goal"], recent, obs[i], infos[i]["admissible"], args, limit)
            prompts.append(ids)
            stats["truncated_prompts"] += cut
        t0 = time.time()
        replies, responses = generate(model, tok, prompts, args, temperature, device, dist)
        stats["gen_s"] += time.time() - t0
        stats["gen_tokens"] += sum(map(len, responses))
        actions, parsed = [None] * n, {}    # None = leave that env alone (finished)
        for j, i in enumerate(active):
            parsed[i] = textenv.parse_action(replies[j])
            actions[i] = parsed[i] if parsed[i] is not None else NO_ACTION
        next_obs, rewards, dones, next_infos = pool.step(actions)
        for j, i in enumerate(active):
            info, traj = next_infos[i], trajs[i]
            valid = parsed[i] is not None and bool(info.get("valid", False))
            traj["states"].append(info.get("state", CRASH_STATE))
            traj["valid"].append(valid)
            traj["score"] += float(rewards[i])
            traj["steps"].append({"obs": obs[i], "admissible": infos[i]["admissible"],
                                  "reply": replies[j], "action": parsed[i], "valid": valid})
            samples.append({"traj": i, "step": step, "prompt_ids": prompts[j], "response_ids": responses[j]})
            history[i].append((obs[i], parsed[i] if parsed[i] is not None else NO_ACTION))
            if dones[i]:
                done[i] = True
                traj["success"] = bool(info.get("won", False))
            else:
                obs[i], infos[i] = next_obs[i], info
    return trajs, samples, stats


# ================================================================================================
# Update (E12): log-probs of response tokens, the clipped surrogate + k3 KL, the optimizer steps
# ================================================================================================

def collate(batch_samples, pad_id, device):
    """Left-pad prompt+response so every response ends at the last column; the response of row i
    is then the last len(response_i) columns. Returns input_ids, attention_mask (n, L), resp_mask (n, R)."""
    L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch_samples)
    R = max(len(s["response_ids"]) for s in batch_samples)
    ids = torch.full((len(batch_samples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch_samples), L), dtype=torch.long)
    resp_mask = torch.zeros((len(batch_samples), R), dtype=torch.float32)
    for i, s in enumerate(batch_samples):
        seq = s["prompt_ids"] + s["response_ids"]
        ids[i, L - len(seq):] = torch.tensor(seq)
        attn[i, L - len(seq):] = 1
        resp_mask[i, R - len(s["response_ids"]):] = 1
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "resp_mask": resp_mask.to(device)}


def _token_logprobs(hidden, weight, bias, targets, temperature):
    """log softmax(W h / T)[target] in fp32 for a chunk of positions: (n, c, H) -> (n, c)."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float()) / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def response_logprobs(model, batch, temperature, device, precision="fp32", chunk_tokens=1024):
    """log pi(token) of every response column, (n, R) fp32; values where resp_mask is 0 are
    meaningless and never used. The transformer runs under `precision`; the output projection,
    temperature and log-softmax run in fp32 (a bf16 head moves a log-prob by up to ~0.06), in
    chunks of columns so that at most ~chunk_tokens rows of (vocab,) logits exist at once: with
    Qwen2.5's 151,936-token vocabulary the full (n, R, vocab) tensor, held for backward, would
    take tens of GB. Each chunk's logits are recomputed in backward instead of stored."""
    n, R = batch["resp_mask"].shape
    # Positions from the mask, as generate computes them, so left padding does not shift RoPE.
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with autocast(device, precision):
        # Through the model's own forward (so FSDP's hooks run), keeping 1 position of its logits;
        # the last hidden state (after the final norm) is what the head needs.
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=position_ids, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, -R - 1:-1]  # (n, R, H): column j predicts token L-R+j
    targets = batch["input_ids"][:, -R:]          # (n, R)
    head = model.get_output_embeddings()
    step = max(1, chunk_tokens // n)
    chunks = []
    with torch.autocast(device.type, enabled=False):
        for lo in range(0, R, step):
            args = (hidden[:, lo:lo + step], head.weight, head.bias, targets[:, lo:lo + step], temperature)
            if torch.is_grad_enabled():
                chunks.append(recompute(_token_logprobs, *args, use_reentrant=False))
            else:
                chunks.append(_token_logprobs(*args))
    return torch.cat(chunks, dim=1)


def policy_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, kl_coef, num_tokens):
    """E12. logp, old_logp, ref_logp, mask: (n, R); adv: (n, 1) or (n, R); num_tokens: response
    tokens of the whole (global) minibatch, so micro-batch losses add up to its token-mean.
    Padded columns (mask 0) never enter the arithmetic: there logp holds a prompt token's log-prob
    and old/ref are 0, and exp() of their difference overflows (inf * 0 = NaN in the gradient).
    Returns (loss, {"pg_loss", "kl", "clip_frac"} as token sums over this micro-batch)."""
    real = mask > 0
    # log-ratio bounded as the reference trainers do (verl: +-20), so exp() stays finite
    log_ratio = torch.where(real, logp - old_logp, 0.0).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)              # = -min(rho*A, clip(rho)*A)
    if ref_logp is not None:
        r = torch.where(real, ref_logp - logp, 0.0).clamp(-20.0, 20.0)
        # k3 = exp(r) - r - 1 >= 0, unbiased for KL(pi||ref); expm1 because exp(r) - 1 in fp32
        # rounds a KL of ~1e-12 (lr 1e-6) to 0; capped at 10 as verl caps it
        kl = (torch.expm1(r) - r).clamp(max=10.0)
    else:
        kl = torch.zeros_like(logp)
    per_token = torch.where(real, pg + kl_coef * kl, 0.0)
    loss = per_token.sum() / num_tokens                          # token-mean over the minibatch
    stats = {"pg_loss": (pg * mask).sum().item(), "kl": (kl * mask).sum().item(),
             "clip_frac": ((pg_clipped > pg_unclipped).float() * mask).sum().item()}
    return loss, stats


def micro_batches(indices, samples, token_budget):
    """Split sample indices into micro-batches of at most token_budget padded tokens (at least one
    sample each), sorted by length so padding is small."""
    order = sorted(indices, key=lambda i: len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"])
        if current and max(longest, length) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


DUMMY = [{"prompt_ids": [0], "response_ids": [0]}]   # the one-token sample of an FSDP dummy micro-batch


def lockstep(plan, dist):
    """Under FSDP every forward and backward is a collective, so each rank runs as many
    micro-batches per optimizer step as the busiest rank: the others get dummies (None)."""
    if not dist.fsdp:
        return plan
    return [(n, mbs + [None] * (dist.max(len(mbs)) - len(mbs))) for n, mbs in plan]


def update_policy(model, ref_model, optimizer, samples, args, device, dist, generator, show=True):
    """E12 over this update's samples (one env step each, advantage attached): one epoch of
    minibatches of args.minibatch_size samples (0 = all in one), each an optimizer step whose loss
    is the token-mean over the minibatch's response tokens, accumulated over micro-batches of at
    most args.token_budget padded tokens. Under torchrun, minibatches are drawn from the global
    sample list (same permutation on every rank), each rank back-propagates its own samples of it,
    and gradients are summed across ranks before the step. Returns the update's statistics."""
    # The global sample list, in a canonical order: (owner rank, local index, response length).
    meta = dist.gather([(s["traj"], s["step"], dist.rank, i, len(s["response_ids"]), s["advantage"])
                        for i, s in enumerate(samples)])
    meta.sort()
    perm = torch.randperm(len(meta), generator=generator).tolist()
    size = args.minibatch_size or max(len(meta), 1)
    plan = []                               # per minibatch: (its global token count, micro-batches)
    for lo in range(0, len(perm), size):
        members = [meta[g] for g in perm[lo:lo + size]]
        mine = [m[3] for m in members if m[2] == dist.rank]
        if ref_model is None:
            # Without the KL term a sample whose advantage is exactly 0 adds exactly 0 to the loss
            # and its gradient: skip its forward and backward (its tokens still count in the mean),
            # and the whole step when no sample of the minibatch has a signal.
            if all(m[5] == 0.0 for m in members):
                continue
            mine = [i for i in mine if samples[i]["advantage"] != 0.0]
        plan.append((sum(m[4] for m in members), micro_batches(mine, samples, args.token_budget)))
    pad = model.generation_config.pad_token_id
    plan = lockstep(plan, dist)
    micros = [m for _, mbs in plan for m in mbs]
    if args.dump_advantages:                    # what each sample's loss term was weighted by
        for s in samples:
            s["loss_advantage"] = 0.0
    batches = {id(m): collate([samples[i] for i in m] if m else DUMMY, pad, device) for m in micros}

    def logprobs(net, micro):
        return response_logprobs(net, batches[id(micro)], args.temperature, device, args.precision,
                                 args.logit_chunk)

    model.train(args.gradient_checkpointing)   # HF checkpoints only in train mode; no dropout either way
    # pi_old: with one optimizer step it is the update's own forward, detached. With several, one
    # no-grad pass before the first step over exactly the micro-batches (same partition, same
    # padding) the steps will use: under bf16 the same sample's log-prob moves by up to ~0.1
    # between batch shapes, noise the clip would act on.
    single_step = len(plan) <= 1
    with torch.no_grad():
        old = {} if single_step else {id(m): logprobs(model, m) for m in micros}
        ref = {id(m): logprobs(ref_model, m) for m in micros} if ref_model is not None else {}
    totals = dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "grad_norm", "tokens"), 0.0)
    first_dev, first_clip = 0.0, 0.0
    bar = tqdm(total=len(micros), desc="update", leave=False, dynamic_ncols=True, disable=not show)
    for step, (num_tokens, mbs) in enumerate(plan):
        optimizer.zero_grad(set_to_none=True)
        for micro in mbs:
            logp = logprobs(model, micro)                                           # (n, R)
            batch_mask = batches[id(micro)]["resp_mask"]
            adv = torch.tensor([[samples[i]["advantage"]] for i in micro] if micro else [[0.0]],
                               device=device)                                                     # (n, 1)
            old_logp = logp.detach() if single_step else old[id(micro)]
            if step == 0:   # |rho - 1| before any step: 0 when pi_old is right
                dev = ((logp.detach() - old_logp).exp() - 1).abs() * batch_mask
                first_dev = max(first_dev, dev.max().item())
            loss, st = policy_loss(logp, old_logp, ref.get(id(micro)), adv, batch_mask,
                                   args.clip_eps, args.kl_coef, num_tokens)
            if micro is None:                        # an FSDP dummy: the collectives, weight 0
                loss, st = loss * 0.0, dict.fromkeys(st, 0.0)
            if step == 0:
                first_clip += st["clip_frac"]
            loss.backward()
            totals["loss"] += loss.item()
            for k in ("pg_loss", "kl", "clip_frac"):
                totals[k] += st[k]
            if args.dump_advantages and micro:
                for i, a in zip(micro, adv[:, 0].tolist()):
                    samples[i]["loss_advantage"] = a
            bar.update()
        dist.sum_gradients(model)
        params = [p for p in model.parameters() if p.requires_grad]
        totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        totals["tokens"] += num_tokens
        optimizer.step()
    bar.close()
    model.eval()
    loss, pg, kl, clip = dist.sum([totals["loss"], totals["pg_loss"], totals["kl"], totals["clip_frac"]])
    steps, tokens = max(len(plan), 1), max(totals["tokens"], 1)
    return {"loss": loss / steps, "pg_loss": pg / tokens, "kl": kl / tokens if ref_model is not None else None,
            "clip_frac": clip / tokens, "grad_norm": totals["grad_norm"] / steps, "optimizer_steps": len(plan),
            "first_step_ratio_dev": max(dist.gather([first_dev])),
            "first_step_clip_frac": dist.sum([first_clip])[0] / max(plan[0][0] if plan else 0, 1)}


# ================================================================================================
# Supervised warm start: behaviour cloning of the generated games' expert walkthroughs
# ================================================================================================

def walkthrough_samples(tok, args, limit):
    """One sample per expert step of every training game: the prompt the agent would see there
    (same format, history and truncation as a rollout) and the expert's reply as the response."""
    env = envs.make_env("alfworld", **{**alfworld_kwargs(args, "train"), "max_steps": 1000})
    samples = []
    for task in env.tasks:
        with open(os.path.join(env.root, task)) as fh:
            plan = json.load(fh).get("walkthrough")
        if not plan:
            raise UsageError(f"--warmup-epochs: {task} has no expert walkthrough (only generated games "
                             f"and the official ones carry it); use --warmup-epochs 0")
        obs, info = env.reset(task)
        goal, history = info["goal"], []
        for action in plan:
            recent = history[len(history) - args.history_length:] if args.history_length else []
            prompt, _ = fit_prompt(tok, goal, recent, obs, info["admissible"], args, limit)
            reply = f"{action}{textenv.ACTION_END}" if args.response_format == "action" else \
                f"{textenv.ACTION_PREFILL}{action}{textenv.ACTION_END}"
            samples.append({"prompt_ids": prompt, "response_ids": tok(reply, add_special_tokens=False).input_ids
                            + ([] if args.response_format == "action" else [tok.eos_token_id])})
            history.append((obs, action))
            obs, _, _, info = env.step(action)
    env.close()
    return samples


def freeze_below(model, trainable_layers):
    """Train only the top `trainable_layers` transformer blocks and the final norm (0 = all).
    On a CPU the backward pass then stops there: the update costs about half as much, and the
    optimizer state shrinks with the trained weights. Returns the trained parameters."""
    if trainable_layers:
        decoder = model.get_decoder()
        model.requires_grad_(False)
        for module in list(decoder.layers[-trainable_layers:]) + [decoder.norm]:
            module.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


def warm_start(model, tok, args, device, dist, show=True):
    """--warmup-epochs of token-mean cross-entropy on walkthrough_samples, minibatches of
    --num-groups x --group-size samples, its own AdamW (not kept). Returns the last epoch's loss."""
    limit = model.config.max_position_embeddings - args.max_new_tokens
    samples = walkthrough_samples(tok, args, limit)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.warmup_lr, weight_decay=args.weight_decay)
    size = args.num_groups * args.group_size
    pad = model.generation_config.pad_token_id
    generator = torch.Generator().manual_seed(args.seed)
    model.train(args.gradient_checkpointing)
    bar = tqdm(total=args.warmup_epochs * -(-len(samples) // size), desc="warm start", leave=False,
               dynamic_ncols=True, disable=not show)
    for epoch in range(args.warmup_epochs):
        total, tokens = 0.0, 0
        perm = torch.randperm(len(samples), generator=generator).tolist()
        for lo in range(0, len(perm), size):
            members = perm[lo:lo + size]
            mine = [i for k, i in enumerate(members) if k % dist.world == dist.rank]
            num_tokens = sum(len(samples[i]["response_ids"]) for i in members)
            optimizer.zero_grad(set_to_none=True)
            [(_, micros)] = lockstep([(num_tokens, micro_batches(mine, samples, args.token_budget))], dist)
            for micro in micros:
                batch = collate([samples[i] for i in micro] if micro else DUMMY, pad, device)
                logp = response_logprobs(model, batch, 1.0, device, args.precision, args.logit_chunk)
                loss = -torch.where(batch["resp_mask"] > 0, logp, 0.0).sum() / num_tokens
                if micro is None:                    # an FSDP dummy: the collectives, weight 0
                    loss = loss * 0.0
                loss.backward()
                total += loss.item() * num_tokens
            dist.sum_gradients(model)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            tokens += num_tokens
            bar.update()
    bar.close()
    model.eval()
    return dist.sum([total])[0] / max(tokens, 1)


# ================================================================================================
# Evaluation: held-out games at eval temperature, from an RNG stream of its own
# ================================================================================================

def eval_splits(args):
    return tuple(args.eval_splits.split(","))


def evaluate(args, model, tok, device, dist, seed, show=True):
    """Success (overall and per task type) and mean score on every held-out split. Draws from its
    own seeded RNG, so evaluating never changes the training stream (a resumed run matches an
    uninterrupted one, evaluated or not). Each rank plays its share of the games."""
    metrics = {}
    cuda_devices = [torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed + 7919 * dist.rank)
        for split in eval_splits(args):
            pool, tasks = make_pool(args, split)
            tasks = tasks[:args.eval_tasks or None]
            mine = [tasks[i] for i in dist.share(len(tasks))]
            trajs, _, _ = run_episodes(pool, mine, model, tok, args, args.eval_temperature, device,
                                       f"eval {split}", show, dist)
            pool.close()
            trajs = dist.gather([{k: t[k] for k in ("success", "score", "valid", "task_type")} for t in trajs])
            metrics.update(summarize(trajs, prefix=f"eval/{split}/"))
    return metrics


# ================================================================================================
# The training loop
# ================================================================================================

def main(argv=None, parsed=None):
    try:
        args, resuming = parsed or parse_args(sys.argv[1:] if argv is None else argv)
        run(args, resuming)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args, resuming):
    dist = Dist()
    setup = build(args, resuming, dist)
    if setup is None:                          # a finished run, resumed: nothing to do
        return
    pool, model, ref_model, tok, optimizer, memory, scheduler, log, start, device = setup
    if start == 0 and args.eval_every:          # "before": the policy before RL, on held-out games
        metrics = {"update": 0, **evaluate(args, model, tok, device, dist, args.seed, dist.main)}
        log and log.write(metrics, plan=None, trajs=[], advantages=[])

    K = args.group_size
    for update in tqdm(range(start + 1, args.updates + 1), desc="updates", initial=start, total=args.updates,
                       dynamic_ncols=True, disable=not dist.main):
        # ------------------------------------------------------------------------ rollout
        t0 = time.time()
        plan = scheduler.plan(update)                         # E11: B slots, explore + revisit
        tasks = [slot["task"] for slot in plan for _ in range(K)]
        mine = dist.share(len(tasks))                         # this rank's episodes (all of them alone)
        trajs, samples, gen = run_episodes(pool, [tasks[i] for i in mine], model, tok, args,
                                           args.temperature, device, f"rollout {update}", dist.main, dist)
        for s in samples:
            s["traj"] += mine.start                           # index into the whole batch
        trajs = dist.gather(trajs)
        groups = [{"task": slot["task"], "kind": slot["kind"], "ref_scores": slot["ref_scores"],
                   "trajs": trajs[g * K:(g + 1) * K]} for g, slot in enumerate(plan)]
        rollout_s = time.time() - t0

        # ------------------------------------------------------------------------ advantage
        t0 = time.time()
        graph_stats = memory.stats(groups)                    # before add: hit rates of this batch
        advantages = tigpo.compute_advantages(groups, args.algo, memory, **advantage_settings(args))
        attach_advantages(samples, advantages, K)             # E1-E9, [group][traj][step]
        adv_s = time.time() - t0

        # ------------------------------------------------------------------------ update (E12)
        t0 = time.time()
        order = torch.Generator().manual_seed(args.seed * 1000003 + update)   # same on every rank
        stats = update_policy(model, ref_model, optimizer, samples, args, device, dist, order, dist.main)
        update_s = time.time() - t0

        # ------------------------------------------------------------------------ memory and schedule
        if args.dump_advantages:                              # debug: what the loss saw, per sample
            seen = dist.gather([[s["traj"] // K, s["traj"] % K, s["step"], s["loss_advantage"]] for s in samples])
            log and log.dump_advantages(update, groups, memory, seen)
        memory.add(groups)                                    # E10, after the update
        scheduler.record(update, groups)                      # queue this update's exploration groups

        # ------------------------------------------------------------------------ eval
        metrics = {"update": update, **summarize(trajs)}
        if args.eval_every and (update % args.eval_every == 0 or update == args.updates):
            metrics.update(evaluate(args, model, tok, device, dist, args.seed + 1000003 * update, dist.main))

        # ------------------------------------------------------------------------ log and checkpoint
        drift = dist.replica_drift(model)                     # 0.0: every rank holds the same weights
        gen_tokens, gen_s, truncated = dist.sum([gen["gen_tokens"], gen["gen_s"], gen["truncated_prompts"]])
        tokens = dist.sum([sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)])[0]
        metrics.update(behaviour(trajs), **stats, **graph_metrics(graph_stats),
                       **zero_advantage(advantages),
                       revisits=sum(slot["kind"] == "revisit" for slot in plan),
                       num_samples=int(dist.sum([len(samples)])[0]), truncated_prompts=int(truncated),
                       **({"replica_drift": drift} if dist.world > 1 else {}),
                       rollout_s=rollout_s, adv_s=adv_s, update_s=update_s,
                       gen_tokens_per_s=gen_tokens / max(gen_s, 1e-9) * dist.world,
                       update_tokens_per_s=tokens / max(update_s, 1e-9))
        if log:
            log.write(metrics, plan, trajs, advantages)
        if update % args.save_every == 0 or update == args.updates:
            states = dist.gather([checkpoint.rng_state()])    # each rank's sampling stream
            model_state, optim_state = dist.full_state(model, optimizer)
            if dist.main:
                checkpoint.save_checkpoint(args.run_dir, update, model, tok, model_state, optim_state, memory,
                                           scheduler, args.keep_checkpoints, args, states)
            dist.barrier()
    pool.close()
    if log:
        log.close()
    dist.stop()


# ================================================================================================
# Setup: checks, seeding, envs, model (+ warm start, reference, FSDP), optimizer, memory, resume
# ================================================================================================

def build(args, resuming, dist):
    """Everything run() needs, in the order that lets bad input fail before slow work. Returns
    None for a finished run that was resumed."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    # A resumed run's config.json has every value; this only fills fields a newer version added.
    note = resolve_presets(args, torch.cuda.is_available())
    ckpt, start = checkpoint.last_checkpoint(args.run_dir) if resuming else (None, 0)
    if resuming and ckpt is None:
        raise UsageError(f"--resume: {args.run_dir} has no checkpoint; start anew without --resume in a "
                         f"new --run-dir")
    if resuming and start >= args.updates:
        if dist.main:
            print(f"{args.run_dir} is complete: its last checkpoint is update {start} of --updates "
                  f"{args.updates}. To train on, resume with a larger --updates, e.g. --updates "
                  f"{start + args.updates}")
        return None
    checkpoint.check_model_arg(args.model)      # before minutes of game generation
    device = torch.device(f"cuda:{dist.local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.start(device.type)
    say = print if dist.main else (lambda *a, **k: None)
    say(f"resuming {args.run_dir} with the settings of its config.json" if resuming else note)
    say(f"{args.algo} on {args.env}, {device.type} x {dist.world}: B={args.num_groups} (revisit <= "
        f"{args.revisit_groups}, delay {args.revisit_delay}) x K={args.group_size}, {args.updates} updates, "
        f"max_steps {args.max_steps}, response format {args.response_format}, model {args.model}")

    # One seeding block: python, numpy, torch (per rank: each rank samples its own episodes); the
    # envs, the games and the schedule get args.seed itself, so every rank makes the same plan.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed + dist.rank)

    try:       # the environment first: a bad data dir fails before minutes of model loading
        with dist.rank_zero_first():                  # games are generated once, by rank 0
            pool, train_tasks = make_pool(args, "train")
    except (ValueError, OSError, RuntimeError) as e:   # a broken data dir, no WebShop server
        raise UsageError(f"cannot start the {args.env} environment: {e}") from e

    model, tok, source = load_policy(args, device, say)
    log = RunLog(args, dist, resuming, start) if dist.main else None   # the run folder starts here
    if ckpt:
        checkpoint.load_weights(ckpt, model, device)                   # before FSDP shards them
    params = freeze_below(model, args.trainable_layers)
    if args.fsdp:
        dist.shard(model)                          # parameters, gradients, optimizer state
    warm_dir = os.path.join(args.run_dir, "warmstart")
    if args.warmup_epochs and start == 0:
        t0 = time.time()
        loss = warm_start(model, tok, args, device, dist, dist.main)
        say(f"warm start: {args.warmup_epochs} epoch(s) on the training games' walkthroughs, loss {loss:.3f}, "
            f"{time.time() - t0:.0f}s")
        if args.kl_coef > 0:                       # the KL reference of a resumed run
            state, _ = dist.full_state(model)
            if dist.main:
                checkpoint.save_model(warm_dir, model, tok, state)
    # The KL reference is the policy before RL (after the warm start), frozen, fp32 like the policy
    # (a bf16 copy would differ from pi_theta at update 1).
    ref_model = None
    if args.kl_coef > 0:
        if args.fsdp or start > 0:                 # a fresh copy: --model, or the warm-started weights
            ref_model, _, _ = load_policy(args, device, say=None)
            if args.warmup_epochs:
                checkpoint.load_weights(warm_dir, ref_model, device)
            if args.fsdp:
                dist.shard(ref_model)
        else:
            import copy
            ref_model = copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(params if not args.fsdp else [p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=args.weight_decay)
    memory = tigpo.GraphMemory(max_edges_per_task=args.max_edges_per_task)
    scheduler = tigpo.RevisitScheduler(train_tasks, args.num_groups, args.revisit_groups, args.revisit_delay,
                                       seed=args.seed)
    if ckpt:
        optim_state = checkpoint.load_state(ckpt, memory, scheduler, device, dist)
        dist.load_optimizer(model, optimizer, optim_state)
        say(f"resumed from {ckpt} at update {start}")
    return pool, model, ref_model, tok, optimizer, memory, scheduler, log, start, device


def load_policy(args, device, say):
    """The model and tokenizer of --model, fp32 on `device`, checked for a chat template and a
    context that leaves room for --max-new-tokens."""
    model, tok, source = checkpoint.load_model(args.model)
    if say:
        say(f"model {args.model} loaded from {source}")
    if not tok.chat_template:
        raise UsageError(f"--model {args.model} has no chat template (a base model?): use an instruct model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    context = getattr(model.config, "max_position_embeddings", None)
    if context and args.max_new_tokens >= context:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens")
    # fp32 master weights on every device: at lr 1e-6 bf16 weights do not move (the step is below
    # bf16 resolution); --precision bf16 runs the forward under autocast instead.
    model.to(device).eval()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tok, source


def attach_advantages(samples, advantages, group_size):
    """Give every sample (one env step: traj index in the whole batch, step) its advantage from
    compute_advantages' [group][traj][step] output, unchanged."""
    for s in samples:
        g, j = divmod(s["traj"], group_size)
        s["advantage"] = advantages[g][j][s["step"]]


def advantage_settings(args):
    """The keyword arguments of tigpo.compute_advantages, from the run's arguments."""
    return dict(success_reward=textenv.SUCCESS_REWARD, invalid_penalty=args.invalid_penalty,
                step_gamma=args.step_gamma, graph_gamma=args.graph_gamma, lambda_step=args.lambda_step,
                lambda_ep=args.lambda_ep, norm=args.norm, cross_temporal=args.cross_temporal)


def alfworld_kwargs(args, split):
    num_train, num_eval = map(int, args.num_games.split(","))
    return dict(split=split, data_dir=args.data_dir, max_steps=args.max_steps, state_key=args.state_key,
                seed=args.seed, task_types=args.task_types, max_receptacles=args.max_receptacles or None,
                num_train=num_train, num_eval=num_eval)


def make_pool(args, split):
    """(EnvPool, task keys) of one split. The task list comes from one env in this process
    (cheap: it lists games), the episodes run in the pool's worker processes."""
    if args.env == "alfworld":
        kw = alfworld_kwargs(args, split)
    else:
        # The real server loads its products inside its first request (minutes): make that request
        # once here, with a long timeout, before B*K workers each time out on it. No server listening
        # fails here, clearly, within seconds.
        webshop.warm_up(args.webshop_url)
        kw = dict(url=args.webshop_url, split=split, max_steps=args.max_steps, seed=args.seed,
                  num_goals=args.webshop_goals)
    env = envs.make_env(args.env, **kw)
    tasks = list(env.tasks)
    env.close()
    return envs.EnvPool(args.env, args.num_env_workers, **kw), tasks


if __name__ == "__main__":
    main(parsed=PARSED)
