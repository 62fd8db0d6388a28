"""checkpoint.py: atomic checkpoints, exact resume (RNG states, trimming the logs of lost updates),
and the run's config.json.

A checkpoint is checkpoints/update_NNNNNN/ holding a plain `save_pretrained` model + tokenizer
(loadable and re-savable with plain transformers), optimizer.pt, and state.json (graph memory,
scheduler queue and task order, update counter, RNG states). It is written to a hidden temporary
folder and renamed, so it is whole or absent; the run's config.json is rewritten only after a
checkpoint is complete, so a failed save leaves the run as it was.
"""
import base64
import dataclasses
import json
import os
import random
import re
import shutil

from trainer.config import UsageError

# numpy and torch are imported inside the functions that use them (evaluate.py imports this cheaply).

# ================================================================================================
# RNG states (python, numpy, torch, CUDA) as JSON
# ================================================================================================

def _b64(tensor):
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _unb64(text):
    import torch
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state():
    import numpy as np
    import torch
    py = random.getstate()
    np_state = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state):
    import numpy as np
    import torch
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


# ================================================================================================
# Checkpoints: atomic folders checkpoints/update_NNNNNN, written to .tmp_update_NNNNNN, renamed
# ================================================================================================

def _umask_mode(mode=0o666):
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_config(run_dir, args):
    """config.json: every argument of the run, presets resolved (written atomically)."""
    tmp = os.path.join(run_dir, ".config.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(dataclasses.asdict(args), fh, indent=1)
    os.replace(tmp, os.path.join(run_dir, "config.json"))


def save_model(folder, model, tok, state_dict=None):
    """A plain save_pretrained model + tokenizer (of `state_dict` when given: a gathered FSDP
    model), files readable as the user's umask allows (safetensors writes 0600)."""
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, state_dict=state_dict)
    tok.save_pretrained(folder)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), _umask_mode())


def load_weights(folder, model, device):
    """Load the weights a save_model wrote (one file or shards) into `model`, strictly but for a
    tied output layer, which save_pretrained stores once as the embedding."""
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")   # large models save in shards
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(folder, name), device=str(device)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - allowed:
        raise UsageError(f"--resume: {folder} does not match --model {model.name_or_path} "
                         f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def save_checkpoint(run_dir, update, model, tok, model_state, optim_state, memory, scheduler, keep, args,
                    rng_states):
    """Write checkpoints/update_NNNNNN atomically: the model (model_state: its full state dict),
    the optimizer state, and state.json; rng_states: rng_state() of every rank, in rank order
    (one entry without torchrun)."""
    import torch
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"update_{update:06d}")
    tmp = os.path.join(root, f".tmp_update_{update:06d}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(tmp, model, tok, model_state)
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        state = {"update": update, "memory": memory.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_states[0], "rng_ranks": rng_states}
        with open(os.path.join(tmp, "state.json"), "w") as fh:
            json.dump(state, fh)
        for name in ("optimizer.pt", "state.json"):
            os.chmod(os.path.join(tmp, name), _umask_mode())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a failed save leaves the run as it was
        raise
    if os.path.exists(final):                    # re-saving one update: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)                        # atomic: a checkpoint folder is whole or absent
    write_config(run_dir, args)                  # only now: --updates of a resume, for example
    done = checkpoint_names(root)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old))
    return final


def checkpoint_names(root):
    """The complete checkpoint folders under root (update_NNNNNN), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if re.fullmatch(r"update_\d+", d) and os.path.isdir(os.path.join(root, d)))


def last_checkpoint(run_dir):
    """(path, update) of the newest complete checkpoint, or (None, 0)."""
    root = os.path.join(run_dir, "checkpoints")
    done = checkpoint_names(root)
    if not done:
        return None, 0
    return os.path.join(root, done[-1]), int(done[-1].split("_")[1])


def remove_stale_temporaries(run_dir):
    """A save that crashed mid-write leaves checkpoints/.tmp_update_*: remove it on the next start."""
    root = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".tmp_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_state(ckpt, memory, scheduler, device, rank=0):
    """Restore graph memory, schedule and this rank's RNG states from a checkpoint (its weights
    are loaded with load_weights); returns the optimizer state to load. Resumed on another number
    of ranks, a rank without a saved stream keeps its seed's."""
    import torch
    with open(os.path.join(ckpt, "state.json")) as fh:
        state = json.load(fh)
    memory.load_state_dict(state["memory"])
    try:
        scheduler.load_state_dict(state["scheduler"])
    except ValueError as e:     # e.g. another --data-dir: a different task list
        raise UsageError(f"--resume: {e}") from e
    ranks = state.get("rng_ranks", [state["rng"]])
    if rank < len(ranks):
        set_rng_state(ranks[rank])
    return torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device)


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
