"""bench/core_overhead.py: what TIGPO's bookkeeping costs per update (tigpo.py, E1-E10).

Times compute_advantages(algo="tigpo") + memory.add on a paper-scale batch (B=16 groups, half
of them revisits, K=8 rollouts, T=50 steps: 6,400 transitions) against a persistent memory of
>= 100k edges over 200 tasks, next to a bare pass that touches every transition once (one dict
insert keyed by (task, state)). Prints milliseconds (CPU and wall clock, best and median over
--reps batches), the ratio to the bare pass (target <= 10) and the bytes the memory's containers
take per stored edge. Synthetic rollouts: each task is a random graph of 150 states x 5
actions, 10% invalid actions (the state stays), 25% wins; every state key is a fresh string,
as an env makes them.

    python bench/core_overhead.py [--reps 40] [--seed 0]
"""

import argparse
import functools
import gc
import hashlib
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import tigpo  # noqa: E402

NUM_TASKS, NUM_STATES, NUM_ACTIONS = 200, 150, 5
B, B_REVISIT, K, T = 16, 8, 8, 50
MIN_EDGES = 100_000


def make_world(rng):
    """{task: (state keys, transition table)}; keys look like envs' 16-hex fact digests."""
    world = {}
    for x in range(NUM_TASKS):
        task = f"train/pick_and_place_simple-Obj{x}-None-Recep-{x}/trial_{x}/game.tw-pddl"
        keys = [hashlib.sha1(f"{task}#{s}".encode()).hexdigest()[:16] for s in range(NUM_STATES)]
        table = [[rng.randrange(NUM_STATES) for _ in range(NUM_ACTIONS)] for _ in range(NUM_STATES)]
        world[task] = (keys, table)
    return world


def rollout_group(world, task, rng, kind="explore"):
    keys, table = world[task]
    trajs = []
    for _ in range(K):
        s, states, valid = 0, [keys[0][:8] + keys[0][8:]], []
        for _ in range(T):
            ok = rng.random() < 0.9
            if ok:
                s = table[s][rng.randrange(NUM_ACTIONS)]
            states.append(keys[s][:8] + keys[s][8:])  # a fresh str per step, as an env makes
            valid.append(ok)
        won = rng.random() < 0.25
        trajs.append(
            {"states": states, "valid": valid, "score": 10.0 if won else 0.0, "success": won}
        )
    group = {"task": task, "kind": kind, "trajs": trajs}
    if kind == "revisit":
        group["ref_scores"] = [rng.choice([0.0, 10.0]) for _ in range(K)]
    return group


def bare_pass(groups):
    """The floor: touch every transition once, one dict insert keyed by (task, state)."""
    seen = {}
    for group in groups:
        task = group["task"]
        for traj in group["trajs"]:
            for state in traj["states"][:-1]:
                seen[(task, state)] = True
    return seen


def timed(fn):
    """(cpu ms, wall ms) of one call. CPU time is the headline: on a shared machine the wall clock
    also counts the time other processes hold the core, and a 7 ms pass is preempted far more
    often than a 0.6 ms one, which inflates the ratio."""
    gc.collect()
    gc.disable()  # as timeit does: a collection would bill one pass for every pass's garbage
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    gc.enable()
    return cpu * 1e3, wall * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--reps", type=int, default=40, help="timed batches (best and median reported)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    world = make_world(rng)
    tasks = list(world)

    memory, built = tigpo.GraphMemory(), time.perf_counter()
    while memory.stats()["edges"] < MIN_EDGES:  # one exploration group per task per round
        memory.add([rollout_group(world, task, rng) for task in tasks])
    built = time.perf_counter() - built
    stats = memory.stats()
    print(
        f"memory: {stats['tasks']} tasks, {stats['nodes']:,} nodes, {stats['edges']:,} edges "
        f"(built in {built:.1f} s)"
    )

    # Bytes per edge: what the memory's own containers allocate when loaded from a state dict
    # (the state-key strings are shared with the rollouts and not counted).
    state = memory.state_dict()
    tracemalloc.start()
    copy = tigpo.GraphMemory()
    copy.load_state_dict(state)
    container_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del copy, state

    rows = {name: [] for name in ("bare", "tigpo+add", "tigpo", "add", "graphgpo", "gigpo", "grpo")}
    for _ in range(args.reps):
        picks = rng.sample(tasks, B)
        batch = [rollout_group(world, t, rng, "revisit") for t in picks[:B_REVISIT]] + [
            rollout_group(world, t, rng) for t in picks[B_REVISIT:]
        ]
        rows["bare"].append(timed(functools.partial(bare_pass, batch)))
        for algo in ("graphgpo", "gigpo", "grpo"):
            rows[algo].append(timed(functools.partial(tigpo.compute_advantages, batch, algo)))
        # The timed update, as train.py runs it: advantages, then the memory write (E10) of a
        # batch the memory has not seen yet, so the memory grows a little from batch to batch.
        score = functools.partial(tigpo.compute_advantages, batch, "tigpo", memory)
        rows["tigpo"].append(timed(score))
        rows["add"].append(timed(functools.partial(memory.add, batch)))
        rows["tigpo+add"].append(tuple(map(sum, zip(rows["tigpo"][-1], rows["add"][-1]))))

    n_steps = B * K * T
    print(
        f"batch: B={B} ({B_REVISIT} revisit), K={K}, T={T}: {n_steps:,} transitions; "
        f"{args.reps} batches; best and median per pass"
    )
    print(
        f"{'pass':<11}{'cpu best':>9}{'median':>8}{'x bare':>8}{'us/step':>9}"
        f"{'wall best':>11}{'median':>8}{'x bare':>8}"
    )
    summary = {}
    for name, times in rows.items():
        cpu, wall = zip(*times)
        summary[name] = [f(c) for c in (cpu, wall) for f in (min, statistics.median)]
    bare = summary["bare"]
    for name, (cpu_best, cpu_med, wall_best, wall_med) in summary.items():
        print(
            f"{name:<11}{cpu_best:9.2f}{cpu_med:8.2f}{cpu_best / bare[0]:8.2f}"
            f"{cpu_best * 1e3 / n_steps:9.3f}{wall_best:11.2f}{wall_med:8.2f}"
            f"{wall_best / bare[2]:8.2f}"
        )
    ratio = [a / b for a, b in zip(summary["tigpo+add"], bare)]
    print(
        f"overhead ratio (tigpo advantages + memory.add) / bare pass (target <= 10): "
        f"cpu {ratio[0]:.2f} best, {ratio[1]:.2f} median; "
        f"wall {ratio[2]:.2f} best, {ratio[3]:.2f} median"
    )
    print(
        f"memory containers: {container_bytes / 2**20:.1f} MiB, "
        f"{container_bytes / stats['edges']:.0f} bytes per edge (state strings not counted)"
    )


if __name__ == "__main__":
    main()
