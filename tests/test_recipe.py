"""The README's recipe between flat per-step rows (verl, TRL) and tigpo's [group][traj][step],
run exactly as the README prints it: groups of unequal size, rows in any order."""

import os
import random
import re

import tigpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe():
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    block = re.search(
        r"<!-- recipe:start -->\s*```python\n(.*?)```\s*<!-- recipe:end -->", text, re.S
    )
    assert block, "README.md has no recipe block"
    namespace = {}
    exec(block.group(1), namespace)
    return namespace["rows_to_groups"], namespace["advantages_to_rows"]


def test_the_readme_recipe_maps_rows_to_groups_and_back():
    rows_to_groups, advantages_to_rows = recipe()
    rng = random.Random(0)
    groups = []  # the reference, built directly
    for g, k in enumerate([2, 3, 1, 4]):  # unequal group sizes
        trajs = []
        for _ in range(k):
            T = rng.randint(1, 5)
            states = [rng.choice("abcde") for _ in range(T + 1)]
            won = rng.random() < 0.4
            trajs.append(
                {
                    "states": states,
                    "valid": [rng.random() < 0.8 for _ in range(T)],
                    "score": 10.0 if won else 0.0,
                    "success": won,
                }
            )
        kind = "revisit" if g == 1 else "explore"
        groups.append(
            {
                "task": f"task{g % 3}",
                "kind": kind,
                "ref_scores": [0.0, 10.0] if kind == "revisit" else None,
                "trajs": trajs,
            }
        )
    memory = tigpo.GraphMemory()
    memory.add([groups[0]])
    want = tigpo.compute_advantages(groups, "tigpo", memory)
    rows, expected = [], []
    for g, group in enumerate(groups):
        for j, traj in enumerate(group["trajs"]):
            for t in range(len(traj["valid"])):
                rows.append(
                    {
                        "group_id": f"uid-{g}",
                        "traj_id": f"traj-{g}-{j}",
                        "step": t,
                        "state": traj["states"][t],
                        "next_state": traj["states"][t + 1],
                        "valid": traj["valid"][t],
                        "score": traj["score"],
                        "success": traj["success"],
                    }
                )
                expected.append(want[g][j][t])
    order = list(range(len(rows)))
    rng.shuffle(order)
    rows, expected = [rows[i] for i in order], [expected[i] for i in order]
    meta = {
        f"uid-{g}": {k: group[k] for k in ("task", "kind", "ref_scores")}
        for g, group in enumerate(groups)
    }
    rebuilt, where = rows_to_groups(rows, meta)
    got = advantages_to_rows(tigpo.compute_advantages(rebuilt, "tigpo", memory), where)
    assert got == expected
    assert sorted(len(g["trajs"]) for g in rebuilt) == [1, 2, 3, 4]
