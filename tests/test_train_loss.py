"""Unit tests of train.py's update pieces on hand-made tensors: the E12 loss (clipping on both
sides, the k3 KL, the token-mean reduction), response trimming, and left-padded batching
(a batched log-prob must equal the same sample's log-prob computed alone)."""

import math

import pytest
import torch

import envs
import train


def loss_of(logp, old, ref, adv, mask, clip=0.2, beta=0.0, num_tokens=None):
    def t(x):
        return torch.tensor(x, dtype=torch.float32)

    mask = t(mask)
    return train.policy_loss(
        t(logp),
        t(old),
        None if ref is None else t(ref),
        t(adv),
        mask,
        clip,
        beta,
        mask.sum() if num_tokens is None else num_tokens,
    )


def test_clip_positive_advantage_caps_ratio_above():
    # rho = e^0.5 = 1.6487 > 1.2 with A = +2: the clipped term -1.2*2 = -2.4 is the larger (min of
    # the surrogate), so the loss is -2.4 and no gradient flows through rho.
    logp = torch.tensor([[0.5]], requires_grad=True)
    loss, st = train.policy_loss(
        logp, torch.zeros(1, 1), None, torch.tensor([[2.0]]), torch.ones(1, 1), 0.2, 0.0, 1
    )
    assert loss.item() == pytest.approx(-2.4)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert st["clip_frac"] == 1.0


def test_clip_negative_advantage_caps_ratio_below():
    # rho = e^-0.5 = 0.6065 < 0.8 with A = -1: max(-A*rho, -A*0.8) = max(0.6065, 0.8) = 0.8
    loss, st = loss_of([[-0.5]], [[0.0]], None, [[-1.0]], [[1.0]])
    assert loss.item() == pytest.approx(0.8)
    assert st["clip_frac"] == 1.0


def test_no_clip_where_clipping_would_help_the_objective():
    # rho = 1.6487 with A = -1: the unclipped term 1.6487 is larger, so it is kept (pessimistic
    # bound)
    loss, st = loss_of([[0.5]], [[0.0]], None, [[-1.0]], [[1.0]])
    assert loss.item() == pytest.approx(math.exp(0.5))
    assert st["clip_frac"] == 0.0
    # rho = 0.6065 with A = +1: unclipped -0.6065 > clipped -0.8, kept, gradient flows
    logp = torch.tensor([[-0.5]], requires_grad=True)
    one = torch.ones(1, 1)
    loss, _ = train.policy_loss(logp, torch.zeros(1, 1), None, one, one, 0.2, 0.0, 1)
    assert loss.item() == pytest.approx(-math.exp(-0.5))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-math.exp(-0.5))


def test_k3_kl_value_and_sign():
    # r = log ref - log pi = -0.3 - (-0.1) = -0.2; k3 = e^-0.2 + 0.2 - 1 = 0.018730753
    loss, st = loss_of([[-0.1]], [[-0.1]], [[-0.3]], [[0.0]], [[1.0]], beta=1.0)
    assert loss.item() == pytest.approx(math.exp(-0.2) + 0.2 - 1, rel=1e-5)
    assert st["kl"] == pytest.approx(0.018730753, rel=1e-5)
    # k3 >= 0 on both sides and 0 only when pi == ref
    for r in (-2.0, -0.01, 0.0, 0.01, 2.0):
        _, st = loss_of([[0.0]], [[0.0]], [[r]], [[0.0]], [[1.0]], beta=1.0)
        assert st["kl"] == pytest.approx(math.exp(r) - r - 1, rel=1e-6, abs=1e-9)
        assert st["kl"] >= 0


def test_k3_is_not_rounded_away_at_tiny_drift():
    # after one step at lr 1e-6 the log-probs move by ~1e-6: exp(r) - 1 - r in fp32 would give 0
    _, st = loss_of([[1e-5]], [[1e-5]], [[0.0]], [[0.0]], [[1.0]], beta=1.0)
    assert st["kl"] == pytest.approx(0.5e-10, rel=0.05)


def test_token_mean_weights_every_token_equally_across_micro_batches():
    # Two samples, 1 and 3 response tokens, per-token losses -A*rho with rho = 1: token-mean is
    # (1*a0 + 3*a1) / 4, not the sample-mean (a0 + a1) / 2. Split into two micro-batches whose
    # losses use the minibatch token count, the sum is the same number.
    adv = [[1.0], [-3.0]]
    mask = [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
    zeros = [[0.0] * 3] * 2
    whole, _ = loss_of(zeros, zeros, None, adv, mask)
    assert whole.item() == pytest.approx(-(1 * 1.0 + 3 * -3.0) / 4)
    part0, _ = loss_of(zeros[:1], zeros[:1], None, adv[:1], mask[:1], num_tokens=4)
    part1, _ = loss_of(zeros[1:], zeros[1:], None, adv[1:], mask[1:], num_tokens=4)
    assert (part0 + part1).item() == pytest.approx(whole.item())


def test_padding_columns_do_not_count():
    # a huge garbage value in a masked column changes nothing
    loss_a, _ = loss_of([[0.0, 0.1]], [[0.0, 0.1]], None, [[1.0]], [[0.0, 1.0]])
    loss_b, _ = loss_of([[50.0, 0.1]], [[-50.0, 0.1]], None, [[1.0]], [[0.0, 1.0]])
    assert loss_a.item() == loss_b.item() == pytest.approx(-1.0)


class FakeTok:
    words = {0: "<eos>", 1: "<action>", 2: "look", 3: "</action>", 4: "hi"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.words[i] for i in ids)


def test_trim_reply_keeps_sampled_eos_but_not_padding():
    tok, end = FakeTok(), {0}
    assert envs.trim_reply([4, 4, 0, 0], tok, end) == [4, 4, 0]  # eos sampled: trained on
    assert envs.trim_reply([1, 2, 3, 0, 0], tok, end) == [
        1,
        2,
        3,
    ]  # stopped at </action>: pad after
    assert envs.trim_reply([4, 4, 4], tok, end) == [4, 4, 4]  # hit max_new_tokens
    assert envs.trim_reply([0, 0], tok, end) == [0]  # an immediate eos is one token


def test_micro_batches_respect_the_token_budget():
    samples = [{"prompt_ids": [1] * n, "response_ids": [2]} for n in (9, 3, 5, 1, 7)]
    batches = train.micro_batches(range(5), samples, token_budget=12)
    assert sorted(i for b in batches for i in b) == list(range(5))
    for b in batches:
        longest = max(len(samples[i]["prompt_ids"]) + 1 for i in b)
        assert longest * len(b) <= 12 or len(b) == 1


def test_left_padded_batch_logprobs_equal_single_sample_logprobs():
    """collate + response_logprobs on a ragged batch == each sample alone (no padding): pins the
    response alignment (last columns), the mask, and the mask-derived position ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    samples = [
        {"prompt_ids": [5, 6, 7, 8, 9], "response_ids": [10, 11]},
        {"prompt_ids": [3], "response_ids": [12, 13, 14, 15]},
        {"prompt_ids": [1, 2, 3], "response_ids": [16]},
    ]
    cpu = torch.device("cpu")
    batch = train.collate(samples, pad_id=0, device=cpu)
    R = batch["resp_mask"].shape[1]
    with torch.no_grad():
        batched = train.response_logprobs(model, batch, 1.0)  # (3, R)
        for i, s in enumerate(samples):
            alone = train.response_logprobs(model, train.collate([s], 0, cpu), 1.0)[0]
            n = len(s["response_ids"])
            assert batch["resp_mask"][i].tolist() == [0.0] * (R - n) + [1.0] * n
            assert torch.allclose(batched[i, R - n :], alone, atol=1e-5)
            # and the same numbers as a plain full-logits forward
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
            full = torch.log_softmax(model(ids).logits[0, :-1], -1)
            want = full[len(s["prompt_ids"]) - 1 :].gather(
                -1, ids[0, len(s["prompt_ids"]) :, None]
            )[:, 0]
            assert torch.allclose(alone, want, atol=1e-5)


def old_policy_loss(logp, old, ref, adv, mask, clip, beta, num_tokens):
    """The E12 loss as it was before padded columns were masked out (the reference numbers)."""
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip))
    r = ref - logp
    kl = torch.expm1(r) - r
    return ((pg + beta * kl) * mask).sum() / num_tokens


def test_padded_columns_holding_minus_200_give_a_finite_loss_and_gradient():
    # left padding: column 0 of row 0 is a prompt token (logp -200 there), old/ref hold 0
    logp = torch.tensor([[-200.0, -0.5, -0.2], [-0.3, -0.4, -0.1]], requires_grad=True)
    old = torch.tensor([[0.0, -0.5, -0.25], [-0.3, -0.35, -0.1]])
    ref = torch.tensor([[0.0, -0.6, -0.2], [-0.2, -0.4, -0.3]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.5], [-0.7]])
    loss, st = train.policy_loss(logp, old, ref, adv, mask, 0.2, 0.01, mask.sum())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0] == 0.0 and all(math.isfinite(v) for v in st.values())
    # the unmasked formula overflows there: k3 = exp(0 - (-200)) = inf, and inf * 0 = NaN
    assert torch.isnan(old_policy_loss(logp.detach(), old, ref, adv, mask, 0.2, 0.01, mask.sum()))


def test_masking_changes_nothing_on_a_normal_batch():
    torch.manual_seed(0)
    logp = -torch.rand(4, 6)
    old = logp + 0.05 * torch.randn(4, 6)
    ref = logp + 0.05 * torch.randn(4, 6)
    mask = (torch.arange(6) >= torch.tensor([[0], [2], [3], [5]])).float()
    logp, old, ref = (torch.where(mask > 0, x, -0.5) for x in (logp, old, ref))  # sane padding
    adv = torch.randn(4, 1)
    new, _ = train.policy_loss(logp, old, ref, adv, mask, 0.2, 0.01, mask.sum())
    assert (
        abs(new.item() - old_policy_loss(logp, old, ref, adv, mask, 0.2, 0.01, mask.sum()).item())
        < 1e-6
    )


def tiny_llama(vocab=50, positions=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=positions,
        )
    )


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
@pytest.mark.parametrize("kept", [True, False])  # the logits kept for backward, or recomputed
def test_chunked_logprobs_and_gradients_equal_the_full_logits(chunk, kept, monkeypatch):
    if not kept:
        monkeypatch.setattr(train, "KEEP_LOGITS_BYTES", 0)
    model = tiny_llama()
    samples = [
        {"prompt_ids": [5, 6, 7, 8, 9], "response_ids": [10, 11, 12]},
        {"prompt_ids": [3], "response_ids": [12, 13, 14, 15, 16, 17]},
    ]
    cpu = torch.device("cpu")
    batch = train.collate(samples, pad_id=0, device=cpu)
    got = train.response_logprobs(model, batch, 0.7, "fp32", chunk)
    (got * batch["resp_mask"]).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    R = batch["resp_mask"].shape[1]
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids,
        ).logits[:, -R - 1 : -1]
        / 0.7
    )
    want = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, -R:, None])[..., 0]
    (want * batch["resp_mask"]).sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(grads, model.parameters()))


def test_frozen_layers_stored_in_bf16_give_the_same_logprobs_and_gradients_under_bf16():
    """store_frozen_in_bf16 casts once what bf16 autocast casts every forward: bit-identical."""
    samples = [
        {"prompt_ids": [5, 6, 7, 8, 9], "response_ids": [10, 11, 12]},
        {"prompt_ids": [3], "response_ids": [12, 13, 14, 15, 16, 17]},
    ]
    batch = train.collate(samples, pad_id=0, device=torch.device("cpu"))
    results = []
    for store in (False, True):
        model = tiny_llama()
        model.requires_grad_(False)
        model.model.layers[-1].requires_grad_(True)  # --trainable-layers 1
        if store:
            train.store_frozen_in_bf16(model)
            assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
            assert model.model.layers[-1].mlp.up_proj.weight.dtype == torch.float32
            assert model.lm_head.weight.dtype == torch.float32
        logp = train.response_logprobs(model, batch, 0.7, "bf16")
        (logp * batch["resp_mask"]).sum().backward()
        results.append((logp.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def frozen_llama(layers=4, trained=2, precision="fp32"):
    """A tiny Llama with only its top blocks (and the final norm) trained, as --trainable-layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 0
    train.train_top_layers(model, trained)
    if precision == "bf16":
        train.store_frozen_in_bf16(model)
    return model


def frozen_samples(count=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = torch.randint(
            1, 50, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen
        )
        response = torch.randint(
            1, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen
        )
        advantage = float(torch.randn(1, generator=gen))
        samples.append(
            {
                "traj": i,
                "step": 0,
                "prompt_ids": prompt.tolist(),
                "response_ids": response.tolist(),
                "advantage": advantage,
            }
        )
    return samples


class WordTok:
    """A tokenizer of one token per whitespace word, with a chat template of two tokens."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "<user> " + " ".join(m["content"] for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [hash(w) % 1000 for w in text.split()]

        return Out()


def test_a_long_prompt_is_fitted_to_the_context_by_the_stated_policy():
    tok = WordTok()
    history = [("old obs " * 20, "go to a"), ("recent obs " * 20, "go to b")]
    obs = "word " * 200
    actions = ["go to desk 1", "take mug 1 from desk 1", "look"]
    full, cut = envs.fit_prompt(
        tok, "put a mug in desk", history, obs, actions, "alfworld", "action", None
    )
    assert not cut and len(full) > 300
    # room for everything but the history: the oldest pair goes first, then the other
    ids, cut = envs.fit_prompt(
        tok, "put a mug in desk", history, obs, actions, "alfworld", "action", len(full) - 30
    )
    assert cut and len(ids) <= len(full) - 30
    # little room: no history, the observation's middle cut, every admissible action whole
    limit = 80
    ids, cut = envs.fit_prompt(
        tok, "put a mug in desk", history, obs, actions, "alfworld", "action", limit
    )
    assert cut and len(ids) <= limit
    text_ids = set(ids)
    for a in actions:  # each action line survives whole
        assert all(t in text_ids for t in tok(f"<action>{a}</action>").input_ids)
    # no room even for the actions: the prompt's end (with the prefill) is kept, never more than
    # limit
    ids, cut = envs.fit_prompt(
        tok, "put a mug in desk", history, obs, actions, "alfworld", "action", 12
    )
    assert cut and len(ids) == 12


def test_keeping_the_logits_for_backward_changes_no_gradient_bit(monkeypatch):
    """Small logits kept for backward instead of recomputed there: the same gradients, exactly."""
    samples = [
        {"prompt_ids": [5, 6, 7, 8, 9], "response_ids": [10, 11, 12]},
        {"prompt_ids": [3], "response_ids": [12, 13, 14, 15, 16, 17]},
    ]
    grads = []
    for limit in (0, train.KEEP_LOGITS_BYTES):
        monkeypatch.setattr(train, "KEEP_LOGITS_BYTES", limit)
        torch.manual_seed(0)
        model = tiny_llama()
        batch = train.collate(samples, pad_id=0, device=torch.device("cpu"))
        got = train.response_logprobs(model, batch, 0.7, "fp32", 4)
        (got * batch["resp_mask"]).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
