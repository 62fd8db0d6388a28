"""plot.py: the curves of one or more runs, from their metrics.jsonl alone.

    python tools/plot.py runs/A runs/B ...                 # writes plots.png and plots.svg
    python tools/plot.py runs/alfworld-* --out fig/alfworld

One panel per quantity a paper figure needs: training success rate, valid-action ratio, held-out
success per split, KL, the fraction of zero advantages, the graph memory's size, and its task and
state hit rates. One thin line per run, labelled by algorithm and seed (from the run's
config.json); when several runs share an algorithm, their mean is drawn bold with a +-1 std band.
A run that is still training can be plotted (a half-written last line is skipped). Needs
matplotlib (optional: pip install matplotlib).
"""
import argparse
import json
import os
import sys
from collections import defaultdict

PANELS = [  # (title, metric keys drawn in the panel; a trailing * matches a family)
    ("training success rate", ["success_rate"]),
    ("valid-action ratio", ["valid_action_ratio"]),
    ("held-out success rate", ["eval/*/success_rate"]),
    ("KL(pi || ref), per token", ["kl"]),
    ("zero-advantage fraction", ["zero_adv_frac"]),
    ("graph memory size", ["graph_nodes", "graph_edges"]),
    ("graph hit rates", ["task_hit_rate", "state_hit_rate"]),
    ("distinct actions per update", ["distinct_actions"]),
]


def read_run(folder):
    """(label, algo, {metric: [(update, value), ...]}) of one run folder."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"plot.py: error: {folder} has no metrics.jsonl (is it a run folder?)")
    config = {}
    if os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
    series = defaultdict(list)
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:   # a run still writing its last line
                continue
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "update":
                    series[key].append((row["update"], float(value)))
    algo = config.get("algo", os.path.basename(os.path.normpath(folder)))
    label = f"{algo} seed {config['seed']}" if "seed" in config else os.path.basename(os.path.normpath(folder))
    return label, algo, dict(series)


def expand(pattern, runs):
    if "*" not in pattern:
        return [pattern]
    head, tail = pattern.split("*")
    return sorted({k for _, _, s in runs for k in s if k.startswith(head) and k.endswith(tail)})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
    parser.add_argument("--out", default="plots", help="output path without extension (default: plots)")
    a = parser.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        sys.exit("plot.py: error: matplotlib is not installed: pip install matplotlib")
    import numpy as np
    runs = [read_run(folder) for folder in a.runs]
    by_algo = defaultdict(list)
    for run in runs:
        by_algo[run[1]].append(run)
    colors = {algo: f"C{i}" for i, algo in enumerate(by_algo)}
    panels = [(title, [k for p in keys for k in expand(p, runs)]) for title, keys in PANELS]
    panels = [(title, keys) for title, keys in panels if any(k in s for _, _, s in runs for k in keys)]
    cols = 3
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        styles = ["-", "--", ":", "-."]
        for k_index, key in enumerate(keys):
            style = styles[k_index % len(styles)]
            suffix = f" {key}" if len(keys) > 1 else ""
            for algo, members in by_algo.items():
                color = colors[algo]
                curves = [dict(s[key]) for _, _, s in members if key in s]
                for (label, _, s) in members:
                    if key in s:
                        xs, ys = zip(*s[key])
                        ax.plot(xs, ys, style, color=color, alpha=0.35 if len(curves) > 1 else 1.0,
                                lw=1, marker="o" if len(xs) == 1 else None,
                                label=None if len(curves) > 1 else label + suffix)
                if len(curves) > 1:   # mean +- std over the runs of this algorithm
                    xs = sorted(set.intersection(*(set(c) for c in curves)))
                    if xs:
                        values = np.array([[c[x] for x in xs] for c in curves])
                        mean, std = values.mean(0), values.std(0)
                        ax.plot(xs, mean, style, color=color, lw=2.2,
                                label=f"{algo} (mean of {len(curves)}){suffix}")
                        ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    folder = os.path.dirname(a.out)
    if folder:
        os.makedirs(folder, exist_ok=True)
    for ext in ("png", "svg"):
        fig.savefig(f"{a.out}.{ext}", dpi=110)
    print(f"wrote {a.out}.png and {a.out}.svg ({len(runs)} run(s), {len(panels)} panels)")


if __name__ == "__main__":
    main()
