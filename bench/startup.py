"""bench/startup.py: how long `python train.py --help` takes beside a bare `import torch,
transformers`, measured side by side in one run (issue 39: --help within 1.5x of the bare import
plus a second).

    python bench/startup.py            # 5 rounds, each command once per round, interleaved
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {
    "import torch, transformers": [sys.executable, "-c", "import torch, transformers"],
    "train.py --help": [sys.executable, os.path.join(ROOT, "train.py"), "--help"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    seconds = {name: [] for name in COMMANDS}
    for _ in range(a.rounds + 1):  # the first round fills the page cache
        for name, command in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            seconds[name].append(time.perf_counter() - t0)
    bare, help_ = (statistics.median(seconds[name][1:]) for name in COMMANDS)
    for name in COMMANDS:
        print(f"{name:28s} median {statistics.median(seconds[name][1:]):.2f} s ({a.rounds} runs)")
    limit = 1.5 * bare + 1.0
    print(f"--help / bare import: {help_ / bare:.2f}x; the limit 1.5 x bare + 1 s = {limit:.2f} s")


if __name__ == "__main__":
    main()
