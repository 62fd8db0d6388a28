"""bench/gpu_check.py: a one-shot check of the paper path on one CUDA GPU, in under 5 minutes.

Runs a few updates of `--preset paper` shrunk in steps and groups (bf16 autocast, several optimizer
steps per update, the think format), with the paper model when it is available locally, else the
model named by --model, and prints: seconds per update split into rollout / advantage / update,
generated tokens/s, update tokens/s, peak GPU memory, clip fraction, the sampler/trainer log-prob
gap (rollout_logprob_gap, mean and max), KL at update 1, and whether any value was non-finite.
Exits non-zero when a check fails, and with one line when there is no CUDA device.

    python bench/gpu_check.py                                   # Qwen/Qwen2.5-1.5B-Instruct if cached
    python bench/gpu_check.py --rollout-engine vllm             # the same with vLLM rollouts
    python bench/gpu_check.py --model /path/to/local/model --updates 3
"""
import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--run-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--rollout-engine", default="hf", choices=("hf", "vllm"))
    a = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_check.py: no CUDA device visible; run it on a machine with one GPU")
    import train
    run_dir = a.run_dir or os.path.join(tempfile.mkdtemp(prefix="tigpo-gpu-check-"), "run")
    argv = ["--env", "alfworld", "--preset", "paper", "--model", a.model, "--updates", str(a.updates),
            "--num-groups", "4", "--revisit-groups", "2", "--revisit-delay", "1", "--group-size", "4",
            "--max-steps", "8", "--max-new-tokens", "256", "--minibatch-size", "32", "--eval-every", "0",
            "--save-every", str(a.updates), "--num-env-workers", "8", "--run-dir", run_dir,
            "--rollout-engine", a.rollout_engine]
    args, resuming = train.parse_args(argv)
    torch.cuda.reset_peak_memory_stats()
    train.run(args, resuming)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        metrics = [json.loads(line) for line in fh if json.loads(line)["update"] > 0]
    print(f"\n{a.model} on {torch.cuda.get_device_name()}, {a.rollout_engine} rollouts, {a.updates} updates of "
          f"B=4 x K=4, 8 steps")
    print("update | rollout s | adv s | update s | gen tok/s | update tok/s | opt steps | clip frac | gap mean | "
          "gap max | KL")
    for m in metrics:
        print(f"{m['update']:6d} | {m['rollout_s']:9.1f} | {m['adv_s']:5.2f} | {m['update_s']:8.1f} | "
              f"{m['gen_tokens_per_s']:9.0f} | {m['update_tokens_per_s']:12.0f} | {m['optimizer_steps']:9d} | "
              f"{m['clip_frac']:9.4f} | {m['rollout_logprob_gap']:8.2e} | {m['rollout_logprob_gap_max']:7.2e} | "
              f"{m['kl']:.2e}")
    print(f"peak GPU memory {peak_gib:.1f} GiB")
    numbers = [v for m in metrics for v in m.values() if isinstance(v, float)]
    checks = {"every metric finite": all(math.isfinite(v) for v in numbers),
              "sampler and trainer agree (mean log-prob gap < 0.05)": all(m["rollout_logprob_gap"] < 0.05
                                                                          for m in metrics),
              "KL at update 1 is small (< 1e-2)": metrics[0]["kl"] is not None and metrics[0]["kl"] < 1e-2,
              "several optimizer steps per update": all(m["optimizer_steps"] > 1 for m in metrics)}
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
