"""config.py: the command line of train.py, made from its Args dataclass: one flag per field, the
preset's values for the fields not given, --resume's saved settings, and the range checks.
Standard library only."""
import argparse
import dataclasses
import json
import os


class UsageError(Exception):
    """Bad input: reported as one line `train.py: error: ...`, exit code 2, nothing written."""


def arg(default, help, choices=None, type=None):
    """A dataclass field that is also a command-line flag (--field-name) with its help text."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "type": type})


# Flags that may change when a run is resumed; every other field must match the saved run.
RESUMABLE = {"eval_splits", "updates", "resume", "save_every", "eval_every", "eval_tasks", "eval_repeats",
             "num_env_workers", "keep_checkpoints", "log_trajectories", "dump_advantages", "track", "device",
             "token_budget", "logit_chunk", "gen_batch_size", "data_dir", "webshop_url"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line naming the fix, instead of argparse's usage dump
        raise UsageError(f"{message} (see python train.py --help)")


SPLITS = {"alfworld": ("train", "valid_seen", "valid_unseen"), "webshop": ("train", "test")}   # each env's splits


def parse(Args, settings, argv, cuda, description):
    """(args, resuming): the flags given, over the values of settings[(preset, env)], over Args'
    defaults; with --resume, the saved config.json instead (only RESUMABLE flags may change)."""
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Args):
        shown = [f"{f.default}"] + [f"{p} {e}: {v[f.name]}" for (p, e), v in settings.items() if f.name in v]
        kw = dict(help=f"{f.metadata['help']} [default: {'; '.join(shown)}]", default=argparse.SUPPRESS)
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = f.metadata["type"] or type(f.default)
            kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    given = vars(parser.parse_args(argv))                 # only the flags on the command line
    first = Args(**given)
    run_dir = first.run_dir or os.path.join("runs", f"{first.env}-{first.algo}-seed{first.seed}")
    if first.resume:
        return _resumed(Args, given, run_dir), True
    if os.path.exists(run_dir) and os.listdir(run_dir):
        raise UsageError(f"{run_dir} already holds a run; pass --resume to continue it, or another --run-dir")
    if first.device == "cuda" and not cuda:
        raise UsageError("--device cuda but no CUDA device is visible; use --device auto or cpu")
    preset = first.preset if first.preset != "auto" else ("paper" if cuda and first.device != "cpu" else "cpu")
    args = Args(**{**settings.get((preset, first.env), {}), **given, "preset": preset, "run_dir": run_dir})
    if args.algo != "tigpo":
        if given.get("revisit_groups"):
            raise UsageError(f"--revisit-groups needs --algo tigpo ({args.algo} explores only); drop it")
        args.revisit_groups = 0                           # the baselines explore only
    if args.env != "alfworld" and args.warmup_epochs:
        raise UsageError("--warmup-epochs clones ALFWorld's expert walkthroughs; WebShop has none: "
                         "use --warmup-epochs 0")
    check(args)
    return args, False


def _resumed(Args, given, run_dir):
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise UsageError(f"--resume: {run_dir} holds no run (no config.json); drop --resume to start one")
    with open(path) as fh:
        saved = json.load(fh)
    for k, v in given.items():
        if k not in RESUMABLE and k != "run_dir" and saved.get(k) != v:
            raise UsageError(f"--resume: --{k.replace('_', '-')} {v} differs from the saved run "
                             f"({saved.get(k)}); drop the flag or start a new --run-dir")
    known = {f.name for f in dataclasses.fields(Args)}
    args = Args(**{**{k: v for k, v in saved.items() if k in known},
                   **{k: v for k, v in given.items() if k in RESUMABLE}, "run_dir": run_dir, "resume": True})
    check(args)
    return args


def check(args):
    """Range checks of every value, and the files the flags name, before any slow work."""
    types = [t.strip() for t in args.task_types.split(",")]
    task_types = ("pick", "look", "clean", "heat", "cool", "pick2")
    checks = [
        (args.num_groups >= 1, "--num-groups must be >= 1"),
        (args.group_size >= 1, "--group-size must be >= 1"),
        (0 <= args.revisit_groups <= args.num_groups, "--revisit-groups must be in [0, --num-groups]"),
        (args.revisit_delay >= 1 or not args.revisit_groups, "--revisit-delay must be >= 1 when --revisit-groups > 0: "
         "a group explored at update k can be revisited at k + 1 at the earliest"),
        (args.updates >= 1, "--updates must be >= 1"),
        (args.max_steps >= 1, "--max-steps must be >= 1"),
        (args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (args.history_length >= 0, "--history-length must be >= 0"),
        (args.temperature > 0, "--temperature must be > 0 (E12's ratio needs a sampling distribution)"),
        (args.eval_temperature > 0, "--eval-temperature must be > 0"),
        (args.eval_repeats >= 1, "--eval-repeats must be >= 1"),
        (args.warmup_minibatch_size >= 1, "--warmup-minibatch-size must be >= 1"),
        (args.logit_chunk >= 1, "--logit-chunk must be >= 1"),
        (args.rollout_is_cap is None or args.rollout_is_cap >= 0, "--rollout-is-cap must be >= 0 (0 = off)"),
        (len(args.num_games.split(",")) == 2 and all(x.strip().isdigit() for x in args.num_games.split(","))
         and int(args.num_games.split(",")[0]) >= 1, "--num-games must be TRAIN,EVAL, e.g. 24,6"),
        (types == ["all"] or set(types) <= set(task_types),
         f"--task-types must be 'all' or some of {','.join(task_types)}"),
        (not args.fsdp or int(os.environ.get("WORLD_SIZE", "1")) >= 2,
         "--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)"),
        (not args.track or __import__("importlib").util.find_spec("wandb") is not None,
         "--track needs Weights & Biases: pip install wandb (or drop --track)"),
        (not args.data_dir or os.path.isdir(os.path.expanduser(args.data_dir)),
         f"--data-dir {args.data_dir} is not a folder; point it at the folder holding json_2.1.1 or drop "
         f"it to use generated games"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    known = SPLITS[args.env]
    if not set(args.eval_splits.split(",")) <= set(known):
        raise UsageError(f"--eval-splits {args.eval_splits}: {args.env} has the splits {','.join(known)}")
