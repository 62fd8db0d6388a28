"""A run re-runs from its config.json (`python train.py --config PATH --run-dir NEW`, flags given
overriding it): config.json records what decides the arithmetic (the seed, torch's thread count,
the precision, the versions), and the same config on the same machine gives the same
metrics.jsonl apart from timings."""

import json
import os

import pytest
import torch
from test_train_e2e import TINY, read_jsonl, run_train

import train

pytestmark = pytest.mark.slow

# metrics that measure seconds, not what the run computed
TIMINGS = {"rollout_s", "adv_s", "update_s", "gen_tokens_per_s", "update_tokens_per_s"}


def without_timings(metrics):
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics]


def test_a_run_re_run_from_its_config_gives_the_same_metrics(tiny_model, alfworld_data, tmp_path):
    first, again, other = (str(tmp_path / name) for name in ("first", "again", "other"))
    flags = [*TINY, "--model", tiny_model, "--data-dir", alfworld_data, "--updates", "2"]
    run_train("--env", "alfworld", "--algo", "tigpo", "--seed", "3", *flags, "--run-dir", first)
    with open(os.path.join(first, "config.json")) as fh:
        config = json.load(fh)
    assert config["threads"] == 1  # OMP_NUM_THREADS=1 in the test's subprocess: resolved, kept
    assert config["seed"] == 3 and config["precision"] in ("fp32", "bf16")
    machine = {"device"} if torch.cuda.is_available() else {"device", "cpu_flags"}
    assert set(config["versions"]) == {"python", "torch", "transformers", *machine}
    run_train("--config", os.path.join(first, "config.json"), "--run-dir", again)
    want = read_jsonl(os.path.join(first, "metrics.jsonl"))
    got = read_jsonl(os.path.join(again, "metrics.jsonl"))
    assert len(want) == 2 and without_timings(got) == without_timings(want)
    assert any(m["update_s"] != n["update_s"] for m, n in zip(got, want))  # timings do differ
    # a flag given after --config overrides the saved value; the rest stand as saved
    args, resuming = train.parse_args(
        ["--config", os.path.join(first, "config.json"), "--seed", "4", "--run-dir", other]
    )
    kept = {k: v for k, v in vars(args).items() if k not in ("seed", "run_dir", "config")}
    assert args.seed == 4 and not resuming and all(config[k] == v for k, v in kept.items())


def test_config_errors_are_one_line(tmp_path):
    missing = run_train("--config", str(tmp_path / "nope.json"), check=False)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    torn = tmp_path / "torn.json"
    torn.write_text('{"seed": ')
    broken = run_train("--config", str(torn), "--run-dir", str(tmp_path / "r"), check=False)
    assert broken.returncode == 2 and "not a whole config.json" in broken.stderr


def test_config_warns_only_where_a_recorded_version_differs(tmp_path, capsys):
    now = train.versions()
    path = tmp_path / "config.json"
    older = {k: v for k, v in now.items() if k != "cpu_flags"}  # before cpu_flags was recorded
    for recorded, warned in ((now, False), (older, False), ({**now, "device": "Z"}, True)):
        path.write_text(json.dumps({"seed": 5, "versions": recorded}))
        assert train.saved_settings(str(path))["seed"] == 5
        assert ("recorded with" in capsys.readouterr().out) is warned


def test_a_config_from_before_a_flag_existed_re_runs_with_the_flag_off(tmp_path):
    # issue 38's cells were recorded before --lr-ramp-updates; the CPU preset now ramps over 3
    # updates, and a re-run of such a cell must run as it ran: without a ramp
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"env": "alfworld", "preset": "cpu", "seed": 71, "lr": 5e-5}))
    args, _ = train.parse_args(
        ["--config", str(path), "--run-dir", str(tmp_path / "r")], cuda=False
    )
    assert (args.seed, args.lr, args.lr_ramp_updates) == (71, 5e-5, 0)
    fresh, _ = train.parse_args(["--env", "alfworld", "--run-dir", str(tmp_path / "f")], cuda=False)
    assert fresh.lr_ramp_updates == 3  # the preset's value, where no config.json is given


def test_the_warm_start_floor_continues_the_same_cloning(tiny_model, alfworld_data, tmp_path):
    """--warmup-floor: while eval on the training games before RL is below the floor, one more
    warm-start epoch, up to --warmup-max-epochs. The random tiny model never succeeds, so a
    floor of 0.5 runs all 3 epochs: then the run equals one of 3 plain warm-start epochs, metric
    for metric (the evals in between draw from their own RNG; the KL reference is the policy
    after the last epoch, not the one the floor first evaluated)."""
    flags = [*TINY, "--model", tiny_model, "--data-dir", alfworld_data, "--updates", "1"]
    flags += ["--eval-every", "1", "--eval-splits", "train", "--eval-tasks", "1"]
    floor = str(tmp_path / "floor")
    plain = str(tmp_path / "plain")
    proc = run_train(
        *flags,
        "--warmup-epochs",
        "1",
        "--warmup-floor",
        "0.5",
        "--warmup-max-epochs",
        "3",
        "--run-dir",
        floor,
    )
    assert proc.stdout.count("< --warmup-floor 0.5") == 2
    assert "warm start: epoch 3, loss" in proc.stdout
    run_train(*flags, "--warmup-epochs", "3", "--warmup-floor", "0", "--run-dir", plain)
    got = without_timings(read_jsonl(os.path.join(floor, "metrics.jsonl")))
    want = without_timings(read_jsonl(os.path.join(plain, "metrics.jsonl")))
    assert got[0].pop("warmup_epochs") == 3 and got[1]["kl"] is not None
    assert got == want
