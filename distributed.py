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

    def sum(self, values):
        """Element-wise sum over ranks of a list of floats."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def sum_gradients(self, model):
        """all_reduce(SUM) of every gradient, flattened into one buffer: each rank's loss is already
        divided by the global minibatch's token count, so the sum is the global token-mean's
        gradient. A parameter without a gradient on this rank contributes zeros."""
        if self.world == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def barrier(self):
        if self.world > 1:
            dist.barrier()
