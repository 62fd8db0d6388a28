"""The modules' imports run one way: no cycle among the project's modules (imports inside functions
count too), and the shared vocabulary (textenv) and WebShop work on a machine without ALFWorld."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("environments", "trainer", "tools")
# Every project module by its import name: top-level files and the modules of the packages.
FILES = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
FILES.update({f"{pkg}.{f[:-3]}": os.path.join(pkg, f) for pkg in PACKAGES
              for f in os.listdir(os.path.join(ROOT, pkg)) if f.endswith(".py") and f != "__init__.py"})
MODULES = sorted(FILES)


def imports_of(module):
    with open(os.path.join(ROOT, FILES[module])) as fh:
        tree = ast.parse(fh.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}   # from pkg import module
    return {m for m in found if m in FILES} - {module}


def test_the_project_import_graph_has_no_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert graph["tigpo"] == set() and graph["environments.textenv"] == set()   # the two leaves copiers take
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        state[m] = "open"
        for n in sorted(graph[m]):
            visit(n, path + [m])
        state[m] = "done"

    for m in MODULES:
        visit(m, [])


BLOCKER = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('alfworld', 'textworld', 'fast_downward'):
            raise ImportError(f'{name} is blocked for this test')
sys.meta_path.insert(0, Blocker())
"""


def test_webshop_and_the_prompt_work_without_alfworld():
    code = BLOCKER + """
from environments import textenv, webshop
try:
    import alfworld
    raise SystemExit('the blocker did not block alfworld')
except ImportError:
    pass
assert not any(m.split('.')[0] in ('alfworld', 'textworld') for m in sys.modules)
prompt = textenv.build_prompt('buy shoes', [], 'WebShop [SEP] Search', ['search[<query>]'], 'webshop', 'action')
assert '<action>search[<query>]</action>' in prompt
assert textenv.parse_action(textenv.ACTION_PREFILL + 'search[red shoes]</action>') == 'search[red shoes]'
env = webshop.WebShopEnv(url='http://127.0.0.1:9', split='test', num_goals=520)
assert env.tasks[0] == 'webshop/0'
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_top_level_holds_only_what_a_user_runs_or_copies():
    """The core, the envs, the trainer and the entry points; the rest lives in the packages."""
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(top) <= 5, top
    assert {"tigpo.py", "envs.py", "train.py"} <= set(top), top
