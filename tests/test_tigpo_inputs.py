"""tigpo.py on the containers copiers have: verl-style code holds states and flags in NumPy arrays,
other code in tuples. Every public function must give exactly the answer it gives for lists, and
never write into its input (a NumPy slice is a view; a '<U1' array would cut SUCCESS to '<')."""

import copy
import json
import random

import numpy as np
import pytest
from test_tigpo_properties import random_batch

from tigpo import ALGOS, GraphMemory, RevisitScheduler, compute_advantages


def as_container(groups, kind):
    """The same batch with states, valid flags, scores and ref_scores in another container."""

    def conv(values, strings):
        if kind == "tuple":
            return tuple(values)
        if kind == "numpy-str":
            return np.array(values, dtype=str if strings else None)  # states: '<U1' here
        return np.array(values, dtype=object)  # numpy-object

    out = []
    for group in groups:
        g = {
            **group,
            "trajs": [
                {
                    "states": conv(t["states"], True),
                    "valid": conv(t["valid"], False),
                    "score": np.float64(t["score"]) if kind != "tuple" else t["score"],
                    "success": np.bool_(t["success"]) if kind != "tuple" else t["success"],
                }
                for t in group["trajs"]
            ],
        }
        if group.get("ref_scores") is not None:
            g["ref_scores"] = conv(group["ref_scores"], False)
        out.append(g)
    return out


def snapshot(groups):
    return json.dumps(
        [
            {
                **g,
                "ref_scores": list(map(float, g["ref_scores"]))
                if g.get("ref_scores") is not None
                else None,
                "trajs": [
                    {
                        "states": [str(s) for s in t["states"]],
                        "valid": [bool(v) for v in t["valid"]],
                        "score": float(t["score"]),
                        "success": bool(t["success"]),
                    }
                    for t in g["trajs"]
                ],
            }
            for g in groups
        ]
    )


@pytest.mark.parametrize("kind", ["tuple", "numpy-str", "numpy-object"])
@pytest.mark.parametrize("seed", range(6))
def test_every_public_function_agrees_with_lists_and_leaves_the_input_alone(kind, seed):
    rng = random.Random(seed)
    history = [random_batch(rng) for _ in range(3)]
    batch = random_batch(rng)
    # at least one won trajectory with a '<U1'-sized last state, the case that used to go wrong
    batch[0]["trajs"][0] = {"states": ["a", "b"], "valid": [True], "score": 10.0, "success": True}
    results = {}
    for container in ("list", kind):
        conv = (lambda gs: gs) if container == "list" else (lambda gs: as_container(gs, kind))
        memory = GraphMemory(max_edges_per_task=7)
        scheduler = RevisitScheduler(["x", "y", "z"], 4, 2, 1, seed=seed)
        for k, past in enumerate(history, start=1):
            memory.add(conv(past))
            scheduler.record(k, conv(past))
        current = conv(batch)
        before = snapshot(current)
        advantages = {algo: compute_advantages(current, algo, memory) for algo in ALGOS}
        stats = memory.stats(current)
        memory.add(current)
        scheduler.record(len(history) + 1, current)
        assert snapshot(current) == before, "the input was changed"
        results[container] = (
            advantages,
            stats,
            json.dumps(memory.state_dict()),
            json.dumps(scheduler.state_dict()),
            memory.edges("x"),
        )
    assert results["list"] == results[kind]


def test_the_documented_numpy_trap_gives_the_right_advantage():
    """The review's case: 2 rollouts of one task, '<U1' states; the won one ends in SUCCESS."""
    won = {
        "states": np.array(["a", "b"]),
        "valid": np.array([True]),
        "score": 10.0,
        "success": True,
    }
    lost = {
        "states": np.array(["a", "c"]),
        "valid": np.array([True]),
        "score": 0.0,
        "success": False,
    }
    groups = [{"task": "t", "trajs": [won, lost]}]
    kept = copy.deepcopy(groups)
    adv = compute_advantages(groups, "graphgpo")
    listed = compute_advantages(
        [
            {
                "task": "t",
                "trajs": [
                    {**won, "states": ["a", "b"], "valid": [True]},
                    {**lost, "states": ["a", "c"], "valid": [True]},
                ],
            }
        ],
        "graphgpo",
    )
    assert adv == listed and abs(adv[0][0][0]) > 1.0  # +-1.414, not +-0.707
    assert np.array_equal(groups[0]["trajs"][0]["states"], kept[0]["trajs"][0]["states"])
    memory = GraphMemory()
    memory.add(groups)
    assert memory.edges("t") == {"a": {"<success>", "c"}}
