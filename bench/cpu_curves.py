"""bench/cpu_curves.py: the tables and the learning-curve figure of the README's "CPU results", from
the runs bench/cpu_evidence.sh wrote (their metrics.jsonl and /usr/bin/time -v reports).

    python bench/cpu_curves.py runs/cpu-evidence            # prints markdown tables, writes bench/cpu_curves.png
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def read(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def ms(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def timing(path):
    """(wall seconds, peak RSS GB) of a /usr/bin/time -v report, or (None, None)."""
    if not os.path.exists(path):
        return None, None
    text = open(path).read()
    wall = re.search(r"Elapsed \(wall clock\) time.*?: (?:(\d+):)?(\d+):([\d.]+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    seconds = None
    if wall:
        h, m, s = wall.groups()
        seconds = int(h or 0) * 3600 + int(m) * 60 + float(s)
    return seconds, int(rss.group(1)) / 2**20 if rss else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--out", default=os.path.join(HERE, "cpu_curves.png"))
    a = parser.parse_args()
    runs = {}
    for path in sorted(glob.glob(os.path.join(a.folder, "alfworld-*-seed[0-9]", "metrics.jsonl"))):
        algo, seed = re.search(r"alfworld-(\w+)-seed(\d+)", path).groups()
        rows = read(path)
        if not any(m["update"] > 0 and any(k.startswith("eval/") for k in m) for m in rows):
            print(f"skipped {path}: not finished (no evaluation after training yet)")
            continue
        runs.setdefault(algo, {})[int(seed)] = rows
    if not runs:
        sys.exit(f"bench/cpu_curves.py: no runs under {a.folder}")
    for algo, seeds in runs.items():
        print(f"\n### {algo} ({len(seeds)} seeds: {sorted(seeds)})\n")
        updates = sorted({m["update"] for rows in seeds.values() for m in rows if m["update"] > 0})
        print("| update | train success | valid-action ratio | distinct actions | zero-adv fraction |")
        print("|---|---|---|---|---|")
        for u in updates:
            rows = [next((m for m in r if m["update"] == u), None) for r in seeds.values()]
            rows = [m for m in rows if m]
            print(f"| {u} | {ms([m['success_rate'] for m in rows])} | {ms([m['valid_action_ratio'] for m in rows])} | "
                  f"{ms([m['distinct_actions'] for m in rows])} | {ms([m['zero_adv_frac'] for m in rows])} |")
        early = [statistics.fmean(m["success_rate"] for m in r if m["update"] in updates[:2]) for r in seeds.values()]
        late = [statistics.fmean(m["success_rate"] for m in r if m["update"] in updates[-2:]) for r in seeds.values()]
        print(f"\ntrain success, mean of updates {updates[0]}-{updates[1]}: {ms(early)}; of updates "
              f"{updates[-2]}-{updates[-1]}: {ms(late)}; per seed {', '.join(f'{e:.2f}->{l:.2f}' for e, l in zip(early, late))}")
        first = [next(m for m in r if m["update"] == 0) for r in seeds.values()]
        last = [[m for m in r if any(k.startswith("eval/") for k in m)][-1] for r in seeds.values()]
        print("\n| eval success (temperature 0.4) | before RL | after |\n|---|---|---|")
        for split in ("train", "valid_seen", "valid_unseen"):
            key = f"eval/{split}/success_rate"
            if key in first[0]:
                print(f"| {split} | {ms([m[key] for m in first])} | {ms([m.get(key) for m in last])} |")
        times = [timing(os.path.join(a.folder, f"time-{algo}-seed{s}.txt")) for s in seeds]
        walls = [t for t, _ in times if t]
        rss = [r for _, r in times if r]
        if walls:
            print(f"\nwall time per run {ms([w / 60 for w in walls])} min; peak RSS {ms(rss)} GB")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench/cpu_curves.py: the tables are above; the figure needs pip install matplotlib")
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for i, (algo, seeds) in enumerate(sorted(runs.items(), key=lambda kv: kv[0] != "tigpo")):
        color = f"C{i}"
        for key, ax in (("success_rate", axes[0]), ("valid_action_ratio", axes[1])):
            curves = [{m["update"]: m[key] for m in r if m["update"] > 0} for r in seeds.values()]
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            for c in curves:
                ax.plot(sorted(c), [c[x] for x in sorted(c)], color=color, alpha=0.25, lw=1)
            mean = [statistics.fmean(c[x] for c in curves) for x in xs]
            ax.plot(xs, mean, color=color, lw=2.2, marker="o", label=f"{algo} (mean of {len(curves)} seeds)")
        before = [next(m for m in r if m["update"] == 0).get("eval/train/success_rate") for r in seeds.values()]
        after = [[m for m in r if any(k.startswith("eval/") for k in m)][-1].get("eval/train/success_rate")
                 for r in seeds.values()]
        axes[2].errorbar([i - 0.1, i + 0.1], [statistics.fmean(before), statistics.fmean(after)],
                         yerr=[statistics.pstdev(before), statistics.pstdev(after)], color=color, marker="o",
                         capsize=4, label=algo)
    axes[0].set_title("training success per update")
    axes[1].set_title("valid-action ratio per update")
    axes[2].set_title("eval success on the training games (T 0.4):\nbefore RL (left) and after (right)")
    axes[2].set_xticks([])
    for ax in axes[:2]:
        ax.set_xlabel("update")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
