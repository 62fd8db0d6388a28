"""extras/plot.py: the curves of one or more runs, from their metrics.jsonl alone.

    python extras/plot.py runs/alfworld-tigpo-seed0     # -> runs/alfworld-tigpo-seed0/plots.png
    python extras/plot.py runs/alfworld-tigpo-seed0 runs/alfworld-grpo-seed0   # -> runs/plots.png
    python extras/plot.py runs/alfworld-* --out fig/alfworld  # -> fig/alfworld.png, .svg

Where the figure goes: next to the run. One run: into its folder (<run>/plots.png and
<run>/plots.svg); several runs: into the folder that holds the first of them (runs/plots.png for
runs/A runs/B). --out PATH (without extension) writes PATH.png and PATH.svg instead.

The figure is the same 3 x 3 grid for every set of runs, so two figures compare panel by panel:

    training success rate | eval success on the training games | held-out success (other eval
    splits)
    valid-action ratio    | KL(pi || ref), per token            | zero-advantage fraction
    graph memory size     | graph hit rates (task, state)       | distinct actions per update

A panel whose quantity no run logged is drawn empty with one line saying why (e.g. "no KL term:
trained with --kl-coef 0"), not left out. Per-update curves: one thin line per run, coloured by
algorithm and labelled by algorithm and seed (from config.json); when several runs share an
algorithm, their mean is drawn bold with a +-1 std band. Eval curves (a few points: before training
and every --eval-every updates) are markers, one shape per split, joined by a dotted line only when
a series has at least DENSE points; each point has its 95% Wilson interval when metrics.jsonl has
eval/<split>/episodes (no bars without it); series are nudged sideways so equal values (two splits
at 0) stay visible; several runs of an algorithm: faint markers per run and their mean, bold, with
+-1 std across runs. A run that is still training can be plotted (a half-written last line is
skipped). Needs matplotlib (in requirements.txt).
"""

import argparse
import json
import math
import os
import sys
from collections import defaultdict

# (title, metric keys drawn in the panel; a trailing * matches a family, keys after "-" are left
# out, whether the values are rates in [0, 1], the note when no run logged the panel's keys)
PANELS = [
    ("training success rate", ["success_rate"], True, "no training success logged"),
    (
        "eval success on the training games",
        ["eval/train/success_rate"],
        True,
        "no eval on the training games\n(--eval-splits has no train)",
    ),
    (
        "held-out success",
        ["eval/*/success_rate", "-eval/train/success_rate"],
        True,
        "no held-out eval in these runs",
    ),
    ("valid-action ratio", ["valid_action_ratio"], True, "no valid-action ratio logged"),
    ("KL(pi || ref), per token", ["kl"], False, None),  # note: see kl_note
    ("zero-advantage fraction", ["zero_adv_frac"], True, "no zero-advantage fraction logged"),
    ("graph memory size", ["graph_nodes", "graph_edges"], False, "no graph memory metrics logged"),
    ("graph hit rates", ["task_hit_rate", "state_hit_rate"], True, "no graph hit rates logged"),
    ("distinct actions per update", ["distinct_actions"], False, "no distinct-action count logged"),
]
COLS = 3
DENSE = 8  # eval series with at least this many points get a line
MARKERS = ["o", "s", "^", "D", "v", "P"]  # one per eval split, the same in every panel
STYLES = ["-", "--", ":", "-."]  # one per key of a per-update panel
Z95 = 1.959964


def read_run(folder):
    """{label, algo, config, series: {metric: [(update, value), ...]}, nulls: {metric logged as
    null}}
    of one run folder."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"plot.py: error: {folder} has no metrics.jsonl (is it a run folder?)")
    config = {}
    if os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
    series, nulls = defaultdict(list), set()
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a run still writing its last line
                continue
            for key, value in row.items():
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and key != "update"
                ):
                    series[key].append((row["update"], float(value)))
                elif value is None:
                    nulls.add(key)
    name = os.path.basename(os.path.normpath(folder))
    algo = config.get("algo", name)
    label = f"{algo} seed {config['seed']}" if "seed" in config else name
    return {
        "folder": folder,
        "label": label,
        "algo": algo,
        "config": config,
        "series": dict(series),
        "nulls": nulls - set(series),
    }


def wilson(p, n, z=Z95):
    """95% Wilson score interval (lo, hi) of a success rate p over n episodes."""
    if n <= 0:
        return p, p
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    return 0.0 if p <= 0 else lo, 1.0 if p >= 1 else hi  # exact at the ends (rounding aside)


def panel_keys(patterns, runs):
    keys, drop = [], set()
    for pattern in patterns:
        if pattern.startswith("-"):
            drop.add(pattern[1:])
        elif "*" in pattern:
            head, tail = pattern.split("*")
            keys += sorted(
                {
                    k
                    for r in runs
                    for k in r["series"]
                    if k.startswith(head) and k.endswith(tail) and len(k) > len(head) + len(tail)
                }
            )
        else:
            keys.append(pattern)
    return [k for k in keys if k not in drop]


def split_of(key):
    """The split of an eval key (eval/<split>/success_rate), else None."""
    parts = key.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "eval" else None


def kl_note(runs):
    """Why the KL panel is empty."""
    if any("kl" in r["nulls"] for r in runs):
        return "no KL term: trained with --kl-coef 0\n(kl is null in metrics.jsonl)"
    return "no KL logged by these runs"


def default_out(folders):
    """One run: <run>/plots; several: plots in the first run's parent folder."""
    if len(folders) == 1:
        return os.path.join(folders[0], "plots")
    return os.path.join(os.path.dirname(os.path.normpath(folders[0])) or ".", "plots")


def make_figure(runs):
    """The figure of the runs (read_run's dicts): a matplotlib Figure, PANELS in a COLS-wide grid.
    Each Axes has the panel's title; an empty panel has one text saying why."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    by_algo = defaultdict(list)
    for run in runs:
        by_algo[run["algo"]].append(run)
    colors = {algo: f"C{i}" for i, algo in enumerate(by_algo)}
    splits = sorted(
        {split_of(k) for r in runs for k in r["series"] if split_of(k)},
        key=lambda s: (s != "train", s),
    )
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(splits)}
    hollow = {s: i % 2 == 1 for i, s in enumerate(splits)}  # alternate filled and hollow shapes
    updates = [x for r in runs for points in r["series"].values() for x, _ in points]
    x_lo, x_hi = (min(updates), max(updates)) if updates else (0, 1)
    pad = 0.04 * max(x_hi - x_lo, 1) + 0.3
    rows = -(-len(PANELS) // COLS)
    fig = Figure(figsize=(5.2 * COLS, 3.6 * rows))
    axes = fig.subplots(rows, COLS, squeeze=False)
    for ax, (title, patterns, rate, note) in zip(axes.flat, PANELS):
        keys = [k for k in panel_keys(patterns, runs) if any(k in r["series"] for r in runs)]
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if rate:
            ax.set_ylim(-0.04, 1.04)
        if not keys:
            ax.text(
                0.5,
                0.5,
                note or kl_note(runs),
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=9,
                color="0.35",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel("")
            continue
        ax.set_xlim(x_lo - pad, x_hi + pad)  # the same updates under every panel
        legend_title = None
        if split_of(keys[0]):
            legend_title = draw_eval(ax, keys, by_algo, colors, marker, hollow, np, x_hi - x_lo)
        else:
            draw_per_update(ax, keys, by_algo, colors, np)
        if title.startswith("KL") and any("kl" in r["nulls"] for r in runs):
            legend_title = "no KL term (--kl-coef 0): " + ", ".join(
                algo
                if all("kl" in r["nulls"] for r in members) and len(members) > 1
                else ", ".join(r["label"] for r in members if "kl" in r["nulls"])
                for algo, members in by_algo.items()
                if any("kl" in r["nulls"] for r in members)
            )
        legend = ax.legend(fontsize=7, title=legend_title, title_fontsize=7)
        legend.get_title().set_color("0.3")
    names = [os.path.basename(os.path.normpath(r["folder"])) for r in runs]
    fig.suptitle(", ".join(names) if len(names) <= 4 else f"{len(names)} runs", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def run_label(run, index, members, mean_xs, suffix):
    """The legend label of one run's series: its own when it is its algorithm's only run; else none
    (the mean is labelled), or, when the runs share no update to average, one label for them all."""
    if len(members) == 1:
        return run["label"] + suffix
    if mean_xs or index > 0:
        return None
    return f"{run['algo']} ({len(members)} runs, no common update){suffix}"


def draw_per_update(ax, keys, by_algo, colors, np):
    """One thin line per run; several runs of an algorithm: their mean, bold, with a +-1 std
    band."""
    for k_index, key in enumerate(keys):
        style = STYLES[k_index % len(STYLES)]
        suffix = f" {key}" if len(keys) > 1 else ""
        for algo, members in by_algo.items():
            color = colors[algo]
            members = [r for r in members if key in r["series"]]
            curves = [dict(r["series"][key]) for r in members]
            mean_xs = sorted(set.intersection(*(set(c) for c in curves))) if len(curves) > 1 else []
            for i, r in enumerate(members):
                xs, ys = zip(*r["series"][key])
                ax.plot(
                    xs,
                    ys,
                    style,
                    color=color,
                    alpha=0.35 if len(curves) > 1 else 1.0,
                    lw=1,
                    marker="o" if len(xs) <= 20 else None,
                    ms=5 if len(xs) == 1 else 2.5,
                    label=run_label(r, i, members, mean_xs, suffix),
                )
            if len(curves) > 1:
                xs = mean_xs
                if xs:
                    values = np.array([[c[x] for x in xs] for c in curves])
                    mean, std = values.mean(0), values.std(0)
                    ax.plot(
                        xs,
                        mean,
                        style,
                        color=color,
                        lw=2.2,
                        label=f"{algo} (mean of {len(curves)}){suffix}",
                    )
                    ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.15)


def draw_eval(ax, keys, by_algo, colors, marker, hollow, np, xrange_):
    """Markers per (split, algorithm), nudged sideways; 95% Wilson bars when episodes are logged.
    Returns the legend's title (what the bars mean), or None."""
    groups = [
        (key, algo)
        for key in keys
        for algo, members in by_algo.items()
        if any(key in r["series"] for r in members)
    ]
    xs_all = sorted(
        {
            x
            for _, members in by_algo.items()
            for r in members
            for key in keys
            for x, _ in r["series"].get(key, [])
        }
    )
    gaps = [b - a for a, b in zip(xs_all, xs_all[1:]) if b > a]
    # Nudge between neighbouring series: 3.5% of the x range (about a marker), and all the nudges
    # together at most 30% of the closest gap between two evals.
    step = min(
        0.035 * max(xrange_, 1.0), 0.3 * (min(gaps) if gaps else 1.0) / max(len(groups) - 1, 1)
    )
    means = 0
    for g, (key, algo) in enumerate(groups):
        offset = (g - (len(groups) - 1) / 2) * step
        split = split_of(key)
        color = colors[algo]
        shape = dict(marker=marker[split], mec=color, mfc="none" if hollow[split] else color)
        suffix = f" {split}" if len(keys) > 1 or split != "train" else ""
        members = [r for r in by_algo[algo] if key in r["series"]]
        episodes_key = key.rsplit("/", 1)[0] + "/episodes"
        curves = [dict(r["series"][key]) for r in members]
        mean_xs = sorted(set.intersection(*(set(c) for c in curves))) if len(members) > 1 else []
        for i, r in enumerate(members):
            xs, ys = zip(*r["series"][key])
            episodes = dict(r["series"].get(episodes_key, []))
            yerr = None
            if all(x in episodes for x in xs):  # eval/<split>/episodes logged: 95% Wilson interval
                bounds = [wilson(y, episodes[x]) for x, y in zip(xs, ys)]
                yerr = [
                    [max(y - lo, 0.0) for y, (lo, _) in zip(ys, bounds)],
                    [max(hi - y, 0.0) for y, (_, hi) in zip(ys, bounds)],
                ]
            several = len(members) > 1
            ax.errorbar(
                [x + offset for x in xs],
                ys,
                yerr=yerr,
                color=color,
                ls=":" if len(xs) >= DENSE else "none",
                lw=1,
                ms=4 if several else 6,
                capsize=0 if several else 2,
                elinewidth=0.7 if several else 0.9,
                alpha=0.35 if several else 1.0,
                label=run_label(r, i, members, mean_xs, suffix),
                **shape,
            )
        if mean_xs:
            means += 1
            values = np.array([[c[x] for x in mean_xs] for c in curves])
            ax.errorbar(
                [x + offset for x in mean_xs],
                values.mean(0),
                yerr=values.std(0),
                color=color,
                ls=":" if len(mean_xs) >= DENSE else "none",
                lw=1.5,
                ms=8,
                capsize=4,
                elinewidth=1.6,
                label=f"{algo} (mean ± std of {len(curves)}){suffix}",
                **shape,
            )
    wilson_bars = any(
        key.rsplit("/", 1)[0] + "/episodes" in r["series"]
        for key, algo in groups
        for r in by_algo[algo]
    )
    notes = (
        ["thin bars: 95% Wilson interval per run" if means else "bars: 95% Wilson interval"]
        if wilson_bars
        else []
    ) + (["bold: mean, bars ± std over runs"] if means else [])
    return "\n".join(notes) or None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
    parser.add_argument(
        "--out",
        default=None,
        help="output path without extension (default: <run>/plots for "
        "one run, plots in the first run's parent folder for several)",
    )
    a = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit(
            "plot.py: error: matplotlib is not installed: pip install matplotlib==3.11.2 "
            "(it is in requirements.txt)"
        )
    folders = [f for f in a.runs if os.path.isdir(f) or not os.path.exists(f)]
    for skipped in sorted(set(a.runs) - set(folders)):  # runs/* also matches runs/plots.png
        print(f"plot.py: skipped {skipped}: a file, not a run folder", file=sys.stderr)
    if not folders:
        sys.exit("plot.py: error: no run folder given")
    runs = [read_run(folder) for folder in folders]
    out = a.out or default_out(folders)
    fig = make_figure(runs)
    folder = os.path.dirname(out)
    if folder:
        os.makedirs(folder, exist_ok=True)
    for ext in ("png", "svg"):
        fig.savefig(f"{out}.{ext}", dpi=110)
    print(f"wrote {out}.png and {out}.svg ({len(runs)} run(s))")


if __name__ == "__main__":
    main()
