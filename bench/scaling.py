"""bench/scaling.py: end-to-end training throughput (env steps per second) on 1 rank and on N ranks
under torchrun, with the same settings, and their ratio.

Each configuration is a short train.py run (the first update is a warm-up and is not counted);
env steps/s = trained samples / (rollout + advantage + update seconds), summed over the counted
updates. On CUDA each rank takes a GPU (NCCL); on a CPU machine the ranks share its cores (gloo), so
expect little: the cores that one process used are now split between two.

    python bench/scaling.py                       # SmolLM2 (packaged), 1 vs 2 ranks
    python bench/scaling.py --ranks 8 --model Qwen/Qwen2.5-1.5B-Instruct --preset paper
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(ranks, a, folder):
    run_dir = os.path.join(folder, f"ranks{ranks}")
    flags = ["--env", "alfworld", "--preset", a.preset, "--updates", str(a.updates), "--num-groups", str(a.groups),
             "--group-size", str(a.group_size), "--revisit-groups", "0", "--max-steps", str(a.steps),
             "--warmup-epochs", "0", "--eval-every", "0", "--save-every", str(a.updates), "--run-dir", run_dir]
    if a.model:
        flags += ["--model", a.model]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    out = subprocess.run(launcher + [os.path.join(ROOT, "train.py"), *flags], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"bench/scaling.py: the {ranks}-rank run failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if json.loads(line)["update"] > 1]   # update 1: warm-up
    seconds = sum(r["rollout_s"] + r["adv_s"] + r["update_s"] for r in rows)
    samples = sum(r["num_samples"] for r in rows)
    return samples / seconds, samples, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the preset's")
    parser.add_argument("--preset", default="cpu", choices=("cpu", "paper"))
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4, help="B (the global batch is the same for every N)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        one = measure(1, a, folder)
        many = measure(a.ranks, a, folder)
    print(f"B={a.groups} x K={a.group_size}, {a.steps} steps, updates 2..{a.updates} counted:")
    for ranks, (rate, samples, seconds) in ((1, one), (a.ranks, many)):
        print(f"  {ranks} rank(s): {rate:6.2f} env steps/s ({samples} steps in {seconds:.0f} s)")
    print(f"  ratio {a.ranks} ranks / 1 rank: {many[0] / one[0]:.2f}x")


if __name__ == "__main__":
    main()
