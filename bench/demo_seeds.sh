#!/usr/bin/env bash
# The CPU demo (the README's first command, `python train.py --env alfworld`) on several seeds and
# algorithms, one run after the other on a 2-core machine, each timed with /usr/bin/time -v.
#
#   bash bench/demo_seeds.sh runs/demo "11 12 13 14 15" "tigpo grpo"     # ~13 min per run alone
#   python bench/demo_results.py runs/demo                                # tables + bench/demo_results.png
#
# Extra arguments after the third are passed to train.py (e.g. --rollout-engine vllm). A finished run is
# skipped, so the script can be stopped and started again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/demo}
seeds=${2:-"11 12 13 14 15"}
algos=${3:-"tigpo grpo"}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
for seed in $seeds; do
  for algo in $algos; do
    run="$out/alfworld-$algo-seed$seed"
    if python -c "import json,sys; m=json.loads(open(sys.argv[1]).read().splitlines()[-1]); sys.exit(not (m['update'] > 0 and 'eval/train/success_rate' in m))" "$run/metrics.jsonl" 2>/dev/null; then
      echo "done already: $run"; continue
    fi
    rm -rf "$run"
    echo "$(date +%T) $run"
    /usr/bin/time -v -o "$out/time-$algo-seed$seed.txt" python train.py --env alfworld --algo "$algo" --seed "$seed" \
      --run-dir "$run" "$@" > "$out/log-$algo-seed$seed.txt" 2>&1
  done
done
