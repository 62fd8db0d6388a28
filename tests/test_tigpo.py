"""tigpo.py pinned by hand-worked examples: each test's numbers were computed on paper from the
equations of docs/ALGORITHM.md (E1-E11), with the arithmetic written beside them."""

import json
import math

import pytest

from tigpo import (
    ALGOS,
    SUCCESS,
    GraphMemory,
    RevisitScheduler,
    _distances,
    _graph_returns,
    compute_advantages,
)

EPS = 1e-6


def traj(states, valid=None, score=0.0, success=False):
    valid = [True] * (len(states) - 1) if valid is None else valid
    return {"states": list(states), "valid": list(valid), "score": score, "success": success}


def group(task, trajs, kind="explore", ref_scores=None):
    out = {"task": task, "kind": kind, "trajs": trajs}
    if ref_scores is not None:
        out["ref_scores"] = ref_scores
    return out


def close(got, want, tol=1e-9):
    """Nested lists equal within tol, same shape."""
    if isinstance(want, list):
        return len(got) == len(want) and all(close(g, w, tol) for g, w in zip(got, want))
    return abs(got - want) <= tol


# A two-rollout group used by several tests: A wins in two steps, B wanders into a dead end.
#   A: s0 -> s1 -> s2, both valid, score 10, won   (G_x edges: s0->s1, s1->SUCCESS)
#   B: s0 -> s3 -> s3, second action invalid, 0    (G_x edge: s0->s3; invalid s3->s3 adds none)
PAIR = [
    group(
        "x",
        [
            traj(["s0", "s1", "s2"], score=10.0, success=True),
            traj(["s0", "s3", "s3"], valid=[True, False]),
        ],
    )
]
# E1 on Z = [10, 0]: mean 5, sample std sqrt((25 + 25) / 1) = sqrt(50).
EP_PAIR = 5 / (math.sqrt(50) + EPS)


# ---------------------------------------------------------------------------------------------
# E1 / E8: episode advantages
# ---------------------------------------------------------------------------------------------


def test_e1_grpo_four_rollouts_sample_std():
    # Z = [10, 0, 0, 0]: mean 2.5; squared deviations 56.25 + 3 * 6.25 = 75; / (4 - 1) = 25,
    # so the sample std is 5 (the population std would be 4.33).
    g = [
        group(
            "x",
            [traj(["a", "b", "c"], score=10.0, success=True)]
            + [traj([f"d{i}", "e"], score=0.0) for i in range(3)],
        )
    ]
    win, lose = 7.5 / (5 + EPS), -2.5 / (5 + EPS)
    assert close(compute_advantages(g, "grpo"), [[[win, win], [lose], [lose], [lose]]])
    # norm="mean" drops the division; lambda_ep scales the episode term.
    assert close(
        compute_advantages(g, "grpo", norm="mean", lambda_ep=2.0),
        [[[15.0, 15.0], [-5.0], [-5.0], [-5.0]]],
    )


@pytest.mark.parametrize("algo", ALGOS)
def test_a_group_of_one_gives_zero(algo):
    # One rollout: E1 gives 0 (a choice: verl-agent would give the raw score); its states are all
    # distinct so every E3 anchor group has one member and gives 0 too.
    g = [group("x", [traj(["a", "b", "c"], score=10.0, success=True)])]
    assert compute_advantages(g, algo, GraphMemory()) == [[[0.0, 0.0]]]


def revisit_batch():
    # Four one-step rollouts from distinct states, so every E3 anchor group is a singleton and
    # the advantage is the episode term alone.
    trajs = [traj([f"a{i}", f"b{i}"], score=z, success=z > 0) for i, z in enumerate([10, 10, 0, 0])]
    return [group("x", trajs, kind="revisit", ref_scores=[0.0, 0.0, 0.0, 0.0])]


def test_e8_pools_reference_scores_for_revisit_groups():
    # Z = Z_E u Z_now = [0, 0, 0, 0, 10, 10, 0, 0]: mean 20 / 8 = 2.5; squared deviations
    # 2 * 7.5^2 + 6 * 2.5^2 = 112.5 + 37.5 = 150; sample variance 150 / 7; std 4.6291005.
    std = math.sqrt(150 / 7)
    win, lose = 7.5 / (std + EPS), -2.5 / (std + EPS)
    assert close(compute_advantages(revisit_batch(), "tigpo"), [[[win], [win], [lose], [lose]]])
    # "mean" norm: 10 - 2.5 and 0 - 2.5.
    assert close(
        compute_advantages(revisit_batch(), "tigpo", norm="mean"), [[[7.5], [7.5], [-2.5], [-2.5]]]
    )


def test_e8_reference_scores_of_any_size_are_pooled():
    # Z_E need not have the group's K scores: the pool Z_E u Z_now is well defined for any size.
    # One score: Z = [5] u [10, 0] = [5, 10, 0]: mean 5, sample variance (0 + 25 + 25) / 2 = 25.
    one = [
        group(
            "x",
            [traj(["a0", "b0"], score=10.0, success=True), traj(["a1", "b1"])],
            kind="revisit",
            ref_scores=[5.0],
        )
    ]
    assert close(compute_advantages(one, "tigpo"), [[[5 / (5 + EPS)], [-5 / (5 + EPS)]]])
    # Two scores, four rollouts: Z = [0, 10] u [10, 0, 0, 0]: mean 20 / 6 = 10 / 3; squared
    # deviations 2 * (20/3)^2 + 4 * (10/3)^2 = 1200 / 9; sample variance 1200 / 9 / 5 = 80 / 3.
    trajs = [traj([f"a{i}", f"b{i}"], score=z, success=z > 0) for i, z in enumerate([10, 0, 0, 0])]
    two = [group("x", trajs, kind="revisit", ref_scores=[0.0, 10.0])]
    std = math.sqrt(80 / 3)
    win, lose = (20 / 3) / (std + EPS), -(10 / 3) / (std + EPS)
    assert close(compute_advantages(two, "tigpo"), [[[win], [lose], [lose], [lose]]])


# 6.6 three or six times: sum / n is 6.6 + 8.9e-16, not 6.6, and eps would turn that into an
# advantage of +-9e-10. A set of equal values has no spread: every advantage must be exactly 0.
def equal_trajs(score, n=3):
    """n one-step rollouts from s0 to distinct next states, all with one score, none won."""
    return [traj(["s0", f"n{i}"], score=score) for i in range(n)]


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_e1_equal_scores_give_exactly_zero(norm):
    g = [
        {
            "task": "x",
            "trajs": [{"states": ["a", "b"], "valid": [True], "score": 6.6, "success": False}] * 3,
        }
    ]
    assert compute_advantages(g, "grpo", norm=norm) == [[[0.0], [0.0], [0.0]]]


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_e3_equal_step_returns_give_exactly_zero(norm):
    # gigpo: T = 1, so E2's R_{i,0} = 6.6 for all three steps of anchor s0 (and E1 sees 6.6 x 3).
    assert compute_advantages([group("x", equal_trajs(6.6))], "gigpo", norm=norm) == [[[0.0]] * 3]
    # graphgpo: nobody wins, every d = 1: q = 10 * 0.01 = 0.1 for all three steps of anchor s0
    # (3 * 0.1 / 3 is not 0.1); the scores are all 0, so E1 is exactly 0 already.
    batch = [group("x", equal_trajs(0.0))]
    assert compute_advantages(batch, "graphgpo", graph_gamma=0.01, norm=norm) == [[[0.0]] * 3]
    # tigpo: the memory has n_i -> SUCCESS for every next state: d = 1, q = 0.1 again, on H u G.
    memory = GraphMemory()
    memory.add([group("x", [traj([f"n{i}", "z"], score=10.0, success=True) for i in range(3)])])
    assert memory.distances("x")["n0"] == 1
    assert compute_advantages(batch, "tigpo", memory, graph_gamma=0.01, norm=norm) == [[[0.0]] * 3]


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_e8_current_scores_equal_to_reference_scores_give_exactly_zero(norm):
    # Z = Z_E u Z_now = six times 6.6 (sum / 6 is not 6.6); the next states are distinct, so
    # every E3 anchor holds one step and the step term is 0.
    trajs = [traj([f"a{i}", f"b{i}"], score=6.6) for i in range(3)]
    batch = [group("x", trajs, kind="revisit", ref_scores=[6.6, 6.6, 6.6])]
    assert compute_advantages(batch, "tigpo", cross_temporal=True, norm=norm) == [[[0.0]] * 3]


@pytest.mark.parametrize(
    "algo,kwargs",
    [("tigpo", {"cross_temporal": False}), ("grpo", {}), ("gigpo", {}), ("graphgpo", {})],
)
def test_e8_off_and_baselines_use_e1_on_revisit_groups(algo, kwargs):
    # E1 on [10, 10, 0, 0]: mean 5, sample variance 4 * 25 / 3, std sqrt(100 / 3) = 5.7735027.
    a = 5 / (math.sqrt(100 / 3) + EPS)
    assert close(compute_advantages(revisit_batch(), algo, **kwargs), [[[a], [a], [-a], [-a]]])


# ---------------------------------------------------------------------------------------------
# E2 + E3: GiGPO
# ---------------------------------------------------------------------------------------------


def test_e2_e3_gigpo_pair():
    # E2 (gamma_s = 0.95, p = 0.1): A: t=0 0.95^1 * 10 = 9.5, t=1 10.
    #                               B: t=0 0.95 * 0 = 0,     t=1 0 - 0.1 = -0.1 (invalid).
    # E3 anchors: s0 = {9.5, 0}: mean 4.75, std sqrt(2 * 4.75^2) = 4.75 * sqrt(2), so
    # +-4.75 / (4.75 sqrt(2) + eps); s1 and s3 are singletons: 0. Episode term: +-EP_PAIR.
    a0 = 4.75 / (4.75 * math.sqrt(2) + EPS)
    assert close(
        compute_advantages(PAIR, "gigpo"), [[[a0 + EP_PAIR, EP_PAIR], [-a0 - EP_PAIR, -EP_PAIR]]]
    )
    # norm="mean", lambda_step = 2, lambda_ep = 0.5: A0 = 2 * 4.75 + 0.5 * 5 = 12.
    assert close(
        compute_advantages(PAIR, "gigpo", norm="mean", lambda_step=2.0, lambda_ep=0.5),
        [[[12.0, 2.5], [-12.0, -2.5]]],
    )


def test_e3_anchor_groups_span_groups_of_one_task_but_not_tasks():
    # Task x has two groups that both leave s0: the anchor group s0 pools them (E3 key is
    # (task, s)). Task y also has a state named "s0", but its anchor group is its own.
    batch = [
        group("x", [traj(["s0", "p"], score=10.0, success=True)]),
        group("x", [traj(["s0", "q"], score=0.0)]),
        group("y", [traj(["s0", "r"], score=10.0, success=True)]),
    ]
    # E2 with T = 1: R = score. Anchor (x, s0) = {10, 0}: mean 5, "mean" norm: +5 and -5;
    # anchor (y, s0) = {10}: singleton, 0. lambda_ep = 0 isolates the step term.
    got = compute_advantages(batch, "gigpo", norm="mean", lambda_ep=0.0)
    assert close(got, [[[5.0]], [[-5.0]], [[0.0]]])


# ---------------------------------------------------------------------------------------------
# E4-E7: graph returns
# ---------------------------------------------------------------------------------------------


def test_e5_distances_unreachable_gets_dmax_plus_one():
    # Reversed valid edges of PAIR, s0->s1, s1->SUCCESS, s0->s3 (B's invalid s3->s3 is no edge):
    # d(SUCCESS)=0, d(s1)=1, d(s0)=2; s3 cannot reach SUCCESS: d_max = 2, so d(s3) = 3.
    preds = {"s1": ["s0"], SUCCESS: ["s1"], "s3": ["s0"]}
    assert _distances(preds, {}) == {"s1": 1, SUCCESS: 0, "s3": 3}
    # d_max counts every node of the graph, not only next states: here s0 (d=2) is only a source.
    # A next state that only invalid steps reach is a key with no sources: no valid edge touches
    # it, the BFS never reaches it, and it gets d_max + 1 like an unreachable node.
    assert _distances({**preds, "s5": []}, {}) == {"s1": 1, SUCCESS: 0, "s3": 3, "s5": 3}


def test_e5_success_reached_only_by_an_invalid_step_is_no_node():
    # SUCCESS as a key with no sources: a won last step that was invalid. No valid edge enters
    # SUCCESS, so there is no SUCCESS node and every state gets 1 (GraphGPO's convention) ...
    assert _distances({"b": ["a"], SUCCESS: []}, {}) == {"b": 1, SUCCESS: 1}
    # ... unless the history holds a valid edge into it: then d(SUCCESS) = 0, d(b) = 2 (b->c in H).
    history = {SUCCESS: {"c"}, "c": {"b"}}
    assert _distances({"b": ["a"], SUCCESS: []}, history) == {"b": 2, SUCCESS: 0}


def test_e5_no_success_anywhere_gives_every_node_one():
    assert _distances({"b": ["a"], "c": ["b"]}, {}) == {"b": 1, "c": 1}


def test_e4_e6_graphgpo_pair():
    # E6 with C = 10, gamma_g = 0.1, d from the test above:
    #   A0 -> s1 (d=1): 10 * 0.1 = 1.0       A1 -> SUCCESS (A won, d=0): 10
    #   B0 -> s3 (d=3): 10 * 0.001 = 0.01    B1 -> s3, invalid: 0.01 - 0.1 = -0.09
    # Anchor s0 = {1.0, 0.01}: mean 0.505, deviations +-0.495, std 0.495 * sqrt(2).
    a0 = 0.495 / (0.495 * math.sqrt(2) + EPS)
    want = [[[a0 + EP_PAIR, EP_PAIR], [-a0 - EP_PAIR, -EP_PAIR]]]
    assert close(compute_advantages(PAIR, "graphgpo"), want)
    # tigpo with an empty (or no) memory is GraphGPO plus E8, and E8 is idle on explore groups.
    assert close(compute_advantages(PAIR, "tigpo", GraphMemory()), want)
    assert close(compute_advantages(PAIR, "tigpo"), want)
    # "mean" norm and lambda_ep = 0 expose the returns: A0 - B0 = 1.0 - 0.01.
    got = compute_advantages(PAIR, "graphgpo", norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.495, 0.0], [-0.495, 0.0]]])


def test_graphgpo_no_success_rule():
    # No rollout wins: every node has d = 1, so a valid step returns 10 * 0.1 = 1.0 and an
    # invalid one 1.0 - 0.1 = 0.9. Anchor s0 = {1.0, 0.9}: mean 0.95, "mean" norm +-0.05.
    batch = [group("x", [traj(["s0", "s1", "s2"]), traj(["s0", "s0", "s5"], valid=[False, True])])]
    got = compute_advantages(batch, "graphgpo", norm="mean", lambda_ep=0.0)
    # Second rollout: t=0 leaves s0 (anchor s0), t=1 leaves s0 again (same anchor group):
    # anchor s0 = {1.0 (A0), 0.9 (B0), 1.0 (B1)}: mean 2.9 / 3.
    m = 2.9 / 3
    assert close(got, [[[1.0 - m, 0.0], [0.9 - m, 1.0 - m]]])


# E4 keeps valid transitions only. With `--state-key obs` every invalid action observes
# "Nothing happens.", one state key for unrelated states; as an edge it was a shortcut that
# counted in its own update and was gone from H_x (E10) afterwards.
NOTHING = "Nothing happens."


def nothing_happens_batch():
    #   A: a0 -x-> N -> SUCCESS          won, 10: its invalid step lands on N, then a valid win
    #   B: s0 -> b1 -x-> N               lost, 0: a dead end, then an invalid step onto N
    #   C: s0 -> c1 -> c2 -> SUCCESS     won, 10 (c3 replaced by the sink)
    # (-x-> an invalid step). G_x = {N->SUCCESS, s0->b1, s0->c1, c1->c2, c2->SUCCESS}.
    return [
        group(
            "x",
            [
                traj(["a0", NOTHING, "a2"], valid=[False, True], score=10.0, success=True),
                traj(["s0", "b1", NOTHING], valid=[True, False]),
                traj(["s0", "c1", "c2", "c3"], score=10.0, success=True),
            ],
        )
    ]


def test_e4_invalid_steps_onto_a_shared_obs_state_add_no_shortcut():
    batch = nothing_happens_batch()
    # E5: d(N) = 1, d(c2) = 1, d(c1) = 2, d(s0) = 3 = d_max. b1 only leaves by an invalid step,
    # so it cannot reach SUCCESS: d(b1) = d_max + 1 = 4. (With invalid edges, b1->N would have
    # given d(b1) = 2, as good as c1: the shortcut.)
    # E6 (C = 10, gamma_g = 0.1, p = 0.1), each step scored by the state it lands on:
    #   A0 -> N, invalid: 1.0 - 0.1 = 0.9     A1 -> SUCCESS: 10
    #   B0 -> b1: 10 * 0.1^4 = 0.001          B1 -> N, invalid: 0.9 (N keeps A's valid edge)
    #   C0 -> c1: 0.1    C1 -> c2: 1.0    C2 -> SUCCESS: 10
    want = [[0.9, 10.0], [0.001, 0.9], [0.1, 1.0, 10.0]]
    assert close(_graph_returns(batch[0]["trajs"], {}, 10.0, 0.1, 0.1), want)
    # E3: anchor s0 = {B0 0.001, C0 0.1}: mean 0.0505, "mean" norm -+0.0495; every other source
    # state (a0, N, b1, c1, c2) anchors one step: 0. (Old rule: {0.1, 0.1}, both 0.)
    got = compute_advantages(batch, "graphgpo", norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.0, 0.0], [-0.0495, 0.0], [0.0495, 0.0, 0.0]]])
    # G_x and H_x hold the same edges now: once stored, the batch scores the same (E7, E10).
    memory = GraphMemory()
    memory.add(batch)
    assert memory.edges("x") == {
        NOTHING: {SUCCESS},
        "s0": {"b1", "c1"},
        "c1": {"c2"},
        "c2": {SUCCESS},
    }
    assert compute_advantages(batch, "tigpo", memory, norm="mean", lambda_ep=0.0) == got


def test_e4_a_trajectory_of_invalid_steps_only_adds_no_edge():
    #   A: s0 -> s1 -> SUCCESS   won, 10      (G_x = {s0->s1, s1->SUCCESS})
    #   D: s0 -x-> d1 -x-> s1    lost, 0, both steps invalid: no edge
    batch = [
        group(
            "x",
            [
                traj(["s0", "s1", "s2"], score=10.0, success=True),
                traj(["s0", "d1", "s1"], valid=[False, False]),
            ],
        )
    ]
    # E5: d(s1) = 1, d(s0) = 2 = d_max; d1 is no node of the graph: d_max + 1 = 3.
    #   A0 -> s1: 1.0      A1 -> SUCCESS: 10
    #   D0 -> d1, invalid: 10 * 0.1^3 - 0.1 = -0.09   (an edge d1->s1 would have given 0.0)
    #   D1 -> s1, invalid: 1.0 - 0.1 = 0.9
    assert close(_graph_returns(batch[0]["trajs"], {}, 10.0, 0.1, 0.1), [[1.0, 10.0], [-0.09, 0.9]])
    # E3: anchor s0 = {1.0, -0.09}: mean 0.455, "mean" norm +-0.545; s1 and d1 anchor one step.
    got = compute_advantages(batch, "graphgpo", norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.545, 0.0], [-0.545, 0.0]]])
    memory = GraphMemory()
    memory.add([group("y", [batch[0]["trajs"][1]])])
    assert memory.edges("y") == {}  # E10 stores nothing of it either


def won_batch(last_valid):
    #   E: s0 -> s1 -> SUCCESS   won, 10, last step valid or not
    #   F: s0 -> s3              lost, 0
    return [
        group(
            "x",
            [
                traj(["s0", "s1", "s2"], valid=[True, last_valid], score=10.0, success=True),
                traj(["s0", "s3"]),
            ],
        )
    ]


def test_e4_a_valid_winning_step_keeps_its_success_edge():
    # G_x = {s0->s1, s1->SUCCESS, s0->s3}: d(s1) = 1, d(s0) = 2 = d_max, s3 unreachable: 3.
    #   E0 -> s1: 1.0    E1 -> SUCCESS: 10    F0 -> s3: 10 * 0.1^3 = 0.01
    batch = won_batch(last_valid=True)
    assert close(_graph_returns(batch[0]["trajs"], {}, 10.0, 0.1, 0.1), [[1.0, 10.0], [0.01]])
    # E3: anchor s0 = {1.0, 0.01}: mean 0.505, "mean" norm +-0.495; s1 anchors one step.
    got = compute_advantages(batch, "graphgpo", norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.495, 0.0], [-0.495]]])
    memory = GraphMemory()
    memory.add(batch)
    assert memory.edges("x") == {"s0": {"s1", "s3"}, "s1": {SUCCESS}}


def test_e4_an_invalid_winning_step_adds_no_success_edge():
    # The last step still leads to SUCCESS (E4's sink), but adds no edge: G_x = {s0->s1, s0->s3}
    # has no SUCCESS node, so every state gets d = 1 (E5): E0 -> s1: 1.0, E1 -> SUCCESS,
    # invalid: 1.0 - 0.1 = 0.9, F0 -> s3: 1.0. Anchor s0 = {1.0, 1.0}: every step term is 0.
    batch = won_batch(last_valid=False)
    assert close(_graph_returns(batch[0]["trajs"], {}, 10.0, 0.1, 0.1), [[1.0, 0.9], [1.0]])
    got = compute_advantages(batch, "graphgpo", norm="mean", lambda_ep=0.0)
    assert got == [[[0.0, 0.0], [0.0]]]
    # With a SUCCESS node in the history (an earlier valid win from s1), d(SUCCESS) = 0 holds for
    # the invalid winning step too: H u G = {s1->SUCCESS, s0->s1, s0->s3} is the graph of
    # test_e4_a_valid_winning_step_keeps_its_success_edge, so E1 -> SUCCESS: 10 - 0.1 = 9.9.
    memory = GraphMemory()
    memory.add([group("x", [traj(["s1", "s2"], score=10.0, success=True)])])
    assert close(
        _graph_returns(batch[0]["trajs"], memory.preds["x"], 10.0, 0.1, 0.1), [[1.0, 9.9], [0.01]]
    )
    got = compute_advantages(batch, "tigpo", memory, norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.495, 0.0], [-0.495]]])


def history_batch():
    # Current update: nobody wins.  A: s0 -> s1 -> s2     B: s0 -> s3 -> s4
    return [group("x", [traj(["s0", "s1", "s2"]), traj(["s0", "s3", "s4"])])]


def memory_with_goal_path():
    # An earlier update won from s2: H_x = {s2 -> SUCCESS}; task "other" must not matter.
    memory = GraphMemory()
    memory.add(
        [
            group("x", [traj(["s9", "s2", "s7"], score=10.0, success=True)]),
            group("other", [traj(["s0", "s3", "s4"], score=10.0, success=True)]),
        ]
    )
    return memory


def test_e7_history_edge_shortens_a_path_and_never_enters_the_output():
    memory = memory_with_goal_path()
    assert memory.edges("x") == {"s9": {"s2"}, "s2": {SUCCESS}}
    before = json.dumps(memory.state_dict(), sort_keys=True)
    # On H u G: d(s2) = 1 (history edge), d(s1) = 2, d(s0) = 3; s3, s4 cannot reach SUCCESS:
    # d_max = 3 (s0 counts), so d(s3) = d(s4) = 4.
    #   A0 -> s1: 10 * 0.1^2 = 0.1     A1 -> s2: 10 * 0.1 = 1.0
    #   B0 -> s3: 10 * 0.1^4 = 0.001   B1 -> s4: 0.001
    # Anchor s0 = {0.1, 0.001}: mean 0.0505, "mean" norm +-0.0495; s1, s3 singletons: 0.
    got = compute_advantages(history_batch(), "tigpo", memory, norm="mean", lambda_ep=0.0)
    assert close(got, [[[0.0495, 0.0], [-0.0495, 0.0]]])
    # Without the history (GraphGPO, or tigpo with an empty memory) nobody reaches SUCCESS:
    # every d = 1, all returns 1.0, all advantages 0.
    for algo, mem in (("graphgpo", memory), ("tigpo", GraphMemory())):
        assert compute_advantages(history_batch(), algo, mem, norm="mean", lambda_ep=0.0) == [
            [[0.0, 0.0], [0.0, 0.0]]
        ]
    # Reading the memory never writes it.
    assert json.dumps(memory.state_dict(), sort_keys=True) == before


# ---------------------------------------------------------------------------------------------
# Shapes, edge cases and bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_zero_action_trajectory_gives_an_empty_step_list(algo):
    batch = [group("x", [traj(["s0"], score=10.0, success=True), traj(["s0", "s1"])])]
    out = compute_advantages(batch, algo, GraphMemory())
    assert [len(steps) for steps in out[0]] == [0, 1]


@pytest.mark.parametrize("algo", ALGOS)
def test_bad_input_raises_value_error_naming_the_group(algo):
    ok = group("x", [traj(["a", "b"])])
    with pytest.raises(ValueError, match="group 1"):
        compute_advantages([ok, group("y", [])], algo)
    ragged = group(
        "y", [traj(["a", "b"]), {"states": ["a", "b"], "valid": [], "score": 0.0, "success": False}]
    )
    with pytest.raises(ValueError, match=r"group 1 \(task 'y'\), trajectory 1: len\(valid\)"):
        compute_advantages([ok, ragged], algo)
    with pytest.raises(ValueError, match="group 1 .*without ref_scores"):
        compute_advantages([ok, group("y", [traj(["a", "b"])], kind="revisit")], algo)
    with pytest.raises(ValueError, match="group 1 .*without ref_scores"):
        compute_advantages(
            [ok, {**group("y", [traj(["a", "b"])], kind="revisit"), "ref_scores": None}], algo
        )
    with pytest.raises(ValueError, match="group 1 .*empty ref_scores"):
        compute_advantages(
            [ok, group("y", [traj(["a", "b"])], kind="revisit", ref_scores=[])], algo
        )
    for scalar in (5.0, "5"):  # the mean of Z_E instead of Z_E: named, not a TypeError
        with pytest.raises(ValueError, match="group 1 .*not a single number"):
            compute_advantages(
                [ok, group("y", [traj(["a", "b"])], kind="revisit", ref_scores=scalar)], algo
            )
    with pytest.raises(ValueError, match="group 0 .*kind"):
        compute_advantages([group("y", [traj(["a", "b"])], kind="replay")], algo)


def test_unknown_algo_or_norm_raises():
    with pytest.raises(ValueError, match="unknown algo 'ppo'"):
        compute_advantages(PAIR, "ppo")
    with pytest.raises(ValueError, match="unknown norm 'std'"):
        compute_advantages(PAIR, "grpo", norm="std")


def test_empty_batch_gives_empty_output():
    assert compute_advantages([], "tigpo", GraphMemory()) == []


# ---------------------------------------------------------------------------------------------
# E10: GraphMemory
# ---------------------------------------------------------------------------------------------


def test_e10_memory_stores_valid_transitions_without_self_loops():
    memory = GraphMemory()
    memory.add(
        [
            group(
                "x",
                [
                    # s0->s1 valid; s1->s1 a self-loop (dropped); the won last step is invalid
                    # (dropped, so no s1->SUCCESS edge).
                    traj(
                        ["s0", "s1", "s1", "s2"],
                        valid=[True, True, False],
                        score=10.0,
                        success=True,
                    ),
                    # s0->s3 valid; the won last step s3->s4 is valid, stored as s3->SUCCESS (E4
                    # sink).
                    traj(["s0", "s3", "s4"], score=10.0, success=True),
                    # an invalid step is never stored, even when it changed the state key.
                    traj(["s0", "s5"], valid=[False]),
                ],
            )
        ]
    )
    assert memory.edges("x") == {"s0": {"s1", "s3"}, "s3": {SUCCESS}}
    assert memory.edges("never seen") == {}
    stats = memory.stats()
    assert {k: stats[k] for k in ("tasks", "nodes", "edges")} == {
        "tasks": 1,
        "nodes": 4,
        "edges": 3,
    }
    # one task: per-task mean and max are its own numbers; nothing evicted without a bound
    assert (stats["nodes_per_task_mean"], stats["nodes_per_task_max"]) == (
        4.0,
        4,
    )  # s0, s1, s3, SUCCESS
    assert (stats["edges_per_task_mean"], stats["edges_per_task_max"]) == (3.0, 3)
    assert stats["evicted_edges"] == 0
    assert "bytes" not in stats  # the size estimate is train.py's memory_bytes


def test_memory_size_estimate_lives_in_the_trainer_log():
    train = pytest.importorskip("train")  # torch, numpy, tqdm: not the core's dependencies
    memory = GraphMemory()
    empty = train.memory_bytes(memory)
    memory.add([chain_group("x", "a", "b", "c")])
    one = train.memory_bytes(memory)
    memory.add([chain_group("x", "c", "d"), chain_group("y", "p", "q")])
    assert empty < one < train.memory_bytes(memory)
    # graph_metrics keeps logging graph_bytes when it gets the memory, and only then
    stats = memory.stats([chain_group("x", "a", "b")])
    logged = train.graph_metrics(stats, memory)
    assert logged["graph_bytes"] == train.memory_bytes(memory)
    assert logged["graph_edges"] == 4 and logged["task_hit_rate"] == 1.0
    assert "graph_bytes" not in train.graph_metrics(stats)


def test_memory_add_checks_every_group_before_storing_any():
    memory = GraphMemory()
    with pytest.raises(ValueError, match="group 1 .*empty"):
        memory.add([chain_group("x", "a", "b"), group("y", [])])
    assert {k: memory.stats()[k] for k in ("tasks", "nodes", "edges")} == {
        "tasks": 0,
        "nodes": 0,
        "edges": 0,
    }


def test_memory_stats_hit_rates():
    memory = GraphMemory()
    memory.add([group("x", [traj(["s0", "s1", "s2"])])])  # nodes s0, s1, s2
    batch = [
        group("x", [traj(["s0", "s1", "s9"])]),  # sources s0, s1: both stored
        group("z", [traj(["s0", "s5"])]),
    ]  # task z unknown: s0 is not its node
    stats = memory.stats(batch)
    assert stats["task_hit_rate"] == 0.5  # 1 of 2 groups
    assert stats["state_hit_rate"] == 2 / 3  # 2 of 3 source states
    empty = GraphMemory().stats([])
    assert {
        k: empty[k] for k in ("tasks", "nodes", "edges", "task_hit_rate", "state_hit_rate")
    } == {"tasks": 0, "nodes": 0, "edges": 0, "task_hit_rate": 0.0, "state_hit_rate": 0.0}


def test_memory_distances_are_e5_on_the_stored_graph():
    memory = GraphMemory()
    memory.add(
        [
            group(
                "x",
                [
                    traj(["a", "b", "c"], score=10.0, success=True),  # a->b->SUCCESS
                    traj(["a", "d", "e"]),
                ],
            )
        ]
    )  # d->e: dead end
    # BFS from SUCCESS on the reversed graph: b 1, a 2; d and e cannot reach it: d_max + 1 = 3
    assert memory.distances("x") == {SUCCESS: 0, "b": 1, "a": 2, "d": 3, "e": 3}
    memory.add([chain_group("y", "p", "q")])  # no success at all: every node 1
    assert memory.distances("y") == {"p": 1, "q": 1}
    assert memory.distances("never seen") == {}


def chain_group(task, *states):
    return group(task, [traj(list(states))])


def test_memory_bound_evicts_oldest_inserted_edges():
    memory = GraphMemory(max_edges_per_task=2)
    memory.add([chain_group("x", "a", "b", "c")])  # a->b, b->c
    memory.add([chain_group("x", "c", "d")])  # c->d evicts a->b (the oldest)
    assert memory.edges("x") == {"b": {"c"}, "c": {"d"}}
    memory.add([chain_group("x", "b", "c")])  # already stored: not refreshed
    memory.add([chain_group("x", "d", "e")])  # evicts b->c, first inserted
    assert memory.edges("x") == {"c": {"d"}, "d": {"e"}}
    assert memory.stats()["nodes"] == 3  # b left with its last edge
    memory.add([chain_group("y", "a", "b", "c", "d")])  # the bound is per task
    assert memory.edges("y") == {"b": {"c"}, "c": {"d"}}
    assert memory.stats()["evicted_edges"] == 3  # a->b, b->c of x; a->b of y
    restored = GraphMemory()
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))
    assert restored.stats()["evicted_edges"] == 3  # the count survives a checkpoint
    with pytest.raises(ValueError, match="max_edges_per_task"):
        GraphMemory(max_edges_per_task=0)


def test_memory_state_dict_round_trip_is_exact_and_json():
    memory = GraphMemory(max_edges_per_task=3)
    memory.add([chain_group("x", "a", "b", "c", "d"), chain_group("y", "p", "q")])
    restored = GraphMemory()
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))
    assert restored.state_dict() == memory.state_dict()
    assert restored.max_edges_per_task == 3
    # The eviction order survived: the next edge evicts a->b in both.
    for m in (memory, restored):
        m.add([chain_group("x", "d", "e")])
    assert restored.edges("x") == memory.edges("x") == {"b": {"c"}, "c": {"d"}, "d": {"e"}}
    batch = history_batch()
    assert compute_advantages(batch, "tigpo", restored) == compute_advantages(
        batch, "tigpo", memory
    )


# ---------------------------------------------------------------------------------------------
# E11: RevisitScheduler
# ---------------------------------------------------------------------------------------------


def scored(task, *scores):
    return group(task, [traj(["s", "t"], score=z) for z in scores])


def test_e11_exploration_is_one_seeded_pass_per_epoch():
    import random

    tasks = ["t0", "t1", "t2", "t3", "t4"]
    sched = RevisitScheduler(tasks, num_groups=2, revisit_groups=0, delay=0, seed=7)
    drawn = [slot["task"] for k in range(5) for slot in sched.plan(k)]  # 10 slots, 2 epochs
    # The documented rule: at each epoch start, copy the task list and shuffle it with the
    # scheduler's Random(seed). The first epoch ends inside the plan of update 2.
    rng, want = random.Random(7), []
    for _ in range(2):
        epoch = list(tasks)
        rng.shuffle(epoch)
        want += epoch
    assert drawn == want
    assert sorted(drawn[:5]) == sorted(drawn[5:]) == tasks


def test_e11_delay_one_use_and_fallback_to_exploration():
    sched = RevisitScheduler(["t0", "t1", "t2"], num_groups=3, revisit_groups=2, delay=2)
    first = sched.plan(0)
    assert [s["kind"] for s in first] == ["explore"] * 3
    assert all(s["ref_scores"] is None for s in first)
    sched.record(0, [scored("a", 10.0, 0.0), scored("b", 0.0, 0.0)])
    sched.record(
        1,
        [
            scored("c", 1.0, 2.0),
            scored("d", 5.0, 5.0, 0.0),
            group("e", [traj(["s", "t"])], kind="revisit", ref_scores=[1.0]),
        ],
    )
    # Update 1: nothing is due yet (0 + 2 > 1): every slot explores, B stays 3.
    assert [s["kind"] for s in sched.plan(1)] == ["explore"] * 3
    # Update 2: the entries of update 0 are due, in the order recorded, with their scores.
    plan2 = sched.plan(2)
    assert [(s["task"], s["kind"], s["ref_scores"]) for s in plan2[:2]] == [
        ("a", "revisit", [10.0, 0.0]),
        ("b", "revisit", [0.0, 0.0]),
    ]
    assert plan2[2]["kind"] == "explore" and len(plan2) == 3
    # Update 3: c and d (update 1) are due; revisit groups ("e") were never queued.
    plan3 = sched.plan(3)
    assert [s["task"] for s in plan3[:2]] == ["c", "d"]
    assert plan3[1]["ref_scores"] == [5.0, 5.0, 0.0]
    # Each entry is used once: the queue is empty now, so update 4 explores only.
    assert [s["kind"] for s in sched.plan(4)] == ["explore"] * 3


def test_e11_zero_revisit_slots_is_exploration_only():
    sched = RevisitScheduler(["t0", "t1"], num_groups=2, revisit_groups=0, delay=0)
    sched.record(0, [scored("a", 1.0)])
    assert [s["kind"] for s in sched.plan(5)] == ["explore", "explore"]
    assert not sched.queue and sched.dropped == 0  # nothing queued that nothing would read


def test_e11_delay_zero_is_rejected_with_revisit_slots():
    # record(k) runs after plan(k): a group can never be revisited in its own update, so delay 0
    # would silently never revisit. The old FIFO served such entries one update late.
    with pytest.raises(ValueError, match="delay must be >= 1"):
        RevisitScheduler(["t"], num_groups=2, revisit_groups=1, delay=0)


def fake_groups(plan, update):
    """The plan's groups as train.py records them (K = 2): an exploration's two scores are the
    update and the slot it was explored in, so a revisit's ref_scores say where it came from."""
    return [
        group(
            s["task"],
            [traj(["s", "t"], score=float(update)), traj(["s", "t"], score=float(slot))],
            kind=s["kind"],
            ref_scores=s["ref_scores"],
        )
        for slot, s in enumerate(plan)
    ]


def run_schedule(sched, first, last):
    """plan + record for updates first..last; {update: [(kind, task, (k_E, slot) or None)]}."""
    out = {}
    for k in range(first, last + 1):
        plan = sched.plan(k)
        out[k] = [
            (s["kind"], s["task"], tuple(s["ref_scores"]) if s["ref_scores"] else None)
            for s in plan
        ]
        sched.record(k, fake_groups(plan, k))
    return out


def test_e11_paper_preset_revisits_exactly_delta_after_exploration():
    # B = 16, B_R = 8, Delta = 10 over 250 updates. Updates 1-10 explore 16 groups each; at
    # 11-20 16 are due and 8 slots free: the first 8 in plan order are revisited, 8 dropped. From
    # 21 on, exactly the 8 explorations of k - 10 are due. (The old FIFO never drained its
    # backlog: its delay grew to 2 * Delta = 20 by update 31, e.g. update 60 revisited 40.)
    sched = RevisitScheduler(range(24), 16, 8, 10)
    explored = {}  # (k_E, slot) -> task
    for k in range(1, 251):
        plan = run_schedule(sched, k, k)[k]
        assert len(sched.queue) <= 10 * 16  # bounded: only the last Delta updates' explorations
        revisits = [ref for kind, _, ref in plan if kind == "revisit"]
        assert len(revisits) == (0 if k <= 10 else 8)
        kinds = ["revisit"] * len(revisits) + ["explore"] * (16 - len(revisits))
        assert [kind for kind, _, _ in plan] == kinds  # revisits first, 16 slots
        for _, task, (k_e, slot) in plan[: len(revisits)]:
            assert k - k_e == 10
            assert explored.pop((k_e, slot)) == task
        assert [slot for _, slot in revisits] == (
            [] if k <= 10 else list(range(8)) if k <= 20 else list(range(8, 16))
        )
        explored.update(
            ((k, slot), task) for slot, (kind, task, _) in enumerate(plan) if kind == "explore"
        )
    assert sched.dropped == 80  # 8 at each of updates 11-20, none after
    # never revisited: the 80 dropped, and the explorations of 241-250 (not due before the end)
    assert len(explored) == 80 + 10 * 8


def test_e11_cpu_preset_schedule():
    # B = 2, B_R = 1, Delta = 1 (the cpu preset on ALFWorld's 4 games): update 1 explores 2; from
    # update 2 on, the first exploration of the update before is revisited and one task is explored;
    # update 1's second exploration is dropped.
    sched = RevisitScheduler(["pick/0", "pick/1", "look/0", "look/1"], 2, 1, 1)
    plans = run_schedule(sched, 1, 10)
    assert [kind for kind, _, _ in plans[1]] == ["explore"] * 2
    for k in range(2, 11):
        assert [kind for kind, _, _ in plans[k]] == ["revisit", "explore"]
        slot = 0 if k == 2 else 1
        assert (plans[k][0][1], plans[k][0][2]) == (plans[k - 1][slot][1], (k - 1, slot))
    assert sched.dropped == 1


def test_e11_four_slots_two_revisits_schedule():
    # B = 4, B_R = 2, Delta = 1: update 1 explores 4; from update 2 on, the first two explorations
    # of the update before are revisited (update 1's slots 0 and 1, then slots 2 and 3 of the
    # update before, where its explorations sit); update 1's slots 2 and 3 are dropped.
    tasks = ["pick/0", "pick/1", "look/0", "look/1"]
    sched = RevisitScheduler(tasks, 4, 2, 1)
    plans = run_schedule(sched, 1, 6)
    assert [kind for kind, _, _ in plans[1]] == ["explore"] * 4
    for k in range(2, 7):
        assert [kind for kind, _, _ in plans[k]] == ["revisit"] * 2 + ["explore"] * 2
        before = plans[k - 1]
        slots = [0, 1] if k == 2 else [2, 3]
        assert [(task, ref) for _, task, ref in plans[k][:2]] == [
            (before[slot][1], (k - 1, slot)) for slot in slots
        ]
    assert sched.dropped == 2


def test_e11_fewer_due_than_revisit_slots_explore_and_keep_the_budget():
    # B = 4, B_R = 3, Delta = 1: only B - B_R = 1 group is explored after a full revisit update,
    # so the next update has one due group: 1 revisit + 3 explorations; the update after has
    # 3 due again. Every plan has 4 slots.
    sched = RevisitScheduler([f"t{i}" for i in range(5)], 4, 3, 1)
    plans = run_schedule(sched, 1, 9)
    revisits = [sum(kind == "revisit" for kind, _, _ in plans[k]) for k in range(1, 10)]
    assert revisits == [0, 3, 1, 3, 1, 3, 1, 3, 1]
    assert all(len(plan) == 4 for plan in plans.values())
    assert all(ref[0] == k - 1 for k, plan in plans.items() for _, _, ref in plan if ref)
    assert sched.dropped == 1  # update 1's 4th exploration, at update 2


def test_e11_an_entry_that_misses_its_update_is_dropped_not_served_late():
    sched = RevisitScheduler(["t0", "t1"], 2, 2, 1)
    sched.record(1, [scored("a", 1.0), scored("b", 2.0)])
    assert [s["kind"] for s in sched.plan(3)] == ["explore", "explore"]  # update 2 never planned
    assert not sched.queue and sched.dropped == 2


def test_e11_bad_settings_raise():
    with pytest.raises(ValueError, match="revisit_groups"):
        RevisitScheduler(["t"], num_groups=2, revisit_groups=3, delay=1)
    with pytest.raises(ValueError, match="delay"):
        RevisitScheduler(["t"], num_groups=2, revisit_groups=1, delay=-1)
    with pytest.raises(ValueError, match="non-empty"):
        RevisitScheduler([], num_groups=2, revisit_groups=1, delay=1)


def test_e11_state_dict_round_trip_gives_identical_next_plans():
    tasks = [f"t{i}" for i in range(7)]
    sched = RevisitScheduler(tasks, num_groups=4, revisit_groups=2, delay=1, seed=3)
    for k in range(3):
        plan = sched.plan(k)
        sched.record(k, [scored(s["task"], float(k), 1.0) for s in plan if s["kind"] == "explore"])
    restored = RevisitScheduler(tasks, num_groups=4, revisit_groups=2, delay=1, seed=99)
    restored.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    for k in range(3, 9):
        a, b = sched.plan(k), restored.plan(k)
        assert a == b
        groups = [scored(s["task"], float(k)) for s in a if s["kind"] == "explore"]
        sched.record(k, groups)
        restored.record(k, groups)
    other = RevisitScheduler(tasks, num_groups=5, revisit_groups=2, delay=1)
    with pytest.raises(ValueError, match="num_groups"):
        other.load_state_dict(sched.state_dict())


def test_e11_resume_at_update_37_of_the_paper_preset_gives_the_uninterrupted_plans():
    tasks = [f"train/task{i}" for i in range(24)]
    whole = RevisitScheduler(tasks, 16, 8, 10, seed=5)
    run_schedule(whole, 1, 37)
    state = json.loads(json.dumps(whole.state_dict()))
    assert state["dropped"] == 80
    resumed = RevisitScheduler(tasks, 16, 8, 10, seed=123)  # the seed is in the saved RNG state
    resumed.load_state_dict(state)
    assert resumed.state_dict() == whole.state_dict()
    assert run_schedule(resumed, 38, 120) == run_schedule(whole, 38, 120)
    assert resumed.dropped == whole.dropped == 80


def test_e11_loads_a_state_saved_before_the_dropped_counter():
    tasks = [f"t{i}" for i in range(6)]
    sched = RevisitScheduler(tasks, 4, 2, 2, seed=1)
    run_schedule(sched, 1, 5)
    state = json.loads(json.dumps(sched.state_dict()))
    saved = state.pop("dropped")
    state["queue"].insert(0, [1, "t0", [0.0, 0.0]])  # an old FIFO backlog entry, long overdue
    old = RevisitScheduler(tasks, 4, 2, 2)
    old.load_state_dict(state)
    assert old.dropped == 0
    assert run_schedule(old, 6, 12) == run_schedule(sched, 6, 12)  # overdue: never served
    assert saved == 4  # updates 3 and 4 each had 4 due and 2 slots
    assert old.dropped == sched.dropped - saved + 1  # the drops after saving + the overdue one
