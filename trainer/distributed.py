"""distributed.py: everything of train.py that crosses ranks, in one place (launch with torchrun).

    torchrun --nproc_per_node N train.py ...                  # one node, N devices
    torchrun --nnodes M --node_rank R --rdzv_endpoint HOST:PORT --nproc_per_node N train.py ...

What a rank does (CleanRL's ppo_atari_multigpu.py pattern: the single-process algorithm plus a few
collectives, no wrapper around the model):
  * every rank makes the same plan (same seed, same scheduler) and runs its contiguous share of the
    update's B*K episodes in its own env pool, with its own model replica;
  * the whole trajectory records are gathered (their text too, for rank 0's log), so every rank
    holds the whole batch and runs the same tigpo.compute_advantages, GraphMemory.add and
    RevisitScheduler.record on it: memory and queue are identical on every rank;
  * the update is data-parallel: every rank draws the same minibatches from the *global* sample
    list (plan), back-propagates its own samples of each, with the global token count as E12's
    token-mean denominator, and gradients are summed (sum_gradients) before the clip and the step,
    so every rank takes the step one process holding all the samples would take;
  * rank 0 alone writes logs, metrics, trajectories and checkpoints.
With one process (no torchrun) every method is the identity and no torch.distributed call is made:
train.py's functions (generate, run_episodes, update_policy, ...) contain no collective; they take
what this module hands them (a plan, a sampler, a before_step hook).
"""
import contextlib
import datetime
import functools
import os

import torch
import torch.distributed as dist

# An FSDP filler: under FSDP every forward and backward is a collective, so a rank with fewer
# micro-batches in a step runs this one (its resp_mask is 0: it adds nothing to loss or gradient).
PADDING = {"traj": -1, "step": -1, "prompt_ids": [0], "response_ids": [0], "advantage": 0.0, "padding": True}


class Dist:
    """rank / world size / local rank of this process; world 1 without torchrun."""
    PADDING = PADDING

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.fsdp = False   # set by shard(): then every forward is a collective (lockstep below)

    @property
    def main(self):
        return self.rank == 0

    def say(self, message):
        if self.main and message:
            print(message)

    @staticmethod
    def cuda(device):
        return torch.cuda.is_available() and device != "cpu"

    def start(self, device, message=None):
        """This rank's device; joins the process group (NCCL on CUDA, gloo on CPU). A rank that dies
        makes torchrun stop the others; the collectives' timeout bounds a rank that hangs."""
        cuda = self.cuda(device)
        out = torch.device(f"cuda:{self.local_rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(out)
        if self.world > 1:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
        self.say(message)
        return out

    def stop(self):
        if self.world > 1 and dist.is_initialized():
            dist.barrier()          # no rank tears gloo down while another still talks to it (SIGABRT)
            dist.destroy_process_group()

    def share(self, n):
        """This rank's contiguous block of range(n): episodes are dealt in order, so a group's K
        rollouts stay on one rank when world size divides B*K, and are split over two otherwise
        (the records are gathered before any group is scored, so either is correct)."""
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return range(lo, hi)

    def gather(self, items):
        """Concatenate every rank's list in rank order (picklable items)."""
        if self.world == 1:
            return list(items)
        parts = [None] * self.world
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]

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

    # --------------------------------------------------------------------------- the update
    def plan(self, plan_fn, samples, minibatch_size, token_budget, generator, skip_zero, micro_batches,
             shared=False):
        """(plan, samples) for train.update_policy. One process: plan_fn's plan of the samples. Under
        torchrun every rank computes the same plan_fn plan over stand-ins of the *global* sample
        list (this rank's samples gathered with the others'; shared=True: every rank holds the same
        list and owns every world-th sample), then packs its own members of each minibatch into
        micro-batches; the token counts stay global. Under FSDP each step gets as many
        micro-batches on every rank, fillers pointing at PADDING appended to the samples."""
        if self.world == 1:
            return plan_fn(samples, minibatch_size, token_budget, generator, skip_zero), samples
        mine = [(s["traj"], s["step"], k % self.world if shared else self.rank, k, len(s["prompt_ids"]),
                 len(s["response_ids"]), s["advantage"]) for k, s in enumerate(samples)]
        records = mine if shared else self.gather(mine)
        stand_ins = [{"traj": t, "step": st, "prompt_ids": [0] * p, "response_ids": [0] * r, "advantage": a}
                     for t, st, _, _, p, r, a in records]
        local = []
        for micros, tokens in plan_fn(stand_ins, minibatch_size, token_budget, generator, skip_zero):
            own = [records[g][3] for micro in micros for g in micro if records[g][2] == self.rank]
            local.append((micro_batches(own, samples, token_budget), tokens))
        if not self.fsdp:
            return local, samples
        filler = [len(samples)]
        return [(mbs + [filler] * (self.max(len(mbs)) - len(mbs)), t) for mbs, t in local], samples + [PADDING]

    def sum_gradients(self, model, bucket=1 << 25):
        """update_policy's before_step: all_reduce(SUM) of every gradient, in flat buckets of at most
        `bucket` elements. Each rank's loss is already divided by the global minibatch's token count,
        so the sum is the global token-mean's gradient. A parameter without a gradient on this rank
        (no sample with a signal) contributes zeros."""
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

    def sum_totals(self, totals):
        """update_policy's token sums over ranks (grad_norm is the same on every rank; gap_max: max)."""
        if self.world == 1:
            return totals
        keys = [k for k in totals if k not in ("grad_norm", "gap_max")]
        out = dict(zip(keys, self.sum([totals[k] for k in keys])))
        t = torch.tensor([totals["gap_max"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {**out, "grad_norm": totals["grad_norm"], "gap_max": t.item()}

    def metrics(self, model):
        """replica_drift: the largest difference between ranks of a checksum of the trained weights,
        0.0 when every replica holds the same model. Only under torchrun without FSDP."""
        if self.world == 1 or self.fsdp:   # sharded: each rank holds a different part by design
            return {}
        checksum = sum(p.detach().double().sum().item() for p in model.parameters() if p.requires_grad)
        sums = self.gather([checksum])
        return {"replica_drift": max(sums) - min(sums)}

    # --------------------------------------------------------------------------- lockstep sampling
    def lockstep(self, sample, batch_size):
        """The sampler train.run_episodes calls. Under FSDP each generate call is a collective
        (synced_gpus, set by shard), so every rank makes as many calls per step, with one-token
        dummy prompts where it has fewer, and finish_sampling joins the others' calls until all are
        done. Otherwise the sampler itself."""
        if not self.fsdp:
            return sample

        def synced(prompts, temperature):
            chunks = [prompts[lo:lo + batch_size] for lo in range(0, len(prompts), batch_size)]
            texts, responses, logprobs = [], [], []
            for c in range(self.max(len(chunks))):
                out = sample(chunks[c] if c < len(chunks) else [[0]], temperature)
                if c < len(chunks):
                    texts += out[0]
                    responses += out[1]
                    logprobs += out[2]
            return texts, responses, logprobs
        synced.dummy = lambda: sample([[0]], 1.0)
        return synced

    def finish_sampling(self, sample):
        """After this rank's episodes end: keep joining the other ranks' generate calls (FSDP)."""
        if not self.fsdp:
            return
        while True:
            calls = self.max(0)
            if calls == 0:
                return
            for _ in range(calls):
                sample.dummy()

    # --------------------------------------------------------------------------- FSDP (--fsdp)
    # Parameters, gradients and optimizer state sharded over the ranks with FSDP2's fully_shard (one
    # unit per transformer block, plus the root), so a model that does not fit one device trains.
    # Checkpoints gather the full state on rank 0.

    def shard(self, model):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(model)
        for unit in model.modules():    # each unit reduces its own gradients
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)          # sum, not mean: each rank's loss is
                unit.set_force_sum_reduction_for_comms(True)  # its share of the global token-mean
        model.generate = functools.partial(model.generate, synced_gpus=True)   # ranks decode in step
        self.fsdp = True
        return model

    def full_state(self, model, optimizer=None):
        """(model state, optimizer state) as plain full tensors on rank 0 (None elsewhere); all ranks
        must call it. Without FSDP: (None: save_pretrained takes the model's own, the optimizer's)."""
        if not self.fsdp:
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
