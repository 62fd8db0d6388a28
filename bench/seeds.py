"""bench/seeds.py: the comparison matrix of issue 38, train.py once per (method, seed) cell, made
to survive the machine: it resumes where it stopped, runs N cells side by side, prints an ETA
for the whole matrix, and copies each finished cell's config.json and metrics.jsonl to a results
folder that can be committed (bench/compare.py reads it).

    python bench/seeds.py --out runs/compare --results results/comparison \\
        --methods grpo,gigpo,graphgpo,tigpo,tigpo-no-revisit,tigpo-no-ct --seeds 71-78 \\
        --lanes 2 --threads 1 [-- extra train.py flags]
    python bench/compare.py results/comparison

Each cell runs `python train.py --env alfworld <method's flags> --seed S --run-dir
<out>/<method>-seed<S> --threads T <extra flags>`, its output in <out>/log-<method>-seed<S>.txt,
its wall time appended to <out>/times.jsonl. Stopped (Ctrl-C, SIGTERM, a crash) and started
again with the same command: a finished cell is skipped, a torn cell with a checkpoint continues
with --resume (exactly: its metrics equal an uninterrupted run's), a torn cell without one is
deleted and started again. Standard library only (and extras/machine.py, which is too).
"""

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# method name -> the train.py flags that make it; everything else is the same for every cell
METHODS = {
    "grpo": ["--algo", "grpo"],
    "gigpo": ["--algo", "gigpo"],
    "graphgpo": ["--algo", "graphgpo"],
    "tigpo": ["--algo", "tigpo"],
    "tigpo-no-revisit": ["--algo", "tigpo", "--revisit-groups", "0"],  # persistent graph alone
    "tigpo-no-ct": ["--algo", "tigpo", "--no-cross-temporal"],  # no cross-temporal reference
}
ENV = "alfworld"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
sys.path.insert(0, ROOT)
from extras import machine  # noqa: E402  (the machine kind, as train.py records it)

# flags the runner sets itself: given again after `--` they would contradict the cell
OWN_FLAGS = {
    "--env",
    "--algo",
    "--seed",
    "--run-dir",
    "--resume",
    "--threads",
    "--revisit-groups",
    "--cross-temporal",
    "--no-cross-temporal",
    "--config",
}
POLL_S = 0.2  # how often running cells are checked; a cell takes minutes, so this costs nothing
GRACE_S = 120  # a stopped train.py gets this long to exit through its cleanup before SIGKILL


def say(text):
    print(text, flush=True)  # flushed: the runner usually writes to a file under nohup


def fail(text):
    sys.exit(f"bench/seeds.py: error: {text}")


# =================================================================================================
# The matrix and the state of each cell
# =================================================================================================


def parse_methods(text):
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        fail(f"unknown method {unknown[0]!r} in --methods; known: {', '.join(METHODS)}")
    if not methods or len(set(methods)) != len(methods):
        fail(f"--methods {text!r}: give each method once, comma-separated, e.g. grpo,tigpo")
    return methods


def parse_seeds(text):
    """'71,72,75' or '71-78' or both mixed ('71-74,80'): a list of distinct integers."""
    seeds = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            fail(f"--seeds {text!r}: {part!r} is not a seed or a range; use e.g. 71,72,73 or 71-78")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            fail(f"--seeds {text!r}: the range {part.strip()!r} runs backwards")
        seeds += range(first, last + 1)
    if len(set(seeds)) != len(seeds):
        fail(f"--seeds {text!r}: a seed appears twice")
    return seeds


def check_extra(extra):
    for token in extra:
        if token.split("=")[0] in OWN_FLAGS:
            fail(f"{token.split('=')[0]} after `--` is set by the runner for each cell; drop it")


def read_metrics(path):
    """metrics.jsonl's entries; a last line cut short (a kill while it was written) is left out,
    as train.py --resume drops it too."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            rows.append(json.loads(line))
    return rows


def finished(folder):
    """The cell in folder is complete: its last metrics line is the last update of its
    config.json and carries the eval on the training games that bench/compare.py needs."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            updates = json.load(fh)["updates"]
        rows = read_metrics(os.path.join(folder, "metrics.jsonl"))
    except (OSError, ValueError, KeyError):  # missing or cut short: the cell is not complete
        return False
    return bool(rows) and rows[-1]["update"] == updates and "eval/train/success_rate" in rows[-1]


def last_checkpoint(run_dir):
    """The update of the newest complete checkpoint (train.py writes checkpoints/update_NNNNNN
    atomically, so such a folder is whole), or None."""
    root = os.path.join(run_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    updates = [int(n.split("_")[1]) for n in names if re.fullmatch(r"update_\d+", n)]
    return max(updates) if updates else None


def plan(cell):
    """What the cell needs: 'done', 'resume' (torn, with a checkpoint), 'restart' (torn, none)
    or 'new', and a few words on why."""
    if finished(cell["run_dir"]):
        return "done", "finished"
    if finished(cell["results"]):  # the run folder was cleared, the committed copy is whole
        return "done", f"finished (in {cell['results']}; no run folder)"
    if not os.path.exists(cell["run_dir"]):
        return "new", "new"
    ckpt = last_checkpoint(cell["run_dir"])
    rows = read_metrics(os.path.join(cell["run_dir"], "metrics.jsonl"))
    last = f"last logged update {rows[-1]['update']}" if rows else "nothing logged"
    if ckpt is not None:
        return "resume", f"torn ({last}): resumed from its checkpoint of update {ckpt}"
    return "restart", f"torn ({last}, no checkpoint): deleted and started again"


def other_machines(cells, queue, here):
    """One line per seed that still has cells to run here while some of its cells finished on
    another machine kind than `here` (machine.cpu()): bf16 rounds differently there, so the
    seed's warm start differs and its pairs would compare different starts (bench/compare.py
    flags such a seed). A config.json from before cpu_flags was recorded is compared by model
    name alone."""
    todo = {cell["seed"] for cell, _ in queue}
    elsewhere = {}
    for cell in cells:
        if cell["seed"] not in todo or not finished(cell["results"]):
            continue
        try:
            with open(os.path.join(cell["results"], "config.json")) as fh:
                recorded = json.load(fh).get("versions", {})
        except (OSError, ValueError):
            continue
        if recorded.get("device") and any(
            recorded.get(key, value) != value for key, value in here.items()
        ):
            where = machine.label(recorded)
            elsewhere.setdefault(cell["seed"], []).append(f"{cell['method']} on {where}")
    return [
        f"note: seed {seed} has cells finished on another machine ({', '.join(done)}) and this "
        f"one is {machine.label(here)}: its cells run here start from another warm start; to "
        "keep a seed on one machine kind, run its remaining cells there, or move its finished "
        "ones aside"
        for seed, done in elsewhere.items()
    ]


def command(args, cell, resume):
    """The train.py command of one cell; a resumed cell repeats every flag, so train.py checks
    that the matrix is still the one the run began with."""
    cmd = [sys.executable, args.trainer, "--env", ENV, *METHODS[cell["method"]]]
    cmd += ["--seed", str(cell["seed"]), "--run-dir", cell["run_dir"]]
    cmd += ["--threads", str(args.threads)]
    return cmd + args.extra + (["--resume"] if resume else [])


def copy_results(cell):
    """config.json and metrics.jsonl only (a few KB; checkpoints and trajectories stay in the run
    folder), each written under a temporary name and renamed, so a copy is whole or absent."""
    os.makedirs(cell["results"], exist_ok=True)
    for name in ("config.json", "metrics.jsonl"):
        tmp = os.path.join(cell["results"], f".{name}.tmp")
        shutil.copyfile(os.path.join(cell["run_dir"], name), tmp)
        os.replace(tmp, os.path.join(cell["results"], name))


# =================================================================================================
# Wall times and the ETA
# =================================================================================================


def mean_run_seconds(path, lanes, threads):
    """(mean seconds, count) of the runs that started fresh and finished, read from times.jsonl
    (this session's and earlier ones'), or (None, 0). Runs side by side each take longer than
    one alone, so only runs with this --lanes and --threads count when there are any."""
    rows = []
    if os.path.exists(path):
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    whole = [r for r in rows if r["finished"] and r["start"] == "new"]  # a resumed run is partial
    alike = [r for r in whole if r["lanes"] == lanes and r["threads"] == threads]
    whole = alike or whole
    if not whole:
        return None, 0
    return sum(r["seconds"] for r in whole) / len(whole), len(whole)


def eta_line(mean, count, queued, running, lanes):
    """The matrix's time left: what the running cells still need (a mean run minus what they ran
    already) plus the queued cells, spread over the lanes, and never less than the longest
    single piece (one lane cannot share a run)."""
    if mean is None:
        return "ETA after the first run that starts and finishes"
    pieces = [max(mean - (time.time() - c["began"]), 0) for c in running] + [mean] * queued
    per_run = f"{minutes(mean)} per run (mean of {count})"
    if not pieces:
        return f"{per_run} | nothing left"
    left = max(sum(pieces) / lanes, max(pieces))
    finish = time.strftime("%a %H:%M", time.localtime(time.time() + left))
    return (
        f"{per_run} | {len(pieces)} left on {lanes} lane(s): about {minutes(left)}, done {finish}"
    )


def minutes(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


# =================================================================================================
# Running the cells
# =================================================================================================


def start(args, cell, kind, running):
    if kind == "restart":
        shutil.rmtree(cell["run_dir"])  # train.py refuses a folder that holds a run
    log = open(cell["log"], "a")  # appended: a torn cell's log keeps its earlier sessions
    log.write(f"\n=== bench/seeds.py, {time.strftime('%Y-%m-%d %H:%M:%S')}: {kind}\n")
    log.flush()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    cell["proc"] = subprocess.Popen(
        command(args, cell, resume=kind == "resume"),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        # a session of its own: the terminal's Ctrl-C reaches the runner only, which then
        # stops each child once with SIGTERM (train.py exits through its cleanup on it)
        start_new_session=True,
        # the child holds the matrix lock too: an orphan still writing a run folder after the
        # runner was SIGKILLed keeps a new runner off the same folder
        pass_fds=(args.lock.fileno(),),
    )
    cell["kind"], cell["began"] = kind, time.time()
    running.append(cell)  # at once: a Ctrl-C from here on stops this child too
    log.close()  # the child has its own copy of the file
    say(f"start {cell['name']} ({kind}) | log {cell['log']}")


def record(args, cell, done):
    """One line of times.jsonl: the cell's wall time in this session and how it ended."""
    seconds = time.time() - cell["began"]
    line = dict(method=cell["method"], seed=cell["seed"], start=cell["kind"], seconds=seconds)
    line.update(exit=cell["proc"].returncode, finished=done)
    line.update(lanes=args.lanes, threads=args.threads)
    with open(args.times, "a") as fh:
        fh.write(json.dumps(line) + "\n")
    return seconds


def end(args, cell, counts, total):
    """Record a cell that exited: its wall time, and its results copy when it finished."""
    rc = cell["proc"].returncode
    done = rc == 0 and finished(cell["run_dir"])
    seconds = record(args, cell, done)
    if done:
        copy_results(cell)
        counts["done"] += 1
        what = f"finished in {minutes(seconds)} -> {cell['results']}"
    else:
        counts["failed"] += 1
        what = f"FAILED (exit {rc}) after {minutes(seconds)}; {last_words(cell['log'])}"
        if rc == 0:
            what = "FAILED: exit 0 but metrics.jsonl does not end at its last update with an eval"
    say(f"[{counts['done']}/{total} done] {cell['name']}: {what}")


def last_words(log):
    with open(log) as fh:
        lines = [line.strip() for line in fh if line.strip()]
    return f"the log ends: {lines[-1]!r}" if lines else "the log is empty"


def stop(args, running):
    """SIGTERM to each child, then wait: each writes nothing more once it exits, and resumes from
    its last checkpoint (train.py saves every few updates). A second Ctrl-C kills at once."""
    for cell in running:
        cell["proc"].send_signal(signal.SIGTERM)
    say(f"stopping {len(running)} run(s) (SIGTERM; Ctrl-C again to kill them)")
    try:
        deadline = time.time() + GRACE_S
        for cell in running:
            cell["proc"].wait(timeout=max(deadline - time.time(), 0.1))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        for cell in running:
            if cell["proc"].poll() is None:
                cell["proc"].kill()
                cell["proc"].wait()
    for cell in running:
        record(args, cell, done=False)


def raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the matrix the way Ctrl-C does


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python bench/seeds.py --out DIR --results DIR --methods M,M --seeds S,S "
        "[--lanes N] [--threads T] [-- extra train.py flags]",
    )
    parser.add_argument("--out", required=True, help="run folders, logs and times.jsonl")
    parser.add_argument("--results", required=True, help="each finished cell's config + metrics")
    parser.add_argument(
        "--methods", required=True, help=f"comma-separated, of: {', '.join(METHODS)}"
    )
    parser.add_argument("--seeds", required=True, help="comma-separated seeds or ranges: 71-78")
    parser.add_argument("--lanes", type=int, default=1, help="cells run side by side")
    parser.add_argument("--threads", type=int, default=1, help="train.py --threads of each cell")
    parser.add_argument("--trainer", default=TRAIN, help="the script run per cell (tests: a fake)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]
    check_extra(args.extra)
    methods, seeds = parse_methods(args.methods), parse_seeds(args.seeds)
    if args.lanes < 1 or args.threads < 1:
        fail("--lanes and --threads must be at least 1")
    if args.lanes * args.threads > (os.cpu_count() or 1):
        say(f"note: {args.lanes} lanes x {args.threads} threads > {os.cpu_count()} cores")

    os.makedirs(args.out, exist_ok=True)
    args.lock = open(os.path.join(args.out, ".lock"), "w")
    try:
        fcntl.flock(args.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(
            f"{args.out} is in use by another bench/seeds.py or its train.py runs; stop them first"
        )
    args.times = os.path.join(args.out, "times.jsonl")

    # seed by seed: a matrix stopped halfway holds every method on its first seeds, so the
    # paired differences of bench/compare.py can already be read
    cells = []
    for seed in seeds:
        for method in methods:
            name = f"{method}-seed{seed}"
            cells.append(
                dict(
                    method=method,
                    seed=seed,
                    name=name,
                    run_dir=os.path.join(args.out, name),
                    log=os.path.join(args.out, f"log-{name}.txt"),
                    results=os.path.join(args.results, method, f"seed{seed}"),
                )
            )
    queue = []
    for cell in cells:
        kind, why = plan(cell)
        say(f"{cell['name']}: {why}")
        if kind == "done":
            if finished(cell["run_dir"]):
                copy_results(cell)  # again: an earlier session may have stopped before the copy
        else:
            queue.append((cell, kind))
    counts = {"done": len(cells) - len(queue), "failed": 0}
    say(f"{len(cells)} cells, {counts['done']} done already, {len(queue)} to run")
    for line in other_machines(cells, queue, machine.cpu()):
        say(line)

    signal.signal(signal.SIGTERM, raise_interrupt)
    running, interrupted = [], False
    try:
        while queue or running:
            while queue and len(running) < args.lanes:
                cell, kind = queue.pop(0)
                start(args, cell, kind, running)
            time.sleep(POLL_S)
            for cell in [c for c in running if c["proc"].poll() is not None]:
                running.remove(cell)
                end(args, cell, counts, len(cells))
                mean, count = mean_run_seconds(args.times, args.lanes, args.threads)
                say("  " + eta_line(mean, count, len(queue), running, args.lanes))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # whatever ends the loop (Ctrl-C, SIGTERM, an error in the runner itself), no train.py
        # outlives it: an orphan would go on writing a run folder that the next session resumes
        if running:
            stop(args, running)
    if interrupted:
        left = len(running) + len(queue)
        sys.exit(f"stopped: {left} cell(s) left; run the same command again to continue")
    if counts["failed"]:
        sys.exit(
            f"bench/seeds.py: {counts['failed']} cell(s) failed (see their logs in {args.out}); "
            "run the same command again to redo them"
        )
    say(f"all {len(cells)} cells done: python bench/compare.py {args.results}")


if __name__ == "__main__":
    main()
