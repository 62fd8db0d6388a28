"""bench/seeds.py (the comparison matrix runner) against a fake train.py, and bench/compare.py
(the comparison table) on a hand-made results folder whose numbers are worked out below."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "bench", "seeds.py")
COMPARE = os.path.join(ROOT, "bench", "compare.py")

# What the runner relies on in train.py: config.json (with `updates`, written at the start and
# at each checkpoint), one metrics.jsonl line per update (update 0 = the eval before RL, the last
# update with the eval after), checkpoints/update_NNNNNN every --save-every updates, --resume
# continuing from the newest one, and a refusal to start in a folder that holds a run.
# FAKE_DIE = {"<method>-seed<S>": k} makes a cell die after logging update k (and half a line);
# FAKE_SLEEP = seconds per update.
FAKE_TRAIN = textwrap.dedent(
    """
    import argparse, json, os, signal, sys, time
    p = argparse.ArgumentParser()
    for flag in ("--env", "--algo", "--run-dir"):
        p.add_argument(flag)
    for flag, default in (("--seed", 0), ("--threads", 0), ("--revisit-groups", 2),
                          ("--updates", 4), ("--save-every", 2)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--cross-temporal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    name = os.path.basename(a.run_dir)
    if a.algo != "tigpo":
        a.revisit_groups = 0
    if not a.resume and os.path.isdir(a.run_dir) and os.listdir(a.run_dir):
        sys.exit(f"train.py: error: {a.run_dir} already holds a run")
    os.makedirs(a.run_dir, exist_ok=True)

    def note(**kw):
        with open(os.path.join(a.run_dir, "calls.jsonl"), "a") as fh:
            row = dict(kw, argv=sys.argv[1:], pid=os.getpid(), t=time.time())
            fh.write(json.dumps(row) + "\\n")

    def on_term(signum, frame):
        note(event="sigterm")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    note(event="start", omp=os.environ.get("OMP_NUM_THREADS"))
    metrics = os.path.join(a.run_dir, "metrics.jsonl")

    def success(update):  # a deterministic curve per cell, so a resumed run can be checked
        return round(((a.seed * 7 + update * 3 + len(name)) % 10) / 10, 2)

    def log(update):
        row = {"update": update, "success_rate": success(update)}
        if update in (0, a.updates):
            row.update({"eval/train/success_rate": success(update) / 2, "eval/train/episodes": 32})
        with open(metrics, "a") as fh:
            fh.write(json.dumps(row) + "\\n")

    if a.resume:
        saved = os.listdir(os.path.join(a.run_dir, "checkpoints"))
        start = max(int(n.split("_")[1]) for n in saved)
        with open(metrics) as fh:
            kept = [l for l in fh if l.endswith("\\n") and json.loads(l)["update"] <= start]
        with open(metrics, "w") as fh:
            fh.writelines(kept)
    else:
        start = 0
        config = dict(vars(a), resume=False, preset="cpu")
        with open(os.path.join(a.run_dir, "config.json"), "w") as fh:
            json.dump(config, fh)
        log(0)
    open(os.path.join(a.run_dir, "trajectories.txt"), "a").write("not for the results folder\\n")
    die = json.loads(os.environ.get("FAKE_DIE", "{}")).get(name)
    for update in range(start + 1, a.updates + 1):
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
        log(update)
        if update % a.save_every == 0 or update == a.updates:
            os.makedirs(os.path.join(a.run_dir, "checkpoints", f"update_{update:06d}"))
        if update == die:
            open(metrics, "a").write('{"update": ')  # killed while writing a line
            os._exit(1)
    note(event="end")
    """
)


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return str(path)


def seeds_py(tmp_path, fake, *flags, env=None, extra=("--updates", "4")):
    cmd = [sys.executable, SEEDS, "--out", str(tmp_path / "runs"), "--results"]
    cmd += [str(tmp_path / "results"), "--trainer", fake, *flags, "--", *extra]
    env = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def calls(tmp_path, cell):
    with open(tmp_path / "runs" / cell / "calls.jsonl") as fh:
        return [json.loads(line) for line in fh]


def expected_metrics(seed, name, updates=4):
    """The fake's uninterrupted metrics.jsonl of one cell."""
    rows = []
    for update in range(updates + 1):
        s = round(((seed * 7 + update * 3 + len(name)) % 10) / 10, 2)
        row = {"update": update, "success_rate": s}
        if update in (0, updates):
            row.update({"eval/train/success_rate": s / 2, "eval/train/episodes": 32})
        rows.append(row)
    return rows


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_fresh_matrix_runs_every_cell_and_copies_config_and_metrics_only(tmp_path, fake):
    methods = "grpo,tigpo-no-revisit,tigpo-no-ct"
    r = seeds_py(tmp_path, fake, "--methods", methods, "--seeds", "5-6", "--threads", "1")
    assert r.returncode == 0, r.stderr
    for seed in (5, 6):
        for method in methods.split(","):
            cell = f"{method}-seed{seed}"
            results = tmp_path / "results" / method / f"seed{seed}"
            assert sorted(os.listdir(results)) == ["config.json", "metrics.jsonl"]
            run = tmp_path / "runs" / cell
            for name in ("config.json", "metrics.jsonl"):
                assert (results / name).read_text() == (run / name).read_text()
            assert read_jsonl(results / "metrics.jsonl") == expected_metrics(seed, cell)
            (start,) = [c for c in calls(tmp_path, cell) if c["event"] == "start"]
            assert start["omp"] == "1"
            assert start["argv"][start["argv"].index("--threads") + 1] == "1"
            assert start["argv"][start["argv"].index("--seed") + 1] == str(seed)
            assert os.path.exists(tmp_path / "runs" / f"log-{cell}.txt")
    # the method -> flags mapping reached train.py
    config = json.loads((tmp_path / "results/tigpo-no-ct/seed5/config.json").read_text())
    assert (config["algo"], config["cross_temporal"], config["revisit_groups"]) == (
        "tigpo",
        False,
        2,
    )
    config = json.loads((tmp_path / "results/tigpo-no-revisit/seed5/config.json").read_text())
    assert (config["algo"], config["cross_temporal"], config["revisit_groups"]) == (
        "tigpo",
        True,
        0,
    )
    times = read_jsonl(tmp_path / "runs" / "times.jsonl")
    assert len(times) == 6 and all(t["finished"] and t["start"] == "new" for t in times)
    assert "[6/6 done]" in r.stdout and "per run (mean of 6)" in r.stdout
    assert "[1/6 done]" in r.stdout and "5 left on 1 lane(s)" in r.stdout


def test_stopped_matrix_skips_finished_resumes_torn_with_checkpoint_restarts_without(
    tmp_path, fake
):
    # session 1: grpo seed 1 dies after update 3 (checkpoint at 2), gigpo seed 1 after update 1
    # (no checkpoint yet); the seed-2 cells finish
    die = json.dumps({"grpo-seed1": 3, "gigpo-seed1": 1})
    flags = ("--methods", "grpo,gigpo", "--seeds", "1,2")
    r = seeds_py(tmp_path, fake, *flags, env={"FAKE_DIE": die})
    assert r.returncode == 1 and "2 cell(s) failed" in r.stderr
    assert "grpo-seed1: FAILED (exit 1)" in r.stdout
    assert not os.path.exists(tmp_path / "results" / "grpo" / "seed1")
    assert sorted(os.listdir(tmp_path / "results" / "grpo")) == ["seed2"]

    r = seeds_py(tmp_path, fake, *flags)  # session 2, the same command
    assert r.returncode == 0, r.stdout + r.stderr
    assert "grpo-seed2: finished" in r.stdout and "gigpo-seed2: finished" in r.stdout
    assert "grpo-seed1: torn (last logged update 3): resumed from its checkpoint of update 2" in (
        r.stdout
    )
    assert (
        "gigpo-seed1: torn (last logged update 1, no checkpoint): deleted and started" in r.stdout
    )
    assert "4 cells, 2 done already, 2 to run" in r.stdout
    # finished cells were not run again
    for cell in ("grpo-seed2", "gigpo-seed2"):
        assert [c["event"] for c in calls(tmp_path, cell)] == ["start", "end"]
    # the torn cell with a checkpoint was continued with --resume, to the uninterrupted metrics
    starts = [c for c in calls(tmp_path, "grpo-seed1") if c["event"] == "start"]
    assert ["--resume" in c["argv"] for c in starts] == [False, True]
    for folder in (tmp_path / "runs" / "grpo-seed1", tmp_path / "results" / "grpo" / "seed1"):
        assert read_jsonl(folder / "metrics.jsonl") == expected_metrics(1, "grpo-seed1")
    # the one without was deleted (the fake, like train.py, refuses a folder holding a run)
    # and started fresh: one start only in its calls, no --resume
    starts = [c for c in calls(tmp_path, "gigpo-seed1") if c["event"] == "start"]
    assert len(starts) == 1 and "--resume" not in starts[0]["argv"]
    assert read_jsonl(tmp_path / "results/gigpo/seed1/metrics.jsonl") == expected_metrics(
        1, "gigpo-seed1"
    )
    times = read_jsonl(tmp_path / "runs" / "times.jsonl")
    assert [(t["method"], t["seed"], t["start"], t["finished"]) for t in times[-2:]] == [
        ("grpo", 1, "resume", True),
        ("gigpo", 1, "restart", True),
    ]
    # a third session has nothing to do
    r = seeds_py(tmp_path, fake, *flags)
    assert r.returncode == 0 and "4 cells, 4 done already, 0 to run" in r.stdout


def test_a_seed_with_cells_finished_on_another_machine_is_named(tmp_path, fake):
    flags = ("--methods", "grpo,gigpo", "--seeds", "1,2")
    r = seeds_py(tmp_path, fake, "--methods", "grpo", "--seeds", "1,2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: seed" not in r.stdout  # the fake writes no versions: nothing to compare
    config = tmp_path / "results" / "grpo" / "seed1" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "versions": {"device": "Z"}}))
    shutil.rmtree(tmp_path / "runs" / "grpo-seed1")  # a new session: the committed copy alone
    r = seeds_py(tmp_path, fake, *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: seed")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: seed 1 has cells finished on another machine (grpo on Z) and this one is "
    )


def test_the_machine_kind_is_the_model_name_and_the_kernel_flags_where_recorded(tmp_path, fake):
    from extras import machine

    here = machine.cpu()  # what train.py records in config.json's versions, off a GPU
    r = seeds_py(tmp_path, fake, "--methods", "grpo", "--seeds", "1,2")
    assert r.returncode == 0, r.stdout + r.stderr
    config = tmp_path / "results" / "grpo" / "seed1" / "config.json"
    saved = json.loads(config.read_text())
    shutil.rmtree(tmp_path / "runs" / "grpo-seed1")
    flags = ("--methods", "grpo,gigpo", "--seeds", "1,2")
    # this model name, no cpu_flags (a config.json from before they were recorded): same kind
    config.write_text(json.dumps({**saved, "versions": {"device": here["device"]}}))
    assert "note: seed" not in seeds_py(tmp_path, fake, *flags).stdout
    # this model name with other kernel flags (AMX on one, not the other): another kind
    other = {"device": here["device"], "cpu_flags": "avx2"}
    if here["cpu_flags"] == "avx2":
        other["cpu_flags"] = "amx_bf16 avx512_bf16 avx512f avx2"
    config.write_text(json.dumps({**saved, "versions": other}))
    for cell in ("gigpo-seed1", "gigpo-seed2"):
        shutil.rmtree(tmp_path / "runs" / cell)
    shutil.rmtree(tmp_path / "results" / "gigpo")
    r = seeds_py(tmp_path, fake, *flags)
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: seed")]
    assert notes == [
        f"note: seed 1 has cells finished on another machine (grpo on {here['device']} "
        f"({other['cpu_flags']})) and this one is {here['device']} ({here['cpu_flags']}): its "
        "cells run here start from another warm start; to keep a seed on one machine kind, run "
        "its remaining cells there, or move its finished ones aside"
    ]


def intervals(tmp_path, cells):
    spans = []
    for cell in cells:
        events = {c["event"]: c["t"] for c in calls(tmp_path, cell)}
        spans.append((events["start"], events["end"]))
    return spans


@pytest.mark.parametrize("lanes", [1, 2])
def test_lanes_run_cells_side_by_side(tmp_path, fake, lanes):
    r = seeds_py(
        tmp_path,
        fake,
        *("--methods", "grpo,tigpo", "--seeds", "3", "--lanes", str(lanes)),
        env={"FAKE_SLEEP": "0.15"},
    )
    assert r.returncode == 0, r.stderr
    (a0, a1), (b0, b1) = intervals(tmp_path, ["grpo-seed3", "tigpo-seed3"])  # ~0.6 s each
    overlap = a0 < b1 and b0 < a1
    assert overlap == (lanes == 2)


def test_sigterm_stops_the_children_and_the_matrix_resumes(tmp_path, fake):
    cmd = [sys.executable, SEEDS, "--out", str(tmp_path / "runs"), "--results"]
    cmd += [str(tmp_path / "results"), "--trainer", fake, "--methods", "grpo,tigpo"]
    cmd += ["--seeds", "4", "--lanes", "2", "--", "--updates", "4"]
    env = dict(os.environ, FAKE_SLEEP="0.5")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cells = ["grpo-seed4", "tigpo-seed4"]
    deadline = time.time() + 20
    while time.time() < deadline:  # both children past update 2: each has a checkpoint
        if all(os.path.isdir(tmp_path / "runs" / c / "checkpoints") for c in cells):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "stopped: 2 cell(s) left" in err
    for cell in cells:
        events = [c["event"] for c in calls(tmp_path, cell)]
        assert events == ["start", "sigterm"]
        pid = calls(tmp_path, cell)[0]["pid"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(tmp_path / "results")
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("resumed from its checkpoint") == 2
    for cell in cells:
        method = cell.split("-")[0]
        rows = read_jsonl(tmp_path / "results" / method / "seed4" / "metrics.jsonl")
        assert rows == expected_metrics(4, cell)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--methods", "grpo,tigpo-fast", "--seeds", "1"), "unknown method 'tigpo-fast'"),
        (("--methods", "grpo", "--seeds", "1,x"), "'x' is not a seed or a range"),
        (("--methods", "grpo", "--seeds", "1,1"), "a seed appears twice"),
        (("--methods", "grpo", "--seeds", "1", "--", "--seed", "3"), "--seed after `--`"),
    ],
)
def test_bad_matrix_is_a_one_line_error(tmp_path, fake, flags, message):
    r = seeds_py(tmp_path, fake, *flags, extra=())
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert r.stderr.startswith("bench/seeds.py: error:")
    assert not os.path.exists(tmp_path / "runs")


# ---------------------------------------------------------------------------------------------
# bench/compare.py on a hand-made results folder
# ---------------------------------------------------------------------------------------------

# (before, after) per seed. tigpo gains 0.40, 0.50, 0.30; grpo 0.20, 0.10, 0.10; gigpo (no
# seed 3) 0.40, 0.20.
HAND = {
    "tigpo": {1: (0.1, 0.5), 2: (0.2, 0.7), 3: (0.3, 0.6)},
    "grpo": {1: (0.1, 0.3), 2: (0.2, 0.3), 3: (0.3, 0.4)},
    "gigpo": {1: (0.1, 0.5), 2: (0.2, 0.4)},
}


def write_results(folder, hand, updates=10):
    for method, seeds in hand.items():
        for seed, (before, after) in seeds.items():
            cell = folder / method / f"seed{seed}"
            cell.mkdir(parents=True)
            config = {"algo": method, "seed": seed, "updates": updates, "preset": "cpu"}
            (cell / "config.json").write_text(json.dumps(config))
            rows = [{"update": 0, "eval/train/success_rate": before, "eval/train/episodes": 32}]
            rows += [{"update": u, "success_rate": 0.5} for u in range(1, updates)]
            rows += [
                {"update": updates, "eval/train/success_rate": after, "eval/train/episodes": 32}
            ]
            (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def compare_py(*flags):
    cmd = [sys.executable, COMPARE, *map(str, flags)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def compare_module():
    """bench/compare.py imported, for what needs no subprocess (the figure's matplotlib import
    alone takes ~1 s, so only one test draws it)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import compare

    return compare


def table(folder):
    compare = compare_module()
    return compare.table(*compare.read_results(str(folder)), "tigpo")


def test_t_quantiles():
    compare = compare_module()
    assert compare.t975(1) == 12.7062 and compare.t975(7) == 2.3646 and compare.t975(30) == 2.0423
    # beyond the table, the expansion: scipy's t.ppf(0.975, df) for df 40, 60, 120
    for df, exact in ((40, 2.021075), (60, 2.000298), (120, 1.979930)):
        assert abs(compare.t975(df) - exact) < 1e-4


def test_compare_table_numbers_worked_by_hand(tmp_path):
    write_results(tmp_path / "results", HAND)
    r = compare_py(tmp_path / "results", "--out", tmp_path / "fig.png")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "<!-- comparison:start -->" and lines[-1] == "<!-- comparison:end -->"
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    # n = 3, t_{0.975, 2} = 4.3027, half width = 4.3027 * s / sqrt(3)
    # tigpo: before 0.2 (s 0.1: +- 0.248), after 0.6 (s 0.1), gain 0.4 (s 0.1)
    assert rows["tigpo"] == (
        "| tigpo | 3 | 0.20 [-0.05, 0.45] | 0.60 [0.35, 0.85] | +0.40 [+0.15, +0.65] "
        "| (reference) |  |"
    )
    # grpo: after 0.333 (s 0.0577: +- 0.143), gain 0.133 (s 0.0577);
    # paired tigpo - grpo: 0.2, 0.4, 0.2 -> 0.267 (s 0.1155: +- 0.287), ahead on all three
    assert rows["grpo"] == (
        "| grpo | 3 | 0.20 [-0.05, 0.45] | 0.33 [0.19, 0.48] | +0.13 [-0.01, +0.28] "
        "| +0.27 [-0.02, +0.55] | 3 / 0 / 0 |"
    )
    # gigpo: 2 seeds (flagged); n = 2, t_{0.975, 1} = 12.7062, half = 12.7062 * s / sqrt(2)
    # before 0.15 (s 0.0707: +- 0.635), after 0.45 (s 0.0707), gain 0.30 (s 0.1414: +- 1.271);
    # paired: 0.0, 0.3 -> 0.15 (s 0.2121: +- 1.906), level on seed 1, ahead on seed 2
    assert rows["gigpo"] == (
        "| gigpo | 2 of 3 ⚠ | 0.15 [-0.49, 0.79] | 0.45 [-0.19, 1.09] | +0.30 [-0.97, +1.57] "
        "| +0.15 [-1.76, +2.06] | 1 / 1 / 0 |"
    )
    assert [m for m in rows if m != "method" and not m.startswith("-")] == [
        "grpo",
        "gigpo",
        "tigpo",
    ]
    assert "95 % Student-t interval over seeds" in r.stdout
    assert "⚠ gigpo: fewer seeds than the others, no 3." in lines
    assert "No results for: graphgpo, tigpo-no-revisit, tigpo-no-ct." in lines
    assert "Each eval: 32 episodes. Seeds: 1, 2, 3." in lines
    assert os.path.getsize(tmp_path / "fig.png") > 10_000


def test_compare_reports_cells_it_leaves_out_and_config_differences(tmp_path):
    write_results(tmp_path / "results", HAND)
    torn = tmp_path / "results" / "grpo" / "seed3" / "metrics.jsonl"
    torn.write_text("".join(torn.read_text().splitlines(keepends=True)[:5]))
    config = tmp_path / "results" / "tigpo" / "seed1" / "config.json"
    config.write_text(json.dumps({"algo": "tigpo", "seed": 1, "updates": 10, "preset": "paper"}))
    out = table(tmp_path / "results")
    assert "Left out: grpo seed 3, not finished (last line: update 4 of 10)." in out
    assert "| grpo | 2 of 3 ⚠ |" in out
    assert '⚠ The cells\' config.json differ beyond method and seed: preset ("cpu" / "paper").' in (
        out
    )


def test_compare_names_each_seeds_machine_and_flags_a_seed_with_two_starts(tmp_path):
    write_results(tmp_path / "results", HAND)
    for cell in (tmp_path / "results").glob("*/seed*"):
        config = json.loads((cell / "config.json").read_text())
        machine = "Xeon" if cell.name == "seed3" else "EPYC"
        config["versions"] = {"torch": "2.13.0+cpu", "device": machine}
        (cell / "config.json").write_text(json.dumps(config))
    out = table(tmp_path / "results")
    assert "Machines (config.json's versions.device): EPYC: seeds 1, 2; Xeon: seed 3." in out
    assert "⚠ seed" not in out and "differ beyond method and seed" not in out
    # grpo's seed 3 on another machine kind: another warm start, so another eval before RL
    cell = tmp_path / "results" / "grpo" / "seed3"
    config = json.loads((cell / "config.json").read_text())
    config["versions"]["device"] = "EPYC"
    (cell / "config.json").write_text(json.dumps(config))
    rows = (cell / "metrics.jsonl").read_text().splitlines(keepends=True)
    rows[0] = rows[0].replace('"eval/train/success_rate": 0.3', '"eval/train/success_rate": 0.1')
    (cell / "metrics.jsonl").write_text("".join(rows))
    out = table(tmp_path / "results")
    assert "EPYC: seeds 1, 2; EPYC / Xeon: seed 3." in out
    assert (
        "⚠ seed 3: its cells differ in machines (EPYC: grpo; Xeon: tigpo): its paired "
        "differences compare different warm starts." in out
    )
    assert "⚠ seed 3: its cells differ in evals before RL (0.10: grpo; 0.30: tigpo)" in out
    # a version other than the machine is a difference of the preset's arithmetic, flagged
    config["versions"]["torch"] = "2.14.1+cpu"
    (cell / "config.json").write_text(json.dumps(config))
    assert "differ beyond method and seed: versions (" in table(tmp_path / "results")


def test_compare_tells_machine_kinds_apart_by_their_recorded_kernel_flags(tmp_path):
    write_results(tmp_path / "results", HAND)
    for cell in (tmp_path / "results").glob("*/seed*"):
        config = json.loads((cell / "config.json").read_text())
        flags = "amx_bf16 avx512_bf16" if cell.name == "seed3" else "avx512_bf16"
        config["versions"] = {"torch": "2.13.0+cpu", "device": "Xeon", "cpu_flags": flags}
        (cell / "config.json").write_text(json.dumps(config))
    out = table(tmp_path / "results")
    assert (
        "Machines (config.json's versions.device (cpu_flags)): Xeon (avx512_bf16): seeds 1, 2; "
        "Xeon (amx_bf16 avx512_bf16): seed 3." in out
    )
    assert "⚠ seed" not in out and "differ beyond method and seed" not in out
    cell = tmp_path / "results" / "grpo" / "seed3"
    config = json.loads((cell / "config.json").read_text())
    config["versions"]["cpu_flags"] = "avx512_bf16"  # one model name, another kind
    (cell / "config.json").write_text(json.dumps(config))
    out = table(tmp_path / "results")
    assert "⚠ seed 3: its cells differ in machines (Xeon (amx_bf16 avx512_bf16): tigpo; " in out
    assert "differ beyond method and seed" not in out


def test_compare_check_readme(tmp_path):
    write_results(tmp_path / "results", HAND)
    block = table(tmp_path / "results")
    readme = tmp_path / "README.md"
    readme.write_text(f"# tigpo\n\nsome text\n\n{block}\nmore text\n")
    r = compare_py(tmp_path / "results", "--check", readme)
    assert r.returncode == 0, r.stderr
    readme.write_text(f"# tigpo\n\n{block.replace('+0.27', '+0.28')}\n")
    r = compare_py(tmp_path / "results", "--check", readme)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "comparison block differs" in r.stderr
    readme.write_text("# tigpo\n")
    r = compare_py(tmp_path / "results", "--check", readme)
    assert r.returncode == 1 and "has no <!-- comparison:start -->" in r.stderr


def test_every_seed_pools_the_sets_and_reads_the_bar_worked_by_hand(tmp_path):
    """bench/every_seed.py: per set and pooled, the bar's three terms, the shuffle test between
    sets and the share of drawn sets of 8 that meet the bar, on numbers worked by hand."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import every_seed

    # set a: gains +0.4, +0.5 (mean +0.45, both rise); set b: +0.3 and 0.0 (a flat run)
    write_results(tmp_path / "a", {"tigpo": {1: (0.1, 0.5), 2: (0.2, 0.7)}})
    write_results(tmp_path / "b", {"tigpo": {3: (0.3, 0.6), 4: (0.2, 0.2)}})
    # seed 3 wins no training episode in updates 4-8: 5 in a row after update 2, the bar's stall
    metrics = tmp_path / "b" / "tigpo" / "seed3" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in rows:
        if 4 <= r["update"] <= 8:
            r["success_rate"] = 0.0
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = every_seed.read_set(str(tmp_path / "a"), "tigpo")
    b = every_seed.read_set(str(tmp_path / "b"), "tigpo")
    assert [r["stretch"] for r in a + b] == [0, 0, 5, 0]
    assert every_seed.meets_bar(a) and not every_seed.meets_bar(b)
    assert not every_seed.meets_bar(b[:1])  # rises +0.30, but the stall
    assert every_seed.longest_stretch([{"update": u, "success_rate": 0.0} for u in range(6)]) == 3


def test_every_seed_prints_the_table_and_the_draws(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import every_seed

    write_results(tmp_path / "a", {"tigpo": {1: (0.1, 0.5), 2: (0.2, 0.7)}})
    write_results(tmp_path / "b", {"tigpo": {3: (0.3, 0.6), 4: (0.2, 0.2)}})
    every_seed.main([str(tmp_path / "a"), str(tmp_path / "b"), "--draws", "4000"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line for line in out.splitlines() if line.startswith("| ")}
    # a: n = 2, gain 0.45 (s 0.0707: +- 12.7062 * 0.05 = 0.635)
    assert rows["a"] == "| a | 2 | 0.15 → 0.60 | +0.45 [-0.19, +1.09] | 2 of 2 | 0 | — | yes |"
    # b: gains 0.3, 0.0: mean 0.15 (s 0.2121: +- 1.906); one flat run, so the bar is not met
    assert rows["b"] == "| b | 2 | 0.25 → 0.40 | +0.15 [-1.76, +2.06] | 1 of 2 | 0 | — | no |"
    # pooled: 0.4, 0.5, 0.3, 0.0 -> 0.30 (s 0.2160: t_{0.975,3} 3.1824 * 0.1080 = 0.344)
    assert rows["all 2 sets"].startswith("| all 2 sets | 4 | 0.20 → 0.50 | +0.30 [-0.04, +0.64] |")
    assert "rises 3 of 4." in out
    # a drawn set of 8 meets the bar if it holds no flat run (every other gain is >= +0.30):
    # (3/4)^8 = 10.0 %, up to the draws' own error (4000 draws: +- 0.5 %)
    share = float(out.split("meet the bar")[1].split(" in ")[1].split("%")[0])
    assert abs(share - 100 * 0.75**8) < 1.5
    # 4 runs into two sets of two: 3 partitions, equally likely; the measured one (0.45 against
    # 0.15) is the most spread of them, so p is 1/3
    p = float(out.split("p = ")[1].split(" ")[0])
    assert abs(p - 1 / 3) < 0.03
