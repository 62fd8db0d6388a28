"""Helper of tests/test_distributed.py: one train.update_policy step on a fixed batch, run alone or
under torchrun; writes what the optimizer step did to every weight (SGD, lr 0.01: the gradients
scaled) and the advantages each rank's loss saw.

    python tests/dist_grad.py OUT.pt                     # one process holding every sample
    torchrun --nproc_per_node 2 tests/dist_grad.py OUT.pt  # each rank its share
    torchrun --nproc_per_node 2 tests/dist_grad.py OUT.pt --fsdp   # and the model sharded (FSDP2)
"""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402


def main(out, fsdp=False):
    ranks = None
    if train.WORLD_SIZE > 1:
        from extras.distributed import Ranks

        ranks = Ranks("cpu")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
        )
    )
    model.generation_config.pad_token_id = 0
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    # 12 samples of ragged length: 3 groups x 2 trajectories x 2 steps, advantages from a fixed draw
    batch = [
        {
            "traj": i // 2,
            "step": i % 2,
            "prompt_ids": torch.randint(
                1, 64, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen
            ).tolist(),
            "response_ids": torch.randint(
                1, 64, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen
            ).tolist(),
            "advantage": float(torch.randn(1, generator=gen)),
        }
        for i in range(12)
    ]
    batch[3]["advantage"] = 0.0
    trajs = ranks.share(6) if ranks else range(6)
    mine = [batch[i] for i in range(len(batch)) if i // 2 in trajs]  # this rank's trajectories
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    if fsdp:
        ranks.shard(model)
        ranks.shard(ref)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plan_args = (5, 24, torch.Generator().manual_seed(7), False)
    if ranks:
        plan, mine = ranks.minibatches(train.minibatch_plan, train.micro_batches, mine, *plan_args)
    else:
        plan = train.minibatch_plan(mine, *plan_args)
    totals = train.update_policy(
        model,
        optimizer,
        mine,
        plan,
        ref,
        temperature=0.8,
        kl_coef=0.01,
        max_grad_norm=1e9,
        before_step=ranks.sum_gradients if ranks else None,
    )
    if ranks:
        totals = ranks.sum_totals(totals)
    stats = train.update_metrics(totals, plan, kl_used=True)
    after = ranks.full_state(model)[0] if fsdp else None
    after = after if fsdp else {k: v.detach() for k, v in model.named_parameters()}
    if train.IS_MAIN:
        steps = {k: before[k] - after[k] for k in before}
        torch.save({"steps": steps, "stats": stats}, out)
    if ranks:
        ranks.stop()


if __name__ == "__main__":
    main(sys.argv[1], "--fsdp" in sys.argv[2:])
