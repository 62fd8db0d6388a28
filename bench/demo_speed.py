"""bench/demo_speed.py: the CPU demo (`python train.py --env alfworld`) at an earlier commit beside
this checkout's, on the same seed and machine, one after the other: seconds per update (rollout,
update), update tokens/s, the whole run's wall time, and what each run learned.

    python bench/demo_speed.py                      # seed 0, the 10-update demo (~45 min, 2 cores)
    python bench/demo_speed.py --seeds 0 51 -- --updates 4   # any train.py flag after --
    python bench/demo_speed.py --baseline 9883660 -- --rollout-engine vllm

The earlier commit is checked out into a temporary git worktree (the repository's history is
all it needs) and runs with the Python that runs this script. Both runs write under --out. Run
it on a quiet machine: other processes slow both runs, and not equally.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "9883660"  # the last commit before the update reuses the frozen blocks (issue 29)


def run_demo(tree, run_dir, seed, extra):
    """Wall seconds of one `python train.py --env alfworld` in `tree`; its log beside the run."""
    cmd = [sys.executable, "train.py", "--env", "alfworld", "--seed", str(seed)]
    cmd += ["--run-dir", run_dir, *extra]
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    start = time.time()
    with open(run_dir + ".log", "w") as log:
        subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - start


def read(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def learned(rows):
    """(eval on the training games before, after; training success, first quarter, last)."""
    evals = [r["eval/train/success_rate"] for r in rows if "eval/train/success_rate" in r]
    train = [r["success_rate"] for r in rows if r["update"] > 0]
    quarter = max(len(train) // 4, 1)
    first = sum(train[:quarter]) / quarter
    last = sum(train[-quarter:]) / quarter
    before = evals[0] if len(evals) > 1 else None
    return before, evals[-1] if evals else None, first, last


def mean(values):
    return sum(values) / len(values)


def report(seed, runs):
    """The side-by-side table of one seed; runs: {label: (rows, wall seconds)}."""
    (old_label, (old, old_wall)), (new_label, (new, new_wall)) = runs.items()
    old = [r for r in old if r["update"] > 0]
    new = [r for r in new if r["update"] > 0]
    print(f"\nseed {seed}: {old_label} vs {new_label} (seconds; ratio new / old)")
    header = "update | rollout s old  new | update s old  new | update tok/s old  new | s/update"
    print(header)
    print("-" * len(header))
    for a, b in zip(old, new):
        per_update = (b["rollout_s"] + b["update_s"]) / (a["rollout_s"] + a["update_s"])
        print(
            f"{a['update']:6d} | {a['rollout_s']:13.1f} {b['rollout_s']:4.1f} | "
            f"{a['update_s']:12.1f} {b['update_s']:4.1f} | {a['update_tokens_per_s']:16.0f} "
            f"{b['update_tokens_per_s']:4.0f} | {per_update:7.2f}x"
        )

    def per_update(rows, key):
        return mean([key(r) for r in rows])

    def total(r):
        return r["rollout_s"] + r["update_s"]

    def tokens(r):
        return r["update_tokens_per_s"] * r["update_s"]

    def rollout(r):
        return r["rollout_s"]

    def update(r):
        return r["update_s"]

    o, n = per_update(old, total), per_update(new, total)
    print(f"mean per update: {o:.1f} s -> {n:.1f} s ({n / o:.2f}x)")
    for name, key, unit in (
        ("rollout", rollout, "s"),
        ("update", update, "s"),
        ("update tokens", tokens, ""),
    ):
        print(f"  {name}: {per_update(old, key):.0f} -> {per_update(new, key):.0f} {unit}")

    # per unit of work: a run that learns plays shorter episodes, and the update skips samples
    # whose advantage is 0, so the seconds per update also measure what each run learned
    def per(rows, seconds, count):
        return sum(map(seconds, rows)) / sum(map(count, rows))

    def trained(r):
        return r["num_samples"] * (1.0 - r["zero_adv_frac"])

    for name, seconds, count in (
        ("rollout s per env step", rollout, lambda r: r["num_samples"]),
        ("update s per trained sample", update, trained),
    ):
        o, n = per(old, seconds, count), per(new, seconds, count)
        print(f"  {name}: {o:.2f} -> {n:.2f} ({n / o:.2f}x)")
    print(f"whole run: {old_wall / 60:.1f} -> {new_wall / 60:.1f} min ({new_wall / old_wall:.2f}x)")
    for label, (rows, _) in runs.items():
        before, after, first, last = learned(rows)
        shown = f"{before:.2f} -> {after:.2f}" if before is not None else "-"
        print(
            f"  {label}: eval on the training games {shown}; training success, first quarter "
            f"{first:.2f} -> last {last:.2f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the earlier commit")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "demo-speed"))
    parser.add_argument("extra", nargs="*", help="train.py flags for both runs (after --)")
    a = parser.parse_args()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    )
    label = head + ("+changes" if dirty.stdout.strip() else "")
    tree = os.path.join(tempfile.mkdtemp(prefix="tigpo-baseline-"), "tree")
    add = ["git", "worktree", "add", "--detach", tree, a.baseline]
    subprocess.run(add, cwd=ROOT, check=True, capture_output=True)
    load = os.getloadavg()[0]
    print(f"{a.baseline} (in {tree}) vs this checkout ({label}); load average {load:.1f}")
    try:
        for seed in a.seeds:
            runs = {}
            for name, where in ((a.baseline, tree), (label, ROOT)):
                run_dir = os.path.join(os.path.abspath(a.out), f"{name}-seed{seed}")
                shutil.rmtree(run_dir, ignore_errors=True)
                wall = run_demo(where, run_dir, seed, a.extra)
                runs[name] = (read(run_dir), wall)
            report(seed, runs)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=False)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
