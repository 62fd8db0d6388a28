#!/usr/bin/env bash
# The CPU evidence in the README ("CPU results"): the README's first command (the cpu preset) for
# seeds 0-2 with --algo tigpo and --algo grpo, one after the other on a 2-core machine (~1.5 hours
# quiet). Then: python bench/cpu_curves.py runs/cpu-evidence
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/cpu-evidence}
mkdir -p "$out"
for seed in 0 1 2; do
  for algo in tigpo grpo; do
    /usr/bin/time -v -o "$out/time-$algo-seed$seed.txt" python train.py --env alfworld --algo $algo --seed $seed \
      --run-dir "$out/alfworld-$algo-seed$seed" > "$out/log-$algo-seed$seed.txt" 2>&1
  done
done
