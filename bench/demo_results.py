"""bench/demo_results.py: the tables and the figure of docs/RESULTS.md's "The CPU demo over seeds",
from the runs bench/demo_seeds.sh wrote (their metrics.jsonl and /usr/bin/time -v reports).

    python bench/demo_results.py runs/demo     # markdown tables; writes bench/demo_results.png
    python bench/demo_results.py results/every-seed   # bench/seeds.py's results folder

The wall column is /usr/bin/time's where the run folder has its report (time-ALGO-seedN.txt), and
the run's own rollout + update seconds (metrics.jsonl) otherwise.

Per run: eval success on the training games before RL -> after (with the episode counts and 95 %
Wilson intervals the run logged), training success in the first and the last quarter of its updates,
wall time. Paired by seed: each algorithm's change minus TIGPO's baseline's (GRPO, ...), mean +- std
over seeds.
"""

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from train import wilson  # noqa: E402


def read(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def ms(values):
    """mean ± sample std of the values given (None dropped), or "-"."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def timing(path):
    """(wall seconds, peak RSS GB) of a /usr/bin/time -v report, or (None, None)."""
    if not os.path.exists(path):
        return None, None
    with open(path) as fh:
        text = fh.read()
    wall = re.search(r"Elapsed \(wall clock\) time.*?: (?:(\d+):)?(\d+):([\d.]+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    seconds = None
    if wall:
        h, m, s = wall.groups()
        seconds = int(h or 0) * 3600 + int(m) * 60 + float(s)
    return seconds, int(rss.group(1)) / 2**20 if rss else None


def summary(rows):
    """What one run shows: eval before/after on the training games, quarter means of training
    success."""
    before = next(m for m in rows if m["update"] == 0)
    after = [m for m in rows if m["update"] > 0 and "eval/train/success_rate" in m][-1]
    curve = [(m["update"], m["success_rate"]) for m in rows if m["update"] > 0]
    q = max(1, math.ceil(len(curve) / 4))
    return {
        "before": before["eval/train/success_rate"],
        "before_n": before.get("eval/train/episodes"),
        "after": after["eval/train/success_rate"],
        "after_n": after.get("eval/train/episodes"),
        "first_q": statistics.fmean(s for _, s in curve[:q]),
        "last_q": statistics.fmean(s for _, s in curve[-q:]),
        "quarter": q,
        "curve": curve,
        "evals": [
            (m["update"], m["eval/train/success_rate"])
            for m in rows
            if "eval/train/success_rate" in m
        ],
        "steps": sum(m.get("optimizer_steps", 0) for m in rows if m["update"] > 0),
    }


def paired(runs, other):
    """Seeds both TIGPO and `other` ran: (seeds, TIGPO's eval change minus other's, last-quarter
    difference)."""
    t, o = runs["tigpo"], runs[other]
    common = sorted(set(t) & set(o))
    gain = [(t[s]["after"] - t[s]["before"]) - (o[s]["after"] - o[s]["before"]) for s in common]
    return common, gain, [t[s]["last_q"] - o[s]["last_q"] for s in common]


def interval(p, n):
    if not n:
        return f"{p:.2f}"
    lo, hi = wilson(p, n)
    return f"{p:.2f} [{lo:.2f}, {hi:.2f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--out", default=os.path.join(HERE, "demo_results.png"))
    a = parser.parse_args()
    runs, walls = {}, {}
    # bench/demo_seeds.sh's run folders (alfworld-ALGO-seedN) or bench/seeds.py's results
    # folder (ALGO/seedN, config.json and metrics.jsonl only)
    paths = glob.glob(os.path.join(a.folder, "alfworld-*-seed*", "metrics.jsonl"))
    paths += glob.glob(os.path.join(a.folder, "*", "seed*", "metrics.jsonl"))
    for path in sorted(paths):
        name = os.path.relpath(path, a.folder)
        algo, seed = re.match(r"(?:alfworld-)?([\w-]+?)[-/]seed(\d+)", name).groups()
        rows = read(path)
        wall, _ = timing(os.path.join(a.folder, f"time-{algo}-seed{seed}.txt"))
        if wall is None:  # no /usr/bin/time report: the run's own rollout + update seconds
            wall = sum(m.get("rollout_s", 0) + m.get("update_s", 0) for m in rows) or None
        walls[algo, int(seed)] = wall
        if not any(m["update"] > 0 and "eval/train/success_rate" in m for m in rows):
            print(f"skipped {path}: not finished (no evaluation after training yet)")
            continue
        runs.setdefault(algo, {})[int(seed)] = summary(rows)
    if not runs:
        sys.exit(f"bench/demo_results.py: no finished runs under {a.folder}")
    algos = sorted(runs, key=lambda x: (x != "tigpo", x))
    for algo in algos:
        seeds = runs[algo]
        print(f"\n### {algo} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})\n")
        print(
            "| seed | eval on the training games, before RL | after RL | change | training "
            "success, first "
            "quarter | last quarter | optimizer steps | wall |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for seed, s in sorted(seeds.items()):
            wall = walls[algo, seed]
            print(
                f"| {seed} | {interval(s['before'], s['before_n'])} (n={s['before_n']}) | "
                f"{interval(s['after'], s['after_n'])} (n={s['after_n']}) | "
                f"{s['after'] - s['before']:+.2f} | "
                f"{s['first_q']:.2f} (updates 1-{s['quarter']}) | {s['last_q']:.2f} | "
                f"{s['steps']} | "
                f"{'-' if wall is None else f'{wall / 60:.1f} min'} |"
            )
        up = sum(s["after"] > s["before"] for s in seeds.values())
        rising = sum(s["last_q"] > s["first_q"] for s in seeds.values())
        print(
            f"\nmean ± std over seeds: before {ms([s['before'] for s in seeds.values()])}, after "
            f"{ms([s['after'] for s in seeds.values()])}, "
            f"change {ms([s['after'] - s['before'] for s in seeds.values()])};"
            f" training success first quarter {ms([s['first_q'] for s in seeds.values()])}, last "
            "quarter "
            f"{ms([s['last_q'] for s in seeds.values()])}. After > before on {up} of {len(seeds)} "
            "seeds; "
            f"last quarter > first quarter on {rising} of {len(seeds)}."
        )
    if "tigpo" in runs:
        for other in algos[1:]:
            common, gain, last = paired(runs, other)
            if not common:
                continue
            print(f"\n### tigpo minus {other}, paired by seed (seeds {common})\n")
            print(
                "| seed | difference in eval change (after - before) | difference in last-quarter "
                "training success |"
            )
            print("|---|---|---|")
            for s, g, l_ in zip(common, gain, last):
                print(f"| {s} | {g:+.2f} | {l_:+.2f} |")
            print(f"| mean ± std | {ms(gain)} | {ms(last)} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(
            "bench/demo_results.py: the tables are above; the figure needs pip install matplotlib"
        )
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for i, algo in enumerate(algos):
        color, seeds = f"C{i}", runs[algo]
        curves = [dict(s["curve"]) for s in seeds.values()]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        for c in curves:
            axes[0].plot(sorted(c), [c[x] for x in sorted(c)], color=color, alpha=0.2, lw=1)
        axes[0].plot(
            xs,
            [statistics.fmean(c[x] for c in curves) for x in xs],
            color=color,
            lw=2.2,
            marker="o",
            ms=3,
            label=algo if len(curves) == 1 else f"{algo} (mean of {len(curves)} seeds)",
        )
        evals = [dict(s["evals"]) for s in seeds.values()]
        ex = sorted(set.intersection(*(set(e) for e in evals)))
        axes[0].plot(
            ex,
            [statistics.fmean(e[x] for e in evals) for x in ex],
            color=color,
            lw=1.2,
            ls="--",
            marker="s",
            ms=5,
            label=f"{algo}: eval on the training games (T 0.4)",
        )
        for k, (_, s) in enumerate(sorted(seeds.items())):
            x = i * 0.25 + k * 0.03
            axes[1].plot(
                [x, x + 1],
                [s["before"], s["after"]],
                color=color,
                alpha=0.6,
                marker="o",
                ms=3,
                label=algo if k == 0 else None,
            )
    axes[0].set_title(
        "training success per update (thin: one seed)\nsquares: eval before RL (update 0) and after"
    )
    axes[0].set_xlabel("update")
    axes[1].set_title(
        "eval success on the training games (T 0.4)\nbefore RL (left) -> after (right), one line "
        "a seed"
    )
    axes[1].set_xticks([0.3, 1.3], ["before RL", "after RL"])
    if "tigpo" in runs and len(algos) > 1:
        width = 0.8 / (len(algos) - 1)
        for j, other in enumerate(algos[1:]):
            common, gain, _ = paired(runs, other)
            axes[2].bar(
                [k + j * width for k in range(len(common))],
                gain,
                width=width,
                color=f"C{j + 1}",
                label=f"tigpo - {other}",
            )
            axes[2].set_xticks(range(len(common)), [f"seed {s}" for s in common])
        axes[2].axhline(0, color="black", lw=0.8)
        axes[2].set_title("paired by seed: TIGPO's eval change\nminus the baseline's")
    else:
        axes[2].text(
            0.5,
            0.5,
            "one algorithm only: no pairing",
            ha="center",
            va="center",
            transform=axes[2].transAxes,
        )
        axes[2].set_xticks([])
        axes[2].set_yticks([])
    for ax in axes[:2]:
        ax.set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
