"""bench/core_overhead.py: what TIGPO's bookkeeping costs per update (tigpo.py, E1-E10).

Times compute_advantages(algo="tigpo") + memory.add on a paper-scale batch (B=16 groups, half
of them revisits, K=8 rollouts, T=50 steps: 6,400 transitions) against a persistent memory of
>= 100k edges over 200 tasks, next to a bare pass that touches every transition once (one dict
insert keyed by (task, state)). Prints milliseconds (best and median over --reps batches), the
ratio to the bare pass (target <= 10) and the bytes the memory's containers take per stored
edge. Synthetic rollouts: each task is a random graph of 150 states x 5 actions, 10% invalid
actions (the state stays), 25% wins; every state key is a fresh string, as an env makes them.

    python bench/core_overhead.py [--reps 40] [--seed 0]
"""
import argparse
import gc
import hashlib
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere
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
            states.append(keys[s][:8] + keys[s][8:])   # a fresh str per step, as an env makes
            valid.append(ok)
        won = rng.random() < 0.25
        trajs.append({"states": states, "valid": valid, "score": 10.0 if won else 0.0,
                      "success": won})
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
    gc.collect()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=40,
                        help="timed batches (best and median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    world = make_world(rng)
    tasks = list(world)

    memory, built = tigpo.GraphMemory(), time.perf_counter()
    while memory.stats()["edges"] < MIN_EDGES:   # one exploration group per task per round
        memory.add([rollout_group(world, task, rng) for task in tasks])
    built = time.perf_counter() - built
    stats = memory.stats()
    print(f"memory: {stats['tasks']} tasks, {stats['nodes']:,} nodes, {stats['edges']:,} edges "
          f"(built in {built:.1f} s)")

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
        batch = ([rollout_group(world, t, rng, "revisit") for t in picks[:B_REVISIT]]
                 + [rollout_group(world, t, rng) for t in picks[B_REVISIT:]])
        rows["bare"].append(timed(lambda: bare_pass(batch)))
        for algo in ("graphgpo", "gigpo", "grpo"):
            rows[algo].append(timed(lambda: tigpo.compute_advantages(batch, algo)))
        # The timed update, as train.py runs it: advantages, then the memory write (E10) of a
        # batch the memory has not seen yet, so the memory grows a little from batch to batch.
        rows["tigpo"].append(timed(lambda: tigpo.compute_advantages(batch, "tigpo", memory)))
        rows["add"].append(timed(lambda: memory.add(batch)))
        rows["tigpo+add"].append(rows["tigpo"][-1] + rows["add"][-1])

    # Best of N is the headline (timeit's convention): on a shared machine the other processes
    # only ever add time, and they hit a 7 ms pass far more often than a 0.6 ms one, which
    # inflates a ratio of medians. The median is printed beside it.
    n_steps = B * K * T
    best_bare, median_bare = min(rows["bare"]), statistics.median(rows["bare"])
    print(f"batch: B={B} ({B_REVISIT} revisit), K={K}, T={T}: {n_steps:,} transitions; "
          f"{args.reps} batches")
    print(f"{'pass':<12}{'best ms':>9}{'x bare':>8}{'us/step':>9}{'median ms':>11}{'x bare':>8}")
    for name, times in rows.items():
        best, median = min(times), statistics.median(times)
        print(f"{name:<12}{best:9.2f}{best / best_bare:8.2f}{best * 1e3 / n_steps:9.3f}"
              f"{median:11.2f}{median / median_bare:8.2f}")
    print(f"overhead ratio (tigpo advantages + memory.add) / bare pass = "
          f"{min(rows['tigpo+add']) / best_bare:.2f} best, "
          f"{statistics.median(rows['tigpo+add']) / median_bare:.2f} median (target <= 10)")
    print(f"memory containers: {container_bytes / 2**20:.1f} MiB, "
          f"{container_bytes / stats['edges']:.0f} bytes per edge (state strings not counted)")


if __name__ == "__main__":
    main()
