"""bench/engines.py: the rollout engines and the update's precision, side by side in one run, on the
CPU preset's own prompts (SmolLM2-135M, ALFWorld step prompts of the generated games, action
format).

Prints, measured in this process one after the other (ratios against today's default of the
previous release, HF generate in fp32):
  * seconds per batched sampling call of P prompts (<= 16 new tokens, the preset's training
    temperature, fresh sampling every repetition, vLLM's prefix cache emptied before each call, so
    prompts shared within a call are the only reuse, as in a rollout step) for HF generate fp32, HF
    generate bf16 autocast over fp32 weights, HF generate bf16 autocast with the frozen layers
    stored in bf16 (train.py's default here: train.store_frozen_in_bf16), and, when vLLM is
    installed, vLLM fp32 and vLLM bf16;
  * each engine's rollout_logprob_gap (mean / max |log pi_sampler - log pi_trainer| over the tokens
    it sampled, the trainer at the engine's precision) -- the sync check of docs/ALGORITHM.md E12;
  * the update's tokens/s (update_policy over those samples, the preset's top 8 blocks trained, one
    optimizer step) in fp32, under bf16 autocast, and under bf16 autocast with the frozen layers in
    bf16;
  * with --whole: train.py's CPU preset for 2 updates per engine (no warm start, no eval) in a fresh
    process each, its rollout_s / update_s / gen_tokens_per_s / update_tokens_per_s from
    metrics.jsonl.

    python bench/engines.py                      # ~3 minutes on 2 CPU cores
    python bench/engines.py --whole              # + ~4 minutes per engine
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import envs  # noqa: E402
import train  # noqa: E402
from extras import cpu_sampling  # noqa: E402


def preset_prompts(args, tok, model, n):
    """n step prompts of the CPU preset: the first step of each training game, the games
    repeated."""
    pool, _ = train.make_pool(args, "train")
    pool.close()
    env = envs.AlfWorldEnv(**pool.kwargs)
    prompt = train.prompt_builder(args, tok, model)
    out = []
    for i in range(n):
        obs, info = env.reset(env.tasks[i % len(env.tasks)])
        out.append(prompt(info["goal"], [], obs, info["admissible"])[0])
    env.close()
    return out


def gap(model, samples, precision, temperature):
    batch = train.collate(samples, model.generation_config.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logp = train.response_logprobs(
            model, batch, temperature, precision
        )  # the temperature sampled at
    diff = (logp - batch["sampler_logp"]).abs() * batch["sampled_mask"]
    return diff.sum().item() / batch["sampled_mask"].sum().item(), diff.max().item()


def whole(engine, precision, seed):
    run_dir = os.path.join(tempfile.mkdtemp(prefix="tigpo-engines-"), "run")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--env",
        "alfworld",
        "--updates",
        "2",
        "--warmup-epochs",
        "0",
        "--eval-every",
        "0",
        "--seed",
        str(seed),
        "--rollout-engine",
        engine,
        "--precision",
        precision,
        "--run-dir",
        run_dir,
    ]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return time.time() - t0, rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--whole", action="store_true")
    a = p.parse_args()
    args, _ = train.parse_args(
        [
            "--env",
            "alfworld",
            "--preset",
            "cpu",
            "--run-dir",
            "/nonexistent/bench",
            "--precision",
            "fp32",
        ],
        cuda=False,
    )
    model, tok, _ = train.load_policy(
        args.model, torch.device("cpu"), args.max_new_tokens
    )  # fp32 weights
    train.train_top_layers(model, args.trainable_layers)
    stored = copy.deepcopy(model)  # the same, frozen layers in bf16
    train.store_frozen_in_bf16(stored)
    prompts = preset_prompts(args, tok, model, a.prompts)
    print(
        f"{a.prompts} CPU-preset prompts of {sum(map(len, prompts)) / len(prompts):.0f} tokens "
        "(mean), <= "
        f"{args.max_new_tokens} new tokens, T {args.temperature}, {torch.get_num_threads()} "
        "threads; "
        f"bf16 instructions on this CPU: {train.bf16_is_fast(False)}"
    )
    # "hf" samples as train.py does on a CPU, through extras/cpu_sampling.py; "hf-plain" is
    # train.generate itself (model.generate), what a GPU runs
    engines = [("hf", "fp32", model), ("hf", "bf16", model), ("hf", "bf16 stored", stored)]
    engines += [("hf-plain", "bf16 stored", stored)]
    from extras import vllm_engine

    if vllm_engine.available():
        engines += [("vllm", "fp32", model), ("vllm", "bf16", stored)]
    else:
        print("vLLM not installed (pip install --no-deps -r extras/requirements-vllm.txt): HF only")
    rows, samples_of = [], {}
    for engine, name, net in engines:
        precision = name.split()[0]
        run_args, _ = train.parse_args(
            [
                "--preset",
                "cpu",
                "--run-dir",
                "/nonexistent/bench",
                "--precision",
                precision,
                "--rollout-engine",
                "hf" if engine == "hf-plain" else engine,
            ],
            cuda=False,
        )
        sampler = vllm_engine.start(net, tok, precision, 0) if engine == "vllm" else None
        fast = cpu_sampling if engine == "hf" else None
        sample = train.make_sampler(run_args, net, tok, sampler, fast)
        sample(prompts[:2], args.temperature)  # warm-up
        times = []
        for rep in range(a.reps):
            torch.manual_seed(rep)
            if sampler is not None:  # no KV reused from the previous repetition's identical prompts
                sampler.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            texts, responses, logprobs = sample(prompts, args.temperature)
            times.append(time.perf_counter() - t0)
        samples = [
            {
                "traj": i,
                "step": 0,
                "prompt_ids": pr,
                "response_ids": r,
                "sampler_logprobs": lp,
                "advantage": 1.0 if i % 2 else -1.0,
            }
            for i, (pr, r, lp) in enumerate(zip(prompts, responses, logprobs))
        ]
        samples_of[engine, name] = samples
        mean_gap, max_gap = gap(net, samples, precision, args.temperature)
        tokens = sum(map(len, responses))
        rows.append((f"{engine} {name}", min(times), tokens, mean_gap, max_gap))
        if sampler is not None:
            sampler.close()
    base = rows[0][1]
    print(
        f"\n{'engine':<15} {'s/call (best)':>14} {'vs hf fp32':>11} {'new tokens':>11} "
        f"{'gap mean':>10} {'gap max':>9}"
    )
    for name, s, tokens, mg, xg in rows:
        print(f"{name:<15} {s:14.2f} {base / s:10.2f}x {tokens:11d} {mg:10.2e} {xg:9.2e}")

    samples = samples_of["hf", "fp32"]
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    speed = {}
    for name, precision, net in (
        ("fp32", "fp32", model),
        ("bf16", "bf16", model),
        ("bf16 stored", "bf16", stored),
    ):
        optimizer = torch.optim.AdamW(
            [q for q in net.parameters() if q.requires_grad], lr=0.0
        )  # lr 0: same weights
        plan = train.minibatch_plan(
            samples, 0, args.token_budget, torch.Generator().manual_seed(0), skip_zero=True
        )
        train.update_policy(
            net, optimizer, samples, plan, temperature=args.temperature, precision=precision
        )  # warm-up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            train.update_policy(
                net, optimizer, samples, plan, temperature=args.temperature, precision=precision
            )
            times.append(time.perf_counter() - t0)
        speed[name] = tokens / min(times)
    print(
        f"\nupdate ({len(samples)} samples, {tokens} tokens, top {args.trainable_layers} blocks "
        "trained): "
        + ", ".join(f"{k} {v:.0f} tok/s ({v / speed['fp32']:.2f}x)" for k, v in speed.items())
    )

    if a.whole:
        print("\ntrain.py, CPU preset, 2 updates, no warm start, no eval (seed 0), per engine:")
        print(
            f"{'engine':<12} {'wall s':>7} {'rollout s':>10} {'update s':>9} {'gen tok/s':>10} "
            f"{'update tok/s':>13} "
            f"{'gap mean':>9}"
        )
        for engine, name, _ in engines:
            # train.py stores the frozen layers in bf16 under bf16, and samples on a CPU fast
            if (name == "bf16" and engine == "hf") or engine == "hf-plain":
                continue
            precision = name.split()[0]
            wall, metrics = whole(engine, precision, 0)
            for m in metrics:
                print(
                    f"{engine + ' ' + precision:<12} {wall:7.0f} {m['rollout_s']:10.1f} "
                    f"{m['update_s']:9.1f} "
                    f"{m['gen_tokens_per_s']:10.1f} {m['update_tokens_per_s']:13.0f} "
                    f"{m['rollout_logprob_gap']:9.2e}"
                )


if __name__ == "__main__":
    main()
