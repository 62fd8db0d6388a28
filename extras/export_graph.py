"""extras/export_graph.py: one task's persistent instance graph H_x (E7), as Graphviz DOT or JSON.

    python extras/export_graph.py runs/NAME --list             # the tasks stored, numbered
    python extras/export_graph.py runs/NAME --task 1 > g.dot   # the first of --list
    dot -Tpng g.dot -o g.png
    python extras/export_graph.py runs/NAME --task look_at_obj_in_light-Pencil   # part of a key
    python extras/export_graph.py runs/NAME --checkpoint update_000006 --task KEY --format json
    python extras/export_graph.py memory.json --task t3       # a GraphMemory.state_dict() file

--task takes an exact task key, a number N (the N-th task of --list, counting from 1), or a part of
a key that only one key contains; a part that several keys contain is an error naming them.

Nodes are labelled by their distance to success d(s) on the stored graph (E5: fewest edges to the
SUCCESS sink; d_max + 1 when it cannot be reached; 1 for every node when the task was never won)
and a short form of their state key; the SUCCESS sink is drawn as a double octagon. The export needs
nothing but this repository; rendering needs Graphviz (`apt install graphviz`, or any DOT viewer).
"""

import argparse
import json
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the repository root
import tigpo  # noqa: E402


def load_memory(path, checkpoint_name=None):
    """A GraphMemory from a run folder (its newest or named checkpoint's state.json), a checkpoint
    folder, a state.json, or a file holding GraphMemory.state_dict()."""
    if os.path.isdir(path):
        root = os.path.join(path, "checkpoints")
        if checkpoint_name:
            path = os.path.join(root, checkpoint_name)
        elif os.path.isdir(root):
            done = sorted(
                d
                for d in os.listdir(root)
                if d.startswith("update_") and os.path.isdir(os.path.join(root, d))
            )
            if not done:
                raise ValueError(f"{path} has no checkpoint yet")
            path = os.path.join(root, done[-1])
        path = os.path.join(path, "state.json")
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    with open(path) as fh:
        state = json.load(fh)
    memory = tigpo.GraphMemory()
    memory.load_state_dict(state.get("memory", state))
    return memory


def find_task(memory, key):
    """The stored task `key` names: the task whose key is `key`; the N-th task of --list when `key`
    is a number N (1-based); else the only task whose key contains `key`. Otherwise a one-line
    error:
    the candidates when several keys contain `key`, a few known keys when none does."""
    tasks = sorted(memory.order)
    if key in memory.order:
        return key
    if key.strip().isdigit():
        index = int(key)
        if 1 <= index <= len(tasks):
            return tasks[index - 1]
        raise ValueError(
            f"--task {key}: there is no task {index}; the memory holds {len(tasks)} "
            f"task(s), numbered 1 to {len(tasks)} by --list"
            if tasks
            else f"--task {key}: the memory holds no task (empty memory)"
        )
    hits = [t for t in tasks if key in t]
    if len(hits) == 1:
        return hits[0]
    if hits:
        shown = ", ".join(f"{tasks.index(t) + 1}: {t}" for t in hits[:6]) + (
            ", ..." if len(hits) > 6 else ""
        )
        raise ValueError(
            f"{len(hits)} tasks contain {key!r} ({shown}); give the task's number from "
            f"--list (e.g. --task {tasks.index(hits[0]) + 1}), or a longer part of its key"
        )
    shown = ", ".join(tasks[:5]) + (
        f", ... ({len(tasks)} in all, see --list)" if len(tasks) > 5 else ""
    )
    raise ValueError(
        f"no stored task matches {key!r}; known tasks: {shown or 'none (empty memory)'}"
    )


def short(state, width=10):
    return state if len(state) <= width else state[:width]


def to_json(memory, task):
    dist = memory.distances(task)
    edges = memory.edges(task)
    return {
        "task": task,
        "success": tigpo.SUCCESS,
        "nodes": [
            {"state": n, "distance": dist[n]} for n in sorted(dist, key=lambda n: (dist[n], n))
        ],
        "edges": [[src, dst] for src in sorted(edges) for dst in sorted(edges[src])],
    }


def to_dot(memory, task):
    graph = to_json(memory, task)
    ids = {node["state"]: f"n{i}" for i, node in enumerate(graph["nodes"])}
    lines = [
        f"// {task}: persistent instance graph, nodes labelled d = distance to success (E5)",
        "digraph H {",
        "  rankdir=LR;",
        '  node [shape=box, style=rounded, fontname="Helvetica"];',
    ]
    for node in graph["nodes"]:
        state, d = node["state"], node["distance"]
        if state == tigpo.SUCCESS:
            lines.append(
                f'  {ids[state]} [label="SUCCESS", shape=doubleoctagon, color=darkgreen, '
                "fontcolor=darkgreen];"
            )
        else:
            label = json.dumps(f"d={d}\n{short(state)}")
            lines.append(f"  {ids[state]} [label={label}];")
    for src, dst in graph["edges"]:
        lines.append(f"  {ids[src]} -> {ids[dst]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "source",
        help="run folder, checkpoint folder, state.json, or a GraphMemory.state_dict() file",
    )
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint of a run folder (default: the newest)"
    )
    parser.add_argument(
        "--task",
        default=None,
        help="task key, its number in --list (1 = the first), "
        "or a part of a key that only one key contains",
    )
    parser.add_argument("--format", choices=("dot", "json"), default="dot")
    parser.add_argument("--out", default=None, help="output file (default: standard output)")
    parser.add_argument(
        "--list", action="store_true", help="list the stored tasks, numbered, with their sizes"
    )
    a = parser.parse_args(argv)
    try:
        memory = load_memory(a.source, a.checkpoint)
        if a.list:
            for index, task in enumerate(sorted(memory.order), 1):  # the numbers --task takes
                print(f"{index}\t{task}\t{len(memory.order[task])} edges")
            if not memory.order:
                print("export_graph.py: the memory holds no task (empty memory)", file=sys.stderr)
            return
        if a.task is None:
            raise ValueError("give --task KEY, or --task N for the N-th task of --list")
        task = find_task(memory, a.task)
    except ValueError as e:
        sys.exit(f"export_graph.py: error: {e}")
    text = (
        to_dot(memory, task)
        if a.format == "dot"
        else json.dumps(to_json(memory, task), indent=1) + "\n"
    )
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
