"""tigpo.py: the TIGPO algorithm core (arXiv 2609.03383), equations E1-E11 of docs/ALGORITHM.md.

Three pieces, Python standard library only, plain data in and out, so that verl, TRL or
OpenRLHF code can copy this file and call it as is:
  * compute_advantages: the GRPO (E1), GiGPO (E1-E3), GraphGPO (E1, E3-E6) and TIGPO
    (E1-E9: persistent graph E7 + cross-temporal episode advantage E8) advantages;
  * GraphMemory: the persistent per-task instance graph H (E7), written only by add (E10);
  * RevisitScheduler: the exploration-revisit schedule of group slots (E11).

A batch is a list of groups; a group is K rollouts of one task:
    {"task": task_key,                        # kappa(x), stable across updates
     "kind": "explore" | "revisit",           # missing means "explore" *(choice)*
     "ref_scores": [z, ...],                  # Z_E, revisit groups only
     "trajs": [{"states": [s0, ..., sT],      # T+1 state keys (str)
                "valid": [v0, ..., vT-1],     # T admissible-action flags
                "score": R,                   # outcome score R_i
                "success": bool}, ...]}
States and valid flags may be lists, tuples or NumPy arrays (str or object dtype): every function
gives the same answer for each and never writes into its input. Details the paper leaves open are
marked *(choice)* here and in docs/ALGORITHM.md.
"""

import math
import random
from collections import defaultdict, deque

__all__ = ["SUCCESS", "ALGOS", "NORMS", "compute_advantages", "GraphMemory", "RevisitScheduler"]

SUCCESS = "<success>"  # E4: the goal sink every won trajectory's last step leads to
ALGOS = ("grpo", "gigpo", "graphgpo", "tigpo")
NORMS = ("mean_std", "mean")
_TRAJ_KEYS = frozenset(("states", "valid", "score", "success"))


# ---------------------------------------------------------------------------------------------
# Input checks. Every error names the group, so a bad rollout can be found in a batch of 16.
# ---------------------------------------------------------------------------------------------


def _check_trajs(group, g):
    where = f"group {g} (task {group.get('task')!r})"
    if "task" not in group:
        raise ValueError(f"{where} has no 'task' key: every group needs its task key kappa(x)")
    trajs = group.get("trajs")
    if not trajs:
        raise ValueError(f"{where} is empty: a group needs at least one trajectory in 'trajs'")
    for i, traj in enumerate(trajs):
        if not _TRAJ_KEYS <= traj.keys():
            missing = sorted(_TRAJ_KEYS - traj.keys())
            raise ValueError(f"{where}, trajectory {i}: missing keys {missing}")
        if len(traj["valid"]) != len(traj["states"]) - 1:
            raise ValueError(
                f"{where}, trajectory {i}: len(valid) = {len(traj['valid'])} but len(states) = "
                f"{len(traj['states'])}; give one valid flag per action, i.e. len(states) - 1"
            )
    return where


def _check_groups(groups, algo, norm):
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}: use one of {ALGOS}")
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}: use one of {NORMS}")
    for g, group in enumerate(groups):
        where = _check_trajs(group, g)
        kind = group.get("kind", "explore")
        if kind not in ("explore", "revisit"):
            raise ValueError(f"{where} has kind {kind!r}: use 'explore' or 'revisit'")
        # Checked for every algo, not only tigpo, so a broken schedule fails on any baseline too.
        # Any number >= 1 of scores is accepted: E8's pool Z_E u Z_now is well defined for every
        # size, and the count need not be this group's K *(choice)*.
        if kind == "revisit":
            _check_ref_scores(group.get("ref_scores"), where)


def _check_ref_scores(ref_scores, where):
    if ref_scores is None:
        raise ValueError(
            f"{where} is a revisit group without ref_scores: pass the scores "
            f"Z_E recorded at exploration (RevisitScheduler.plan gives them)"
        )
    try:
        size = len(ref_scores)  # len, not truthiness: ref_scores may be a NumPy array
    except TypeError:
        size = None
    if size is None or isinstance(ref_scores, (str, bytes)):
        raise ValueError(
            f"{where} has ref_scores {ref_scores!r}: pass the list of scores Z_E "
            f"recorded at exploration, not a single number"
        )
    if size == 0:
        raise ValueError(
            f"{where} is a revisit group with empty ref_scores: pass the scores "
            f"Z_E recorded at exploration (RevisitScheduler.plan gives them)"
        )


# ---------------------------------------------------------------------------------------------
# Shared pieces: E1's statistics rule and the next state of a step (E4's success sink).
# ---------------------------------------------------------------------------------------------


def _norm_stats(pool, norm, eps):
    """E1's statistics of a reference set Z, shared by E1, E3 and E8: returns (mean, scale) so
    that an advantage is (z - mean) / scale. scale = sample std (ddof=1, as torch.std) + eps, or
    1.0 for norm="mean" (GiGPO "w/o std"; dividing by 1.0 is exact). A set of one gives its own
    value and 1.0, so its advantage is exactly 0 *(choice: verl-agent gives a lone rollout its
    raw score)*; so does a set of equal values, whose spread is 0."""
    n = len(pool)
    first = pool[0]
    # Equal values first: sum / n is inexact for n not a power of two (3 * 6.6 / 3 = 6.6 + 9e-16,
    # and eps would turn that into a 9e-10 advantage). list.count runs in C, and E3's equal-return
    # anchors skip the sum and the loop below.
    if n == 1 or pool.count(first) == n:
        return first, 1.0
    mean = sum(pool) / n
    if norm == "mean":
        return mean, 1.0
    squares = 0.0  # a plain loop: the cheapest form for the small pools E3 makes by the thousand
    for z in pool:
        squares += (z - mean) ** 2
    return mean, math.sqrt(squares / (n - 1)) + eps


def _next_states(traj):
    """s_{i,t+1} of every step of a trajectory, except that the last step of a won trajectory
    leads to the sink SUCCESS (E4). Used by both the batch graph (E4) and the memory (E10)."""
    # A new list: a NumPy slice would be a view into the caller's array (and a '<U1' array would
    # cut SUCCESS to '<'), a tuple cannot be written to.
    nexts = list(traj["states"][1:])
    if traj["success"] and nexts:
        nexts[-1] = SUCCESS
    return nexts


# ---------------------------------------------------------------------------------------------
# Step returns: E2 (GiGPO) and E4-E7 (GraphGPO / TIGPO), then E3. The return functions take the
# current trajectories of one task and give one list of step returns per trajectory.
# ---------------------------------------------------------------------------------------------


def _discounted_returns(trajs, step_gamma, invalid_penalty):
    """E2: R_{i,t} = step_gamma^(T_i-1-t) * R_i - p * (1 - v_{i,t}); the outcome arrives at the
    last step, so earlier steps see it discounted."""
    returns = []
    for traj in trajs:
        score, valid = float(traj["score"]), traj["valid"]
        last = len(valid) - 1
        returns.append(
            [
                score * step_gamma ** (last - t) - (0.0 if ok else invalid_penalty)
                for t, ok in enumerate(valid)
            ]
        )
    return returns


def _distances(batch_preds, hist_preds):
    """E5 on the graph H u G (E7; H is empty for GraphGPO): for every next state of a current step
    (the keys of batch_preds), the fewest edges to SUCCESS, found by BFS from SUCCESS over
    reversed edges. batch_preds maps each such state to the sources of its valid steps (E4), an
    empty list when only invalid steps lead there; hist_preds is H's reversed index, which never
    holds an empty set. A state that cannot reach SUCCESS gets d_max + 1, d_max the largest finite
    distance of the whole graph; so does a state that is no node of the graph at all (no valid
    edge touches it: the BFS never reaches it). With no SUCCESS node at all every state gets 1
    (GraphGPO's convention).

    Fast path: the BFS walks the memory's own reversed index in place (no copy or merge of H),
    one level at a time with set operations (C speed), and stops as soon as every current next
    state has its distance; it runs to the end only when some next state cannot reach SUCCESS,
    which is exactly when d_max is needed."""
    # Trap: SUCCESS can be a key with no valid edge into it (a won last step that was invalid);
    # it is a node only when some valid edge of G or H enters it.
    if not batch_preds.get(SUCCESS) and SUCCESS not in hist_preds:
        return dict.fromkeys(batch_preds, 1)
    dist = dict.fromkeys(batch_preds)  # None until reached
    dist[SUCCESS] = 0
    seen, frontier, d = {SUCCESS}, {SUCCESS}, 0
    unseen = set(batch_preds) - seen  # current next states still without a distance
    while frontier and unseen:
        d += 1
        reached = set()
        for node in frontier:  # E7: predecessors in G_x and in the history H_x
            reached.update(batch_preds.get(node, ()), hist_preds.get(node, ()))
        frontier = reached - seen
        seen |= frontier
        for node in frontier & unseen:
            dist[node] = d
        unseen -= frontier
    # Some next states left unseen means the BFS ran to the end: level d found nothing new, so
    # d_max = d - 1 and an unreachable or off-graph state gets d_max + 1 = d.
    for node in unseen:
        dist[node] = d
    return dist


def _graph_returns(trajs, hist_preds, success_reward, graph_gamma, invalid_penalty):
    """E4 + E6: q_{i,t} = C * graph_gamma^d(s_{i,t+1}) - p * (1 - v_{i,t}), with d from E5 on the
    batch-local graph G_x of this task's valid current steps joined with the task's persistent
    graph H_x (E7; hist_preds, empty for GraphGPO). Every step gets a return, invalid ones
    included; only valid steps add an edge. History only changes distances: it never adds a step
    to the output."""
    batch_preds, nexts_of = {}, []  # batch_preds: reversed G_x, {next state: [source states]}
    for traj in trajs:
        nexts = _next_states(traj)
        nexts_of.append(nexts)
        for src, nxt, ok in zip(traj["states"], nexts, traj["valid"]):
            into = batch_preds.get(nxt)
            if into is None:
                # An invalid step adds no edge (E4), but its next state is still a key so that
                # E5 scores it: d_max + 1 when no valid edge of G or H touches it.
                batch_preds[nxt] = [src] if ok else []
            elif ok:
                into.append(src)  # duplicates are cheaper to keep than to remove here
    dist = _distances(batch_preds, hist_preds)
    graph_return = [
        success_reward * graph_gamma**d  # C * gamma^d, once per distance
        for d in range(max(dist.values(), default=0) + 1)
    ]
    value = {n: graph_return[d] for n, d in dist.items()}
    return [
        [value[n] if ok else value[n] - invalid_penalty for n, ok in zip(nexts, traj["valid"])]
        for traj, nexts in zip(trajs, nexts_of)
    ]


def _anchor_stats(trajs, returns, norm, eps):
    """E3: the statistics of each anchor group, the current steps of one task that share a source
    state s_{i,t} (the caller passes one task at a time, so the key (task, s) of
    docs/ALGORITHM.md is the state alone here), with E1's rule: {state: (mean, scale)}; a step's
    normalised value is (q - mean) / scale, exactly 0 in a group of one."""
    anchors = defaultdict(list)  # {state: [step returns]} in batch order
    for traj, row in zip(trajs, returns):
        for s, q in zip(traj["states"], row):
            anchors[s].append(q)
    # A lone state skips the call: (q - q) / 1.0 is exactly 0.
    return {
        s: (b[0], 1.0) if len(b) == 1 else _norm_stats(b, norm, eps) for s, b in anchors.items()
    }


# ---------------------------------------------------------------------------------------------
# The advantages of all four algorithms (docs/ALGORITHM.md table) and their combination (E9).
# ---------------------------------------------------------------------------------------------


def compute_advantages(
    groups,
    algo="tigpo",
    memory=None,
    *,
    success_reward=10.0,
    invalid_penalty=0.1,
    step_gamma=0.95,
    graph_gamma=0.1,
    lambda_step=1.0,
    lambda_ep=1.0,
    norm="mean_std",
    eps=1e-6,
    cross_temporal=True,
):
    """Per-step advantages, [group][traj][step], for one batch of groups.

      grpo:     A_{i,t} = lambda_ep * A^ep_i                        (E1, no step term)
      gigpo:    A_{i,t} = lambda_step * E3(E2) + lambda_ep * A^ep_i  (E9)
      graphgpo: A_{i,t} = lambda_step * E3(E6 on G_x) + lambda_ep * A^ep_i
      tigpo:    A_{i,t} = lambda_step * E3(E6 on H_x u G_x) + lambda_ep * A^ep_i, where A^ep is
                E8 (scores pooled with ref_scores) for revisit groups when cross_temporal, else E1.

    Step groups (E3) and graphs (E4/E7) are per task over all current groups of that task in the
    batch, explore and revisit alike. `memory` (a GraphMemory, or None for an empty one) is read
    by tigpo only and never written: call memory.add(groups) after the update (E10). Inputs are
    never mutated. A trajectory with no action gets an empty step list. Raises ValueError on an
    unknown algo or norm, an empty group, ragged states/valid, or a revisit group whose
    ref_scores are missing, None, empty or not a sequence (for every algo); any number of
    ref_scores >= 1 is fine (E8 pools them with the group's K scores)."""
    _check_groups(groups, algo, norm)
    if memory is not None and not isinstance(memory, GraphMemory):
        raise ValueError(f"memory must be a GraphMemory or None, got {type(memory).__name__}")

    # Episode term, one value per trajectory: E1, or E8 for a tigpo revisit group.
    episode = []
    for group in groups:
        scores = [float(traj["score"]) for traj in group["trajs"]]
        pool = scores
        if algo == "tigpo" and cross_temporal and group.get("kind", "explore") == "revisit":
            pool = [float(z) for z in group["ref_scores"]] + scores  # Z = Z_E u Z_now (E8)
        mean, scale = _norm_stats(pool, norm, eps)
        episode.append([(z - mean) / scale for z in scores])

    if algo == "grpo":
        return [
            [[lambda_ep * ep] * len(traj["valid"]) for traj, ep in zip(group["trajs"], row)]
            for group, row in zip(groups, episode)
        ]

    # Step term, task by task (E3 groups and E4/E7 graphs never cross tasks), then E9.
    by_task = {}
    for g, group in enumerate(groups):
        by_task.setdefault(group["task"], []).append(g)
    out = [None] * len(groups)
    for task, members in by_task.items():
        trajs = [traj for g in members for traj in groups[g]["trajs"]]
        if algo == "gigpo":
            returns = _discounted_returns(trajs, step_gamma, invalid_penalty)
        else:
            # E7: tigpo's distances are taken on H_x u G_x; the baselines see G_x alone
            hist = memory.preds.get(task, {}) if algo == "tigpo" and memory is not None else {}
            returns = _graph_returns(trajs, hist, success_reward, graph_gamma, invalid_penalty)
        stats = _anchor_stats(trajs, returns, norm, eps)
        rows = iter(returns)
        for g in members:
            per_traj = []
            for traj, ep in zip(groups[g]["trajs"], episode[g]):
                step_returns = next(rows)  # q_{i,t} (or R_{i,t}) for t < T_i
                # E3's (mean, scale) of the anchor group of each s_{i,t}; zip stops at the
                # shorter step_returns, so s_{i,T} (no step leaves it) is never looked up.
                anchors = map(stats.__getitem__, traj["states"])
                # E9: A_{i,t} = lambda_step * A^step_{i,t} + lambda_ep * A^ep_i, with E3's
                # A^step_{i,t} = (q - mean) / scale
                per_traj.append(
                    [
                        lambda_step * ((q - mean) / scale) + lambda_ep * ep
                        for q, (mean, scale) in zip(step_returns, anchors)
                    ]
                )
            out[g] = per_traj
    return out


# ---------------------------------------------------------------------------------------------
# Persistent instance graph H (E7, E10).
# ---------------------------------------------------------------------------------------------


class GraphMemory:
    """H: the persistent transition graph of every task, {task: {src: {dst}}} (E7), written only
    by add (E10). It is stored reversed, `preds[task][dst] = {src, ...}`, because E5's BFS walks
    edges backwards from SUCCESS; `order[task]` keeps the edges in first-insertion order.

    Bound *(choice)*: with max_edges_per_task = N, inserting a task's (N+1)-th edge evicts that
    task's oldest-inserted edge (FIFO by first insertion; re-adding a stored edge does not
    refresh it). A node exists while some stored edge touches it."""

    def __init__(self, max_edges_per_task=None):
        if max_edges_per_task is not None and (
            isinstance(max_edges_per_task, bool)
            or not isinstance(max_edges_per_task, int)
            or max_edges_per_task < 1
        ):
            raise ValueError(
                f"max_edges_per_task must be None (unbounded) or an int >= 1, "
                f"got {max_edges_per_task!r}"
            )
        self.max_edges_per_task = max_edges_per_task
        self.preds = {}  # {task: {dst: set(src)}}: the reversed graph, read by compute_advantages
        self.order = {}  # {task: deque([(src, dst), ...])}: first-insertion order of the edges
        self.evicted = 0  # edges dropped by the bound, over the memory's life

    def add(self, groups):
        """E10: H_x <- H_x u G_x, whose edges are the valid transitions (E4); self-loops are not
        stored *(choice)*. The success edge of a won trajectory's last step is, when that step
        was valid."""
        for g, group in enumerate(groups):  # check everything first: a bad group adds nothing
            _check_trajs(group, g)
        for group in groups:
            for traj in group["trajs"]:
                self._insert(group["task"], zip(traj["states"], _next_states(traj), traj["valid"]))

    def _insert(self, task, transitions):
        """Store the valid, non-self-loop (src, dst, valid) transitions, in order, new edges only;
        then evict the task's oldest edges beyond the bound."""
        preds, order = self.preds.get(task), self.order.get(task)
        cap = self.max_edges_per_task
        for src, dst, ok in transitions:
            if not ok or src == dst:
                continue  # an invalid action is no transition; a self-loop never shortens a path
            if preds is None:  # a task enters the memory with its first edge, never empty
                preds = self.preds[task] = {}
                order = self.order[task] = deque()
            into = preds.get(dst)
            if into is None:
                preds[dst] = {src}
            elif src in into:
                continue
            else:
                into.add(src)
            order.append((src, dst))
            if cap is not None and len(order) > cap:
                old_src, old_dst = order.popleft()
                self.evicted += 1
                old = preds[old_dst]
                old.discard(old_src)
                if not old:
                    del preds[old_dst]

    def edges(self, task):
        """The stored graph of one task as {src: {dst}}, a fresh copy; {} for an unknown task."""
        out = {}
        for src, dst in self.order.get(task, ()):
            out.setdefault(src, set()).add(dst)
        return out

    def _nodes(self, task):
        return {node for edge in self.order.get(task, ()) for node in edge}

    def distances(self, task):
        """E5 on the stored graph H_x alone: {node: fewest edges to SUCCESS}, d_max + 1 for a node
        that cannot reach it, 1 for every node when SUCCESS was never reached; {} for an unknown
        task. What the memory alone says about each remembered state."""
        nodes = self._nodes(task)
        return _distances(dict.fromkeys(nodes, ()), self.preds.get(task, {})) if nodes else {}

    def stats(self, groups=None):
        """The diagnostics the paper plots: stored tasks, nodes (SUCCESS counts as a node of each
        task that reached it) and edges, each task's nodes and edges (mean and max), and the edges
        the bound evicted so far (the size in bytes is train.py's memory_bytes, a
        diagnostic kept out of the core). With `groups` (call it before add), also
        task_hit_rate, the fraction of those groups whose task is stored, and state_hit_rate, the
        fraction of their current source states s_{i,t} (every step counts) already a node of that
        task's stored graph; each is 0.0 when there is nothing to count. Costs O(stored edges)."""
        nodes = {t: self._nodes(t) for t in self.order}
        edges = [len(o) for o in self.order.values()]
        sizes = [len(n) for n in nodes.values()]
        out = {
            "tasks": len(self.order),
            "nodes": sum(sizes),
            "edges": sum(edges),
            "nodes_per_task_mean": sum(sizes) / len(sizes) if sizes else 0.0,
            "nodes_per_task_max": max(sizes, default=0),
            "edges_per_task_mean": sum(edges) / len(edges) if edges else 0.0,
            "edges_per_task_max": max(edges, default=0),
            "evicted_edges": self.evicted,
        }
        if groups is not None:
            steps, hits = 0, 0
            for group in groups:
                task_nodes = nodes.get(group["task"], ())
                for traj in group["trajs"]:
                    src_states = traj["states"][:-1]
                    steps += len(src_states)
                    hits += sum(s in task_nodes for s in src_states)
            stored = sum(group["task"] in self.order for group in groups)
            out["task_hit_rate"] = stored / len(groups) if groups else 0.0
            out["state_hit_rate"] = hits / steps if steps else 0.0
        return out

    def state_dict(self):
        """JSON-serialisable: the bound and every task's edges in first-insertion order."""
        return {
            "max_edges_per_task": self.max_edges_per_task,
            "evicted": self.evicted,
            "edges": {
                task: [[src, dst] for src, dst in order] for task, order in self.order.items()
            },
        }

    def load_state_dict(self, state):
        """Replace this memory by a saved one (bound included); the eviction order survives."""
        self.__init__(state["max_edges_per_task"])
        for task, edges in state["edges"].items():
            self._insert(task, ((src, dst, True) for src, dst in edges))
        self.evicted = state.get("evicted", 0)


# ---------------------------------------------------------------------------------------------
# Exploration-revisit schedule (E11).
# ---------------------------------------------------------------------------------------------


class RevisitScheduler:
    """E11: num_groups group slots per update, at most revisit_groups of them revisits, each
    exactly `delay` updates after its exploration.

    record(k, groups) queues update k's exploration groups as (k, task, Z_E), in plan order.
    plan(k) gives the revisit slots to the entries explored at k - delay, in that order; a due
    entry beyond the revisit_groups slots is dropped, never served later, so that no revisit
    comes late *(choice)*, and counted in `dropped` (so is an entry whose update was never
    planned). Each entry is used once. Slots left over go to exploration, so the rollout budget
    num_groups * K never changes. record(k) comes after plan(k), so a revisit needs delay >= 1.
    Exploration walks a seeded shuffle of `tasks`, reshuffled at each epoch start (an epoch may
    end in the middle of a plan). Call plan once per update, with consecutive updates."""

    def __init__(self, tasks, num_groups, revisit_groups, delay, seed=0):
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError("RevisitScheduler needs a non-empty list of tasks to explore")
        for name, value in (
            ("num_groups", num_groups),
            ("revisit_groups", revisit_groups),
            ("delay", delay),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if revisit_groups > num_groups:
            raise ValueError(
                f"revisit_groups ({revisit_groups}) > num_groups ({num_groups}): "
                f"revisits take slots of the fixed budget, use at most num_groups"
            )
        if revisit_groups and delay < 1:
            raise ValueError(
                f"delay must be >= 1 with revisit_groups > 0, got {delay}: a group "
                f"explored at update k is recorded after plan(k), so k + 1 is the "
                f"first update that can revisit it"
            )
        self.num_groups, self.revisit_groups, self.delay = num_groups, revisit_groups, delay
        self.rng = random.Random(seed)
        self.queue = deque()  # (k_E, task, Z_E) of the last `delay` updates, oldest first
        self.dropped = 0  # entries never revisited (no free slot at k_E + delay)
        self.epoch = []  # this epoch's shuffled task order ...
        self.pos = 0  # ... and how much of it has been explored

    def plan(self, update):
        """The num_groups slots of update `update`: revisits first, then explorations; each a
        dict {"task", "kind", "ref_scores"} (ref_scores None for explorations)."""
        slots, waiting = [], deque()
        for explored_at, task, ref_scores in self.queue:  # at most delay * num_groups entries
            due = explored_at + self.delay
            if due > update:
                waiting.append((explored_at, task, ref_scores))
            elif due == update and len(slots) < self.revisit_groups:
                slots.append({"task": task, "kind": "revisit", "ref_scores": list(ref_scores)})
            else:  # no slot left at its update, or its update was skipped: never served late
                self.dropped += 1
        self.queue = waiting
        while len(slots) < self.num_groups:
            if self.pos == len(self.epoch):  # epoch start: a fresh pass over the task list
                self.epoch = list(self.tasks)
                self.rng.shuffle(self.epoch)
                self.pos = 0
            slots.append({"task": self.epoch[self.pos], "kind": "explore", "ref_scores": None})
            self.pos += 1
        return slots

    def record(self, update, groups):
        """Queue this update's exploration groups with their detached scores Z_E (E8, E11), in
        the order given (plan order); nothing is queued when revisit_groups is 0."""
        for g, group in enumerate(groups):
            _check_trajs(group, g)
        if not self.revisit_groups:
            return
        for group in groups:
            if group.get("kind", "explore") == "explore":
                self.queue.append(
                    (update, group["task"], [float(traj["score"]) for traj in group["trajs"]])
                )

    def state_dict(self):
        """JSON-serialisable, RNG included, so the next plans after a round trip are identical."""
        version, internal, gauss_next = self.rng.getstate()
        return {
            "tasks": list(self.tasks),
            "num_groups": self.num_groups,
            "revisit_groups": self.revisit_groups,
            "delay": self.delay,
            "queue": [[k, task, list(z)] for k, task, z in self.queue],
            "dropped": self.dropped,
            "epoch": list(self.epoch),
            "pos": self.pos,
            "rng": [version, list(internal), gauss_next],
        }

    def load_state_dict(self, state):
        """Restore a saved schedule; the settings must match this scheduler's. A state saved
        before `dropped` existed loads with dropped = 0; its queue entries that are already
        late are dropped (and counted) by the next plan."""
        for key in ("tasks", "num_groups", "revisit_groups", "delay"):
            mine = getattr(self, key)
            if state[key] != mine:
                shown = "the task list" if key == "tasks" else f"{state[key]!r} != {mine!r}"
                raise ValueError(
                    f"scheduler state has a different {key} ({shown}): resume "
                    f"with the settings it was saved with"
                )
        # (an old exploration-only state may hold a queue: nothing would ever read it)
        self.queue = deque(
            (k, task, list(z)) for k, task, z in state["queue"] if self.revisit_groups
        )
        self.dropped = state.get("dropped", 0)
        self.epoch, self.pos = list(state["epoch"]), state["pos"]
        version, internal, gauss_next = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss_next))
