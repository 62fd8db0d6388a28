"""bench/reader_path.py: the path a reader follows through train.py for one update, measured.

Runs a one-update, single-process `train.py` (HF engine, a tiny local model, games in a folder,
the CPU preset otherwise) under a profiler hook and lists every train.py definition the run enters
from `def run` to the end of the first RL update's `update_policy`, with the lines each spans (its
decorators to its last line; a nested function counts as its own definition, its lines once), and
the project modules the process loaded.

    python bench/reader_path.py                    # makes a tiny model and 6 games in a temp folder
    python bench/reader_path.py --update-only      # without the warm start and the eval before RL
    python bench/reader_path.py --model DIR --data-dir DIR [--json]

Lambdas and comprehensions count as part of the definition that holds them. The printed total is
the union of the spans (a nested definition's lines are not counted twice).
"""

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TRAIN = os.path.join(ROOT, "train.py")


def spans(path):
    """{(qualified name, first line of the def): (first line incl. decorators, last line)}."""
    tree = ast.parse(open(path).read())
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name, child.lineno] = (first, child.end_lineno)
                inner = f"{name}.<locals>." if not isinstance(child, ast.ClassDef) else f"{name}."
                visit(child, inner)
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def trace(argv):
    """Run train.main(argv); return the train.py definitions entered between `run` and the end
    of the first update_policy called from run's update loop, in the order first entered."""
    import train

    entered, state = [], {"on": False, "done": False, "updates": 0}

    def hook(frame, event, arg):
        if state["done"] or event not in ("call", "return"):
            return
        code = frame.f_code
        if code.co_filename != TRAIN:
            return
        name = code.co_qualname
        if event == "call":
            if name == "run":
                state["on"] = True
            if state["on"] and not name.split(".")[-1].startswith("<"):
                key = (name, code.co_firstlineno)
                if key not in entered:
                    entered.append(key)
        elif name == "update_policy" and state["on"] and frame.f_back.f_code.co_qualname == "run":
            state["done"] = True

    sys.setprofile(hook)
    try:
        train.main(argv)
    finally:
        sys.setprofile(None)
    return entered


def tiny_inputs(folder):
    """A tiny model (tests/conftest.py's bigram model) and 6 generated games, into folder, made
    in a child process so that what it imports is not counted as the run's."""
    model, games = os.path.join(folder, "model"), os.path.join(folder, "games")
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']\n"
        "import conftest\n"
        "from extras import alfworld_gen\n"
        "conftest.bigram_model(sys.argv[2])\n"
        "alfworld_gen.generate_games(sys.argv[3], num_train=4, num_eval=1, seed=0,\n"
        "    task_types=('pick', 'look'), max_receptacles=9, progress=False)\n"
    )
    subprocess.run([sys.executable, "-c", code, ROOT, model, games], check=True)
    return model, games


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local model folder (default: a tiny one is made)")
    p.add_argument("--data-dir", help="a folder holding json_2.1.1 (default: games are made)")
    p.add_argument(
        "--update-only",
        action="store_true",
        help="no warm start, no eval before RL (--warmup-epochs 0 --eval-every 0)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="reader-path-")
    model, games = a.model, a.data_dir
    if not (model and games):
        made_model, made_games = tiny_inputs(scratch)
        model, games = model or made_model, games or made_games
    argv = [
        "--env",
        "alfworld",
        "--model",
        model,
        "--data-dir",
        games,
        "--updates",
        "1",
        "--num-env-workers",
        "1",
        # fewer episodes than the preset's (the same functions run): quicker under the profiler
        "--eval-repeats",
        "1",
        "--group-size",
        "2",
        "--max-steps",
        "3",
        "--task-types",  # any games given
        "all",
        "--max-receptacles",
        "0",
        "--run-dir",
        os.path.join(scratch, "run"),
    ]
    if a.update_only:
        argv += ["--warmup-epochs", "0", "--eval-every", "0"]
    entered = trace(argv)
    table = spans(TRAIN)
    rows, lines = [], set()
    for name, _ in entered:
        key = next(k for k in table if k[0] == name)  # names are unique in train.py
        first, last = table[key]
        rows.append((name, first, last))
        lines.update(range(first, last + 1))
    loaded = []
    for name, module in sys.modules.items():
        path = getattr(module, "__file__", None) or ""  # some modules name a relative file
        if (
            os.path.isabs(path)
            and path.startswith(ROOT + os.sep)
            and name not in ("__main__", "__mp_main__")
        ):
            loaded.append(name)
    loaded.sort()
    if a.json:
        print(json.dumps({"definitions": rows, "lines": len(lines), "modules": loaded}))
        return
    print("train.py definitions entered from `def run` to the end of the first update_policy:")
    for name, first, last in rows:
        print(f"  {name:40s} lines {first:5d}-{last:<5d} ({last - first + 1})")
    print(f"{len(rows)} definitions, {len(lines)} lines (union of their spans)")
    print(f"project modules loaded: {', '.join(loaded)}")


if __name__ == "__main__":
    main()
