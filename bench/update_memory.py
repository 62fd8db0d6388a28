"""bench/update_memory.py: peak memory of one E12 forward+backward micro-batch, full logits vs the
chunked log-probs train.py uses.

The model is a small random Llama with Qwen2.5's vocabulary (151,936 tokens), so the logits dominate
as they do for the paper's model. "before" is the previous implementation: the model's own
(n, R+1, vocab) fp32 logits, divided by the temperature, log-softmaxed, all held for backward.
"after" is train.response_logprobs: the head, temperature and log-softmax in fp32 over
--logit-chunk tokens at a time, each chunk recomputed in backward. Each method runs in a fresh
subprocess, so one's peak cannot hide in the other's: process peak RSS on CPU,
torch.cuda.max_memory_allocated on CUDA.

    python bench/update_memory.py        # 8 x 1024 tokens, 256 of them response (~1 min)
    python bench/update_memory.py --batch 8 --seq 1024 --response 512
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 151936  # Qwen2.5


def measure(method, batch, seq, response, chunk, device_name):
    import torch

    sys.path.insert(0, ROOT)
    from transformers import LlamaConfig, LlamaForCausalLM

    import train

    torch.manual_seed(0)
    device = torch.device(device_name)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    ).to(device)
    samples = [
        {
            "prompt_ids": torch.randint(0, VOCAB, (seq - response,)).tolist(),
            "response_ids": torch.randint(0, VOCAB, (response,)).tolist(),
        }
        for _ in range(batch)
    ]
    data = train.collate(samples, 0, device)
    n, R = data["resp_mask"].shape
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if method == "before":
        position_ids = (data["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=data["input_ids"],
            attention_mask=data["attention_mask"],
            position_ids=position_ids,
            logits_to_keep=R + 1,
            use_cache=False,
        ).logits
        logits = logits[:, :-1].float() / 1.0  # (n, R, vocab)
        targets = data["input_ids"][:, -R:]
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    else:
        logp = train.response_logprobs(model, data, 1.0, "fp32", chunk)
    loss = -(logp * data["resp_mask"]).sum() / data["resp_mask"].sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
        kind = "CUDA max allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
        kind = "process peak RSS"
    grad = sum(p.grad.double().norm() ** 2 for p in model.parameters()).sqrt().item()
    print(
        json.dumps(
            {
                "method": method,
                "peak_mib": peak,
                "kind": kind,
                "seconds": time.perf_counter() - start,
                "loss": loss.item(),
                "grad_norm": grad,
                "baseline_rss_mib": base / 1024,
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--seq", type=int, default=1024, help="tokens per sample (prompt + response)"
    )
    parser.add_argument("--response", type=int, default=256, help="response tokens per sample")
    parser.add_argument("--chunk", type=int, default=1024, help="train.py --logit-chunk")
    parser.add_argument(
        "--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" else "cpu"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        return measure(a.child, a.batch, a.seq, a.response, a.chunk, a.device)
    import torch

    device = a.device if a.device == "cpu" or torch.cuda.is_available() else "cpu"
    rows = {}
    for method in ("before", "after"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                method,
                "--batch",
                str(a.batch),
                "--seq",
                str(a.seq),
                "--response",
                str(a.response),
                "--chunk",
                str(a.chunk),
                "--device",
                device,
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(f"bench/update_memory.py: the {method} run failed:\n{out.stderr[-2000:]}")
        rows[method] = json.loads(out.stdout.strip().splitlines()[-1])
    b, c = rows["before"], rows["after"]
    print(
        f"one forward+backward micro-batch, {a.batch} x {a.seq} tokens ({a.response} response), "
        f"vocab {VOCAB}, "
        f"{device}, {b['kind']}:"
    )
    for name, r in rows.items():
        print(
            f"  {name:6s} peak {r['peak_mib']:8.0f} MiB  ({r['seconds']:.1f} s, loss "
            f"{r['loss']:.6f}, "
            f"grad norm {r['grad_norm']:.6f})"
        )
    print(
        f"  ratio before/after: {b['peak_mib'] / c['peak_mib']:.2f}x"
        + (
            f" (a process starts at ~{b['baseline_rss_mib']:.0f} MiB RSS with torch and the model)"
            if device == "cpu"
            else ""
        )
    )
    if abs(b["loss"] - c["loss"]) > 1e-4 * max(1.0, abs(b["loss"])):
        sys.exit("bench/update_memory.py: the two methods disagree on the loss")


if __name__ == "__main__":
    main()
