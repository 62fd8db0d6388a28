"""torchrun on CPU (gloo), 2 ranks, tiny model: the data-parallel update equals one process holding
every sample; a 2-rank run trains, logs once, keeps replicas identical, checkpoints and resumes;
the advantages each rank's loss sees are compute_advantages' on the gathered batch; a rank that
dies stops the job with the rank named, and --resume continues."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from test_train_e2e import TINY, read_jsonl

import tigpo

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HELPER = os.path.join(ROOT, "tests", "dist_grad.py")
TEARDOWN_ABORT = "terminate called without an active exception"


@pytest.fixture(scope="module")
def one_process_steps(tmp_path_factory):
    """dist_grad.py's steps in one process holding every sample: the reference of both modes."""
    single = str(tmp_path_factory.mktemp("one-process") / "one.pt")
    subprocess.run([sys.executable, HELPER, single], check=True, env=ENV, timeout=300, cwd=ROOT)
    return single


@pytest.mark.parametrize("mode", ["replicas", "fsdp"])
def test_two_ranks_take_the_same_optimizer_steps_as_one_process(one_process_steps, tmp_path, mode):
    helper, single, double = HELPER, one_process_steps, str(tmp_path / "two.pt")
    command = TORCHRUN + [helper, double] + (["--fsdp"] if mode == "fsdp" else [])
    run = dict(env=ENV, timeout=300, cwd=ROOT, capture_output=True, text=True)
    out = subprocess.run(command, **run)
    if out.returncode != 0 and TEARDOWN_ABORT in out.stderr:
        # Seen once in CI (the replicas job; 8 of 8 reruns of it passed here): a rank aborted at
        # exit by a C++ thread left joinable, after destroy_process_group. The job runs again
        # once, visibly; any other failure, a second abort or a wrong step still fails the test.
        warnings.warn(f"torchrun {mode}: a rank aborted at teardown; ran it again", stacklevel=1)
        out = subprocess.run(command, **run)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = torch.load(single), torch.load(double)
    assert a["stats"]["optimizer_steps"] == b["stats"]["optimizer_steps"] == 3
    for name, step in a["steps"].items():
        assert step.abs().max() > 0 or "embed" in name
        assert torch.allclose(step, b["steps"][name], rtol=1e-4, atol=1e-7), name
    for key in ("loss", "pg_loss", "kl", "clip_frac"):
        assert b["stats"][key] == pytest.approx(a["stats"][key], rel=1e-5, abs=1e-9), key


def torchrun_train(*argv, check=True):
    proc = subprocess.run(
        TORCHRUN + [os.path.join(ROOT, "train.py"), *argv],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun train.py failed:\n{proc.stderr[-4000:]}")
    return proc


def test_two_rank_run_logs_once_keeps_replicas_equal_survives_a_dead_rank_and_resumes(
    tiny_model, alfworld_data, tmp_path
):
    """A 2-rank run that loses rank 1 after its first checkpoint: the job stops non-zero with the
    rank named; --resume finishes it; rank 0 alone wrote one line per update, the replicas stayed
    identical, and every sample's loss saw compute_advantages' value on the gathered batch."""
    run_dir = str(tmp_path / "run")
    common = [
        "--model",
        tiny_model,
        "--data-dir",
        alfworld_data,
        "--run-dir",
        run_dir,
        *TINY,
        "--minibatch-size",
        "5",
    ]
    proc = subprocess.Popen(
        TORCHRUN + [os.path.join(ROOT, "train.py"), "--updates", "3", *common],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = os.path.join(run_dir, "checkpoints", "update_000001")  # renamed into place: whole
    deadline = time.time() + 600
    while time.time() < deadline and not os.path.isdir(first):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    ranks = workers_of(proc.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGKILL)  # rank 1 dies mid-run
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0, err[-3000:]
    assert "rank: 1" in err or "rank 1" in err, err[-3000:]
    torchrun_train("--resume", "--updates", "3", "--run-dir", run_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["update"] for m in metrics] == [1, 2, 3]  # rank 0 alone writes, lost work redone
    assert all(m["replica_drift"] == 0.0 for m in metrics)  # identical weights
    assert all(m["num_samples"] > 0 and m["optimizer_steps"] >= 1 for m in metrics)
    with open(os.path.join(run_dir, "checkpoints", "update_000003", "state.json")) as fh:
        assert len(json.load(fh)["rng_ranks"]) == 2  # each rank's sampling stream
    check_loss_advantages(run_dir)


def test_fsdp_run_shards_checkpoints_a_plain_model_and_resumes(tiny_model, alfworld_data, tmp_path):
    run_dir = str(tmp_path / "fsdp")
    common = [
        "--model",
        tiny_model,
        "--data-dir",
        alfworld_data,
        "--run-dir",
        run_dir,
        *TINY,
        "--minibatch-size",
        "5",
        "--fsdp",
        "--precision",
        "bf16",
    ]
    # the warm start with a KL term: the reference is the warm-started policy on every rank, copied
    # from the shards in memory (no rank reads a folder another is still writing); --bc-coef: each
    # rank adds its share of the expert steps to every update, the resumed run too
    proc = torchrun_train("--updates", "1", *common, "--warmup-epochs", "1", "--bc-coef", "1")
    experts = int(proc.stdout.split(" expert steps join")[0].split()[-1])
    assert os.path.isdir(os.path.join(run_dir, "warmstart"))  # the reference of a resumed run
    torchrun_train("--resume", "--updates", "2", "--run-dir", run_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["update"] for m in metrics] == [1, 2]
    # over both ranks: one sample per env step, and every expert step once
    got = [(m["num_samples"], m["episode_len"], m["episodes"]) for m in metrics]
    assert all(n == round(length * eps) + experts for n, length, eps in got), (experts, got)
    assert all(m["optimizer_steps"] > 1 and m["rollout_logprob_gap"] < 0.05 for m in metrics)
    assert all(m["kl"] is not None and m["kl"] >= 0.0 for m in metrics)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(run_dir, "checkpoints", "update_000002")
    )
    assert model.config.num_hidden_layers == 2  # gathered: a whole, plain model


def test_two_ranks_each_sample_with_their_own_vllm_engine_and_resume(
    tiny_vllm_model, alfworld_data, tmp_path
):
    """--rollout-engine vllm under torchrun: one colocated engine per rank (vLLM joins the
    trainer's gloo world), each sampling its rank's episodes and synced and verified after every
    update. lr 1e-3 moves the policy past the fp32 tolerance at every step, so each rank's gap at
    update 2 is small only if its engine took update 1's weights (checked by hand: with the sync
    and its checks made no-ops, update 2's gaps were 0.012 and 0.037 against ~2e-6); then
    --resume to 3."""
    from extras import vllm_engine

    if not vllm_engine.available():
        pytest.skip("vLLM is not installed (pip install --no-deps -r extras/requirements-vllm.txt)")
    run_dir = str(tmp_path / "vllm")
    common = ["--model", tiny_vllm_model, "--data-dir", alfworld_data, "--run-dir", run_dir]
    common += [*TINY, "--rollout-engine", "vllm", "--precision", "fp32", "--lr", "1e-3"]
    torchrun_train("--updates", "2", *common)
    torchrun_train("--resume", "--updates", "3", "--run-dir", run_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["update"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        print(
            f"update {m['update']}: rollout_logprob_gap per rank {m['rollout_logprob_gap_ranks']}"
        )
        assert len(m["rollout_logprob_gap_ranks"]) == 2
        assert all(0 <= gap < 1e-3 for gap in m["rollout_logprob_gap_ranks"])
        assert m["rollout_logprob_gap_max"] < 1e-2 and m["sync_s"] > 0
        assert m["replica_drift"] == 0.0 and m["grad_norm"] > 0


def check_loss_advantages(run_dir):
    """Every sample of every rank got exactly compute_advantages' value on the gathered batch."""
    with open(os.path.join(run_dir, "config.json")) as fh:
        cfg = json.load(fh)
    for rec in read_jsonl(os.path.join(run_dir, "advantages.jsonl")):
        memory = tigpo.GraphMemory()
        memory.load_state_dict(rec["memory"])
        want = tigpo.compute_advantages(
            rec["groups"],
            cfg["algo"],
            memory,
            invalid_penalty=cfg["invalid_penalty"],
            graph_gamma=cfg["graph_gamma"],
            norm=cfg["norm"],
        )
        seen = {(g, j, t): a for g, j, t, a in rec["loss_advantages"]}
        steps = {
            (g, j, t)
            for g, grp in enumerate(want)
            for j, traj in enumerate(grp)
            for t in range(len(traj))
        }
        assert set(seen) == steps  # both ranks' samples, once each
        for (g, j, t), a in seen.items():
            assert a == want[g][j][t], (g, j, t)  # exactly what the sample trained with


def workers_of(pid):
    """PIDs of train.py processes below `pid`, with their RANK."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = dict(x.split(b"=", 1) for x in fh.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if (
            any(c.endswith(b"train.py") for c in cmd)
            and b"TORCHELASTIC_RUN_ID" in env
            and b"RANK" in env
            and int(entry) != pid
        ):
            out[int(env[b"RANK"])] = int(entry)
    return out
