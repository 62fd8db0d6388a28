"""bench/cpu_memory.py: where the CPU preset's resident memory goes, phase by phase.

Loads the preset's model the way train.py does (the packaged GGUF when nothing else is there),
then runs one batched generation and one E12 update of the preset's size on prompts of the real
length, printing the process's resident set (RSS) and its peak so far (VmHWM) after each phase.

    python bench/cpu_memory.py                   # SmolLM2-135M, 32 prompts of ~330 tokens, 56 samples
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss():
    """(current RSS, peak RSS) of this process in GiB, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 2**20, int(fields["VmHWM"].split()[0]) / 2**20


def report(phase, t0):
    now, peak = rss()
    print(f"{phase:<44} RSS {now:5.2f} GiB   peak {peak:5.2f} GiB   ({time.time() - t0:5.1f} s)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the generate call (--gen-batch-size)")
    parser.add_argument("--prompt-tokens", type=int, default=330)
    parser.add_argument("--samples", type=int, default=56, help="env-step samples in the update (B*K*steps)")
    a = parser.parse_args()
    t0 = time.time()
    report("start (python)", t0)
    import torch
    import train
    report("torch + transformers imported", t0)
    from trainer import build
    from trainer.distributed import Dist
    args, _ = train.parse_args(["--preset", "cpu", "--run-dir", "/nonexistent"], cuda=False)
    model, tok, optimizer = build.policy(args, None, torch.device("cpu"), Dist())
    report(f"model loaded, {args.precision}", t0)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_tokens,), generator=gen).tolist() for _ in range(a.prompts)]
    train.generate(model, tok, prompts, args.temperature, args.max_new_tokens, args.gen_batch_size, args.precision)
    report(f"generate: {a.prompts} prompts x {a.prompt_tokens} tokens", t0)
    samples = [{"traj": i // 7, "step": i % 7, "prompt_ids": prompts[i % a.prompts],
                "response_ids": torch.randint(100, 40000, (8,), generator=gen).tolist(),
                "advantage": 1.0 if i % 2 else -1.0} for i in range(a.samples)]
    for seed in (1, 2):
        plan = train.minibatch_plan(samples, args.minibatch_size, args.token_budget,
                                    torch.Generator().manual_seed(seed), skip_zero=True)
        totals = train.update_policy(model, optimizer, samples, plan, precision=args.precision)
        report(f"update: {a.samples} samples, token budget {args.token_budget}" if seed == 1 else
               "second update (optimizer state exists)", t0)
    report("second update (optimizer state exists)", t0)
    trained = sum(p.numel() for p in params)
    print(f"weights {sum(p.numel() for p in model.parameters()) * 4 / 2**30:.2f} GiB fp32; trained "
          f"{trained / 1e6:.1f} M parameters: gradients {trained * 4 / 2**30:.2f} GiB, AdamW moments "
          f"{trained * 8 / 2**30:.2f} GiB; loss {totals['loss']:.4f}")


if __name__ == "__main__":
    main()
