"""--lora-rank (the LoRA extra, peft): only the adapters receive gradients and move, the base with
the adapters off is the KL reference, a run's checkpoint holds the adapters alone, resumes exactly
and loads with plain transformers + peft. (The learning test trains LoRA on both engines.)"""

import json
import os

import pytest
import torch
from test_train_e2e import TINY, read_jsonl, run_train

import train
from extras import cpu_sampling

pytestmark = pytest.mark.slow
pytest.importorskip(
    "peft", reason="needs the LoRA extra: pip install -r extras/requirements-lora.txt"
)

CPU = torch.device("cpu")


def make_samples(tok):
    """Four env-step samples, two rewarded, two not."""
    prompts = ["go to the desk", "open the drawer", "take the key", "look around"]
    reply = tok("<action>go to desk 1</action>", add_special_tokens=False).input_ids
    samples = []
    for i, text in enumerate(prompts):
        ids = tok(text, add_special_tokens=False).input_ids
        sample = {"traj": i, "step": 0, "prompt_ids": ids, "response_ids": reply}
        samples.append({**sample, "advantage": (-1.0) ** i})
    return samples


def test_only_the_adapters_train_and_the_base_is_the_reference(tiny_model):
    model, tok, _ = train.load_policy(tiny_model, CPU, 16)
    base_model, _, _ = train.load_policy(tiny_model, CPU, 16)  # an untouched copy
    torch.manual_seed(0)
    model = train.add_lora(model, 4, 0, 1)  # rank 4 on the top block (of 2)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 14  # A and B of the block's 7 linear layers
    assert all("lora_" in n and ".layers.1." in n for n in trained)
    assert cpu_sampling.frozen_depth(model) == 1  # on a CPU the bottom block runs once a sample

    samples = make_samples(tok)
    ref = train.AdaptersOff(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    stats = []
    for update in range(2):
        plan = train.minibatch_plan(samples, 0, 4096, torch.Generator().manual_seed(update), True)
        stats.append(train.update_policy(model, optimizer, samples, plan, ref, kl_coef=0.1))
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(trained)  # the base never gets a gradient
        # B starts at zero, so A's first gradient is zero too; B's is not
        assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    # update 1: B = 0, the adapted model is the base, bit for bit: KL exactly 0; then it moves
    assert stats[0]["kl"] == 0.0 and stats[1]["kl"] > 0.0

    batch = train.collate(samples, tok.pad_token_id, CPU)
    with torch.no_grad():
        reference = train.response_logprobs(ref, batch, 1.0)
        base = train.response_logprobs(base_model, batch, 1.0)
        policy = train.response_logprobs(model, batch, 1.0)
    assert torch.equal(reference, base)  # adapters off = the base model
    assert (policy - base).abs().max() > 1e-4  # the adapters moved the policy
    plain = dict(base_model.named_parameters())
    for name, p in model.get_base_model().named_parameters():
        if "lora_" not in name:  # every base weight exactly as loaded
            assert torch.equal(p, plain[name.replace(".base_layer", "")]), name


def test_a_lora_run_resumes_exactly_and_its_checkpoint_loads_with_transformers_and_peft(
    tiny_model, alfworld_data, tmp_path
):
    """Run A: 3 updates. Run B: 2, then --resume to 3. At update 3 B holds A's adapters, graph
    memory, queue and RNG states, bit for bit. The checkpoint holds the adapters alone (and the
    tokenizer); peft loads them onto the base."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = ["--lora-rank", "8", "--lr", "1e-3", "--model", tiny_model, "--data-dir", alfworld_data]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_train("--updates", "3", "--run-dir", a, *TINY, *lora)
    run_train("--updates", "2", "--run-dir", b, *TINY, *lora)
    proc = run_train("--resume", "--updates", "3", "--run-dir", b)
    assert "resumed from" in proc.stdout
    ckpts = [os.path.join(d, "checkpoints", "update_000003") for d in (a, b)]
    assert "model.safetensors" not in os.listdir(ckpts[0])  # the adapters, not the model
    wa, wb = (load_file(os.path.join(c, "adapter_model.safetensors")) for c in ckpts)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(w.abs().sum() > 0 for k, w in wa.items() if "lora_B" in k)  # they trained
    states = [json.load(open(os.path.join(c, "state.json"))) for c in ckpts]
    for key in ("memory", "scheduler", "rng_ranks"):
        assert states[0][key] == states[1][key], key
    ma, mb = (read_jsonl(os.path.join(d, "metrics.jsonl")) for d in (a, b))
    assert [m["update"] for m in mb] == [1, 2, 3]
    for key in ("success_rate", "num_samples", "loss", "kl", "clip_frac", "graph_edges"):
        assert [m[key] for m in ma] == [m[key] for m in mb], key

    # plain transformers + peft: the base model, then the adapters
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    loaded = PeftModel.from_pretrained(base, ckpts[0])
    mine = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert mine.keys() == wa.keys() and all(torch.equal(mine[k], wa[k]) for k in wa)
    # the merged model train.py loads from the checkpoint (evaluate.py, --model) is the same one
    merged, _, source = train.load_policy(ckpts[0], CPU, 16)
    assert "LoRA adapters" in source
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want, got = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-4)
    assert (want - plain).abs().max() > 1e-5  # not the base model
