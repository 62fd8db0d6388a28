"""extras/cpu_sampling.py: sampling on a CPU, fast, and the reuse of frozen blocks' output.

train.py samples with its own `generate`: left-pad, `model.generate`, trim. On a CPU that plain
path spends most of a decoding step copying: transformers' "sdpa" attention repeats every key/value
head for its query heads, its cache concatenates itself at every step, the bf16 output layer is
cast again at every step, and `torch.multinomial` draws a number per vocabulary entry. This module
is the same sampling without those costs (with its pieces in, the demo's rollout took 0.38x the
time per env step it had taken before issue 29, docs/RESULTS.md; `python bench/engines.py` times
it beside train.generate), entered from train.py by one call where the samplers are made (on a
CPU with the HF engine) and one where the update is prepared (FrozenReuse). A reader of the
method can skip it; tests/test_cpu_sampling.py holds it to train.generate's distribution and
log-probs.

  * generate: train.generate's contract (texts, response ids, their log-probs), plus, with
    frozen = N, the output of the bottom N (frozen) blocks for each prompt + response;
  * SampledLogprobs: the sampler, by inverse CDF (one uniform number per row);
  * BufferedLayer, sampling_cache: the KV cache in fp32 buffers, each new token written in place;
  * grouped_attention, decode_attention: SDPA over grouped-query heads without copies, decoding
    steps as two fp32 products; registered with transformers as "grouped_sdpa" by `generate`,
    which switches the model to it for the call and back;
  * head_cast_once: the output layer cast to bf16 once per call;
  * shared_prefill, prefill_rows: each distinct prompt once, in runs of similar length;
  * frozen_depth, frozen_blocks, frozen_rows, FrozenReuse: the frozen bottom blocks
    (--trainable-layers, LoRA on the top blocks) run once per sample, in the rollout, and their
    output stands in for them in every pass of the update.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import sdpa_mask

import envs


def autocast(device, precision):
    """bf16 autocast over fp32 weights, or nothing for fp32 (as train.py runs its forwards)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@functools.lru_cache(maxsize=4)
def stop_at_action_end(tok):
    """generate's stop at '</action>', built once per tokenizer (as train.stop_at_action_end)."""
    return StopStringCriteria(tok, [envs.ACTION_END])


@torch.no_grad()
def generate(
    model, tok, prompt_ids, temperature, max_new_tokens, batch_size=64, precision="fp32", frozen=0
):
    """train.generate on a CPU, fast: one reply per prompt (token ids), in batched left-padded
    calls of model.generate, up to '</action>' or eos, by plain temperature sampling
    (SampledLogprobs draws, generate takes its pick) configured from scratch, so the model's
    generation_config (Qwen's top_p, top_k, repetition_penalty) never applies. Returns (texts,
    response ids, their log-probs); with frozen = N > 0 (frozen_depth), also the output of the
    bottom N blocks for each prompt + response, (P + R, H), which the update then starts from
    instead of running those blocks again (FrozenReuse)."""
    if hasattr(model, "peft_config"):  # LoRA: the wrapped model, its layers hold the adapters
        model = model.get_base_model()
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    end_ids = {tok.pad_token_id, tok.eos_token_id, *eos} - {None}
    config = GenerationConfig(
        do_sample=False,  # SampledLogprobs samples; generate takes its pick
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=sorted(end_ids - {tok.pad_token_id}) or tok.eos_token_id,
    )
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # no model defaults
    attention = model.config._attn_implementation
    if device.type == "cpu" and attention == "sdpa":  # for this call, restored at its end
        register_grouped_attention()
        model.set_attn_implementation("grouped_sdpa")
    texts, responses, logprobs, kept = [], [], [], []
    try:
        for lo in range(0, len(prompt_ids), batch_size):
            rows = prompt_ids[lo : lo + batch_size]
            width = max(map(len, rows))
            pad = tok.pad_token_id
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
            mask = torch.tensor(
                [[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device
            )
            sampler = SampledLogprobs(temperature)
            # the frozen blocks' output: the prompt's, then one token per decoding step
            steps = []
            keep = frozen_blocks(model, frozen, keep=steps) if frozen else contextlib.nullcontext()
            with keep, autocast(device, precision), head_cast_once(model, precision):
                cache = sampling_cache(model)
                shared = shared_prefill(model, rows, ids, mask, cache, steps if frozen else None)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    past_key_values=cache,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([sampler]),
                    stopping_criteria=StoppingCriteriaList([stop_at_action_end(tok)]),
                )
            if frozen and shared is not None:  # the prefill's rows, then the last prompt token's
                steps[:2] = [torch.cat([steps[0][shared], steps[1]], dim=1)]
            last = sampler.last.gather(1, out[:, -1:])
            lps = torch.cat(sampler.picked + [last], dim=1).tolist()  # (n, new tokens)
            for i, (row, lp) in enumerate(zip(out[:, width:].tolist(), lps)):
                response = envs.trim_reply(row, tok, end_ids)
                responses.append(response)
                logprobs.append(lp[: len(response)])
                texts.append(tok.decode(response, skip_special_tokens=True))
                if frozen:
                    kept.append(frozen_rows(steps, i, len(rows[i]), len(response)))
    finally:
        model.generation_config = saved
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    if frozen:
        return texts, responses, logprobs, kept
    return texts, responses, logprobs


class SampledLogprobs(LogitsProcessor):
    """The sampler, owned: samples each row's next token from softmax(logits / temperature) and
    keeps log pi(token) of each sampled token, the sampler's side of rollout_logprob_gap.
    generate runs greedy and takes the pick: this returns 0 at the sampled token, -inf at every
    other. Inverse-CDF sampling, one uniform number per row: torch.multinomial draws one
    exponential number per vocabulary entry (~17 ms per decoding step for 16 rows of SmolLM2's
    49,152 on 2 cores, ~20 % of the step; this takes ~2 ms)."""

    def __init__(self, temperature):
        self.temperature = temperature
        self.last = None
        self.picked = []

    def __call__(self, input_ids, scores):
        if self.last is not None:  # the token sampled from the previous step's scores
            self.picked.append(self.last.gather(1, input_ids[:, -1:]))
        self.last = (scores.float() / self.temperature).log_softmax(-1)
        cdf = self.last.double().exp().cumsum(-1)  # fp64: each token's share exact to ~1e-16
        bad = ~torch.isfinite(cdf[:, -1])  # a NaN or +inf logit, or a row of -inf, ends here
        if bad.any():
            raise FloatingPointError(
                f"the sampler's logits are NaN, +inf or all -inf in {int(bad.sum())} of "
                f"{len(bad)} rows at decoding step {len(self.picked) + 1}: the model's weights "
                f"or activations are not finite"
            )
        u = torch.rand((len(cdf), 1), dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)
        return torch.full_like(self.last, float("-inf")).scatter_(1, token, 0.0)


def sampling_cache(model):
    """An empty KV cache for generate: of BufferedLayer blocks under grouped_attention (on a
    CPU, which reads them), transformers' own under any other attention."""
    cache = DynamicCache(config=model.config)
    if model.config._attn_implementation == "grouped_sdpa":
        cache.layers = [BufferedLayer() for _ in cache.layers]
    return cache


class BufferedLayer(DynamicLayer):
    """One block's KV cache while sampling on a CPU: keys and values in fp32 buffers with room to
    spare, each new token written in place. DynamicLayer concatenates the whole cache at every
    decoding step, and decode_attention then cast it to fp32, per block: 2 copies of the cache
    per step, ~60 % of a decoding step's time (SmolLM2, 16 rows of ~400 tokens, 2 cores). The
    values are the same: bf16 keys are exact in fp32, and the prefill casts them back."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.dtype = torch.float32
        self.length = 0
        self.buffers = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, heads, new, d = key_states.shape
        end = self.length + new
        if self.buffers is None or end > self.buffers[0].shape[2]:
            room = max(end + 64, 2 * self.length)  # 64: the demo's replies never outgrow it
            grown = [key_states.new_zeros((n, heads, room, d), dtype=torch.float32) for _ in "kv"]
            for old, buffer in zip(self.buffers or (), grown):
                buffer[:, :, : self.length] = old[:, :, : self.length]
            self.buffers = grown
        self.buffers[0][:, :, self.length : end] = key_states
        self.buffers[1][:, :, self.length : end] = value_states
        prefill, self.length = self.length == 0, end
        self.keys, self.values = (buffer[:, :, :end] for buffer in self.buffers)
        if prefill:  # it attends over what it just computed, as it is
            return key_states, value_states
        return self.keys, self.values

    def get_seq_length(self):
        return self.length if self.is_initialized else 0

    def write_rows(self, rows, computed, lengths, n, width):
        """A prefill computed elsewhere (prefill_rows), into this layer of an n-row cache
        left-padded to width: computed (a DynamicLayer, right-padded) holds rows[k]'s keys and
        values in its row k, over its first lengths[k] positions."""
        if not self.is_initialized:
            self.lazy_initialization(computed.keys, computed.values)
            shape = (n, computed.keys.shape[1], width + 64, computed.keys.shape[3])
            self.buffers = [computed.keys.new_zeros(shape, dtype=torch.float32) for _ in "kv"]
            self.length = width
            self.keys, self.values = (buffer[:, :, :width] for buffer in self.buffers)
        for k, (row, length) in enumerate(zip(rows, lengths)):
            self.buffers[0][row, :, width - length : width] = computed.keys[k, :, :length]
            self.buffers[1][row, :, width - length : width] = computed.values[k, :, :length]

    def batch_select_indices(self, indices):
        if self.get_seq_length():
            self.buffers = [buffer[indices] for buffer in self.buffers]
            self.keys, self.values = (buffer[:, :, : self.length] for buffer in self.buffers)

    def batch_repeat_interleave(self, repeats):
        self.batch_select_indices(
            torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats)
        )

    def crop(self, tokens_to_remove):
        raise NotImplementedError("sampling never crops its cache")


def grouped_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention while sampling on a CPU: torch's SDPA over grouped-query heads as they are.
    Transformers' "sdpa" repeats every key/value head for its query heads whenever there is a
    padding mask: a copy of the whole KV cache, per block, per new token, most of a decoding
    step's time (SmolLM2 on 2 cores: ~5x slower per step). The same product, without the
    copies. (On CUDA, SDPA with grouped heads and a mask falls back to its slowest kernel.)
    A decoding step (one new token) is two small products in fp32 instead: torch's CPU SDPA
    kernel takes ~10x longer on them in bf16 (16 rows x 300 keys: 3.5 ms vs 0.7 ms per block,
    docs/RESULTS.md) and is less exact than fp32 scores and softmax."""
    if query.shape[2] == 1:
        return decode_attention(query, key, value, attention_mask, scaling)
    key, value = key.to(query.dtype), value.to(query.dtype)  # a BufferedLayer's are fp32
    causal = attention_mask is None
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None  # (n, new tokens, heads, head size)


def decode_attention(query, key, value, attention_mask, scaling=None):
    """One new token's attention, (n, heads, 1, d) over (n, kv heads, L, d) keys and values:
    each key/value head's query heads as the rows of one product, so nothing is copied per head.
    Its inputs are cast to fp32, but under --precision bf16 CPU autocast runs the two products in
    bf16 (their scores then rounded as a bf16 SDPA's would be); the mask and softmax run in fp32.
    bench/sampler_precision.py measures the products with autocast off (docs/RESULTS.md).
    attention_mask: None or sdpa_mask's bool (n, 1, 1, L), True = attend. Returns
    (n, 1, heads, d) in the query's dtype."""
    n, heads, _, d = query.shape
    groups = key.shape[1]
    q = query.reshape(n, groups, heads // groups, d).float()
    scores = q @ key.float().transpose(-1, -2) * (d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # broadcast over the groups and their query rows
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = scores.softmax(-1) @ value.float()  # (n, groups, heads // groups, d)
    return out.reshape(n, 1, heads, d).to(query.dtype), None


def register_grouped_attention():
    """Make "grouped_sdpa" a transformers attention implementation (generate switches the model
    to it for its call): registering twice is harmless."""
    AttentionInterface.register("grouped_sdpa", grouped_attention)
    AttentionMaskInterface.register("grouped_sdpa", sdpa_mask)


@contextlib.contextmanager
def head_cast_once(model, precision):
    """Within one generate call under bf16 autocast: the output layer's weight cast to bf16 once,
    not at every decoding step. The head stays fp32 (store_frozen_in_bf16), and autocast caches
    only weights that require grad: casting SmolLM2's 49,152 x 576 head took ~20 ms of each
    decoding step on 2 cores. The same bf16 weight, so the same logits, bit for bit. Not on a
    sharded model: its weights are whole only inside its forward. (The trainer's head is fp32:
    this bf16 one is about half of the sampler-trainer gap under bf16, 0.02 nats per token;
    an fp32 head halves it for ~7-24 % more per sampling call: docs/RESULTS.md.)"""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    plain = isinstance(head, torch.nn.Linear) and weight.dtype == torch.float32
    if precision != "bf16" or not plain or weight.requires_grad or sharded(model):
        yield
        return
    cast = weight.to(torch.bfloat16)
    bias = None if head.bias is None else head.bias.to(torch.bfloat16)
    head.forward = lambda hidden: F.linear(hidden, cast, bias)  # shadows the class's forward
    try:
        yield
    finally:
        head.__dict__.pop("forward", None)


def shared_prefill(model, rows, ids, mask, cache, kept=None):
    """generate's prefill: all but each prompt's last token, into the empty KV `cache`, through
    the blocks only (the output layer on one position per row cost ~60 ms per forward on 2
    cores: the strided slice made it a batched product over a copy of the head per row).
    generate then runs the last prompt token and samples each row on its own. A prompt that
    several rows share (the K episodes of a group at their first step, and later while they stay
    on one path) runs once: the distinct prompts fill the cache, which is then copied to every
    row holding them. On a CPU (a BufferedLayer cache) they run in runs of similar lengths
    without left padding (prefill_rows). `kept`: the list frozen_blocks records into; the
    prompts' frozen-block output ends there as one left-padded (distinct, width - 1, H) entry.
    Returns shared: shared[i] is row i's prompt among the distinct ones; None when the model is
    sharded (FSDP) or the prompts are one token: generate then runs the whole prefill itself."""
    if sharded(model) or ids.shape[1] < 2:  # FSDP: every rank in lockstep
        return None
    first = {}
    which = [first.setdefault(tuple(r), i) for i, r in enumerate(rows)]
    distinct = sorted(first.values())
    index = {i: j for j, i in enumerate(distinct)}
    if isinstance(cache.layers[0], BufferedLayer):
        prefill_rows(model, [rows[i][:-1] for i in distinct], ids.shape[1] - 1, cache, kept)
    else:
        part = mask[distinct, :-1]
        model.get_decoder()(
            input_ids=ids[distinct, :-1],
            attention_mask=part,
            position_ids=(part.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
        )
    shared = torch.tensor([index[i] for i in which], device=ids.device)
    cache.batch_select_indices(shared)
    return shared


PREFILL_SLACK = 32  # tokens of padding a prompt may take to share a forward (prefill_rows)


def prefill_rows(model, prompts, width, cache, kept=None):
    """The prompts through the model's blocks, sorted by length and cut into runs whose lengths
    differ by at most PREFILL_SLACK tokens, each run one forward right-padded to its longest:
    causal attention without a mask, whose real tokens never see the padding after them. Their
    keys and values are then written into `cache` (BufferedLayer blocks) left-padded to
    `width`, as generate reads them; the padding's are zero and masked out. A batch of the
    demo's prompts left-padded to the longest is ~30 % padding, and its masked attention is
    slower than the causal one; one forward per prompt would instead pay the forward's fixed
    cost (~40 ms on 2 cores, about 32 tokens' worth) for each."""
    device = next(model.parameters()).device
    order = sorted((i for i, p in enumerate(prompts) if p), key=lambda i: -len(prompts[i]))
    runs = []
    for i in order:
        if runs and len(prompts[runs[-1][0]]) - len(prompts[i]) <= PREFILL_SLACK:
            runs[-1].append(i)
        else:
            runs.append([i])
    done = len(kept) if kept is not None else 0
    for run in runs:
        longest = len(prompts[run[0]])
        own = DynamicCache(config=model.config)
        model.get_decoder()(
            input_ids=torch.tensor(
                [prompts[i] + [0] * (longest - len(prompts[i])) for i in run], device=device
            ),
            past_key_values=own,
            use_cache=True,
        )
        for layer, computed in zip(cache.layers, own.layers):
            layer.write_rows(run, computed, [len(prompts[i]) for i in run], len(prompts), width)
    if kept is not None:  # one (run, longest, H) entry per run -> one (n, width, H), left-padded
        out = kept[done].new_zeros((len(prompts), width, kept[done].shape[-1]))
        for run, computed in zip(runs, kept[done:]):
            for k, i in enumerate(run):
                out[i, width - len(prompts[i]) :] = computed[k, : len(prompts[i])]
        kept[done:] = [out]


def frozen_rows(steps, i, prompt_len, response_len):
    """Row i's frozen-block output over its prompt + response, (P + R, H), from what generate
    recorded: steps[0] the prompt's (n, width, H, left-padded), steps[t] decoding step t's
    (n, 1, H), whose input was response token t - 1. The last response token is never an input
    during sampling; its row stays zero: causal attention keeps it out of every earlier
    position, and a response's log-probs are read at the positions before it."""
    prompt = steps[0][i, steps[0].shape[1] - prompt_len :]
    tokens = [step[i] for step in steps[1:response_len]]
    end = prompt.new_zeros((1, prompt.shape[-1]))
    return torch.cat([prompt, *tokens, end])


def sharded(model):
    """Whether FSDP (torchrun --fsdp) shards the model: every rank then runs the same forwards
    in lockstep, each of which gathers the weights (so no rank may skip or add one), and the
    weights are whole only inside a forward."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def frozen_depth(model):
    """How many bottom blocks never train (--trainable-layers, or LoRA on the top blocks): the
    embedding and every weight of those blocks frozen. Their output for a sample is the same in
    every pass of an update, so it is computed once (frozen_blocks). 0 when there is nothing to
    reuse: every block trains, or the model is sharded."""
    if sharded(model):
        return 0
    if any(p.requires_grad for p in model.get_input_embeddings().parameters()):
        return 0
    depth = 0
    for layer in model.get_decoder().layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        depth += 1
    return depth


@contextlib.contextmanager
def frozen_blocks(model, depth, keep=None, given=None):
    """Around a forward of `model` whose bottom `depth` blocks are frozen. With `keep` (a list),
    their output (the hidden state entering block `depth`, (n, L, H)) is appended to it. With
    `given`, that output is known: those blocks are skipped and it stands in for theirs. The
    blocks above get exactly the input they would have computed from, so the result is the
    same, bit for bit, when `given` was recorded from the same batch."""
    layers = model.get_decoder().layers

    def record(module, args, output):
        keep.append((output[0] if isinstance(output, tuple) else output).detach())

    def skip(hidden_states, *args, **kwargs):
        return hidden_states

    def replay(hidden_states, *args, **kwargs):
        return given

    handle = None
    if keep is not None:
        handle = layers[depth - 1].register_forward_hook(record)
    if given is not None:
        for layer in layers[: depth - 1]:
            layer.forward = skip  # an instance attribute shadows the class's forward
        layers[depth - 1].forward = replay
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        for layer in layers[:depth]:
            layer.__dict__.pop("forward", None)


def keep_frozen(model, samples, forward):
    """Give samples that no rollout generated (the expert steps --bc-coef adds to every update)
    what a rollout keeps for FrozenReuse: "frozen", the frozen blocks' output over prompt and
    response, (P + R, H), from forward([sample]) (the trainer's forward of a batch), one sample
    at a time, so no padding enters it."""
    depth = frozen_depth(model)
    for s in samples:
        kept = []
        with torch.no_grad(), frozen_blocks(model, depth, keep=kept):
            forward([s])
        s["frozen"] = kept[0][0]


class FrozenReuse:
    """The update's side of the frozen blocks, for one update's samples: reuse(micro) is the
    context of the policy's forward of the micro-batch holding those sample indices. When each
    of them carries the frozen blocks' output from the rollout ("frozen", (P + R, H), from
    generate), the forward starts above those blocks from it, left-padded as train.collate pads
    the tokens; else a no-grad pass (pi_old) records their output for the passes that follow.
    A micro-batch appears in the pi_old pass and in its step, with the same indices. The result
    is the same, bit for bit, as running the blocks (tests/test_cpu_sampling.py).
    reference(ref_model, micro) is the KL reference's forward of the same micro-batch: its
    frozen blocks are the policy's (a copy, or the policy itself with LoRA's adapters off), so
    an output known here stands in for theirs too."""

    def __init__(self, model, samples):
        self.model = model
        self.samples = samples
        self.depth = frozen_depth(model)
        self.known = {}  # (sample indices) -> (n, L, H) output of the frozen blocks

    def given(self, micro):
        """The frozen blocks' output for this micro-batch: recorded, or carried by every one of
        its samples from the rollout (then kept); None if neither, or no block is frozen."""
        if not self.depth:
            return None
        key = tuple(micro)
        members = [self.samples[i] for i in micro]
        if key not in self.known and all("frozen" in s for s in members):
            L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in members)
            like = members[0]["frozen"]
            given = like.new_zeros((len(members), L, like.shape[-1]))
            for i, s in enumerate(members):
                given[i, L - len(s["frozen"]) :] = s["frozen"]
            self.known[key] = given.to(next(self.model.parameters()).device)
        return self.known.get(key)

    @contextlib.contextmanager
    def __call__(self, micro):
        given = self.given(micro)
        if given is not None:
            with frozen_blocks(self.model, self.depth, given=given):
                yield
        elif self.depth and not torch.is_grad_enabled():
            recorded = []
            with frozen_blocks(self.model, self.depth, keep=recorded):
                yield
            self.known[tuple(micro)] = recorded[0]
        else:
            yield

    @contextlib.contextmanager
    def reference(self, ref_model, micro):
        given = self.given(micro)
        if given is None:  # nothing recorded yet: the reference runs its own frozen blocks
            yield
            return
        model = getattr(ref_model, "peft_model", ref_model)  # train.AdaptersOff wraps the policy
        with frozen_blocks(model, self.depth, given=given):
            yield
