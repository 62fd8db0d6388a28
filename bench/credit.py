"""bench/credit.py: a CPU credit-assignment benchmark: GRPO, GiGPO, GraphGPO, TIGPO and TIGPO's
ablations (docs/ALGORITHM.md E1-E11) trained on a synthetic long-horizon task family with a
tabular softmax policy, using the SAME tigpo.compute_advantages / GraphMemory / RevisitScheduler
as train.py.

    python bench/credit.py --quick     # < 2 min: one row per method, the K=4 column of the table
    python bench/credit.py             # full table, K in {2, 4, 8} x 5 seeds, and bench/credit.png

What it isolates: only the advantage estimator and the schedule change between methods. The
policy is a table of logits per (task, state); there is no language model, no generalisation
across tasks, no PPO clipping (one on-policy gradient step per update, so the ratio of E12 is 1).
"""

import argparse
import bisect
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace
from multiprocessing import get_context

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tigpo  # noqa: E402  (the repository root is put on the path just above)

GOAL, DEAD = -1, -2  # terminal pseudo-states; real states are 0..num_states-1


@dataclass(frozen=True)
class Config:
    # task family (the environment, identical for every method)
    num_tasks: int = 32  # train set: tens of tasks, so each task recurs and memory can matter
    min_length: int = 15  # shortest path start -> goal is min_length..max_length steps
    max_length: int = 18
    num_actions: int = 4  # actions per state
    max_steps: int = 50  # episode horizon (the paper's ALFWorld limit)
    detour_w: float = 0.50  # role weights of each non-forward action of a corridor state:
    back_w: float = 0.10  #   detour (side room that rejoins), back (loop to an earlier
    invalid_w: float = 0.40  #   state), invalid ("nothing happens", penalised), dead end
    dead_end_w: float = 0.02  #   (the episode ends as a failure)
    # training (identical for every method)
    rollouts: int = 32  # B*K rollouts per update for every method and every K
    updates: int = 150
    lr: float = 0.1  # SGD step on the logits per (step, advantage) pair
    revisit_frac: float = 0.5  # TIGPO: share of the B group slots that may be revisits (paper 8/16)
    delay: int = 4  # TIGPO: revisit delay Delta in updates (paper 10 over 250 updates)
    graph_gamma: float = 0.5  # gamma_g of E6, for graphgpo and every tigpo variant
    eval_every: int = 10
    success_reward: float = 10.0


# The methods compared. Baselines run the same scheduler with 0 revisit slots (exploration only).
METHODS = {
    "grpo": dict(algo="grpo", memory=False, revisit=False, cross_temporal=True),
    "gigpo": dict(algo="gigpo", memory=False, revisit=False, cross_temporal=True),
    "graphgpo": dict(algo="graphgpo", memory=False, revisit=False, cross_temporal=True),
    "tigpo": dict(algo="tigpo", memory=True, revisit=True, cross_temporal=True),
    "tigpo-graph-only": dict(algo="tigpo", memory=True, revisit=False, cross_temporal=True),
    "tigpo-no-ct": dict(algo="tigpo", memory=True, revisit=True, cross_temporal=False),
}


# ---------------------------------------------------------------------------------------------
# Task family. A task is a corridor of `length` states ending at the goal. Every corridor state
# has one forward action; each other action is, with the role weights of Config, a detour into a
# side room (whose actions rejoin the corridor one step ahead, return, or do nothing), a loop back
# 1-3 states, an invalid action that leaves the state unchanged, or a dead end. Reward is sparse
# (score C on reaching the goal, else 0), the shortest success takes >= 15 steps, and all rollouts
# of a task walk the same corridor, so their graphs merge. Action order is shuffled per state.
# ---------------------------------------------------------------------------------------------


def make_task(rng, cfg):
    """-> {"next": [[next state per action] per state], "valid": [[bool]...], "names": [str]}."""
    length = rng.randint(cfg.min_length, cfg.max_length)
    nxt, valid = [None] * length, [None] * length
    roles, weights = (
        ("detour", "back", "invalid", "dead"),
        (cfg.detour_w, cfg.back_w, cfg.invalid_w, cfg.dead_end_w),
    )
    for p in range(length):
        ahead = GOAL if p + 1 == length else p + 1
        row = [(ahead, True)]
        for _ in range(cfg.num_actions - 1):
            role = rng.choices(roles, weights)[0]
            if role == "detour":
                room = len(nxt)
                side = [(ahead, True), (p, True)] + [(room, False)] * (cfg.num_actions - 2)
                rng.shuffle(side)
                nxt.append([s for s, _ in side])
                valid.append([v for _, v in side])
                row.append((room, True))
            elif role == "back":
                row.append((max(0, p - rng.randint(1, 3)), True))
            elif role == "invalid":
                row.append((p, False))
            else:
                row.append((DEAD, True))
        rng.shuffle(row)
        nxt[p], valid[p] = [s for s, _ in row], [v for _, v in row]
    names = [f"c{s}" if s < length else f"r{s}" for s in range(len(nxt))]
    return {"next": nxt, "valid": valid, "names": names}


def make_tasks(seed, cfg):
    """The train set of one seed: {task_key: task}. Keys are stable strings (they key the
    memory)."""
    rng = random.Random(f"credit-tasks-{seed}")
    return {f"task{i:02d}": make_task(rng, cfg) for i in range(cfg.num_tasks)}


def state_name(task, s):
    return "goal" if s == GOAL else "dead" if s == DEAD else task["names"][s]


def env_steps_per_second(cfg, seconds=0.3):
    """Raw environment speed: uniform random actions, no policy, no bookkeeping."""
    tasks, rng = list(make_tasks(0, cfg).values()), random.Random(0)
    steps, start, num_actions = 0, time.perf_counter(), cfg.num_actions
    while time.perf_counter() - start < seconds:
        for task in tasks:
            nxt, s = task["next"], 0
            for _ in range(cfg.max_steps):
                s = nxt[s][int(rng.random() * num_actions)]
                steps += 1
                if s < 0:
                    break
    return steps / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Tabular softmax policy: logits theta[task][state] (one row of num_actions floats).
# ---------------------------------------------------------------------------------------------


def softmax(row):
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def sampler(logit_rows):
    """probs(s) -> (pi, cumulative pi) of state s, computed once and frozen: made at the start
    of an update, it is the sampling policy pi_old of every rollout and gradient of that update."""
    frozen = {}

    def probs(s):
        if s not in frozen:
            pi = softmax(logit_rows[s])
            frozen[s] = (pi, list(itertools.accumulate(pi)))
        return frozen[s]

    return probs


def rollout(task, probs, rng, cfg):
    """One episode with the sampling policy (temperature 1). `probs(s)` -> (pi, cumulative pi)."""
    s, state_ids, actions, valid = 0, [0], [], []
    for _ in range(cfg.max_steps):
        pi, cum = probs(s)
        a = min(bisect.bisect_right(cum, rng.random()), cfg.num_actions - 1)  # min: float round-off
        actions.append(a)
        valid.append(task["valid"][s][a])
        s = task["next"][s][a]
        state_ids.append(s)
        if s < 0:
            break
    success = s == GOAL
    return {
        "states": [state_name(task, x) for x in state_ids],
        "valid": valid,
        "score": cfg.success_reward if success else 0.0,
        "success": success,
        "state_ids": state_ids[:-1],
        "actions": actions,
    }  # the last two: policy-gradient only


def success_probability(task, theta_rows, cfg):
    """Exact P(reach the goal within max_steps) under the sampling policy: forward dynamic
    programming over the state distribution, so learning curves carry no evaluation noise."""
    moves = [list(zip(row, softmax(logits))) for row, logits in zip(task["next"], theta_rows)]
    dist, reached = {0: 1.0}, 0.0
    for _ in range(cfg.max_steps):
        new = {}
        for s, mass in dist.items():
            for s2, p in moves[s]:
                if s2 >= 0:
                    new[s2] = new.get(s2, 0.0) + mass * p
                elif s2 == GOAL:
                    reached += mass * p
        dist = new
    return reached


# ---------------------------------------------------------------------------------------------
# One training run: (method, K, seed) -> learning curve and zero-advantage fraction.
# ---------------------------------------------------------------------------------------------


def train_run(method, k, seed, cfg, keep_memory=False):
    """Train a fresh tabular policy on the seed's task set with one method; B = rollouts / K groups
    per update. Per update: plan (E11) -> K rollouts per group -> compute_advantages (E1-E9) ->
    policy gradient -> memory.add (E10) -> scheduler.record (E11), exactly the order of
    docs/ALGORITHM.md."""
    spec = METHODS[method]
    if cfg.rollouts % k:
        raise ValueError(
            f"--rollouts {cfg.rollouts} is not a multiple of K={k}: the budget B*K "
            "must be equal for every K; pick K that divides it"
        )
    num_groups = cfg.rollouts // k
    revisit_groups = int(num_groups * cfg.revisit_frac) if spec["revisit"] else 0
    tasks = make_tasks(seed, cfg)
    # Common random numbers: every method of one (K, seed) starts from the same stream and tasks.
    rng = random.Random(f"credit-rollouts-{seed}-{k}")
    scheduler = tigpo.RevisitScheduler(
        list(tasks), num_groups, revisit_groups, cfg.delay, seed=seed
    )
    memory = tigpo.GraphMemory() if spec["memory"] else None
    theta = {key: [[0.0] * cfg.num_actions for _ in task["next"]] for key, task in tasks.items()}

    def evaluate():
        return statistics.fmean(success_probability(tasks[key], theta[key], cfg) for key in tasks)

    curve, zero_steps, all_steps, train_seconds = [(0, evaluate())], 0, 0, 0.0
    task_hits, state_hits = [], []
    for update in range(cfg.updates):
        start = time.perf_counter()
        policy, groups = {}, []  # policy: task -> its frozen sampler for this update
        for slot in scheduler.plan(update):
            key = slot["task"]
            probs = policy.setdefault(key, sampler(theta[key]))
            groups.append(
                dict(slot, trajs=[rollout(tasks[key], probs, rng, cfg) for _ in range(k)])
            )
        advantages = tigpo.compute_advantages(
            groups,
            spec["algo"],
            memory,
            success_reward=cfg.success_reward,
            graph_gamma=cfg.graph_gamma,
            cross_temporal=spec["cross_temporal"],
        )
        # Policy gradient, one SGD step per update: theta_s += lr * A_t * grad log pi(a_t|s_t),
        # grad wrt the logits = onehot(a) - pi, with pi the sampling policy, so the step is exactly
        # on-policy (E12's ratio is 1, its clip inert; no KL term). Summed over steps, REINFORCE's
        # estimator: E12's token-mean would divide by the batch's step count, which shrinks as
        # episodes get shorter, so one fixed lr would mean different steps for different methods.
        for group, group_adv in zip(groups, advantages):
            key = group["task"]
            for traj, traj_adv in zip(group["trajs"], group_adv):
                for s, a, adv in zip(traj["state_ids"], traj["actions"], traj_adv):
                    all_steps += 1
                    if abs(adv) < 1e-6:  # counted as zero: below E1's epsilon; skipping it moves
                        zero_steps += 1  # a logit by < lr * 1e-6
                        continue
                    pi, row = policy[key](s)[0], theta[key][s]
                    for b in range(cfg.num_actions):
                        row[b] -= cfg.lr * adv * pi[b]
                    row[a] += cfg.lr * adv
        if memory is not None:
            hits = memory.stats(groups)  # before add: was this batch's task / state already stored?
            task_hits.append(hits["task_hit_rate"])
            state_hits.append(hits["state_hit_rate"])
            memory.add(groups)  # E10: after the update, so this batch never reads its own edges
        scheduler.record(update, groups)
        train_seconds += time.perf_counter() - start
        if (update + 1) % cfg.eval_every == 0 or update + 1 == cfg.updates:
            curve.append((update + 1, evaluate()))
    return {
        "method": method,
        "k": k,
        "seed": seed,
        "curve": curve,
        "zero_frac": zero_steps / max(all_steps, 1),
        "steps": all_steps,
        "memory_hits": (statistics.fmean(task_hits), statistics.fmean(state_hits))
        if task_hits
        else None,
        "train_seconds": train_seconds,
        **({"memory": memory.state_dict()} if keep_memory and memory is not None else {}),
    }


def _train_run_star(job):
    return train_run(*job)


# ---------------------------------------------------------------------------------------------
# Table and plot
# ---------------------------------------------------------------------------------------------


def updates_to(curve, level=0.5):
    return next((u for u, s in curve if s >= level), math.inf)


def mean_std(values):
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def summarize(results, methods, ks, label_k=True):
    """Markdown table, one row per (method, K), each row starting with the method name."""
    lines = [
        "| method | final success | mean success over training | updates to 50% (median, "
        "reached) | zero-advantage steps | memory hit task / state |",
        "|---|---|---|---|---|---|",
    ]
    for method in methods:
        for k in ks:
            runs = [r for r in results if r["method"] == method and r["k"] == k]
            finals = [r["curve"][-1][1] for r in runs]
            # Mean over the evaluated points = area under the learning curve: learning speed,
            # which still separates methods where final success saturates.
            aucs = [statistics.fmean(s for _, s in r["curve"]) for r in runs]
            # Median with "never" as infinity: honest when a minority of seeds never get there.
            reach_at = [updates_to(r["curve"]) for r in runs]
            median = statistics.median(reach_at)
            reached = sum(u < math.inf for u in reach_at)
            reach_txt = (
                f"{'never' if median == math.inf else f'{median:g}'} ({reached}/{len(runs)})"
            )
            zero = statistics.fmean(r["zero_frac"] for r in runs)
            hits = [r["memory_hits"] for r in runs if r["memory_hits"]]
            hit_txt = (
                (
                    f"{statistics.fmean(h[0] for h in hits):.2f} / "
                    f"{statistics.fmean(h[1] for h in hits):.2f}"
                )
                if hits
                else "—"
            )
            name = f"{method} K={k}" if label_k else method
            lines.append(
                f"| {name} | {mean_std(finals)} | {mean_std(aucs)} | {reach_txt} | "
                f"{zero:.3f} | {hit_txt} |"
            )
    return "\n".join(lines)


def plot(results, methods, ks, rollouts, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed: no plot written to {path} "
            "(pip install matplotlib to get it; the table above is the full result)"
        )
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        for method in methods:
            runs = [r for r in results if r["method"] == method and r["k"] == k]
            xs = [u for u, _ in runs[0]["curve"]]
            per_point = list(zip(*[[s for _, s in r["curve"]] for r in runs]))
            mean = [statistics.fmean(p) for p in per_point]
            err = [
                statistics.stdev(p) / math.sqrt(len(p)) if len(p) > 1 else 0.0 for p in per_point
            ]
            (line,) = ax.plot(xs, mean, label=method, linestyle="--" if "-" in method else "-")
            ax.fill_between(
                xs,
                [m - e for m, e in zip(mean, err)],
                [m + e for m, e in zip(mean, err)],
                color=line.get_color(),
                alpha=0.15,
            )
        ax.set_title(f"K = {k} (B·K = {rollouts} rollouts/update)")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("train success (sampling policy, exact)")
    num_seeds = len({r["seed"] for r in results})
    axes[0][0].legend(fontsize=8, title=f"mean ± s.e. over {num_seeds} seeds", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def run_benchmark(cfg, methods, ks, seeds, workers, log=print):
    """Every (method, K, seed) run, over `workers` processes; the runs are independent."""
    jobs = [(m, k, s, cfg) for k in ks for s in seeds for m in methods]
    results = []

    def collect(stream):
        for r in stream:
            results.append(r)
            log(
                f"[{len(results)}/{len(jobs)}] {r['method']} K={r['k']} seed={r['seed']}: final "
                f"success {r['curve'][-1][1]:.3f}, {r['steps'] / r['train_seconds']:,.0f} steps/s "
                "training (rollouts + advantages + update)"
            )

    if workers <= 1:
        collect(map(_train_run_star, jobs))
    else:
        with get_context().Pool(workers) as pool:
            collect(pool.imap_unordered(_train_run_star, jobs))
    # imap_unordered finishes in any order: sort so the output does not depend on scheduling.
    results.sort(key=lambda r: (list(methods).index(r["method"]), r["k"], r["seed"]))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="K=4 only: the K=4 rows of the full table, one row per method (< 2 min)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    parser.add_argument("--ks", default=None, help="group sizes K (default 2,4,8; quick: 4)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per (method, K)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--save-memory",
        default=None,
        metavar="PATH",
        help="also train tigpo once (first K, seed 0) and write its GraphMemory.state_dict() "
        "to PATH, for extras/export_graph.py",
    )
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG path (default bench/credit.png for the full run, none for --quick)",
    )
    for f in fields(Config):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=None,
            help=f"Config.{f.name} (default {f.default})",
        )
    args = parser.parse_args(argv)

    cfg = replace(
        Config(),
        **{
            f.name: getattr(args, f.name)
            for f in fields(Config)
            if getattr(args, f.name) is not None
        },
    )
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    ks = [int(x) for x in (args.ks or ("4" if args.quick else "2,4,8")).split(",")]
    bad_ks = [k for k in ks if k < 1 or cfg.rollouts % k]
    if bad_ks:
        parser.error(
            f"K={bad_ks} does not divide --rollouts {cfg.rollouts}: the budget B*K must be "
            "the same for every K; pick K among the divisors of --rollouts"
        )
    seeds = range(args.seeds)
    default_plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "credit.png")
    plot_path = args.plot or (None if args.quick else default_plot)

    print(f"config: {cfg}")
    print(f"env: {env_steps_per_second(cfg):,.0f} steps/s (pure Python, uniform random actions)")
    start = time.perf_counter()
    results = run_benchmark(cfg, methods, ks, seeds, args.workers)
    table = summarize(results, methods, ks, label_k=len(ks) > 1)
    print(
        f"\nFinal success = exact success probability of the sampling policy (temperature 1) "
        f"over the {cfg.num_tasks} train tasks after {cfg.updates} updates, mean ± std over "
        f"{len(seeds)} seeds; B*K = {cfg.rollouts} rollouts per update for every method"
        + (f" (K = {ks[0]})" if len(ks) == 1 else "")
        + ".\n"
    )
    print(table)
    print(
        f"\nmean success over training = area under the learning curve (evaluated every "
        f"{cfg.eval_every} updates); updates to 50% = first evaluation at >= 0.5, median over "
        "seeds (never = infinity), with how many seeds got there; zero-advantage steps = share "
        "of training steps with |A| < 1e-6; memory hit = share of groups whose task, and of "
        "current states, already in GraphMemory before the update (tigpo variants)."
    )
    print(
        f"\n{len(results)} runs in {time.perf_counter() - start:.0f} s with {args.workers} workers"
    )
    if plot_path:
        plot(results, methods, ks, cfg.rollouts, plot_path)
    if args.save_memory:
        run = train_run("tigpo", ks[0], 0, cfg, keep_memory=True)
        with open(args.save_memory, "w") as fh:
            json.dump(run["memory"], fh)
        print(
            f"wrote the persistent graph of tigpo (K={ks[0]}, seed 0) to {args.save_memory}: "
            f"python extras/export_graph.py {args.save_memory} --list"
        )


if __name__ == "__main__":
    main()
