"""Tests of extras/cpu_sampling.py, the CPU fast path of sampling and of the frozen blocks: each
speed-only piece changes no sampled token, log-prob or weight (bit for bit where it claims to),
and the fast path draws from the distribution train.generate draws from, recording the log-probs
the trainer computes for the same tokens. Every monkeypatch targets cpu_sampling's own names and
checks that it was reached, so that no comparison is of the fast path with itself."""

import contextlib

import pytest
import torch
from test_train_loss import frozen_llama, frozen_samples, tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

import train
from extras import cpu_sampling


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_frozen_blocks_run_once_per_sample_and_the_update_is_bit_identical(precision):
    """--trainable-layers: the pi_old pass records what the frozen blocks hand to the first
    trained one, and every later pass starts there (FrozenReuse). The same update with the
    frozen blocks run in every pass (no reuse): the same weights and statistics, bit for bit."""
    assert cpu_sampling.frozen_depth(frozen_llama()) == 2
    results = []
    for reusing in (True, False):  # as the trainer runs it on a CPU; then the plain update
        model = frozen_llama(precision=precision)
        samples = frozen_samples()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        plan = train.minibatch_plan(samples, 4, 32, torch.Generator().manual_seed(0), True)
        assert len(plan) == 3 and sum(len(micros) for micros, _ in plan) > 3
        reuse = cpu_sampling.FrozenReuse(model, samples) if reusing else None
        totals = train.update_policy(
            model, optimizer, samples, plan, temperature=0.8, precision=precision, reuse=reuse
        )
        if reusing:  # it did record and replay: the micro-batches of minibatches 2 and 3
            assert len(reuse.known) == sum(len(micros) for micros, _ in plan[1:])
        results.append((totals, [p.detach().clone() for p in model.parameters()]))
    (reused, a), (recomputed, b) = results
    assert reused == recomputed
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_expert_steps_get_the_frozen_blocks_output_a_forward_computes():
    """keep_frozen (the expert steps of --bc-coef, which no rollout generated): each sample gets
    the hidden state a forward of it alone hands to the first trained block, over its prompt and
    response; FrozenReuse then starts every pass of an update above the frozen blocks from it."""
    model = frozen_llama()
    samples = frozen_samples(5)
    cpu = torch.device("cpu")
    cpu_sampling.keep_frozen(
        model, samples, lambda b: train.response_logprobs(model, train.collate(b, 0, cpu), 1.0)
    )
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
        assert s["frozen"].shape == hidden.shape
        assert torch.allclose(s["frozen"], hidden, atol=1e-6)
    replayed = []
    params = [p for p in model.parameters() if p.requires_grad]
    plan = train.minibatch_plan(samples, 2, 32, torch.Generator().manual_seed(0), True)
    reuse = cpu_sampling.FrozenReuse(model, samples)
    original = cpu_sampling.frozen_blocks
    cpu_sampling.frozen_blocks = counting(replayed)
    try:
        train.update_policy(model, torch.optim.AdamW(params), samples, plan, reuse=reuse)
    finally:
        cpu_sampling.frozen_blocks = original
    assert replayed and all(replayed)


def counting(replayed):
    """cpu_sampling.frozen_blocks, noting in `replayed` whether each call replays a known output."""
    forward = cpu_sampling.frozen_blocks

    def frozen_blocks(*args, **kwargs):
        replayed.append(kwargs.get("given") is not None)
        return forward(*args, **kwargs)

    return frozen_blocks


@pytest.mark.parametrize("reference", ["copy", "adapters off"])
def test_the_kl_reference_reuses_the_frozen_blocks_and_the_update_is_bit_identical(reference):
    """--kl-coef with --trainable-layers (or LoRA on the top blocks): the reference's frozen
    blocks are the policy's, so its forward starts from their recorded output too
    (FrozenReuse.reference). Against the same update with every block run in every pass: the
    same weights and statistics, KL included, bit for bit."""
    results = []
    for reusing in (True, False):
        model = frozen_llama()
        if reference == "copy":
            ref_model = frozen_llama().eval().requires_grad_(False)  # the policy before RL
        else:
            pytest.importorskip("peft", reason="needs the LoRA extra")
            torch.manual_seed(0)
            model = train.add_lora(model, 4, 0, 2)  # the top 2 blocks (of 4) adapted
            ref_model = train.AdaptersOff(model)
        samples = frozen_samples()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        totals = []
        for update in range(2):  # update 2: the reference differs from the policy
            plan = train.minibatch_plan(
                samples, 4, 32, torch.Generator().manual_seed(update), False
            )
            reuse = cpu_sampling.FrozenReuse(model, samples) if reusing else None
            replayed = []
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(cpu_sampling, "frozen_blocks", counting(replayed))
                totals.append(
                    train.update_policy(
                        model, optimizer, samples, plan, ref_model, kl_coef=0.1, reuse=reuse
                    )
                )
            # minibatches 2 and 3, recorded by the pi_old pass: replayed by the reference's
            # pass and by their steps
            later = sum(len(micros) for micros, _ in plan[1:])
            assert sum(replayed) == (2 * later if reusing else 0)
        assert totals[1]["kl"] > 0.0
        results.append((totals, [p.detach().clone() for p in model.parameters()]))
    (reused, a), (recomputed, b) = results
    assert reused == recomputed
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def left_padded_frozen(samples):
    """The samples' frozen-block outputs left-padded as collate pads their tokens, (n, L, H)."""
    L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    out = samples[0]["frozen"].new_zeros((len(samples), L, samples[0]["frozen"].shape[-1]))
    for i, s in enumerate(samples):
        out[i, L - len(s["frozen"]) :] = s["frozen"]
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_frozen_blocks_output_kept_by_generate_is_what_a_forward_computes(
    precision, tiny_model
):
    """generate(frozen=N) keeps the bottom N blocks' output over every prompt + response (the
    last response token's row excepted: it never enters the model while sampling). It equals a
    full-sequence forward's up to the rounding of another batch shape, and the update that
    starts from it (FrozenReuse) takes its first step at ratio exactly 1."""
    model, tok = load(tiny_model)
    train.train_top_layers(model, 1)  # the tiny model has 2 blocks
    if precision == "bf16":
        train.store_frozen_in_bf16(model)
    assert cpu_sampling.frozen_depth(model) == 1
    # rows 0 and 2 share their prompt, as do 1 and 4: their prefill runs once (shared_prefill)
    words = ["look", "go to the cabinet", "look", "take mug", "go to the cabinet"]
    words += ["you see a drawer and a desk lamp"]
    prompts = [tok(f"{w}\n", add_special_tokens=False).input_ids for w in words]
    torch.manual_seed(0)
    texts, responses, logprobs, frozen = cpu_sampling.generate(
        model, tok, prompts, 1.0, 8, precision=precision, frozen=1
    )
    assert responses[0] != responses[2] and responses[1] != responses[4]  # each row samples
    samples = []
    for i, (p, r, lp, f) in enumerate(zip(prompts, responses, logprobs, frozen)):
        assert f.shape == (len(p) + len(r), model.config.hidden_size)
        samples.append(
            {"traj": i, "step": 0, "prompt_ids": p, "response_ids": r, "frozen": f,
             "sampler_logprobs": lp, "advantage": 1.0 if i % 2 else -1.0}
        )  # fmt: skip
    batch = train.collate(samples, tok.pad_token_id, torch.device("cpu"))
    kept = left_padded_frozen(samples)
    recorded = []
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), cpu_sampling.frozen_blocks(model, 1, keep=recorded):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=position_ids,
            )
    real = batch["attention_mask"].bool().clone()
    real[:, -1] = False  # the last response token's row is never computed while sampling
    gap = (recorded[0] - kept)[real].abs().max().item()
    print(f"\n{precision}: frozen blocks' output, sampling vs one forward: max |diff| {gap:.2g}")
    assert gap < (1e-4 if precision == "fp32" else 0.5)
    with torch.no_grad():  # the sampler's log-probs are the distribution it sampled from
        trainer = train.response_logprobs(model, batch, 1.0, precision)
    sampled = batch["sampled_mask"].bool()
    drift = (trainer - batch["sampler_logp"])[sampled].abs().max().item()
    assert drift < (1e-4 if precision == "fp32" else 0.2), drift
    # the update starts above the frozen blocks: ratio 1 at the first step, exactly
    seen = []
    loss = train.policy_loss

    def recording(logp, old_logp, *args):
        seen.append((logp - old_logp).abs().max().item())
        return loss(logp, old_logp, *args)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    plan = train.minibatch_plan(samples, 2, 4096, torch.Generator().manual_seed(0), True)
    reuse = cpu_sampling.FrozenReuse(model, samples)
    original = train.policy_loss
    train.policy_loss = recording
    try:
        train.update_policy(
            model, optimizer, samples, plan, temperature=1.0, precision=precision, reuse=reuse
        )
    finally:
        train.policy_loss = original
    assert len(plan) == 3 and seen[0] == 0.0 and max(seen) > 0.0
    assert len(reuse.known) == sum(len(micros) for micros, _ in plan)  # every one from sampling


@pytest.mark.parametrize("masked", [True, False])
def test_a_decoding_step_attends_as_sdpa_over_repeated_heads(masked):
    """grouped_attention's one-new-token path (fp32 products, no per-head copies) is the
    attention SDPA computes over key/value heads repeated for their query heads."""
    torch.manual_seed(0)
    n, heads, groups, L, d = 3, 6, 2, 11, 8
    query = torch.randn(n, heads, 1, d)
    key, value = torch.randn(n, groups, L, d), torch.randn(n, groups, L, d)
    mask = None
    if masked:
        mask = torch.ones(n, 1, 1, L, dtype=torch.bool)
        mask[0, ..., :4] = False  # left padding of row 0
    out, _ = cpu_sampling.grouped_attention(None, query, key, value, mask, scaling=0.3)
    repeat = heads // groups
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(repeat, 1),
        value.double().repeat_interleave(repeat, 1),
        attn_mask=mask,
        scale=0.3,
    ).transpose(1, 2)
    assert out.shape == (n, 1, heads, d)
    assert (out.double() - expected).abs().max() < 1e-5
    if masked:  # the padded keys are out of row 0's attention entirely
        shifted = value.clone()
        shifted[0, :, :4] += 100.0
        again, _ = cpu_sampling.grouped_attention(None, query, key, shifted, mask, scaling=0.3)
        assert torch.equal(again, out)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sampling_with_the_buffered_cache_and_head_cast_once_is_bit_identical(
    precision, tiny_model, monkeypatch
):
    """generate's KV cache written in place in fp32 (BufferedLayer) and its output layer cast
    to bf16 once per call (head_cast_once) sample the same tokens with the same log-probs and
    keep the same frozen blocks' output as transformers' concatenating cache with autocast's
    cast at every step: speed only. (With the BufferedLayer cache the prefill also runs in
    runs of similar length, prefill_rows, whose rounding may differ from one batched prefill's
    (the test above); on these short prompts it does not.)"""
    model, tok = load(tiny_model)
    train.train_top_layers(model, 1)
    if precision == "bf16":
        train.store_frozen_in_bf16(model)
    words = ["look", "go to the cabinet", "look", "take mug", "you see a drawer and a lamp"]
    prompts = [tok(f"{w}\n", add_special_tokens=False).input_ids for w in words]
    runs, reached = [], []

    def plain_cache(m):
        reached.append("cache")
        return DynamicCache(config=m.config)

    def no_cast(m, p):
        reached.append("head")
        return contextlib.nullcontext()

    for rows in (prompts, prompts[1:]):  # with a shared prompt, and all distinct
        for plain in (False, True):
            if plain:
                monkeypatch.setattr(cpu_sampling, "sampling_cache", plain_cache)
                monkeypatch.setattr(cpu_sampling, "head_cast_once", no_cast)
            torch.manual_seed(0)
            runs.append(cpu_sampling.generate(model, tok, rows, 1.0, 8, 64, precision, 1))
            monkeypatch.undo()
    assert reached.count("cache") == reached.count("head") == 2  # the patches reached generate
    for fast, plain in (runs[:2], runs[2:]):
        assert fast[1] == plain[1] and fast[2] == plain[2]  # responses, sampler log-probs
        assert all(torch.equal(a, b) for a, b in zip(fast[3], plain[3]))
    head = model.get_output_embeddings().weight  # what head_cast_once casts once
    assert head.dtype == torch.float32 and not head.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.4])
def test_the_sampler_draws_each_token_with_its_probability(temperature):
    """SampledLogprobs' inverse-CDF draw: over 200,000 rows, each token's frequency within 5
    standard errors of softmax(logits / T), tokens of probability 0 never drawn; it returns 0 at
    the pick and -inf elsewhere (generate's greedy step takes it), and keeps the pick's log-prob."""
    torch.manual_seed(0)
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5, -3.0])
    n = 200_000
    sampler = cpu_sampling.SampledLogprobs(temperature)
    scores = sampler(torch.zeros((n, 1), dtype=torch.long), logits.repeat(n, 1))
    picks = scores.argmax(-1)
    assert torch.equal(scores.isfinite().sum(-1), torch.ones(n, dtype=torch.long))
    assert torch.all(scores.gather(1, picks[:, None]) == 0.0)
    p = (logits / temperature).softmax(-1).double()
    freq = torch.bincount(picks, minlength=len(logits)).double() / n
    assert freq[4] == 0.0
    assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-12)
    sampler(picks[:, None], logits.repeat(n, 1))  # the next step records the previous pick
    want = (logits / temperature).log_softmax(-1)[picks]
    assert torch.equal(sampler.picked[0].squeeze(1), want)


def test_the_buffered_cache_holds_what_concatenation_would():
    """BufferedLayer past its first buffer's room, and after selecting rows: the keys and
    values transformers' DynamicLayer would hold, in fp32."""
    torch.manual_seed(0)
    buffered, plain = cpu_sampling.BufferedLayer(), DynamicLayer()
    for step in range(100):  # a 5-token prefill, then one token at a time
        new = [torch.randn(3, 2, 5 if step == 0 else 1, 4).bfloat16() for _ in "kv"]
        got, want = buffered.update(*new), plain.update(*new)
        if step == 50:
            buffered.batch_select_indices(torch.tensor([2, 0, 0]))
            plain.batch_select_indices(torch.tensor([2, 0, 0]))
    assert buffered.get_seq_length() == plain.get_seq_length() == 104
    assert all(torch.equal(a, b.float()) for a, b in zip(got, want))


@pytest.mark.parametrize("slack", [0, 3, 1000])  # a run per prompt, some shared, one run
def test_prefill_in_runs_of_similar_length_leaves_the_batched_prefills_cache(slack, monkeypatch):
    """prefill_rows (sorted by length, runs right-padded, causal attention without a mask) leaves
    the keys, values and frozen-block output that one left-padded, masked prefill of all the
    prompts computes, up to fp32 rounding; the padding's keys and values are zero."""
    monkeypatch.setattr(cpu_sampling, "PREFILL_SLACK", slack)
    model = tiny_llama()
    model.set_attn_implementation("grouped_sdpa")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    prompts.append([])  # a one-token prompt: generate runs its only token
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    want, want_frozen = DynamicCache(config=model.config), []
    got, got_frozen = cpu_sampling.sampling_cache(model), []
    with torch.no_grad():
        with cpu_sampling.frozen_blocks(model, 1, keep=want_frozen):
            model.get_decoder()(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=want,
                use_cache=True,
            )
        with cpu_sampling.frozen_blocks(model, 1, keep=got_frozen):
            cpu_sampling.prefill_rows(model, prompts, width, got, kept=got_frozen)
    assert len(got_frozen) == 1 and got.get_seq_length() == width
    real = mask.bool()
    assert torch.allclose(got_frozen[0][real], want_frozen[0][real], atol=1e-5)
    for buffered, plain in zip(got.layers, want.layers):
        for a, b in ((buffered.keys, plain.keys), (buffered.values, plain.values)):
            assert a.dtype == torch.float32
            assert torch.allclose(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-5)
            assert not a.transpose(1, 2)[~real].any()


@pytest.mark.slow
def test_both_samplers_draw_from_one_distribution_and_record_the_trainers_logprobs(tiny_model):
    """train.generate (model.generate samples) and cpu_sampling.generate (inverse CDF): over 600
    rows of one prompt, each first token's frequency is within 5 standard errors of
    softmax(logits / T) from a plain forward, for both; and each path's recorded log-probs of
    the tokens it drew are the trainer's (response_logprobs) for the same tokens."""
    model, tok = load(tiny_model)
    temperature = 0.6
    prompt = tok("\n<action>", add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    p = (logits / temperature).softmax(-1).double()
    assert (p > 0.02).sum() >= 4  # several likely first tokens: a distribution to compare
    n = 600
    for sampler in (train.generate, cpu_sampling.generate):
        torch.manual_seed(0)
        texts, responses, logprobs = sampler(model, tok, [prompt] * n, temperature, 3, 600)
        first = torch.tensor([r[0] for r in responses])
        freq = torch.bincount(first, minlength=len(p)).double() / n
        se = (p * (1 - p) / n).sqrt()
        assert torch.all((freq - p).abs() <= 5 * se + 1e-3), sampler.__module__
        samples = [
            {"prompt_ids": prompt, "response_ids": r, "sampler_logprobs": lp}
            for r, lp in zip(responses[:64], logprobs[:64])
        ]
        batch = train.collate(samples, tok.pad_token_id, torch.device("cpu"))
        with torch.no_grad():
            trainer = train.response_logprobs(model, batch, temperature)
        gap = ((trainer - batch["sampler_logp"]).abs() * batch["sampled_mask"]).max().item()
        assert gap < 1e-4, (sampler.__module__, gap)


@pytest.mark.parametrize("processor", [cpu_sampling.SampledLogprobs, train.TemperatureLogprobs])
def test_non_finite_logits_stop_the_sampler_saying_what(processor):
    """A NaN or +inf logit, or a row of -inf, stops both samplers at once, saying which rows and
    which step (torch.multinomial raised on them; the inverse-CDF draw returned a token)."""
    good = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, 0.0, 1.0]])
    for bad in (float("nan"), float("inf")):
        sampler = processor(0.7)
        sampler(torch.zeros((2, 1), dtype=torch.long), good)  # a -inf entry alone is fine
        logits = good.clone()
        logits[1, 0] = bad
        with pytest.raises(FloatingPointError, match="in 1 of 2 rows at decoding step 2"):
            sampler(torch.zeros((2, 1), dtype=torch.long), logits)
    with pytest.raises(FloatingPointError, match="not finite"):
        processor(0.7)(torch.zeros((1, 1), dtype=torch.long), torch.full((1, 3), float("-inf")))
