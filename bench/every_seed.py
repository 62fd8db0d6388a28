"""bench/every_seed.py: issue 37's reported runs, pooled. Each folder is one set of fresh seeds
that bench/seeds.py filled (<folder>/tigpo/seed<S>/config.json + metrics.jsonl); the sets ran
different presets of one family (docs/RESULTS.md says which). Read from the files alone:

    python bench/every_seed.py results/every-seed results/every-seed-2 ...

Per set and pooled: eval on the training games before RL (update 0) and after (the last update),
the gain with its 95 % Student-t interval over seeds, the runs that rise, the runs with 5
updates in a row without a training success after update 2, and each task type's eval before
and after.
Then two questions about the sets:

* Do the presets differ? The spread of the set means against the spread that seeds alone give:
  the runs are shuffled between the sets (each keeping its size) many times, and p is the share
  of shuffles whose set means are at least as spread as the measured ones.
* How often would 8 fresh seeds meet issue 37's bar, if a run's outcome is like one drawn from
  the pooled runs? Sets of 8 are drawn with replacement; the bar: every run rises, the mean gain
  is at least +0.30, no run has the 5-update stretch.

Standard library only.
"""

import argparse
import json
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import mean_ci, read_results, shown  # noqa: E402

BAR_MEAN, BAR_STRETCH, BAR_SEEDS = 0.30, 5, 8
KIND = "eval/train/success/"


def longest_stretch(rows, after=2):
    """The most updates in a row, after the first `after`, whose training episodes won none."""
    longest = run = 0
    for row in rows:
        if row.get("update", 0) > after and "success_rate" in row:
            run = run + 1 if row["success_rate"] == 0 else 0
            longest = max(longest, run)
    return longest


def read_set(folder, method):
    """[run] of one set: dict(seed, before, after, gain, stretch, kinds={type: (before, after)})."""
    cells, notes = read_results(folder)
    for note in notes:
        print(f"  {folder}: left out: {note}")
    runs = []
    for seed, cell in sorted(cells.get(method, {}).items()):
        path = os.path.join(folder, method, f"seed{seed}", "metrics.jsonl")
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        kinds = {
            key[len(KIND) :]: (rows[0][key], rows[-1].get(key))
            for key in rows[0]
            if key.startswith(KIND)
        }
        gain = cell["after"] - cell["before"]
        runs.append(dict(seed=seed, gain=gain, stretch=longest_stretch(rows), kinds=kinds, **cell))
    return runs


def meets_bar(runs):
    return (
        all(r["gain"] > 0 for r in runs)
        and statistics.fmean(r["gain"] for r in runs) >= BAR_MEAN - 1e-9
        and all(r["stretch"] < BAR_STRETCH for r in runs)
    )


def row(name, runs):
    kinds = sorted({k for r in runs for k in r["kinds"]})
    each = {k: [r["kinds"][k] for r in runs if k in r["kinds"]] for k in kinds}
    types = ", ".join(
        f"{k} {statistics.fmean(b for b, _ in v):.2f} → {statistics.fmean(a for _, a in v):.2f}"
        for k, v in each.items()
    )
    before = statistics.fmean(r["before"] for r in runs)
    after = statistics.fmean(r["after"] for r in runs)
    rises = sum(r["gain"] > 0 for r in runs)
    stalls = sum(r["stretch"] >= BAR_STRETCH for r in runs)
    gain = shown([r["gain"] for r in runs], sign=True)
    bar = "yes" if meets_bar(runs) else "no"
    return (
        f"| {name} | {len(runs)} | {before:.2f} → {after:.2f} | {gain} "
        f"| {rises} of {len(runs)} | {stalls} | {types or '—'} | {bar} |"
    )


def spread_p(sets, shuffles, rng):
    """p of the set means' spread (their variance) under shuffles of the runs between sets."""
    sizes = [len(s) for s in sets]
    pooled = [r["gain"] for s in sets for r in s]

    def spread(gains):
        means, start = [], 0
        for size in sizes:
            means.append(statistics.fmean(gains[start : start + size]))
            start += size
        return statistics.pvariance(means)

    measured = spread(pooled)
    hits = 0
    for _ in range(shuffles):
        rng.shuffle(pooled)
        hits += spread(pooled) >= measured - 1e-12
    return measured, hits / shuffles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="results folders, one per set of fresh seeds")
    p.add_argument("--method", default="tigpo")
    p.add_argument("--draws", type=int, default=20000, help="shuffles and drawn sets of 8")
    p.add_argument("--seed", type=int, default=0, help="of the shuffles and draws")
    a = p.parse_args(argv)
    sets = []
    for folder in a.folders:
        if not os.path.isdir(folder):
            sys.exit(f"bench/every_seed.py: error: no results folder {folder}")
        runs = read_set(folder, a.method)
        if not runs:
            sys.exit(f"bench/every_seed.py: error: no finished {a.method} run in {folder}")
        sets.append((folder, runs))
    print(
        "| set | runs | eval before → after | gain [95 % t] | rise | 5-update stretch "
        "| each type before → after | bar |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for folder, runs in sets:
        print(row(os.path.basename(os.path.normpath(folder)), runs))
    pooled = [r for _, runs in sets for r in runs]
    print(row(f"all {len(sets)} sets", pooled))
    gains = [r["gain"] for r in pooled]
    print(
        f"\nPooled: gain {statistics.fmean(gains):+.3f}, sd over runs "
        f"{statistics.stdev(gains):.3f}; rises {sum(g > 0 for g in gains)} of {len(gains)}."
    )
    rng = random.Random(a.seed)
    if len(sets) > 1:
        measured, p_value = spread_p([runs for _, runs in sets], a.draws, rng)
        means = [statistics.fmean(r["gain"] for r in runs) for _, runs in sets]
        print(
            f"Set means {min(means):+.2f} to {max(means):+.2f} (sd {measured**0.5:.3f}); "
            f"shuffling the runs between sets gives a spread at least as large in p = "
            f"{p_value:.2f} of {a.draws} shuffles."
        )
    met = sum(meets_bar(rng.choices(pooled, k=BAR_SEEDS)) for _ in range(a.draws))
    mean, low, high = mean_ci(gains)
    print(
        f"Sets of {BAR_SEEDS} drawn from the pooled runs meet the bar (every run rises, mean "
        f"≥ +{BAR_MEAN:.2f}, no {BAR_STRETCH}-update stretch) in {met / a.draws:.1%} of "
        f"{a.draws} draws; pooled gain {mean:+.2f} [{low:+.2f}, {high:+.2f}]."
    )


if __name__ == "__main__":
    main()
