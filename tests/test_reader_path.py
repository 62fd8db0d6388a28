"""The path a reader follows through train.py for one update (issue 39), measured by
bench/reader_path.py on a tiny model and the test games: the definitions it enters from `def run`
to the end of the first update_policy, the lines they span, and the project modules loaded."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reader_path(tiny_model, alfworld_data, *flags):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "reader_path.py"), "--json", *flags]
        + ["--model", tiny_model, "--data-dir", alfworld_data],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_update_reads_in_few_definitions_with_no_hidden_module(tiny_model, alfworld_data):
    path = reader_path(tiny_model, alfworld_data, "--update-only")
    names = [name for name, _, _ in path["definitions"]]
    assert names[0] == "run" and "update_policy" in names and "run_episodes" in names
    assert len(names) <= 24 and path["lines"] <= 750, (len(names), path["lines"], names)
    # train, tigpo, envs, and on a CPU the opt-in modules a CPU asks for (in their package): the
    # sampling fast path, and the CPU's kind that config.json records (train.versions)
    cpu = {"extras", "extras.cpu_sampling", "extras.machine"}
    assert set(path["modules"]) <= {"train", "tigpo", "envs"} | cpu
    assert "extras.cpu_sampling" in path["modules"]  # the CPU run took the fast path
