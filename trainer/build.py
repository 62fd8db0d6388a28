"""build.py: the setup steps of train.py's run(), in the order it calls them, each from the run's
arguments: where a run starts (resume), the environment, the policy and its optimizer, the KL
reference, the warm start's expert samples, checkpoints. Scaffolding: nothing here is the
algorithm."""
import json
import os
import random

import numpy as np
import torch

import envs
from environments import textenv, webshop
from trainer import checkpoint, models
from trainer.config import UsageError


def resume_point(args, resuming, dist):
    """(first update to train from, checkpoint folder or None); (None, None) for a finished run."""
    ckpt, start = checkpoint.last_checkpoint(args.run_dir) if resuming else (None, 0)
    if resuming and ckpt is None:
        raise UsageError(f"--resume: {args.run_dir} has no checkpoint; start anew without --resume in a new --run-dir")
    if resuming and start >= args.updates:
        dist.say(f"{args.run_dir} is complete: its last checkpoint is update {start} of --updates {args.updates}. "
                 f"To train on, resume with a larger --updates, e.g. --updates {start + args.updates}")
        return None, None
    models.check_model_arg(args.model)          # before minutes of game generation
    if args.rollout_engine == "vllm":
        from trainer import vllm_rollout
        if dist.world > 1:
            raise UsageError("--rollout-engine vllm runs in one process; under torchrun use --rollout-engine hf")
        if not vllm_rollout.available():
            raise UsageError(vllm_rollout.MISSING)
    return start, ckpt


def describe(args, resuming, dist):
    return "\n".join([f"resuming {args.run_dir} with the settings of its config.json" if resuming else
                      f"preset {args.preset}; explicit flags override it",
                      f"{args.algo} on {args.env}, {'cuda' if dist.cuda(args.device) else 'cpu'} x {dist.world}: "
                      f"B={args.num_groups} (revisit <= {args.revisit_groups}, delay {args.revisit_delay}) x "
                      f"K={args.group_size}, {args.updates} updates, max_steps {args.max_steps}, response format "
                      f"{args.response_format}, {args.rollout_engine} rollouts, {args.precision}, model {args.model}"])


def open_env(args, split, dist):
    """The train split's pool and task list; games are generated once, by rank 0. Seeds python,
    numpy and torch (per rank: each samples its own episodes); envs, games and schedule get the
    seed itself, so every rank makes the same plan."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed + dist.rank)
    try:
        with dist.rank_zero_first():
            return make_pool(args, split)
    except (ValueError, OSError, RuntimeError) as e:   # a broken data dir, no WebShop server
        raise UsageError(f"cannot start the {args.env} environment: {e}") from e


def make_pool(args, split):
    """(EnvPool, task keys) of one split: the task list from one env in this process (cheap: it
    lists games), the episodes in the pool's worker processes."""
    if args.env == "alfworld":
        kw = alfworld_kwargs(args, split)
    else:
        webshop.warm_up(args.webshop_url)   # the real server loads its products in its first request
        kw = dict(url=args.webshop_url, split=split, max_steps=args.max_steps, seed=args.seed,
                  num_goals=args.webshop_goals)
    env = envs.make_env(args.env, **kw)
    tasks = list(env.tasks)
    env.close()
    return envs.EnvPool(args.env, args.num_env_workers, **kw), tasks


def policy(args, ckpt, device, dist):
    """The policy (fp32 master weights; a checkpoint's on resume), its trained parameters, sharded
    under --fsdp, and AdamW over them."""
    model, tok, source = models.load_policy(args.model, device, args.max_new_tokens, args.gradient_checkpointing)
    dist.say(f"model {args.model} loaded from {source}")
    if ckpt:
        checkpoint.load_weights(ckpt, model, device)     # before FSDP shards them
    if args.trainable_layers:   # the top blocks and the final norm: on a CPU the backward stops there
        decoder = model.get_decoder()
        model.requires_grad_(False)
        for module in list(decoder.layers[-args.trainable_layers:]) + [decoder.norm]:
            module.requires_grad_(True)
        if args.precision == "bf16" and not args.fsdp:
            models.store_frozen_in_bf16(model)           # what autocast would cast every forward, cast once
    if args.fsdp:
        dist.shard(model)                                # parameters, gradients, optimizer state
    params = [p for p in model.parameters() if p.requires_grad]
    return model, tok, torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def reference_model(args, model, tok, start, dist):
    """The KL reference: the policy before RL (after the warm start), frozen, fp32 like the policy
    (a bf16 copy would differ from pi_theta at update 1). A copy of the weights in memory; on
    resume, the --model's weights with the warm start's saved in the run folder."""
    if args.kl_coef == 0:
        return None
    warm_dir = os.path.join(args.run_dir, "warmstart")
    ref_model, _, _ = models.load_policy(args.model, next(model.parameters()).device, args.max_new_tokens)
    if start > 0 and args.warmup_epochs:
        checkpoint.load_weights(warm_dir, ref_model, next(model.parameters()).device)
    if args.fsdp:
        dist.shard(ref_model)
    if start == 0:
        with torch.no_grad():       # same structure (and shards) as the policy: copy what this rank holds
            for mine, theirs in zip(ref_model.parameters(), model.parameters()):
                mine.copy_(theirs)
        if args.warmup_epochs:      # for a resumed run's reference
            state, _ = dist.full_state(model)
            if dist.main:
                checkpoint.save_model(warm_dir, model, tok, state)
            dist.barrier()
    return ref_model.eval().requires_grad_(False)


def walkthrough_samples(args, prompt, tok):
    """One sample per expert step of every game of an ALFWorld env: the prompt the agent would see
    there (same format, history and truncation as a rollout) and the expert's reply as response."""
    env = envs.make_env("alfworld", **{**alfworld_kwargs(args, "train"), "max_steps": 1000})
    response_format, samples = args.response_format, []
    for g, task in enumerate(env.tasks):
        with open(os.path.join(env.root, task)) as fh:
            plan = json.load(fh).get("walkthrough")
        if not plan:
            raise UsageError(f"--warmup-epochs: {task} has no expert walkthrough (only generated games and the "
                             f"official ones carry it); use --warmup-epochs 0")
        obs, info = env.reset(task)
        goal, history, H = info["goal"], [], args.history_length
        for step, action in enumerate(plan):
            ids, _ = prompt(goal, history[len(history) - H:] if H else [], obs, info["admissible"])
            reply = (f"{action}{textenv.ACTION_END}" if response_format == "action"
                     else f"{textenv.ACTION_PREFILL}{action}{textenv.ACTION_END}")
            response = tok(reply, add_special_tokens=False).input_ids
            samples.append({"traj": g, "step": step, "prompt_ids": ids, "advantage": 1.0,
                            "response_ids": response + ([] if response_format == "action" else [tok.eos_token_id])})
            history.append((obs, action))
            obs, _, _, info = env.step(action)
    env.close()
    return samples


def load_state(ckpt, memory, scheduler, model, optimizer, device, dist):
    optim_state = checkpoint.load_state(ckpt, memory, scheduler, device, dist.rank)
    dist.load_optimizer(model, optimizer, optim_state)
    dist.say(f"resumed from {ckpt}")


def save(args, update, model, tok, optimizer, memory, scheduler, dist):
    states = dist.gather([checkpoint.rng_state()])      # each rank's sampling stream
    model_state, optim_state = dist.full_state(model, optimizer)
    if dist.main:
        checkpoint.save_checkpoint(args.run_dir, update, model, tok, model_state, optim_state, memory, scheduler,
                                   args.keep_checkpoints, args, states)
    dist.barrier()


def advantage_settings(args):
    """The keyword arguments of tigpo.compute_advantages, from the run's arguments."""
    return dict(success_reward=textenv.SUCCESS_REWARD, invalid_penalty=args.invalid_penalty,
                step_gamma=args.step_gamma, graph_gamma=args.graph_gamma, lambda_step=args.lambda_step,
                lambda_ep=args.lambda_ep, norm=args.norm, cross_temporal=args.cross_temporal)


def alfworld_kwargs(args, split):
    num_train, num_eval = map(int, args.num_games.split(","))
    return dict(split=split, data_dir=args.data_dir, max_steps=args.max_steps, state_key=args.state_key,
                seed=args.seed, task_types=args.task_types, max_receptacles=args.max_receptacles or None,
                num_train=num_train, num_eval=num_eval)


def prompt_fn(args, tok, model):
    """prompt(goal, history, obs, admissible) -> (ids, truncated) in the run's format and context."""
    limit = context_limit(model, args)
    return lambda *step: textenv.fit_prompt(tok, *step, args.env, args.response_format, limit)


def context_limit(model, args):
    """Prompt tokens that leave room for --max-new-tokens in the model's context (None: no limit)."""
    context = getattr(model.config, "max_position_embeddings", None)
    return context - args.max_new_tokens if context else None


def engine(args, model, tok):
    """The vLLM engine of --rollout-engine vllm (None for hf), started from the policy's weights."""
    if args.rollout_engine != "vllm":
        return None
    from trainer import vllm_rollout
    return vllm_rollout.VLLMSampler(model, tok, dtype="bfloat16" if args.precision == "bf16" else "float32",
                                    max_model_len=model.config.max_position_embeddings, seed=args.seed)


LOGPROB_GAP_LIMIT = 1.0   # nats per token: a sampler this far from the trainer samples another model


def check_sampler(stats, args):
    """Stop a run whose sampler draws from other weights than the trained ones (a failed sync)."""
    if not stats["rollout_logprob_gap"] <= LOGPROB_GAP_LIMIT:     # a NaN stops it too
        raise RuntimeError(f"the {args.rollout_engine} sampler's log-probs differ from the trainer's by "
                           f"{stats['rollout_logprob_gap']:.3f} per token (max {stats['rollout_logprob_gap_max']:.2f}):"
                           f" it samples from other weights than the ones being trained")
