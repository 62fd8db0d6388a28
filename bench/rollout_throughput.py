"""bench/rollout_throughput.py: rollout and update speed of train.py's code paths on this machine.

Measures, with SmolLM2-135M-Instruct by default (models.load_model: HF cache/hub, else the GGUF):
  * generation tokens/s for P ALFWorld-style step prompts in one batched generate call (KV cache,
    left padding) vs the same prompts one at a time; the ratio is why train.py batches every step.
    Reported end to end and for decoding alone (minus the prompt prefill, timed as one forward):
    prefill is the same compute either way, decoding is where batching pays;
  * update tokens/s: one forward+backward of the E12 loss over those P samples (prompt + response);
  * peak memory (process RSS; CUDA max allocated on GPU).
Every reply is forced to exactly --new-tokens tokens so both generation modes do the same work.

    python bench/rollout_throughput.py                 # ~2-4 minutes on 2 CPU cores
"""
import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer import models  # noqa: E402
from environments import textenv  # noqa: E402
import train   # noqa: E402

PLACES = ["cabinet", "drawer", "countertop", "shelf", "sidetable", "fridge", "microwave", "sinkbasin"]


def step_prompts(n):
    """n distinct step prompts shaped like ALFWorld's (task, history, observation, admissible)."""
    prompts = []
    for i in range(n):
        seen = [f"a {p} {k}" for p in PLACES for k in range(1, 2 + (i + len(p)) % 4)]
        admissible = [f"go to {s[2:]}" for s in seen] + ["inventory", "look"]
        history = [(f"You arrive at {seen[i % len(seen)][2:]}. On it, you see nothing.", admissible[i % 5])]
        obs = "You are in the middle of a room. Looking quickly around you, you see " + ", ".join(seen) + "."
        prompts.append(textenv.build_prompt(f"put a clean mug {i + 1} in the coffeemachine.", history, obs,
                                         admissible, "alfworld"))
    return prompts


def timed_generate(model, tok, chats, new_tokens, device):
    """(generate seconds, prefill seconds, prompt ids, response ids) of one batched call."""
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        model(**enc, logits_to_keep=1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=tok.pad_token_id)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    prompt_ids = [[t for t, m in zip(row, mask) if m] for row, mask in
                  zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
    return seconds, prefill, prompt_ids, out[:, enc["input_ids"].shape[1]:].tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="HF name or local directory")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = p.parse_args()
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model, tok, source = models.load_model(args.model)
    model.to(device).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in step_prompts(args.prompts)]
    n_tok = args.prompts * args.new_tokens
    print(f"model {args.model} ({source}), {device.type}, {torch.get_num_threads()} threads, "
          f"{args.prompts} prompts of ~{len(tok(chats[0]).input_ids)} tokens, "
          f"{args.new_tokens} new tokens each")

    timed_generate(model, tok, chats[:1], 4, device)            # warm-up (allocator, kernels)
    batched_s, batched_prefill, prompt_ids, responses = timed_generate(model, tok, chats, args.new_tokens,
                                                                       device)
    singles = [timed_generate(model, tok, [c], args.new_tokens, device)[:2] for c in chats]
    single_s, single_prefill = sum(s for s, _ in singles), sum(p for _, p in singles)
    batched_decode, single_decode = batched_s - batched_prefill, single_s - single_prefill

    # One E12 update step over the batch: forward + backward of every (prompt, response) sample.
    samples = [{"prompt_ids": pi, "response_ids": r} for pi, r in zip(prompt_ids, responses)]
    batch = train.collate(samples, tok.pad_token_id, device)
    with torch.no_grad():
        old = train.response_logprobs(model, batch, 1.0)
    start = time.perf_counter()
    logp = train.response_logprobs(model, batch, 1.0)
    adv = torch.randn(len(samples), 1, device=device)
    loss, _ = train.policy_loss(logp, old, old, adv, batch["resp_mask"], 0.2, 0.01, batch["resp_mask"].sum())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    update_s = time.perf_counter() - start
    update_tokens = int(batch["attention_mask"].sum())

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [("generation, one batched call", f"{n_tok / batched_s:.1f} tok/s", f"{batched_s:.1f} s"),
            ("generation, one prompt at a time", f"{n_tok / single_s:.1f} tok/s", f"{single_s:.1f} s"),
            ("batched / sequential", f"{single_s / batched_s:.2f}x", "end to end, prefill included"),
            ("decoding only, batched", f"{n_tok / batched_decode:.1f} tok/s", f"{batched_decode:.1f} s"),
            ("decoding only, one at a time", f"{n_tok / single_decode:.1f} tok/s", f"{single_decode:.1f} s"),
            ("decoding batched / sequential", f"{single_decode / batched_decode:.2f}x", "target >= 4x"),
            (f"update fwd+bwd, {update_tokens} tokens", f"{update_tokens / update_s:.1f} tok/s",
             f"{update_s:.1f} s"),
            ("peak RSS", f"{peak_mb:.0f} MB", "")]
    if device.type == "cuda":
        rows.append(("peak CUDA allocated", f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MB", ""))
    for name, value, note in rows:
        print(f"{name:<36} {value:>14}  {note}")


if __name__ == "__main__":
    main()
