"""tigpo.py property tests on random batches: the fast path equals a naive, literal reading of
docs/ALGORITHM.md E1-E10 (written out below), inputs are never mutated, group order does not matter,
and a task's advantages depend only on that task's groups and memory."""

import copy
import json
import random
import statistics

import pytest

from tigpo import ALGOS, SUCCESS, GraphMemory, RevisitScheduler, compute_advantages

TOL = 1e-9


# ---------------------------------------------------------------------------------------------
# Naive reference: every equation in its most literal form, no shortcuts.
# ---------------------------------------------------------------------------------------------


def naive_norm(values, pool, norm, eps):
    if len(set(pool)) == 1:  # one value, or equal values: no spread, exactly 0 (fmean is inexact)
        return [0.0 for _ in values]
    mean = statistics.fmean(pool)
    if norm == "mean":
        return [v - mean for v in values]
    return [(v - mean) / (statistics.stdev(pool) + eps) for v in values]


def naive_distances(edges, states):
    """E5 by repeated relaxation over an explicit edge set (no BFS, no early stop), for every
    state in `states`, nodes of the graph or not. A state no edge touches, or one that cannot
    reach SUCCESS, gets d_max + 1; with no SUCCESS node, every state gets 1."""
    nodes = {n for edge in edges for n in edge}
    if SUCCESS not in nodes:
        return {n: 1 for n in states}
    dist = {SUCCESS: 0}
    changed = True
    while changed:
        changed = False
        for src, dst in edges:
            if dst in dist and dist.get(src, float("inf")) > dist[dst] + 1:
                dist[src] = dist[dst] + 1
                changed = True
    d_max = max(dist.values())
    return {n: dist.get(n, d_max + 1) for n in states}


def naive_steps(traj):
    """(src, next, valid, t, T) per step, the last step of a won trajectory ending in SUCCESS."""
    states, valid, T = traj["states"], traj["valid"], len(traj["valid"])
    won = traj["success"]
    return [
        (states[t], SUCCESS if won and t == T - 1 else states[t + 1], valid[t], t, T)
        for t in range(T)
    ]


def naive_advantages(
    groups,
    algo,
    history,
    C=10.0,
    p=0.1,
    gs=0.95,
    gg=0.1,
    ls=1.0,
    le=1.0,
    norm="mean_std",
    eps=1e-6,
    cross_temporal=True,
):
    """history: {task: set of (src, dst)} for tigpo."""
    episode = []
    for g in groups:
        scores = [t["score"] for t in g["trajs"]]
        pool = scores
        if algo == "tigpo" and cross_temporal and g.get("kind") == "revisit":
            pool = list(g["ref_scores"]) + scores
        episode.append(naive_norm(scores, pool, norm, eps))
    if algo == "grpo":
        return [
            [[le * e] * len(t["valid"]) for t, e in zip(g["trajs"], ep)]
            for g, ep in zip(groups, episode)
        ]
    # One record per current step: ((task, src), return), computed per task.
    returns = {}
    for task in {g["task"] for g in groups}:
        mine = [
            (gi, i, t)
            for gi, g in enumerate(groups)
            if g["task"] == task
            for i, t in enumerate(g["trajs"])
        ]
        # E4: G_x holds the valid transitions only (valid self-loops too: they change nothing)
        edges = {(s, n) for _, _, t in mine for s, n, ok, _, _ in naive_steps(t) if ok}
        if algo == "tigpo":
            edges |= history.get(task, set())
        nexts = {n for _, _, t in mine for _, n, _, _, _ in naive_steps(t)}
        dist = naive_distances(edges, nexts) if algo != "gigpo" else None
        for gi, i, t in mine:
            for src, nxt, ok, step, T in naive_steps(t):
                if algo == "gigpo":
                    q = gs ** (T - 1 - step) * t["score"] - p * (1 - ok)
                else:
                    q = C * gg ** dist[nxt] - p * (1 - ok)
                returns[gi, i, step] = (task, src), q
    anchors = {}
    for key, q in returns.values():
        anchors.setdefault(key, []).append(q)
    out = []
    for gi, g in enumerate(groups):
        out.append([])
        for i, t in enumerate(g["trajs"]):
            row = []
            for step in range(len(t["valid"])):
                key, q = returns[gi, i, step]
                row.append(ls * naive_norm([q], anchors[key], norm, eps)[0] + le * episode[gi][i])
            out[-1].append(row)
    return out


def naive_memory_add(history, groups):
    """E10: valid transitions, no self-loops, success edges included."""
    for g in groups:
        for t in g["trajs"]:
            for src, nxt, ok, _, _ in naive_steps(t):
                if ok and src != nxt:
                    history.setdefault(g["task"], set()).add((src, nxt))


# ---------------------------------------------------------------------------------------------
# Random batches: few states per task so anchors, merges, dead ends and wins all occur.
# ---------------------------------------------------------------------------------------------


def random_batch(rng, tasks=("x", "y", "z")):
    groups = []
    for _ in range(rng.randint(1, 6)):
        task = rng.choice(tasks)
        trajs = []
        for _ in range(rng.randint(1, 4)):
            T = rng.randint(0, 6)
            states = [rng.choice("abcdefg") for _ in range(T + 1)]
            success = T > 0 and rng.random() < 0.3
            score = rng.choice([10.0, 7.5]) if success else rng.choice([0.0, 0.0, 1.25, -3.0])
            trajs.append(
                {
                    "states": states,
                    "valid": [rng.random() < 0.8 for _ in range(T)],
                    "score": score,
                    "success": success,
                }
            )
        group = {"task": task, "kind": "explore", "trajs": trajs}
        if rng.random() < 0.4:
            group["kind"] = "revisit"
            group["ref_scores"] = [rng.choice([0.0, 10.0, 2.5]) for _ in range(rng.randint(1, 4))]
        groups.append(group)
    return groups


def seeded_memory(rng, updates=3):
    memory, history = GraphMemory(), {}
    for _ in range(updates):
        batch = random_batch(rng)
        memory.add(batch)
        naive_memory_add(history, batch)
    return memory, history


def close(a, b):
    if isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return abs(a - b) <= TOL


SETTINGS = [
    dict(),
    dict(norm="mean"),
    dict(cross_temporal=False),
    dict(lambda_step=0.5, lambda_ep=2.0, graph_gamma=0.2, invalid_penalty=0.3),
]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_fast_path_equals_naive_reference(algo, setting):
    kwargs = SETTINGS[setting]
    naive_kwargs = {
        "norm": kwargs.get("norm", "mean_std"),
        "cross_temporal": kwargs.get("cross_temporal", True),
        "ls": kwargs.get("lambda_step", 1.0),
        "le": kwargs.get("lambda_ep", 1.0),
        "gg": kwargs.get("graph_gamma", 0.1),
        "p": kwargs.get("invalid_penalty", 0.1),
    }
    rng = random.Random(1000 * setting + ALGOS.index(algo))
    for _ in range(60):
        memory, history = seeded_memory(rng)
        assert {t: set(map(tuple, e)) for t, e in memory.state_dict()["edges"].items()} == history
        batch = random_batch(rng)
        got = compute_advantages(batch, algo, memory, **kwargs)
        want = naive_advantages(batch, algo, history, **naive_kwargs)
        assert close(got, want), (algo, kwargs, batch)


@pytest.mark.parametrize("algo", ALGOS)
def test_inputs_and_memory_are_never_mutated(algo):
    rng = random.Random(7)
    for _ in range(30):
        memory, _ = seeded_memory(rng)
        batch = random_batch(rng)
        batch_before = copy.deepcopy(batch)
        memory_before = json.dumps(memory.state_dict())
        compute_advantages(batch, algo, memory)
        assert batch == batch_before
        assert json.dumps(memory.state_dict()) == memory_before


@pytest.mark.parametrize("algo", ALGOS)
def test_group_order_does_not_change_any_advantage(algo):
    rng = random.Random(11)
    for _ in range(40):
        memory, _ = seeded_memory(rng)
        batch = random_batch(rng)
        order = list(range(len(batch)))
        rng.shuffle(order)
        base = compute_advantages(batch, algo, memory)
        shuffled = compute_advantages([batch[i] for i in order], algo, memory)
        assert close(shuffled, [base[i] for i in order])


@pytest.mark.parametrize("algo", ALGOS)
def test_a_tasks_advantages_depend_only_on_its_groups_and_memory(algo):
    rng = random.Random(13)
    for _ in range(40):
        memory, _ = seeded_memory(rng)
        batch = random_batch(rng)
        full = compute_advantages(batch, algo, memory)
        keep = [i for i, g in enumerate(batch) if g["task"] == "x"]
        # Only task x's groups, and a memory holding only task x's graph.
        state = memory.state_dict()
        alone = GraphMemory()
        alone.load_state_dict(
            {**state, "edges": {t: e for t, e in state["edges"].items() if t == "x"}}
        )
        part = compute_advantages([batch[i] for i in keep], algo, alone)
        assert close(part, [full[i] for i in keep])


def test_a_batch_scores_the_same_once_the_memory_holds_it():
    """E4 and E10 keep the same edges (valid transitions; H drops self-loops, which change no
    distance), so H u G does not change when H already holds G: storing a batch and scoring it
    again gives the same advantages, and GraphGPO's G_x equals tigpo on a memory of that batch
    alone (E8 off, so revisit groups use E1 in both)."""
    rng = random.Random(29)
    for _ in range(60):
        memory, _ = seeded_memory(rng)
        batch = random_batch(rng)
        before = compute_advantages(batch, "tigpo", memory)
        memory.add(batch)
        assert compute_advantages(batch, "tigpo", memory) == before
        alone = GraphMemory()
        alone.add(batch)
        assert compute_advantages(
            batch, "tigpo", alone, cross_temporal=False
        ) == compute_advantages(batch, "graphgpo")


def test_memory_bound_keeps_the_newest_edges_of_each_task():
    rng = random.Random(17)
    for cap in (1, 3, 8):
        bounded, log = GraphMemory(max_edges_per_task=cap), {}
        for _ in range(6):
            batch = random_batch(rng)
            bounded.add(batch)
            for g in batch:  # naive: the first-insertion order of distinct edges, FIFO-evicted
                kept = log.setdefault(g["task"], [])
                for t in g["trajs"]:
                    for src, nxt, ok, _, _ in naive_steps(t):
                        if ok and src != nxt and (src, nxt) not in kept:
                            kept.append((src, nxt))
                            del kept[:-cap]
        assert {
            t: [tuple(e) for e in edges] for t, edges in bounded.state_dict()["edges"].items()
        } == log


def test_scheduler_budget_and_exact_delay_invariants():
    rng = random.Random(19)
    tasks = [f"t{i}" for i in range(5)]
    for _ in range(40):
        num = rng.randint(1, 6)
        revisit = rng.randint(0, num)
        delay = rng.randint(1 if revisit else 0, 3)
        sched = RevisitScheduler(tasks, num, revisit, delay, seed=rng.randint(0, 99))
        recorded, dropped = {}, 0  # naive: {update: [(task, scores)] in record order}
        for k in range(1, 16):
            plan = sched.plan(k)
            assert len(plan) == num  # B never changes
            revisits = [s for s in plan if s["kind"] == "revisit"]
            assert plan[: len(revisits)] == revisits  # revisits come first
            # Exactly the groups explored at k - delay, the first `revisit` of them in record
            # order; the rest are dropped, never served at a later update.
            due = recorded.pop(k - delay, [])
            assert [(s["task"], s["ref_scores"]) for s in revisits] == due[:revisit]
            dropped += len(due[revisit:])
            assert sched.dropped == dropped
            explored = [
                {
                    "task": s["task"],
                    "kind": "explore",
                    "trajs": [{"states": ["s"], "valid": [], "score": float(k), "success": False}],
                }
                for s in plan
                if s["kind"] == "explore"
            ]
            sched.record(k, explored)
            if revisit:
                recorded[k] = [(g["task"], [float(k)]) for g in explored]
            assert len(sched.queue) <= delay * num  # the last `delay` updates' explorations


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_equal_values_give_exactly_zero(algo, norm):
    """E1, E3 and E8 on sets of equal values: exactly 0, for any value and set size (sum / n is
    inexact for most of them). Every rollout leaves s0 for its own next state in one step, with
    the group's one score; nobody wins, so every E6 return is C * graph_gamma."""
    rng = random.Random(23)
    for _ in range(200):
        value = rng.uniform(-10.0, 10.0)
        trajs = [
            {"states": ["s0", f"n{i}"], "valid": [True], "score": value, "success": False}
            for i in range(rng.randint(2, 9))
        ]
        kind = rng.choice(["explore", "revisit"])
        batch = [
            {
                "task": "x",
                "kind": kind,
                "trajs": trajs,
                "ref_scores": [value] * rng.randint(1, 9) if kind == "revisit" else None,
            }
        ]
        got = compute_advantages(
            batch,
            algo,
            success_reward=rng.uniform(0.1, 20.0),
            norm=norm,
            graph_gamma=rng.uniform(0.05, 0.5),
        )
        assert got == [[[0.0]] * len(trajs)], (algo, norm, value, len(trajs))
