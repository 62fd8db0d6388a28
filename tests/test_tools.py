"""plot.py, export_graph.py and evaluate.py: the figures and numbers a paper needs."""
import json
import os
import subprocess
import sys

from tools import export_graph
import tigpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*argv, env=None):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# ---------------------------------------------------------------------------------------------- export
def hand_built_memory():
    memory = tigpo.GraphMemory()
    memory.add([{"task": "kitchen/mug", "trajs": [
        {"states": ["start", "counter", "mug-held"], "valid": [True, True], "score": 10.0, "success": True},
        {"states": ["start", "sink", "sink"], "valid": [True, True], "score": 0.0, "success": False}]}])
    return memory


def test_graph_export_has_the_edges_and_the_distances_to_success(tmp_path):
    memory = hand_built_memory()
    # start -> counter -> SUCCESS; start -> sink (a dead end, self-loop not stored)
    graph = export_graph.to_json(memory, "kitchen/mug")
    assert graph["edges"] == [["counter", tigpo.SUCCESS], ["start", "counter"], ["start", "sink"]]
    assert {n["state"]: n["distance"] for n in graph["nodes"]} == {tigpo.SUCCESS: 0, "counter": 1, "start": 2,
                                                                  "sink": 3}
    dot = export_graph.to_dot(memory, "kitchen/mug")
    assert dot.startswith("// kitchen/mug") and "digraph H {" in dot and "doubleoctagon" in dot
    assert dot.count("->") == 3 and '"d=2\\nstart"' in dot and '"d=3\\nsink"' in dot
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(memory.state_dict()))
    out = tool("tools/export_graph.py", str(path), "--task", "mug", "--format", "json")
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(json.dumps(graph))


def test_graph_export_bad_task_is_one_line_listing_known_keys(tmp_path):
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(hand_built_memory().state_dict()))
    out = tool("tools/export_graph.py", str(path), "--task", "bathroom")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bathroom" in lines[0] and "kitchen/mug" in lines[0]


# The training games of the README's default run (`python train.py --env alfworld`: cpu preset, seed 0,
# 4 generated pick/look games, scenes of at most 9 receptacles), as envs.alfworld_tasks keys them.
DEFAULT_RUN_TASKS = [
    "train/look_at_obj_in_light-KeyChain-None-FloorLamp-230/trial_T00000000_000003_957828/game.tw-pddl",
    "train/look_at_obj_in_light-Pencil-None-DeskLamp-328/trial_T00000000_000001_328821/game.tw-pddl",
    "train/pick_and_place_simple-Mug-None-DiningTable-329/trial_T00000000_000002_716505/game.tw-pddl",
    "train/pick_and_place_simple-Newspaper-None-SideTable-214/trial_T00000000_000000_382247/game.tw-pddl"]


def default_like_run(tmp_path):
    """A run folder whose newest checkpoint holds a memory over the default run's four task keys."""
    memory = tigpo.GraphMemory()
    for i, task in enumerate(reversed(DEFAULT_RUN_TASKS)):
        memory.add([{"task": task, "trajs": [{"states": ["s0", f"s{i + 1}", "s9"], "valid": [True, True],
                                              "score": 10.0, "success": i % 2 == 0}]}])
    for update in (3, 6):
        folder = tmp_path / "run" / "checkpoints" / f"update_{update:06d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"update": update, "memory": memory.state_dict()}))
    return str(tmp_path / "run")


def export(argv, capsys):
    """(exit message or None, stdout) of export_graph.main(argv), in this process."""
    try:
        export_graph.main(argv)
        message = None
    except SystemExit as e:
        message = str(e.code)
    return message, capsys.readouterr().out


def test_graph_export_takes_the_number_from_list_an_exact_key_or_a_unique_part(tmp_path, capsys):
    run = default_like_run(tmp_path)
    error, listing = export([run, "--list"], capsys)
    assert error is None
    assert listing.splitlines() == [f"{i}\t{task}\t2 edges" for i, task in enumerate(DEFAULT_RUN_TASKS, 1)]
    for i, task in enumerate(DEFAULT_RUN_TASKS, 1):
        error, dot = export([run, "--task", str(i)], capsys)
        assert error is None and dot.startswith(f"// {task}:") and "digraph H {" in dot
        assert export([run, "--task", task], capsys) == (None, dot)   # the exact key
    assert export([run, "--task", "Pencil"], capsys)[1].startswith(f"// {DEFAULT_RUN_TASKS[1]}:")
    assert export([run, "--task", "pick_and_place_simple-Mug"], capsys)[1].startswith(f"// {DEFAULT_RUN_TASKS[2]}:")
    error, text = export([run, "--task", "1", "--format", "json"], capsys)
    assert error is None and json.loads(text)["task"] == DEFAULT_RUN_TASKS[0]


def test_graph_export_ambiguous_part_names_the_candidates_and_the_way_out(tmp_path, capsys):
    run = default_like_run(tmp_path)
    error, out = export([run, "--task", "look_at"], capsys)
    assert out == "" and error.startswith("export_graph.py: error: 2 tasks contain 'look_at'")
    assert f"1: {DEFAULT_RUN_TASKS[0]}" in error and f"2: {DEFAULT_RUN_TASKS[1]}" in error
    assert DEFAULT_RUN_TASKS[2] not in error and "--task 1" in error and "longer part" in error
    assert "\n" not in error
    error, out = export([run, "--task", "5"], capsys)           # a number past the end of --list
    assert out == "" and "no task 5" in error and "1 to 4" in error
    error, out = export([run, "--task", "0"], capsys)
    assert out == "" and "no task 0" in error


# ---------------------------------------------------------------------------------------------- plot
def fake_run(folder, algo, seed, updates):
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({"algo": algo, "seed": seed}, fh)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        fh.write(json.dumps({"update": 0, "eval/valid_seen/success_rate": 0.1}) + "\n")
        for u in range(1, updates + 1):
            fh.write(json.dumps({"update": u, "success_rate": u / 10 + seed / 100, "valid_action_ratio": 0.5,
                                 "kl": 1e-4 * u, "zero_adv_frac": 0.3, "graph_nodes": 3 * u, "graph_edges": 4 * u,
                                 "task_hit_rate": 0.5, "state_hit_rate": 0.2, "distinct_actions": 5}) + "\n")
        fh.write('{"update": 99, "success_ra')                      # a run still writing


def test_plot_writes_a_png_and_an_svg_for_several_runs_and_a_one_line_run(tmp_path):
    runs = [str(tmp_path / name) for name in ("a", "b", "c")]
    fake_run(runs[0], "tigpo", 0, 4)
    fake_run(runs[1], "tigpo", 1, 4)
    fake_run(runs[2], "grpo", 0, 1)
    out = tool("tools/plot.py", *runs, "--out", str(tmp_path / "fig" / "curves"))
    assert out.returncode == 0, out.stderr[-2000:]
    png = (tmp_path / "fig" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "fig" / "curves.svg").read_text().lstrip().startswith("<?xml")


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    fake_run(str(tmp_path / "a"), "tigpo", 0, 2)
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('matplotlib is blocked for this test')\n")
    out = tool("tools/plot.py", str(tmp_path / "a"), env={"PYTHONPATH": str(blocker)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and "pip install matplotlib" in lines[0]
