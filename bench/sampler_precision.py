"""bench/sampler_precision.py: what the CPU fast path's arithmetic costs and buys under bf16.

On the CPU preset's own prompts (SmolLM2-135M, its top 8 blocks trained and the frozen ones stored
in bf16, ALFWorld step prompts of the generated games), extras/cpu_sampling.generate is timed and
its rollout_logprob_gap (mean |log pi_sampler - log pi_trainer| over the sampled tokens, the
trainer being train.response_logprobs under bf16 autocast with its fp32 output layer) measured,
side by side in one process, the variants interleaved over the repetitions:

  * decode attention: its two small products under the CPU's bf16 autocast (as train.py runs
    them) or in fp32 (autocast off inside decode_attention);
  * the sampler's output layer: a bf16 copy (head_cast_once) or fp32, as the trainer's.

    python bench/sampler_precision.py            # ~2 minutes on 2 CPU cores
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from engines import gap, preset_prompts  # noqa: E402

import train  # noqa: E402
from extras import cpu_sampling  # noqa: E402


@contextlib.contextmanager
def fp32_head(model, precision):
    """The output layer in fp32 inside a bf16 autocast forward, as the trainer computes it."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias

    def forward(hidden):
        with torch.autocast("cpu", enabled=False):
            return F.linear(hidden.float(), weight, bias)

    head.forward = forward  # bench only: shadows the class's forward for this call
    try:
        yield
    finally:
        head.__dict__.pop("forward", None)


CPU_SAMPLING_DECODE = cpu_sampling.decode_attention  # as train.py samples


def decode_fp32_products(query, key, value, attention_mask, scaling=None):
    """cpu_sampling.decode_attention with autocast off inside: its two products in fp32."""
    with torch.autocast("cpu", enabled=False):
        return CPU_SAMPLING_DECODE(query, key, value, attention_mask, scaling)


@contextlib.contextmanager
def variant(decode_fp32, head_fp32):
    """cpu_sampling with the variant's decode attention and output layer."""
    saved = cpu_sampling.decode_attention, cpu_sampling.head_cast_once
    if decode_fp32:
        cpu_sampling.decode_attention = decode_fp32_products
    if head_fp32:
        cpu_sampling.head_cast_once = fp32_head
    try:
        yield
    finally:
        cpu_sampling.decode_attention, cpu_sampling.head_cast_once = saved


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="prompts per sampling call")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per variant")
    a = p.parse_args()
    args, _ = train.parse_args(["--env", "alfworld", "--run-dir", "/nonexistent/bench"], cuda=False)
    if args.precision != "bf16":
        sys.exit("this CPU has no bf16 instructions: the preset runs fp32, nothing to compare")
    model, tok, _ = train.load_policy(args.model, torch.device("cpu"), args.max_new_tokens)
    train.train_top_layers(model, args.trainable_layers)
    train.store_frozen_in_bf16(model)
    prompts = preset_prompts(args, tok, model, a.prompts)
    names = {
        (False, False): "as train.py samples: decode products under bf16 autocast, bf16 head copy",
        (True, False): "decode products in fp32, bf16 head copy",
        (True, True): "decode products in fp32, fp32 head",
        (False, True): "decode products under bf16 autocast, fp32 head",
    }
    seconds = {k: [] for k in names}
    gaps = {k: [] for k in names}
    for r in range(a.repeats + 1):  # the first round warms up
        for key in names:
            with variant(*key):
                torch.manual_seed(r)
                t0 = time.perf_counter()
                texts, responses, logprobs = cpu_sampling.generate(
                    model, tok, prompts, args.temperature, args.max_new_tokens, 64, "bf16"
                )
                took = time.perf_counter() - t0
            samples = [
                {"prompt_ids": q, "response_ids": x, "sampler_logprobs": lp}
                for q, x, lp in zip(prompts, responses, logprobs)
            ]
            if r:
                seconds[key].append(took)
                gaps[key].append(gap(model, samples, "bf16", args.temperature)[0])
    base = statistics.median(seconds[False, False])
    print(f"{a.prompts} prompts per call, <= {args.max_new_tokens} new tokens, {a.repeats} calls")
    print("| variant | s per call (median) | vs train.py's | gap mean |")
    print("|---|---|---|---|")
    for key, name in names.items():
        s = statistics.median(seconds[key])
        print(f"| {name} | {s:.3f} | {s / base:.2f}x | {statistics.fmean(gaps[key]):.4f} |")


if __name__ == "__main__":
    main()
