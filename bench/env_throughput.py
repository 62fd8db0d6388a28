"""bench/env_throughput.py: ALFWorld env steps/s, stock vs tigpo (docs/ALGORITHM.md "Environments").

Three measurements in one run, on the same games and the same action scripts:
  1. stock   : ALFWorld's own AlfredTWEnv(config).init_env(1) (textworld gym, unpatched), in a
               clean subprocess; it also records the scripts (seeded random walks over admissible
               actions) and every observation and admissible list it saw;
  2. tigpo   : envs.AlfWorldGame replaying those scripts in this process; every observation and
               admissible list must be identical to the stock ones;
  3. pool    : envs.EnvPool with --workers workers replaying --slots scripts at once.
Steps/s count env.step calls only (resets are reported apart). Usage:
  python bench/env_throughput.py [--data-dir DIR] [--games 6] [--steps 40] [--slots 8] [--workers 2]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def stock_run(data_dir, games, steps, seed):
    """Runs in a subprocess: the stock AlfredTWEnv path records scripts and times its steps."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    import envs

    config = {
        "env": {
            "goal_desc_human_anns_prob": 0,
            "task_types": [1, 2, 3, 4, 5, 6],
            "domain_randomization": False,
            "expert_type": "handcoded",
        },
        "dataset": {
            "data_path": os.path.join(data_dir, "json_2.1.1", "train"),
            "num_train_games": -1,
        },
        "general": {"training_method": "dqn"},
        "rl": {"training": {"max_nb_steps_per_episode": 10 * steps}},
    }
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # AlfredTWEnv prints; stdout carries the JSON
    env = AlfredTWEnv(config, train_eval="train").init_env(batch_size=1)
    sys.stdout = real_stdout
    rng = random.Random(seed)
    records, step_time, reset_time = [], 0.0, 0.0
    for _ in range(games):
        t = time.perf_counter()
        obs, infos = env.reset()
        reset_time += time.perf_counter() - t
        rec = {
            "gamefile": infos["extra.gamefile"][0],
            "commands": [],
            "obs": [obs[0].replace(envs.BANNER, "").strip()],
            "admissible": [[a for a in infos["admissible_commands"][0] if a != "help"]],
        }
        for _ in range(steps):
            command = rng.choice(rec["admissible"][-1])
            t = time.perf_counter()
            obs, _, dones, infos = env.step([command])
            step_time += time.perf_counter() - t
            rec["commands"].append(command)
            rec["obs"].append(obs[0].strip())
            rec["admissible"].append([a for a in infos["admissible_commands"][0] if a != "help"])
            if dones[0]:
                break
        records.append(rec)
    env.close()
    n = sum(len(r["commands"]) for r in records)
    return {"records": records, "steps": n, "step_s": step_time, "reset_s": reset_time}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir", default=None, help="folder with json_2.1.1 (default: generate 6 games)"
    )
    parser.add_argument("--games", type=int, default=6, help="episodes on the stock path")
    parser.add_argument("--steps", type=int, default=40, help="max steps per episode")
    parser.add_argument("--slots", type=int, default=8, help="envs stepped together in the pool")
    parser.add_argument("--workers", type=int, default=2, help="pool worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stock-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stock_only:
        print(json.dumps(stock_run(args.data_dir, args.games, args.steps, args.seed)))
        return

    import envs

    data_dir = args.data_dir
    if data_dir is None:  # removed at the end
        data_dir = tempfile.mkdtemp(prefix="tigpo-bench-")
        t = time.perf_counter()  # in a subprocess: generating here would warm our memo of the games
        subprocess.run(
            [
                sys.executable,
                "-m",
                "extras.alfworld_gen",
                data_dir,
                "--num-train",
                "6",
                "--num-eval",
                "0",
                "--seed",
                str(args.seed),
            ],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        print(f"generated 6 games in {time.perf_counter() - t:.1f} s -> {data_dir}")

    # 1. stock, in a clean process (our parse memo is process-wide and must not help it)
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--stock-only",
            "--data-dir",
            data_dir,
            "--games",
            str(args.games),
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    stock = json.loads(out.stdout)
    records = stock["records"]

    # 2. tigpo single env, same scripts; observations must match the stock ones exactly
    step_time = reset_time = 0.0
    mismatches = 0
    for rec in records:
        t = time.perf_counter()  # load + reset, as the stock reset loads the game too
        game = envs.AlfWorldGame(rec["gamefile"], max_steps=10 * args.steps)
        obs, info = game.reset()
        reset_time += time.perf_counter() - t
        mismatches += (obs, info["admissible"]) != (rec["obs"][0], rec["admissible"][0])
        for k, command in enumerate(rec["commands"]):
            t = time.perf_counter()
            obs, _, _, info = game.step(command)
            step_time += time.perf_counter() - t
            mismatches += (obs, info["admissible"]) != (rec["obs"][k + 1], rec["admissible"][k + 1])
        game.close()
    ours = {"steps": stock["steps"], "step_s": step_time, "reset_s": reset_time}

    # 3. the pool: --slots envs at once, scripts cycled over the slots
    root = os.path.join(data_dir, "json_2.1.1")
    slots = [records[j % len(records)] for j in range(args.slots)]
    tasks = [os.path.relpath(r["gamefile"], root).replace(os.sep, "/") for r in slots]
    pool = envs.EnvPool(
        envs.AlfWorldEnv, num_workers=args.workers, data_dir=data_dir, max_steps=10 * args.steps
    )
    t = time.perf_counter()
    pool.reset(tasks)
    pool_reset = time.perf_counter() - t
    t, n = time.perf_counter(), 0
    for k in range(max(len(r["commands"]) for r in slots)):
        actions = [r["commands"][k] if k < len(r["commands"]) else None for r in slots]
        pool.step(actions)
        n += sum(a is not None for a in actions)
    pool_s = time.perf_counter() - t
    pool.close()

    rate = {
        "stock": stock["steps"] / stock["step_s"],
        "tigpo": ours["steps"] / ours["step_s"],
        "pool": n / pool_s,
    }
    print(f"\n{'path':<34}{'steps':>7}{'steps/s':>10}{'reset s/game':>14}")
    print(
        f"{'stock AlfredTWEnv (1 env)':<34}{stock['steps']:>7}{rate['stock']:>10.1f}"
        f"{stock['reset_s'] / len(records):>14.2f}"
    )
    print(
        f"{'tigpo AlfWorldGame (1 env)':<34}{ours['steps']:>7}{rate['tigpo']:>10.1f}"
        f"{ours['reset_s'] / len(records):>14.2f}"
    )
    print(
        f"{f'tigpo EnvPool ({args.workers} workers, {args.slots} envs)':<34}"
        f"{n:>7}{rate['pool']:>10.1f}"
        f"{pool_reset / args.slots:>14.2f}"
    )
    print(
        f"\nspeed-up tigpo/stock {rate['tigpo'] / rate['stock']:.2f}x, pool/stock "
        f"{rate['pool'] / rate['stock']:.2f}x, pool/tigpo {rate['pool'] / rate['tigpo']:.2f}x"
    )
    print(
        f"observation or admissible-list mismatches vs stock: {mismatches} "
        f"(over {ours['steps'] + len(records)} observations)"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other processes "
        "slow all rows)"
    )
    if args.data_dir is None:
        shutil.rmtree(data_dir)


if __name__ == "__main__":
    main()
