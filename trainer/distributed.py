"""distributed.py: every torch.distributed line of train.py, in one place (launch with torchrun).

    torchrun --nproc_per_node N train.py ...                  # one node, N devices
    torchrun --nnodes M --node_rank R --rdzv_endpoint HOST:PORT --nproc_per_node N train.py ...

What a rank does (CleanRL's ppo_atari_multigpu.py pattern: the single-process algorithm plus a few
collectives, no wrapper around the model):
  * every rank makes the same plan (same seed, same scheduler) and runs its contiguous share of the
    update's B*K episodes in its own env pool, with its own model replica;
  * the per-trajectory records the core needs (states, valid flags, score, success) are gathered,
    so every rank holds the whole batch and runs the same tigpo.compute_advantages, GraphMemory.add
    and RevisitScheduler.record on it: memory and queue are identical on every rank;
  * the update is data-parallel: each rank back-propagates its samples of a *global* minibatch,
    whose token count is global (E12's token-mean), then gradients are summed with all_reduce, so
    every rank takes the same optimizer step as one process holding all the samples;
  * rank 0 alone writes logs, metrics, trajectories and checkpoints.
Without torchrun (no WORLD_SIZE in the environment, or 1) every function here is the identity.
"""
import contextlib
import datetime
import os

import torch
import torch.distributed as dist


class Dist:
    """rank / world size / local rank of this process; world 1 without torchrun."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.fsdp = False   # set by shard(): then every forward is a collective (lockstep below)

    @property
    def main(self):
        return self.rank == 0

    def start(self, device_type):
        """Join the process group (NCCL on CUDA, gloo on CPU). A rank that dies makes torchrun
        stop the others; the collectives' timeout bounds a rank that hangs."""
        if self.world > 1:
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))

    def stop(self):
        if self.world > 1 and dist.is_initialized():
            dist.barrier()          # no rank tears gloo down while another still talks to it (SIGABRT)
            dist.destroy_process_group()

    def share(self, n):
        """This rank's contiguous block of range(n) (K rollouts of a group stay together)."""
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return range(lo, hi)

    def gather(self, items):
        """Concatenate every rank's list in rank order (picklable items; small records only)."""
        if self.world == 1:
            return list(items)
        parts = [None] * self.world
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]

    def broadcast(self, obj):
        """Rank 0's value of a picklable object, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max(self, value):
        """The largest value of an int over ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum(self, values):
        """Element-wise sum over ranks of a list of floats."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def sum_gradients(self, model, bucket=1 << 25):
        """all_reduce(SUM) of every gradient, in flat buckets of at most `bucket` elements: each
        rank's loss is already divided by the global minibatch's token count, so the sum is the
        global token-mean's gradient. A parameter without a gradient on this rank (it had no
        sample with a signal) contributes zeros."""
        if self.world == 1 or self.fsdp:   # FSDP reduce-scatters (sums) them in backward itself
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(params):
            group, size = [], 0
            while start < len(params) and (not group or size + params[start].numel() <= bucket):
                group.append(params[start])
                size += params[start].numel()
                start += 1
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def replica_drift(self, model):
        """The largest difference between ranks of a checksum of the trained weights: 0.0 when
        every replica holds the same model (logged as replica_drift)."""
        if self.world == 1 or self.fsdp:   # sharded: each rank holds a different part by design
            return 0.0
        checksum = sum(p.detach().double().sum().item() for p in model.parameters() if p.requires_grad)
        sums = self.gather([checksum])
        return max(sums) - min(sums)

    # --------------------------------------------------------------------------- FSDP (--fsdp)
    # Parameters, gradients and optimizer state sharded over the ranks with FSDP2's fully_shard (one
    # unit per transformer block, plus the root), so a model that does not fit one device trains.
    # Every forward and backward is then a collective: ranks must run the same number of them, so
    # train.py pads generate calls (synced_gpus) and micro-batches with zero-weight dummies when
    # self.fsdp is set. Checkpoints gather the full state on rank 0.

    def shard(self, model):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(model)
        for unit in model.modules():    # each unit reduces its own gradients
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)          # sum, not mean: each rank's loss is
                unit.set_force_sum_reduction_for_comms(True)  # its share of the global token-mean
        self.fsdp = True
        return model

    def full_state(self, model, optimizer=None):
        """(model state, optimizer state) as plain full tensors on rank 0 (None elsewhere); all ranks
        must call it. Without FSDP: the local state dicts."""
        if not self.fsdp:   # model None: save_pretrained takes the model's own
            return None, optimizer.state_dict() if optimizer is not None else None
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
        return (model_state, optim_state) if self.main else (None, None)

    def load_optimizer(self, model, optimizer, state):
        """Load a full optimizer state (from full_state) into a possibly sharded optimizer."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    @contextlib.contextmanager
    def rank_zero_first(self):
        """Rank 0 runs the block first (e.g. generates the games into the cache), then the others."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def barrier(self):
        if self.world > 1:
            dist.barrier()
