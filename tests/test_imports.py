"""The shape a reader relies on: a one-GPU run loads train.py, tigpo.py and envs.py and nothing
else of the project; the opt-in modules of extras/ are imported only inside the functions that
need them; the imports run one way, counting those inside functions (tigpo is a leaf, envs never
imports extras); the top level holds the six pieces plus a few entries; WebShop and the prompt
work on a machine without ALFWorld."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every project module by its import name: the top-level files and extras/.
FILES = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
FILES.update(
    {
        f"extras.{f[:-3]}": os.path.join("extras", f)
        for f in os.listdir(os.path.join(ROOT, "extras"))
        if f.endswith(".py") and f != "__init__.py"
    }
)


def imported_names(module, top_level_only):
    """Every module name `module` imports (at module level only, or anywhere, functions too)."""
    with open(os.path.join(ROOT, FILES[module])) as fh:
        tree = ast.parse(fh.read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # from pkg import module
    return found


def imports_of(module, top_level_only):
    """The project modules `module` imports (at module level only, or anywhere)."""
    return {m for m in imported_names(module, top_level_only) if m in FILES} - {module}


def import_cycle(graph):
    """The first import cycle of {module: modules it imports} as a path, or None."""
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return None
        if state.get(m) == "open":
            return path[path.index(m) :] + [m]
        state[m] = "open"
        for n in sorted(graph[m]):
            cycle = visit(n, path + [m])
            if cycle:
                return cycle
        state[m] = "done"
        return None

    return next(filter(None, (visit(m, []) for m in sorted(graph))), None)


def test_module_level_imports_run_one_way_and_extras_are_entered_lazily():
    graph = {m: imports_of(m, top_level_only=True) for m in FILES}
    assert graph["tigpo"] == set()  # the core copiers take: standard library only
    assert graph["envs"] == set()
    assert graph["train"] == {"envs", "tigpo"}
    lazy = imports_of("train", top_level_only=False) - graph["train"]
    assert lazy and all(m.startswith("extras.") for m in lazy), lazy
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_imports_inside_functions_run_one_way_too_and_envs_never_imports_extras():
    """A lazy import is still an edge a reader follows: envs.py importing extras/webshop.py inside
    a function, while webshop imports envs at its top, is a cycle (issue 39, item 8)."""
    graph = {m: imports_of(m, top_level_only=False) for m in FILES}
    cycle = import_cycle(graph)
    assert cycle is None, f"import cycle (imports in functions included): {' -> '.join(cycle)}"
    tops = {m: {n.split(".")[0] for n in imported_names(m, False)} - {m} for m in ("tigpo", "envs")}
    assert "extras" not in tops["envs"], imported_names("envs", False)
    assert tops["tigpo"] <= sys.stdlib_module_names, tops["tigpo"] - sys.stdlib_module_names
    engines = {"alfworld", "textworld", "fast_downward", "requests"}  # textworld's planner too
    assert tops["envs"] <= sys.stdlib_module_names | engines, tops["envs"]


LOADED = """
import runpy, sys
sys.argv = ["train.py"] + sys.argv[1:]
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    project = {"train", "tigpo", "envs", "extras", "bench", "evaluate"}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in project)
    print("LOADED", ",".join(loaded))
"""


@pytest.mark.slow
def test_a_one_gpu_run_loads_only_train_tigpo_and_envs(tiny_model, alfworld_data, tmp_path):
    """One update, HF engine, a local model, given games: the project modules in the process.
    On a CPU also the two opt-in modules a CPU asks for: extras/cpu_sampling.py (train.run
    enters it there by one visible call) and extras/machine.py (the CPU's kind, for
    config.json); on a GPU nothing of extras/."""
    argv = ["--model", tiny_model, "--data-dir", alfworld_data, "--updates", "1"]
    argv += ["--run-dir", str(tmp_path / "run"), "--num-groups", "1", "--group-size", "2"]
    argv += ["--max-steps", "2", "--max-new-tokens", "8", "--num-env-workers", "1"]
    argv += ["--task-types", "all", "--max-receptacles", "0", "--warmup-epochs", "0"]
    argv += ["--eval-every", "0", "--revisit-groups", "0"]
    out = subprocess.run(
        [sys.executable, "-c", LOADED, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("LOADED"))
    loaded = set(line.split()[1].split(","))  # train.py itself is __main__
    import torch

    cpu = {"extras", "extras.cpu_sampling", "extras.machine"}
    fast = set() if torch.cuda.is_available() else cpu
    assert loaded == {"tigpo", "envs"} | fast, line


BLOCKER = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('alfworld', 'textworld', 'fast_downward'):
            raise ImportError(f'{name} is blocked for this test')
sys.meta_path.insert(0, Blocker())
"""


def test_webshop_and_the_prompt_work_without_alfworld():
    code = (
        BLOCKER
        + """
import envs
from extras import webshop
try:
    import alfworld
    raise SystemExit('the blocker did not block alfworld')
except ImportError:
    pass
assert not any(m.split('.')[0] in ('alfworld', 'textworld') for m in sys.modules)
prompt = envs.build_prompt('buy shoes', [], 'WebShop [SEP] Search', ['search[<query>]'], 'webshop',
                           'action')
assert '<action>search[<query>]</action>' in prompt
assert envs.parse_action(envs.ACTION_PREFILL + 'search[red shoes]</action>') == 'search[red shoes]'
env = webshop.WebShopEnv(url='http://127.0.0.1:9', split='test', num_goals=520)
assert env.tasks[0] == 'webshop/0'
print('ok')
"""
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def ignored(name):
    """True for what .gitignore covers (runs/, plots, caches): not part of the project."""
    out = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT, capture_output=True)
    return out.returncode == 0


def test_the_top_level_holds_the_six_pieces_and_at_most_four_more():
    shown = {f for f in os.listdir(ROOT) if not f.startswith(".") and not ignored(f)}
    core = {"tigpo.py", "envs.py", "train.py", "tests", "requirements.txt", "README.md"}
    assert core <= shown, core - shown
    more = shown - core - {"docs", "pyproject.toml"}
    assert len(more) <= 4, sorted(more)


def test_the_readme_states_each_files_line_count():
    """The README's file table gives each file's length as it is (issue 39: it said 2,371 when
    train.py had 2,564 lines)."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    for name in ("tigpo.py", "train.py", "envs.py"):
        with open(os.path.join(ROOT, name)) as fh:
            lines = len(fh.read().splitlines())
        assert f"| [`{name}`]({name}) | {lines:,} |" in readme, (name, lines)
