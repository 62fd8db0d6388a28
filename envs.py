"""envs.py: environment adapters for tigpo (DESIGN.md "Environments"): ALFWorld on the real
engine, WebShop over HTTP, the parallel env pool, and the step prompt / action parsing."""
import re

# ---------------------------------------------------------------------------------------------
# Step prompt and action parsing (DESIGN.md "Prompt"). One prompt per step, not a growing chat:
# the task, the last H (observation, action) pairs, the current observation, the admissible
# actions. The model answers with <think>...</think> then one <action>...</action>.
# ---------------------------------------------------------------------------------------------

def normalize_action(text):
    """The validity convention: strip, lowercase, collapse runs of whitespace to one space."""
    return " ".join(str(text).strip().lower().split())


def build_prompt(goal, history, obs, admissible, env_name="alfworld"):
    """The user message for one step. `history` is the list of earlier (observation, action)
    pairs of this episode; the caller passes only the last H of them."""
    setting = {"alfworld": "a text-based household", "webshop": "a web shop"}.get(env_name, "a text")
    lines = [f"You are an agent acting in {setting} environment.", f"Your task: {goal}", ""]
    if history:
        lines.append(f"Your last {len(history)} step(s):")
        for past_obs, past_action in history:
            lines += [f"Observation: {past_obs.strip()}", f"Action: {past_action}"]
        lines.append("")
    lines += [f"Current observation: {obs.strip()}", "", "Admissible actions:"]
    lines += [f"- {a}" for a in admissible]
    lines += ["",
              "First reason briefly inside <think>...</think>. Then give exactly one of the "
              "admissible actions inside <action>...</action>."]
    return "\n".join(lines)


_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)


def parse_action(reply):
    """The action of a model reply: the text of its last closed <action> tag, stripped, or None
    when there is none (an empty tag counts as none). None is an invalid step: penalised, and the
    episode goes on (DESIGN.md)."""
    found = _ACTION_RE.findall(reply or "")
    if not found:
        return None
    action = " ".join(found[-1].split())
    return action or None
