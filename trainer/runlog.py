"""runlog.py: what train.py writes while it trains (rank 0 only): metrics.jsonl, trajectories.txt,
advantages.jsonl (--dump-advantages), TensorBoard and W&B, and the status line. The metrics are
defined in the README ("Metrics"); this module computes the behavioural ones from the rollouts.
"""
import dataclasses
import importlib.util
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from trainer import checkpoint
from environments import textenv


def summarize(trajs, prefix=""):
    """Success rate overall and per task type, mean score, episode length, episode count."""
    m = {f"{prefix}success_rate": float(np.mean([t["success"] for t in trajs])) if trajs else 0.0,
         f"{prefix}episodes": len(trajs),
         f"{prefix}mean_score": float(np.mean([t["score"] for t in trajs])) if trajs else 0.0,
         f"{prefix}episode_len": float(np.mean([len(t["valid"]) for t in trajs])) if trajs else 0.0}
    for kind in sorted({t["task_type"] for t in trajs}):
        m[f"{prefix}success/{kind}"] = float(np.mean([t["success"] for t in trajs if t["task_type"] == kind]))
    return m


def behaviour(trajs):
    """Valid-action ratio, and what shows a collapse onto one action: how many distinct actions
    were taken, and the share of the most frequent one."""
    valid = [v for t in trajs for v in t["valid"]]
    actions = [textenv.normalize_action(s["action"]) for t in trajs for s in t["steps"] if s["action"]]
    counts = {}
    for a in actions:
        counts[a] = counts.get(a, 0) + 1
    return {"valid_action_ratio": float(np.mean(valid)) if valid else 0.0,
            "distinct_actions": len(counts),
            "top_action": max(counts, key=counts.get) if counts else None,
            "top_action_frac": max(counts.values()) / len(actions) if actions else 0.0}


def zero_advantage(advantages):
    flat = [a for group in advantages for traj in group for a in traj]
    return {"zero_adv_frac": float(np.mean([abs(a) < 1e-6 for a in flat])) if flat else 1.0,
            "adv_mean": float(np.mean(flat)) if flat else 0.0}


def memory_bytes(memory):
    """An estimate of a tigpo.GraphMemory's size in bytes: its containers and strings, each string
    counted once (sys.getsizeof, so shallow sizes; the state keys are shared with the rollouts).
    A diagnostic, kept out of the core: O(stored edges)."""
    strings = {id(x): x for order in memory.order.values() for edge in order for x in edge}
    strings.update((id(t), t) for t in memory.order)
    return (sys.getsizeof(memory.preds) + sys.getsizeof(memory.order)
            + sum(sys.getsizeof(x) for x in strings.values())
            + sum(sys.getsizeof(p) + sum(sys.getsizeof(srcs) for srcs in p.values())
                  for p in memory.preds.values())
            + sum(sys.getsizeof(o) + len(o) * sys.getsizeof((None, None)) for o in memory.order.values()))


def update_metrics(totals, plan, kl_used):
    """update_policy's token sums as the logged means (under torchrun, of the sums over ranks)."""
    steps, tokens, sampled = max(len(plan), 1), max(sum(t for _, t in plan), 1), max(totals["sampled_tokens"], 1)
    return {"loss": totals["loss"] / steps, "pg_loss": totals["pg_loss"] / tokens,
            "kl": totals["kl"] / tokens if kl_used else None, "clip_frac": totals["clip_frac"] / tokens,
            "grad_norm": totals["grad_norm"] / steps, "optimizer_steps": len(plan),
            "rollout_logprob_gap": totals["gap"] / sampled, "rollout_logprob_gap_max": totals["gap_max"],
            "rollout_is_weight": totals["is_weight"] / sampled if totals["is_weight"] else None,
            "rollout_is_clip_frac": totals["is_clipped"] / sampled}


def throughput(gen, samples, rollout_s, adv_s, update_s, dist):
    """Samples, truncated prompts, seconds per phase and tokens/s of one update (summed over ranks)."""
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    gen_tokens, gen_s, truncated, num, tokens = dist.sum([gen["gen_tokens"], gen["gen_s"], gen["truncated_prompts"],
                                                          len(samples), tokens])
    return {"num_samples": int(num), "truncated_prompts": int(truncated), "rollout_s": rollout_s, "adv_s": adv_s,
            "update_s": update_s, "gen_tokens_per_s": gen_tokens / max(gen_s, 1e-9) * dist.world,
            "update_tokens_per_s": tokens / max(update_s, 1e-9)}


def graph_metrics(before, memory=None):
    """memory.stats(groups) taken before this update's E10 insert, as graph_* metrics (sizes,
    per-task sizes, evicted edges) plus the task and state hit rates of this batch; with `memory`,
    also graph_bytes, memory_bytes(memory) at the time of the call."""
    out = {f"graph_{k}": v for k, v in before.items() if not k.endswith("hit_rate")}
    out.update(task_hit_rate=before.get("task_hit_rate"), state_hit_rate=before.get("state_hit_rate"))
    if memory is not None:
        out["graph_bytes"] = memory_bytes(memory)
    return out


def _evals(metrics):
    """{split: (success rate, episodes)} of the eval keys of one metrics line."""
    return {k[5:-13]: (v, metrics.get(k[:-12] + "episodes")) for k, v in metrics.items()
            if k.startswith("eval/") and k.endswith("/success_rate")}


def wilson(p, n, z=1.96):
    """95% Wilson score interval of a success rate p over n episodes."""
    if not n:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5 / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _rate(value):
    p, n = value
    if not n:
        return f"{p:.2f}"
    lo, hi = wilson(p, n)
    return f"{p:.2f} [{lo:.2f}, {hi:.2f}] (n={n})"


def _cut(text, limit=600):
    text = text.strip()
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} more characters cut]"


class RunLog:
    """The run folder's logs, written by rank 0. On resume, entries of updates after the checkpoint
    are dropped first (that work is redone)."""

    def __init__(self, args, resuming, start):
        self.args, self.dir = args, args.run_dir
        os.makedirs(self.dir, exist_ok=True)          # nothing is written before every check passed
        checkpoint.remove_stale_temporaries(self.dir)
        if resuming:
            checkpoint.drop_lost_updates(self.dir, start)
        else:
            checkpoint.write_config(self.dir, args)
        self.before = {}   # eval before RL (update 0), also when resumed: the last line's "before -> after"
        if resuming and os.path.exists(os.path.join(self.dir, "metrics.jsonl")):
            with open(os.path.join(self.dir, "metrics.jsonl")) as fh:
                first = [json.loads(line) for line in fh if line.strip()][:1]
            if first and first[0]["update"] == 0:
                self.before = _evals(first[0])
        self.tb = self.wandb = None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(self.dir, "tb"))
        if args.track:
            import wandb
            self.wandb = wandb
            wandb.init(project="tigpo", name=os.path.basename(self.dir), config=dataclasses.asdict(args),
                       resume="allow", id=os.path.basename(self.dir))

    def write(self, metrics, plan, trajs, advantages):
        update = metrics["update"]
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "update"}
        if self.tb:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, update)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(numeric, step=update)
        evals = _evals(metrics)
        if update == 0:
            self.before = evals
            tqdm.write("before training | " + " | ".join(f"eval {k} {_rate(v)}" for k, v in evals.items()))
            return
        self.write_trajectories(update, plan, trajs, advantages)
        kl = f"{metrics['kl']:.4f}" if metrics["kl"] is not None else "-"
        tqdm.write(f"update {update}/{self.args.updates} | success {metrics['success_rate']:.2f} | score "
                   f"{metrics['mean_score']:.2f} | valid {metrics['valid_action_ratio']:.2f} | actions "
                   f"{metrics['distinct_actions']} | KL {kl} | revisits {metrics['revisits']} | "
                   f"{metrics['rollout_s'] + metrics['adv_s'] + metrics['update_s']:.0f}s"
                   + "".join(f" | eval {k} {v[0]:.2f}" for k, v in evals.items()))
        if update == self.args.updates and evals:
            tqdm.write(f"eval success (temperature {self.args.eval_temperature}, 95% interval, episodes), "
                       "before RL -> after: " + "; ".join(
                           f"{k} {_rate(self.before[k])} -> {_rate(v)}" if k in self.before else f"{k} {_rate(v)}"
                           for k, v in evals.items()))

    def write_trajectories(self, update, plan, trajs, advantages):
        """One trajectory of each kind (explore, revisit) first, then the rest in batch order."""
        K = self.args.group_size
        firsts = {}
        for i in range(len(trajs)):
            firsts.setdefault(plan[i // K]["kind"], i)
        chosen = sorted(firsts.values()) + [i for i in range(len(trajs)) if i not in set(firsts.values())]
        with open(os.path.join(self.dir, "trajectories.txt"), "a") as fh:
            for i in chosen[:self.args.log_trajectories]:
                g, j = divmod(i, K)
                t = trajs[i]
                fh.write(f"=== update {update} | {plan[g]['kind']} | {t['task']} | score {t['score']} | "
                         f"success {t['success']}\ngoal: {t['goal']}\n")
                for step, (s, adv) in enumerate(zip(t["steps"], advantages[g][j])):
                    shown = ", ".join(s["admissible"][:8]) + (", ..." if len(s["admissible"]) > 8 else "")
                    adv = adv if abs(adv) >= 5e-5 else 0.0        # no "-0.0000"
                    fh.write(f"--- step {step} | valid {s['valid']} | advantage {adv:+.4f}\n"
                             f"obs: {_cut(s['obs'])}\nadmissible ({len(s['admissible'])}): {shown}\n"
                             f"reply: {_cut(s['reply'])}\naction: {s['action']}\n")

    def dump_advantages(self, update, groups, memory, seen):
        plain = [{**g, "trajs": [{k: t[k] for k in ("states", "valid", "score", "success")} for t in g["trajs"]]}
                 for g in groups]                   # compute_advantages' input
        with open(os.path.join(self.dir, "advantages.jsonl"), "a") as fh:
            fh.write(json.dumps({"update": update, "algo": self.args.algo, "memory": memory.state_dict(),
                                 "groups": plain, "loss_advantages": seen}) + "\n")

    def close(self):
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        print(f"done: {self.dir} (metrics.jsonl, trajectories.txt, checkpoints/)")
