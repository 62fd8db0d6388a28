"""extras/distributed.py: what crosses ranks when train.py runs under torchrun.

    torchrun --nproc_per_node N train.py ...                  # one node, N devices
    torchrun --nnodes M --node_rank R --rdzv_endpoint HOST:PORT --nproc_per_node N train.py ...

train.py creates one `Ranks` when WORLD_SIZE > 1 and calls it in short `if ranks:` blocks, one
collective each (CleanRL's ppo_atari_multigpu.py pattern: the single-process algorithm plus a few
collectives, no wrapper around the model):
  * every rank makes the same plan (same seed, same scheduler) and runs its contiguous share of
    the update's B*K episodes (`share`) in its own env pool, with its own model replica;
  * the whole trajectory records are gathered (`gather`, their text too, for rank 0's log), so
    every rank holds the whole batch and runs the same tigpo.compute_advantages, GraphMemory.add
    and RevisitScheduler.record: memory and queue are identical on every rank;
  * the update is data-parallel: every rank draws the same minibatches from the *global* sample
    list (`minibatches`), back-propagates its own samples of each with the global token count as
    E12's token-mean denominator, and gradients are summed (`sum_gradients`) before the clip and
    the step, so every rank takes the step one process holding all the samples would take;
  * rank 0 alone writes logs, metrics, trajectories and checkpoints.
--fsdp (FSDP2) shards parameters, gradients and optimizer state instead of replicating them.
"""

import contextlib
import datetime
import functools
import os

import torch
import torch.distributed as dist

# An FSDP filler: under FSDP every forward and backward is a collective, so a rank with fewer
# micro-batches in a step runs this one (its resp_mask is 0: it adds nothing).
PADDING = {
    "traj": -1,
    "step": -1,
    "prompt_ids": [0],
    "response_ids": [0],
    "advantage": 0.0,
    "padding": True,
}


class Ranks:
    """This process' rank among WORLD_SIZE, and every collective train.py uses."""

    def __init__(self, device="auto"):
        """Join the process group (NCCL on CUDA, gloo on CPU). A rank that dies makes torchrun
        stop the others; the collectives' timeout bounds a rank that hangs."""
        self.world = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.fsdp = False  # set by shard(): then every forward is a collective (see lockstep)
        cuda = torch.cuda.is_available() and device != "cpu"
        if cuda:
            torch.cuda.set_device(self.local_rank)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))

    def stop(self, exc_type=None, exc=None, traceback=None):
        """Leave the process group (also an ExitStack exit callback). A rank that failed leaves
        at once: waiting for the others would hang on a rank that died."""
        if dist.is_initialized():
            if exc_type is None:
                dist.barrier()  # no rank tears gloo down while another still talks to it
            dist.destroy_process_group()
        return False  # an exception goes on

    def share(self, n):
        """This rank's contiguous block of range(n): episodes are dealt in order, so a group's
        K rollouts stay on one rank when world size divides B*K, and are split over two
        otherwise (the records are gathered before any group is scored: either is correct)."""
        lo = self.rank * n // self.world
        hi = (self.rank + 1) * n // self.world
        return range(lo, hi)

    def gather(self, items):
        """Every rank's list, concatenated in rank order (picklable items)."""
        parts = [None] * self.world
        dist.all_gather_object(parts, list(items))
        return [x for part in parts for x in part]

    def max(self, value):
        """The largest value of an int over ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum(self, values):
        """Element-wise sum over ranks of a list of floats."""
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def barrier(self):
        dist.barrier()

    @contextlib.contextmanager
    def rank_zero_first(self):
        """Rank 0 runs the block first (e.g. generates the games into the cache), then the
        others."""
        if self.rank != 0:
            self.barrier()
        yield
        if self.rank == 0:
            self.barrier()

    # ------------------------------------------------------------------------------- the update
    def minibatches(
        self,
        plan_fn,
        micro_batches,
        samples,
        minibatch_size,
        token_budget,
        generator,
        skip_zero,
        shared=False,
    ):
        """(minibatches, samples) for train.update_policy. Every rank computes the same plan_fn
        plan over stand-ins of the *global* sample list (this rank's samples gathered with the
        others'; shared=True: every rank holds the same list and owns every world-th sample),
        then packs its own members of each minibatch into micro-batches; the token counts stay
        global. Under FSDP each step gets as many micro-batches on every rank, fillers pointing
        at PADDING appended to the samples."""
        mine = []
        for k, s in enumerate(samples):
            owner = k % self.world if shared else self.rank
            sizes = (len(s["prompt_ids"]), len(s["response_ids"]))
            mine.append((s["traj"], s["step"], owner, k, *sizes, s["advantage"]))
        records = mine if shared else self.gather(mine)
        stand_ins = []
        for traj, step, _, _, prompt_len, response_len, advantage in records:
            stand_ins.append(
                {
                    "traj": traj,
                    "step": step,
                    "prompt_ids": [0] * prompt_len,
                    "response_ids": [0] * response_len,
                    "advantage": advantage,
                }
            )
        local = []
        for micros, tokens in plan_fn(
            stand_ins, minibatch_size, token_budget, generator, skip_zero
        ):
            own = [records[g][3] for micro in micros for g in micro if records[g][2] == self.rank]
            local.append((micro_batches(own, samples, token_budget), tokens))
        if not self.fsdp:
            return local, samples
        filler = [len(samples)]
        padded = []
        for micros, tokens in local:
            padded.append((micros + [filler] * (self.max(len(micros)) - len(micros)), tokens))
        return padded, samples + [PADDING]

    def sum_gradients(self, model, bucket=1 << 25):
        """update_policy's before_step: all_reduce(SUM) of every gradient, in flat buckets of at
        most `bucket` elements. Each rank's loss is already divided by the global minibatch's
        token count, so the sum is the global token-mean's gradient. A parameter without a
        gradient on this rank (no sample with a signal) contributes zeros."""
        if self.fsdp:  # FSDP reduce-scatters (sums) them in backward itself
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(params):
            group = []
            size = 0
            while start < len(params) and (not group or size + params[start].numel() <= bucket):
                group.append(params[start])
                size += params[start].numel()
                start += 1
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def sum_totals(self, totals):
        """update_policy's token sums over ranks (grad_norm is the same on every rank; gap_max:
        the max), and gap_ranks: each rank's own mean gap, in rank order. Every rank samples
        with its own sampler (its own vLLM engine): one that drifts shows there, where the mean
        over ranks would dilute it."""
        keys = [k for k in totals if k not in ("grad_norm", "gap_max")]
        out = dict(zip(keys, self.sum([totals[k] for k in keys])))
        t = torch.tensor([totals["gap_max"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mine = totals["gap"] / max(totals["sampled_tokens"], 1)
        return {
            **out,
            "grad_norm": totals["grad_norm"],
            "gap_max": t.item(),
            "gap_ranks": self.gather([mine]),
        }

    def replica_drift(self, model):
        """{"replica_drift": the largest difference between ranks of a checksum of the trained
        weights}: 0.0 when every replica holds the same model; {} under FSDP (each rank holds
        another part by design)."""
        if self.fsdp:
            return {}
        trained = [p for p in model.parameters() if p.requires_grad]
        checksum = sum(p.detach().double().sum().item() for p in trained)
        sums = self.gather([checksum])
        return {"replica_drift": max(sums) - min(sums)}

    # ------------------------------------------------------------------ lockstep sampling (FSDP)
    def lockstep(self, sample, batch_size):
        """The sampler train.run_episodes calls under FSDP: each generate call is a collective
        (synced_gpus, set by shard), so every rank makes as many calls per step, with one-token
        dummy prompts where it has fewer; finish_sampling joins the others' calls until all are
        done."""

        def synced(prompts, temperature):
            chunks = [prompts[lo : lo + batch_size] for lo in range(0, len(prompts), batch_size)]
            texts, responses, logprobs = [], [], []
            for c in range(self.max(len(chunks))):
                out = sample(chunks[c] if c < len(chunks) else [[0]], temperature)
                if c < len(chunks):
                    texts += out[0]
                    responses += out[1]
                    logprobs += out[2]
            return texts, responses, logprobs

        synced.dummy = functools.partial(sample, [[0]], 1.0)
        return synced

    def finish_sampling(self, sample):
        """After this rank's episodes end: keep joining the other ranks' generate calls."""
        while True:
            calls = self.max(0)
            if calls == 0:
                return
            for _ in range(calls):
                sample.dummy()

    # -------------------------------------------------------------------------- FSDP (--fsdp)
    # Parameters, gradients and optimizer state sharded over the ranks with FSDP2's fully_shard
    # (one unit per transformer block, plus the root), so a model that does not fit one device
    # trains. Checkpoints gather the full state on rank 0.

    def shard(self, model):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(model)
        for unit in model.modules():  # each unit reduces its own gradients
            if isinstance(unit, FSDPModule):
                # sum, not mean: each rank's loss is its share of the global token-mean
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        model.generate = functools.partial(model.generate, synced_gpus=True)  # decode in step
        self.fsdp = True
        return model

    def full_state(self, model, optimizer=None):
        """(model state, optimizer state) as plain full tensors on rank 0 (None elsewhere); all
        ranks must call it. Without FSDP: (None: save_pretrained takes the model's own, the
        optimizer's state_dict)."""
        if not self.fsdp:
            return None, optimizer.state_dict() if optimizer is not None else None
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = None
        if optimizer is not None:
            optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        if self.rank != 0:
            return None, None
        return model_state, optim_state

    def load_optimizer(self, model, optimizer, state):
        """Load a full optimizer state (from full_state) into a possibly sharded optimizer."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)
