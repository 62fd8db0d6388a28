"""evaluate.py: evaluate a checkpoint, or any model, the way papers report it.

    python evaluate.py runs/NAME                              # its newest checkpoint
    python evaluate.py runs/NAME --checkpoint update_000006 --eval-seeds 3
    python evaluate.py --model HuggingFaceTB/SmolLM2-135M-Instruct --preset cpu  # untrained

The protocol of the papers' tables: every game of the held-out splits (ALFWorld valid_seen and
valid_unseen; WebShop test), temperature 0.4, N seeds; success overall and per task type as mean
+- std over the seeds (WebShop: score and success). A run is evaluated with the settings of its
config.json (environment, games, prompt format, horizon); a bare --model with those of --preset.
Prints the table and writes it as JSON beside the checkpoint (checkpoints/update_N.eval.json;
for a bare --model, --out or runs/eval-<model>.json). The run's own files are never changed.
"""

import argparse
import json
import os
import re
import statistics
import sys

import envs
import train
from train import UsageError


def parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", nargs="?", help="a run folder of train.py")
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint name in the run (default: the newest)"
    )
    parser.add_argument(
        "--model", default=None, help="evaluate this model instead (HF id or folder)"
    )
    parser.add_argument(
        "--env", default="alfworld", choices=("alfworld", "webshop"), help="with --model"
    )
    parser.add_argument(
        "--preset",
        default="auto",
        choices=("auto", "paper", "cpu"),
        help="settings for a bare --model (default: paper on CUDA, cpu otherwise)",
    )
    parser.add_argument("--data-dir", default=None, help="ALFWorld data (default: the run's)")
    parser.add_argument("--webshop-url", default=None, help="WebShop server (default: the run's)")
    parser.add_argument(
        "--eval-seeds", type=int, default=3, help="seeds; the table shows mean +- std"
    )
    parser.add_argument(
        "--splits",
        default=None,
        help="comma-separated splits (default: the held-out ones, "
        "ALFWorld valid_seen,valid_unseen; WebShop test)",
    )
    parser.add_argument("--eval-tasks", type=int, default=0, help="games per split; 0 = all")
    parser.add_argument("--eval-temperature", type=float, default=0.4)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--out", default=None, help="where to write the JSON")
    a = parser.parse_args(argv)
    if a.run_dir is None and a.model is None:
        parser.error("give a run folder, or --model (or both: a run's settings with another model)")
    if a.eval_seeds < 1:
        parser.error("--eval-seeds must be >= 1")
    return a


def settings(a):
    """(train.Args, model to load, JSON path) for the run or the bare model."""
    if a.run_dir:
        config = os.path.join(a.run_dir, "config.json")
        if not os.path.exists(config):
            raise UsageError(f"{a.run_dir} holds no run (no config.json)")
        with open(config) as fh:
            saved = json.load(fh)
        known = {f for f in train.Args.__dataclass_fields__}
        args = train.Args(**{k: v for k, v in saved.items() if k in known})
        root = os.path.join(a.run_dir, "checkpoints")
        names = train.checkpoint_names(root)
        name = a.checkpoint or (names[-1] if names else None)
        if a.model is None and (name is None or not os.path.isdir(os.path.join(root, name))):
            raise UsageError(
                f"{a.run_dir} has no checkpoint {a.checkpoint or ''} (have {names or 'none'})"
            )
        model = a.model or os.path.join(root, name)
        out = a.out or (os.path.join(root, f"{name}.eval.json") if a.model is None else None)
    else:
        import torch

        args, _ = train.parse_args(
            [
                "--env",
                a.env,
                "--preset",
                a.preset,
                "--model",
                a.model,
                "--device",
                a.device,
                "--run-dir",
                os.path.join("runs", ".eval-settings-unused"),
            ],
            cuda=torch.cuda.is_available(),
        )
        model = a.model
        out = None
    if out is None:
        out = a.out or os.path.join(
            "runs", "eval-" + re.sub(r"[^\w.-]+", "_", model.strip("/")) + ".json"
        )
    args.eval_tasks, args.eval_temperature, args.device = a.eval_tasks, a.eval_temperature, a.device
    args.eval_repeats = 1  # the seeds are the repeats here
    # the papers' held-out splits, whatever the run evaluated while training (the cpu preset: its
    # train games)
    args.eval_splits = (
        a.splits or {"alfworld": "valid_seen,valid_unseen", "webshop": "test"}[args.env]
    )
    known = envs.SPLITS[args.env]
    if not set(args.eval_splits.split(",")) <= set(known):
        raise UsageError(
            f"--splits {args.eval_splits}: {args.env} has the splits {','.join(known)}"
        )
    if a.data_dir:
        args.data_dir = a.data_dir
    if a.webshop_url:
        args.webshop_url = a.webshop_url
    return args, model, out


def mean_std(values):
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "per_seed": values,
    }


def table(result):
    """The paper's main-table layout: one row per split, success % per task type and overall."""
    types = list(envs.ALFWORLD_TASK_TYPES) if result["env"] == "alfworld" else []
    cols = types + ["all"] + (["score"] if result["env"] == "webshop" else [])
    lines = [f"{'split':14s}" + "".join(f" | {c:>13s}" for c in cols)]
    for split, r in result["splits"].items():
        cells = []
        for c in cols:
            cell = (
                r["success"]
                if c == "all"
                else r["mean_score"]
                if c == "score"
                else r["per_type"].get(c)
            )
            scale = 10.0 if c == "score" else 100.0  # WebShop's score in 0-100, as papers show it
            cells.append(
                "-" if cell is None else f"{scale * cell['mean']:5.1f} ± {scale * cell['std']:4.1f}"
            )
        lines.append(f"{split:14s}" + "".join(f" | {c:>13s}" for c in cells))
    return "\n".join(lines)


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    try:
        import torch

        args, model_name, out = settings(a)
        if a.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is visible")
        train.check_model_arg(model_name)
        device = torch.device("cuda" if torch.cuda.is_available() and a.device != "cpu" else "cpu")
        model, tok, source = train.load_policy(model_name, device, args.max_new_tokens)
        print(
            f"evaluating {model_name} ({source}) on {args.env}, {a.eval_seeds} seed(s), "
            "temperature "
            f"{a.eval_temperature}, response format {args.response_format}"
        )
        fast = None
        if device.type == "cpu":  # on a CPU, sampling as train.py samples there
            from extras import cpu_sampling as fast
        sample = train.make_sampler(args, model, tok, fast=fast)
        prompt = train.prompt_builder(args, tok, model)
        per_seed = [train.evaluate(args, sample, prompt, seed) for seed in range(a.eval_seeds)]
    except UsageError as e:
        sys.exit(f"evaluate.py: error: {e}")
    result = {
        "model": model_name,
        "env": args.env,
        "seeds": list(range(a.eval_seeds)),
        "temperature": a.eval_temperature,
        "eval_tasks": a.eval_tasks,
        "splits": {},
    }
    for split in args.eval_splits.split(","):
        prefix = f"eval/{split}/"
        present = [t for t in envs.ALFWORLD_TASK_TYPES if f"{prefix}success/{t}" in per_seed[0]]
        result["splits"][split] = {
            "success": mean_std([m[f"{prefix}success_rate"] for m in per_seed]),
            "mean_score": mean_std([m[f"{prefix}mean_score"] for m in per_seed]),
            "per_type": {
                t: mean_std([m[f"{prefix}success/{t}"] for m in per_seed]) for t in present
            },
        }
    print(table(result))
    folder = os.path.dirname(out)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
