"""The README's "Copy the update" example runs as printed, and update_policy and the other pieces
people copy take plain inputs: no `args`, no `ranks`, and no collective inside."""

import ast
import inspect
import os
import re
import subprocess
import sys

import pytest

import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a subprocess that imports torch and transformers
def test_the_readme_update_example_runs_as_printed():
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    block = re.search(
        r"<!-- update:start -->\n```python\n(.*?)```\n<!-- update:end -->", text, re.S
    ).group(1)
    out = subprocess.run(
        [sys.executable, "-c", block],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 optimizer steps" in out.stdout


COPYABLE = ("generate", "run_episodes", "response_logprobs", "policy_loss", "update_policy")


def test_the_copyable_pieces_take_plain_inputs_and_hold_no_collective():
    for name in COPYABLE:
        fn = getattr(train, name)
        params = inspect.signature(fn).parameters
        assert not {"args", "dist", "ranks"} & set(params), (name, list(params))
        tree = ast.parse(inspect.getsource(fn).lstrip())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
        }
        assert not names & {
            "dist",
            "ranks",
            "all_reduce",
            "all_gather_object",
            "barrier",
            "broadcast",
            "synced_gpus",
        }, name
