"""bench/compare.py: the comparison table and figure of issue 38, from the results folder that
bench/seeds.py fills (<results>/<method>/seed<S>/config.json + metrics.jsonl) and nothing else.

    python bench/compare.py results/comparison                    # table; bench/comparison.png
    python bench/compare.py results/comparison --check README.md  # exit 1 if README's differs

Per method: eval success on the training games before RL (metrics.jsonl's update-0 line) and
after (its last line), each a mean over seeds with a 95 % Student-t interval over seeds; the gain
(after - before) the same way; and the paired difference: the reference method's gain minus this
method's, seed by seed on the seeds both have, with its t-interval and the seeds where the
reference is ahead / level / behind. The table prints between the README's markers, so it can be
pasted there. Standard library and matplotlib only (no torch: it reads files).
"""

import argparse
import json
import math
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from seeds import METHODS, machine  # noqa: E402  (the methods in the table's order; extras.machine)

START, END = "<!-- comparison:start -->", "<!-- comparison:end -->"
EVAL = "eval/train/success_rate"
# t_{0.975, df}, df = 1..30 (Student t; the standard table, to 4 decimals)
T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281]
T975 += [2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860]
T975 += [2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423]
# config.json keys that are meant to differ between cells; any other difference means the cells
# did not run one preset, and the table says so
PER_CELL = {"seed", "algo", "revisit_groups", "cross_temporal", "run_dir", "resume"}
# config.json's versions keys that name the machine, left to seed_starts
MACHINE = {"device", "cpu_flags"}
LEVEL = 1e-9  # |difference| below this counts as level (gains are differences of fractions)


def t975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom: the table up to 30, beyond it
    the Cornish-Fisher expansion around the normal quantile (within 1e-4 of the exact value)."""
    if df <= len(T975):
        return T975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values):
    """(mean, low, high): the 95 % Student-t interval over the values (sample std, n - 1 degrees
    of freedom); low = high = None for a single value, which has no spread to measure."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def num(x, sign=False):
    x = round(x, 2) + 0.0  # + 0.0: a -0.00 prints as 0.00
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def shown(values, sign=False):
    mean, low, high = mean_ci(values)
    if low is None:
        return f"{num(mean, sign)} (1 seed)"
    return f"{num(mean, sign)} [{num(low, sign)}, {num(high, sign)}]"


# =================================================================================================
# Reading the results folder
# =================================================================================================


def read_cell(folder):
    """(config, before, after, episodes) of one finished cell, or (None, why not)."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
        with open(os.path.join(folder, "metrics.jsonl")) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError) as e:
        return None, f"unreadable ({e})"
    first = rows[0] if rows else {}
    if first.get("update") != 0 or EVAL not in first:
        return None, "no eval before RL (update-0 line)"
    last = rows[-1]
    if last["update"] != config.get("updates") or EVAL not in last:
        return None, f"not finished (last line: update {last['update']} of {config.get('updates')})"
    episodes = (first.get("eval/train/episodes"), last.get("eval/train/episodes"))
    return (config, first[EVAL], last[EVAL], episodes), None


def read_results(folder):
    """{method: {seed: cell}} and the notes on what was left out and why."""
    runs, notes = {}, []
    if not os.path.isdir(folder):
        sys.exit(f"bench/compare.py: error: no results folder {folder}")
    for method in sorted(os.listdir(folder)):
        if not os.path.isdir(os.path.join(folder, method)):
            continue
        for name in sorted(os.listdir(os.path.join(folder, method))):
            match = re.fullmatch(r"seed(\d+)", name)
            if not match:
                continue
            seed = int(match.group(1))
            cell, why = read_cell(os.path.join(folder, method, name))
            if cell is None:
                notes.append(f"{method} seed {seed}, {why}")
            elif cell[0].get("seed") != seed:
                notes.append(
                    f"{method} seed {seed}, its config.json says seed {cell[0].get('seed')}"
                )
            else:
                runs.setdefault(method, {})[seed] = dict(
                    config=cell[0], before=cell[1], after=cell[2], episodes=cell[3]
                )
    return runs, notes


def config_differences(runs):
    """The config.json keys, beyond the method's and the seed's, whose values differ between
    cells: '' when every cell ran one setting. The machine (versions' MACHINE keys) is left to
    seed_starts: the matrix may span machines, one seed's cells may not."""
    values = {}
    for seeds in runs.values():
        for cell in seeds.values():
            for key, value in cell["config"].items():
                if key == "versions" and isinstance(value, dict):
                    value = {k: v for k, v in value.items() if k not in MACHINE}
                if key not in PER_CELL:
                    values.setdefault(key, set()).add(json.dumps(value, sort_keys=True))
    differ = sorted(k for k, v in values.items() if len(v) > 1)
    return ", ".join(f"{k} ({' / '.join(sorted(values[k]))})" for k in differ)


def device(cell):
    """The machine kind: the CPU's (or GPU's) name, and the CPU's kernel flags where recorded."""
    return machine.label(cell["config"].get("versions") or {})


def seed_starts(runs):
    """Note lines on where each seed ran. The warm start does not depend on the method, so one
    seed's cells on one machine kind all start from the same eval before RL; other machine kinds
    round bf16 otherwise and start the same seed elsewhere. A seed whose cells differ in either
    pairs different starts, and is flagged."""
    where, flags = {}, []
    for seed in sorted({s for cells in runs.values() for s in cells}):
        cells = {m: runs[m][seed] for m in runs if seed in runs[m]}
        where.setdefault(" / ".join(sorted({device(c) for c in cells.values()})), []).append(seed)
        for what, key in (("machines", device), ("evals before RL", lambda c: num(c["before"]))):
            groups = {}
            for method, cell in cells.items():
                groups.setdefault(key(cell), []).append(method)
            if len(groups) > 1:
                listed = "; ".join(f"{k}: {', '.join(m)}" for k, m in sorted(groups.items()))
                flags.append(
                    f"⚠ seed {seed}: its cells differ in {what} ({listed}): its paired "
                    "differences compare different warm starts."
                )
    lines = []
    if set(where) != {"unknown"}:
        listed = "; ".join(
            f"{name}: seed{'s' * (len(s) > 1)} {', '.join(map(str, s))}"
            for name, s in where.items()
        )
        flags_recorded = any(
            "cpu_flags" in (cell["config"].get("versions") or {})
            for seeds in runs.values()
            for cell in seeds.values()
        )
        keys = "device" + (" (cpu_flags)" if flags_recorded else "")
        lines.append(f"Machines (config.json's versions.{keys}): {listed}.")
    lines += flags
    return lines


# =================================================================================================
# The table
# =================================================================================================


def paired(runs, reference, method):
    """(seeds, differences): reference's gain minus method's, on the seeds both have."""
    common = sorted(set(runs[reference]) & set(runs[method]))
    ref, other = runs[reference], runs[method]
    gains = [
        (ref[s]["after"] - ref[s]["before"]) - (other[s]["after"] - other[s]["before"])
        for s in common
    ]
    return common, gains


def table(runs, notes, reference):
    """The markdown block, markers included: the same results give the same text."""
    methods = [m for m in METHODS if m in runs] + sorted(m for m in runs if m not in METHODS)
    all_seeds = sorted({s for seeds in runs.values() for s in seeds})
    lines = [
        START,
        f"| method | seeds | eval before RL | after RL | gain | {reference} gain − method's, "
        f"paired | {reference} ahead / level / behind |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in methods:
        seeds = runs[method]
        count = f"{len(seeds)}"
        if len(seeds) < len(all_seeds):  # flagged here and named in a note below the table
            count += f" of {len(all_seeds)} ⚠"
        before = [c["before"] for c in seeds.values()]
        after = [c["after"] for c in seeds.values()]
        gain = [c["after"] - c["before"] for c in seeds.values()]
        if method == reference:
            diff, score = "(reference)", ""
        elif reference not in runs or not paired(runs, reference, method)[0]:
            diff, score = "no common seeds", ""
        else:
            _, d = paired(runs, reference, method)
            diff = shown(d, sign=True)
            ahead = sum(x > LEVEL for x in d)
            behind = sum(x < -LEVEL for x in d)
            score = f"{ahead} / {len(d) - ahead - behind} / {behind}"
        lines.append(
            f"| {method} | {count} | {shown(before)} | {shown(after)} | {shown(gain, True)} "
            f"| {diff} | {score} |"
        )
    lines.append("")
    lines.append(
        "Mean over seeds [95 % Student-t interval over seeds: mean ± t_{0.975, n−1}·s/√n, s the "
        "sample std]. Eval: success on the training games at the run's eval temperature, before "
        f"RL (update 0) and after the last update. Paired: {reference}'s gain minus the method's, "
        "seed by seed, on the seeds both ran."
    )
    episodes = {e for seeds in runs.values() for c in seeds.values() for e in c["episodes"]}
    if len(episodes) == 1 and None not in episodes:
        lines.append(
            f"Each eval: {episodes.pop()} episodes. Seeds: {', '.join(map(str, all_seeds))}."
        )
    else:
        lines.append(f"Seeds: {', '.join(map(str, all_seeds))}.")
    for method in methods:
        missing = [s for s in all_seeds if s not in runs[method]]
        if missing:
            lines.append(
                f"⚠ {method}: fewer seeds than the others, no {', '.join(map(str, missing))}."
            )
    absent = [m for m in METHODS if m not in runs]
    if absent:
        lines.append(f"No results for: {', '.join(absent)}.")
    if reference not in runs:
        lines.append(f"No results for the reference {reference}: no paired differences.")
    lines += [f"Left out: {note}." for note in notes]
    lines += seed_starts(runs)
    differ = config_differences(runs)
    if differ:
        lines.append(f"⚠ The cells' config.json differ beyond method and seed: {differ}.")
    # each note a paragraph of its own: consecutive lines would run together in the README
    return "\n\n".join(["\n".join(lines[: lines.index("")])] + lines[lines.index("") + 1 :] + [END])


def readme_block(path):
    with open(path) as fh:
        text = fh.read()
    if START not in text or END not in text.split(START, 1)[1]:
        return None
    return START + text.split(START, 1)[1].split(END, 1)[0] + END


# =================================================================================================
# The figure
# =================================================================================================


def figure(runs, reference, path):
    import matplotlib

    matplotlib.use("Agg")  # a file only: no display on the machines that run this
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m in runs] + sorted(m for m in runs if m not in METHODS)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, method in enumerate(methods):
        cells = [runs[method][s] for s in sorted(runs[method])]
        for cell in cells:  # one thin line a seed: before (left end) -> after (right end)
            left.plot(
                [i - 0.2, i + 0.2], [cell["before"], cell["after"]], color=f"C{i}", alpha=0.35
            )
        means = [statistics.fmean(c[k] for c in cells) for k in ("before", "after")]
        left.plot([i - 0.2, i + 0.2], means, color=f"C{i}", lw=2.5, marker="o")
    left.set_xticks(range(len(methods)), methods, rotation=20)
    left.set_ylim(-0.02, 1.02)
    left.set_ylabel("eval success on the training games")
    left.set_title(
        "eval on the training games, before RL -> after\none thin line a seed; thick: the mean"
    )
    others = [m for m in methods if m != reference and reference in runs]
    for j, method in enumerate(others):
        seeds, d = paired(runs, reference, method)
        if not seeds:
            continue
        i = methods.index(method)
        spread = [j - 0.2 + 0.3 * k / max(len(d) - 1, 1) for k in range(len(d))]  # seeds apart
        right.scatter(spread, d, color=f"C{i}", alpha=0.6, s=18)
        mean, low, high = mean_ci(d)
        if low is not None:
            right.errorbar(
                [j + 0.25],
                [mean],
                yerr=[[mean - low], [high - mean]],
                color="black",
                capsize=4,
                marker="s",
            )
    right.axhline(0, color="black", lw=0.8)
    right.set_xticks(range(len(others)), others, rotation=20)
    right.set_ylabel(f"{reference} gain − method's gain")
    right.set_title(
        f"{reference}'s gain minus each method's, paired by seed\n"
        "dots: one seed each; square: the mean, with its 95 % t-interval"
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", help="the folder bench/seeds.py --results filled")
    parser.add_argument("--out", default=os.path.join(HERE, "comparison.png"), help="the figure")
    parser.add_argument(
        "--reference", default="tigpo", help="the method the others are paired with"
    )
    parser.add_argument(
        "--check", metavar="README", help="compare the README's block; write nothing"
    )
    args = parser.parse_args(argv)
    runs, notes = read_results(args.results)
    if not runs:
        sys.exit(f"bench/compare.py: error: no finished cells under {args.results}")
    block = table(runs, notes, args.reference)
    if args.check:
        if readme_block(args.check) is None:
            sys.exit(f"bench/compare.py: {args.check} has no {START} ... {END} block")
        if readme_block(args.check) != block:
            sys.exit(
                f"bench/compare.py: {args.check}'s comparison block differs from the table of "
                f"{args.results}: paste `python bench/compare.py {args.results}`'s output there"
            )
        print(f"{args.check}'s comparison block matches {args.results}")
        return
    print(block)
    figure(runs, args.reference, args.out)
    print(f"wrote {args.out}", file=sys.stderr)  # stderr: stdout is the block, as pasted


if __name__ == "__main__":
    main()
