"""plot.py, export_graph.py and evaluate.py: the figures and numbers a paper needs."""

import json
import os
import subprocess
import sys

import pytest

import tigpo
from extras import export_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*argv, env=None, cwd=ROOT):
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


# ---------------------------------------------------------------------------------------------- exp
def hand_built_memory():
    memory = tigpo.GraphMemory()
    memory.add(
        [
            {
                "task": "kitchen/mug",
                "trajs": [
                    {
                        "states": ["start", "counter", "mug-held"],
                        "valid": [True, True],
                        "score": 10.0,
                        "success": True,
                    },
                    {
                        "states": ["start", "sink", "sink"],
                        "valid": [True, True],
                        "score": 0.0,
                        "success": False,
                    },
                ],
            }
        ]
    )
    return memory


def test_graph_export_has_the_edges_and_the_distances_to_success(tmp_path):
    memory = hand_built_memory()
    # start -> counter -> SUCCESS; start -> sink (a dead end, self-loop not stored)
    graph = export_graph.to_json(memory, "kitchen/mug")
    assert graph["edges"] == [["counter", tigpo.SUCCESS], ["start", "counter"], ["start", "sink"]]
    assert {n["state"]: n["distance"] for n in graph["nodes"]} == {
        tigpo.SUCCESS: 0,
        "counter": 1,
        "start": 2,
        "sink": 3,
    }
    dot = export_graph.to_dot(memory, "kitchen/mug")
    assert dot.startswith("// kitchen/mug") and "digraph H {" in dot and "doubleoctagon" in dot
    assert dot.count("->") == 3 and '"d=2\\nstart"' in dot and '"d=3\\nsink"' in dot
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(memory.state_dict()))
    out = tool("extras/export_graph.py", str(path), "--task", "mug", "--format", "json")
    assert out.returncode == 0 and json.loads(out.stdout) == json.loads(json.dumps(graph))


def test_graph_export_bad_task_is_one_line_listing_known_keys(tmp_path):
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(hand_built_memory().state_dict()))
    out = tool("extras/export_graph.py", str(path), "--task", "bathroom")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bathroom" in lines[0] and "kitchen/mug" in lines[0]


# The training games of the README's default run (`python train.py --env alfworld`: cpu preset, seed
# 0, 4 generated pick/look games, scenes of at most 9 receptacles), as envs.alfworld_tasks keys
# them.
DEFAULT_RUN_TASKS = [
    "train/look_at_obj_in_light-KeyChain-None-FloorLamp-230/trial_T00000000_000003_957828/game.tw-pddl",
    "train/look_at_obj_in_light-Pencil-None-DeskLamp-328/trial_T00000000_000001_328821/game.tw-pddl",
    "train/pick_and_place_simple-Mug-None-DiningTable-329/trial_T00000000_000002_716505/game.tw-pddl",
    "train/pick_and_place_simple-Newspaper-None-SideTable-214/trial_T00000000_000000_382247/game.tw-pddl",
]


def default_like_run(tmp_path):
    """A run folder whose newest checkpoint holds a memory over the default run's four task keys."""
    memory = tigpo.GraphMemory()
    for i, task in enumerate(reversed(DEFAULT_RUN_TASKS)):
        memory.add(
            [
                {
                    "task": task,
                    "trajs": [
                        {
                            "states": ["s0", f"s{i + 1}", "s9"],
                            "valid": [True, True],
                            "score": 10.0,
                            "success": i % 2 == 0,
                        }
                    ],
                }
            ]
        )
    for update in (3, 6):
        folder = tmp_path / "run" / "checkpoints" / f"update_{update:06d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(
            json.dumps({"update": update, "memory": memory.state_dict()})
        )
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
    assert listing.splitlines() == [
        f"{i}\t{task}\t2 edges" for i, task in enumerate(DEFAULT_RUN_TASKS, 1)
    ]
    for i, task in enumerate(DEFAULT_RUN_TASKS, 1):
        error, dot = export([run, "--task", str(i)], capsys)
        assert error is None and dot.startswith(f"// {task}:") and "digraph H {" in dot
        assert export([run, "--task", task], capsys) == (None, dot)  # the exact key
    assert export([run, "--task", "Pencil"], capsys)[1].startswith(f"// {DEFAULT_RUN_TASKS[1]}:")
    assert export([run, "--task", "pick_and_place_simple-Mug"], capsys)[1].startswith(
        f"// {DEFAULT_RUN_TASKS[2]}:"
    )
    error, text = export([run, "--task", "1", "--format", "json"], capsys)
    assert error is None and json.loads(text)["task"] == DEFAULT_RUN_TASKS[0]


def test_graph_export_ambiguous_part_names_the_candidates_and_the_way_out(tmp_path, capsys):
    run = default_like_run(tmp_path)
    error, out = export([run, "--task", "look_at"], capsys)
    assert out == "" and error.startswith("export_graph.py: error: 2 tasks contain 'look_at'")
    assert f"1: {DEFAULT_RUN_TASKS[0]}" in error and f"2: {DEFAULT_RUN_TASKS[1]}" in error
    assert DEFAULT_RUN_TASKS[2] not in error and "--task 1" in error and "longer part" in error
    assert "\n" not in error
    error, out = export([run, "--task", "5"], capsys)  # a number past the end of --list
    assert out == "" and "no task 5" in error and "1 to 4" in error
    error, out = export([run, "--task", "0"], capsys)
    assert out == "" and "no task 0" in error


# ---------------------------------------------------------------------------------------------- plo
def fake_run(
    folder,
    algo,
    seed,
    updates,
    kl=True,
    episodes=False,
    eval_at=None,
    splits=("valid_seen",),
    eval_values=None,
):
    """A run folder like train.py writes: per-update metrics, eval rows at `eval_at` (default:
    update
    0 only), `kl` null when kl is False (--kl-coef 0), eval/<split>/episodes when episodes."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({"algo": algo, "seed": seed, "kl_coef": 0.01 if kl else 0.0}, fh)
    eval_at = (0,) if eval_at is None else eval_at
    eval_values = eval_values or {}
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        for u in range(0, updates + 1):
            row = {"update": u}
            if u > 0:
                row.update(
                    {
                        "success_rate": u / 10 + seed / 100,
                        "valid_action_ratio": 0.5,
                        "kl": 1e-4 * u if kl else None,
                        "zero_adv_frac": 0.3,
                        "graph_nodes": 3 * u,
                        "graph_edges": 4 * u,
                        "task_hit_rate": 0.5,
                        "state_hit_rate": 0.2,
                        "distinct_actions": 5,
                    }
                )
            if u in eval_at:
                for split in splits:
                    row[f"eval/{split}/success_rate"] = eval_values.get(split, 0.1)
                    if episodes:
                        row[f"eval/{split}/episodes"] = 4 if split == "train" else 6
            if len(row) > 1:
                fh.write(json.dumps(row) + "\n")
        fh.write('{"update": 99, "success_ra')  # a run still writing


@pytest.mark.slow  # a subprocess that starts matplotlib: seconds
def test_plot_writes_a_png_and_an_svg_for_several_runs_and_a_one_line_run(tmp_path):
    runs = [str(tmp_path / name) for name in ("a", "b", "c")]
    fake_run(runs[0], "tigpo", 0, 4)
    fake_run(runs[1], "tigpo", 1, 4)
    fake_run(runs[2], "grpo", 0, 1)
    out = tool("extras/plot.py", *runs, "--out", str(tmp_path / "fig" / "curves"))
    assert out.returncode == 0, out.stderr[-2000:]
    png = (tmp_path / "fig" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "fig" / "curves.svg").read_text().lstrip().startswith("<?xml")
    assert not (tmp_path / "a" / "plots.png").exists() and not (tmp_path / "plots.png").exists()


@pytest.mark.slow  # a subprocess that starts matplotlib: seconds
def test_plot_writes_next_to_the_run_by_default_not_into_the_current_folder(tmp_path):
    runs = tmp_path / "runs"
    fake_run(str(runs / "alfworld-tigpo-seed0"), "tigpo", 0, 3, kl=False)
    fake_run(str(runs / "alfworld-grpo-seed0"), "grpo", 0, 3, kl=False)
    here = tmp_path / "elsewhere"
    here.mkdir()
    one = tool(
        os.path.join(ROOT, "extras", "plot.py"), str(runs / "alfworld-tigpo-seed0"), cwd=str(here)
    )
    assert one.returncode == 0, one.stderr[-2000:]
    for ext in ("png", "svg"):
        assert (runs / "alfworld-tigpo-seed0" / f"plots.{ext}").stat().st_size > 1000
    several = tool(
        os.path.join(ROOT, "extras", "plot.py"),
        str(runs / "alfworld-tigpo-seed0"),
        str(runs / "alfworld-grpo-seed0"),
        cwd=str(here),
    )
    assert several.returncode == 0, several.stderr[-2000:]
    assert (runs / "plots.png").stat().st_size > 1000 and (runs / "plots.svg").exists()
    assert str(runs / "plots.png") in several.stdout
    assert list(here.iterdir()) == []  # nothing in the current folder
    # runs/* now also matches runs/plots.png and runs/plots.svg: skipped, with a note
    again = tool(
        os.path.join(ROOT, "extras", "plot.py"),
        *sorted(str(p) for p in runs.iterdir()),
        cwd=str(here),
    )
    assert again.returncode == 0 and "skipped" in again.stderr and "plots.png" in again.stderr


def figure_of(*folders):
    from extras import plot

    fig = plot.make_figure([plot.read_run(f) for f in folders])
    return fig, {ax.get_title(): ax for ax in fig.axes}


def eval_points(ax):
    """[(label, marker, linestyle, xs, ys, bar segments)] of the eval error-bar series of a
    panel."""
    out = []
    for container in ax.containers:
        line, _, bars = container.lines
        segments = [seg.tolist() for coll in bars for seg in coll.get_segments()]
        out.append(
            (
                container.get_label(),
                line.get_marker(),
                line.get_linestyle(),
                list(line.get_xdata()),
                list(line.get_ydata()),
                segments,
            )
        )
    return out


def panel_text(ax):
    return " ".join(t.get_text() for t in ax.texts)


def test_plot_figure_has_every_panel_and_splits_training_games_from_held_out(tmp_path):
    run = str(
        tmp_path / "alfworld-tigpo-seed0"
    )  # the default run's shape: eval before and after, no KL
    fake_run(
        run,
        "tigpo",
        0,
        6,
        kl=False,
        eval_at=(0, 6),
        splits=("train", "valid_seen", "valid_unseen"),
        eval_values={"train": 0.5, "valid_seen": 0.0, "valid_unseen": 0.0},
    )
    fig, axes = figure_of(run)
    from extras import plot

    assert list(axes) == [title for title, *_ in plot.PANELS]  # the same grid for every run
    assert len(axes) == 9 and all(ax.get_visible() for ax in axes.values())
    train = eval_points(axes["eval success on the training games"])
    assert [(label, ys) for label, _, _, _, ys, _ in train] == [("tigpo seed 0", [0.5, 0.5])]
    held_out = eval_points(axes["held-out success"])
    assert sorted(label for label, *_ in held_out) == [
        "tigpo seed 0 valid_seen",
        "tigpo seed 0 valid_unseen",
    ]
    for _, marker, linestyle, _, ys, bars in held_out:  # sparse evals: markers, no line
        assert (
            marker not in (None, "", "None")
            and linestyle == "None"
            and ys == [0.0, 0.0]
            and bars == []
        )
    (_, m1, _, xs1, _, _), (_, m2, _, xs2, _, _) = held_out
    assert m1 != m2  # two splits at 0: both visible
    assert all(0 < abs(a - b) < 1 for a, b in zip(xs1, xs2)) and [round(x) for x in xs1] == [0, 6]
    legend = [t.get_text() for t in axes["held-out success"].get_legend().get_texts()]
    assert legend == ["tigpo seed 0 valid_seen", "tigpo seed 0 valid_unseen"]
    kl = axes["KL(pi || ref), per token"]
    assert "no KL term" in panel_text(kl) and "--kl-coef 0" in panel_text(kl) and not kl.lines
    training = axes["training success rate"]
    assert [list(line.get_ydata()) for line in training.lines] == [[u / 10 for u in range(1, 7)]]
    assert (
        training.get_xlim() == axes["held-out success"].get_xlim()
    )  # the same updates under every panel


def test_plot_eval_bars_are_95_percent_wilson_intervals_when_episodes_are_logged(tmp_path):
    from extras import plot

    lo, hi = plot.wilson(0.5, 4)
    assert abs(lo - 0.150) < 1e-3 and abs(hi - 0.850) < 1e-3
    lo, hi = plot.wilson(0.0, 6)
    assert lo == 0.0 and abs(hi - 0.390) < 1e-3
    run = str(tmp_path / "r")
    fake_run(
        run,
        "tigpo",
        0,
        4,
        eval_at=(0, 2, 4),
        splits=("train", "valid_unseen"),
        episodes=True,
        eval_values={"train": 0.5, "valid_unseen": 0.0},
    )
    _, axes = figure_of(run)
    [(_, _, _, xs, ys, bars)] = eval_points(axes["eval success on the training games"])
    assert ys == [0.5] * 3 and len(bars) == 3
    for x, (seg_lo, seg_hi) in zip(xs, bars):
        assert (
            seg_lo[0] == seg_hi[0] == x
            and abs(seg_lo[1] - 0.150) < 1e-3
            and abs(seg_hi[1] - 0.850) < 1e-3
        )
    [(_, _, _, _, _, bars)] = eval_points(axes["held-out success"])
    assert all(abs(a[1]) < 1e-9 and abs(b[1] - 0.390) < 1e-3 for a, b in bars)
    assert "95% Wilson" in axes["held-out success"].get_legend().get_title().get_text()
    kl = axes["KL(pi || ref), per token"]
    assert kl.lines and "no KL term" not in panel_text(kl)


def test_plot_dense_evals_are_joined_and_a_panel_nobody_logged_says_so(tmp_path):
    runs = [str(tmp_path / f"s{seed}") for seed in (0, 1)]
    for seed, run in enumerate(runs):
        fake_run(run, "tigpo", seed, 9, eval_at=tuple(range(10)), splits=("valid_seen",))
    _, axes = figure_of(*runs)
    series = eval_points(axes["held-out success"])
    assert len(series) == 3 and all(
        linestyle == ":" for _, _, linestyle, *_ in series
    )  # 2 runs + mean
    assert [label for label, *_ in series if not label.startswith("_")] == [
        "tigpo (mean ± std of 2) valid_seen"
    ]
    assert "no eval on the training games" in panel_text(axes["eval success on the training games"])


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    fake_run(str(tmp_path / "a"), "tigpo", 0, 2)
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text(
        "raise ImportError('matplotlib is blocked for this test')\n"
    )
    out = tool("extras/plot.py", str(tmp_path / "a"), env={"PYTHONPATH": str(blocker)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and "pip install matplotlib" in lines[0]


def test_evaluate_takes_the_held_out_splits_whatever_the_run_evaluated(tmp_path):
    """The cpu preset evaluates its training games while it trains; evaluate.py still reports the
    papers'
    held-out splits unless --splits says otherwise, and names the known splits for a bad one."""
    import evaluate
    import train
    from train import UsageError

    args, _ = train.parse_args(
        ["--env", "alfworld", "--run-dir", str(tmp_path / "run")], cuda=False
    )
    assert args.eval_splits == "train"
    (tmp_path / "run" / "checkpoints" / "update_000001").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps(vars(args)))
    run = str(tmp_path / "run")
    assert evaluate.settings(evaluate.parse([run]))[0].eval_splits == "valid_seen,valid_unseen"
    assert evaluate.settings(evaluate.parse([run, "--splits", "train"]))[0].eval_splits == "train"
    with pytest.raises(UsageError, match="valid_seen"):
        evaluate.settings(evaluate.parse([run, "--splits", "test"]))
