"""textenv.py: what every text environment and the trainer share (docs/ALGORITHM.md, "Environments").

The vocabulary of one agent step, in one place that imports nothing but the standard library, so
that envs.py (ALFWorld), webshop.py and train.py all import it and never each other in a circle:
  * the outcome score C of a won episode (E2, E6) and the validity convention of an action;
  * the step prompt (task, last H observation/action pairs, observation, admissible actions) in
    the two response formats, and the parser of a model reply;
  * the error for a task key an env does not have;
  * ALFWorld's six task types, and the import of `alfworld` without its ALFWORLD_DATA side effect.
"""
import os
import re

SUCCESS_REWARD = 10.0   # C of E2/E6: the score of a won episode (ALFWorld 10/0; WebShop 10 x score)

# short name (what tigpo reports per type) -> ALFRED task type (the folder prefix of a game)
ALFWORLD_TASK_TYPES = {"pick": "pick_and_place_simple", "look": "look_at_obj_in_light",
                       "clean": "pick_clean_then_place_in_recep",
                       "heat": "pick_heat_then_place_in_recep",
                       "cool": "pick_cool_then_place_in_recep", "pick2": "pick_two_obj_and_place"}
ALFWORLD_SHORT_TYPE = {v: k for k, v in ALFWORLD_TASK_TYPES.items()}
ALFWORLD_DEFAULT_GAMES = (24, 6)   # generated when no data is given: train games, games per eval split

RESPONSE_FORMATS = ("think", "action")
# The prefill of the "action" format: prompt tokens (never generated, never trained), so a reply
# in that format is the text after it, up to and including the stop string ACTION_END.
ACTION_PREFILL, ACTION_END = "<action>", "</action>"


class TaskError(ValueError):
    """A task key the env does not have: the caller's bug, raised (also through EnvPool)."""


def normalize_action(text):
    """The validity convention: strip, lowercase, collapse runs of whitespace to one space."""
    return " ".join(str(text).strip().lower().split())


def build_prompt(goal, history, obs, admissible, env_name="alfworld", response_format="think"):
    """The user message for one step (one prompt per step, not a growing chat). `history` is the
    list of earlier (observation, action) pairs of this episode; the caller passes only the last H.

    response_format "think" (the paper's): reason in <think>...</think>, then one <action>...</action>.
    "action" *(choice, for models too small to follow that)*: the admissible actions are listed as
    <action>...</action> lines and the caller prefills the reply with ACTION_PREFILL; a 135M model
    then names an admissible action ~80% of the time at temperature 0.4 (it follows neither
    change alone: with a plain list it starts a bulleted list, without the prefill it copies)."""
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(f"unknown response_format {response_format!r}: use one of {RESPONSE_FORMATS}")
    setting = {"alfworld": "a text-based household", "webshop": "a web shop"}.get(env_name, "a text")
    lines = [f"You are acting in {setting} environment. Your task: {goal}"]
    if history:
        lines.append(f"Your last {len(history)} step(s):")
        for past_obs, past_action in history:
            lines += [f"Observation: {past_obs.strip()}", f"Action: {past_action}"]
    lines += [f"Current observation: {obs.strip()}", "Admissible actions:"]
    if response_format == "think":
        lines += [f"- {a}" for a in admissible]
        lines += ["First reason briefly inside <think>...</think>. Then give exactly one of the "
                  "admissible actions inside <action>...</action>."]
    else:
        lines += [f"{ACTION_PREFILL}{a}{ACTION_END}" for a in admissible]
        lines += ["Reply with one admissible action as <action>...</action>."]
    return "\n".join(lines)


_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)


def parse_action(reply):
    """The action of a model reply: the text of its last closed <action> tag, stripped, or None
    when there is none (an empty tag counts as none). None is an invalid step: penalised, and the
    episode goes on. In the "action" format the reply is ACTION_PREFILL + the generated text."""
    found = _ACTION_RE.findall(reply or "")
    if not found:
        return None
    action = " ".join(found[-1].split())
    return action or None


def import_alfworld():
    """Import and return the `alfworld` package, undoing its side effect on ALFWORLD_DATA.

    Trap: importing alfworld sets os.environ["ALFWORLD_DATA"] to an empty ~/.cache/alfworld when
    the user has not set it, and the data lookup would then take that folder for the user's
    choice of data (and find no games in it)."""
    user_value = os.environ.get("ALFWORLD_DATA")
    import alfworld
    if user_value is None:
        os.environ.pop("ALFWORLD_DATA", None)
    return alfworld


def fit_prompt(tok, goal, history, obs, admissible, env, response_format, limit):
    """(prompt ids in the chat template, truncated) for one step, at most `limit` tokens. When too
    long: drop the oldest history pairs, then shorten the observation's middle, then drop
    admissible actions from the end, then keep the last `limit` tokens. Never a crash in the model."""
    prefill = ACTION_PREFILL if response_format == "action" else ""

    def ids(hist, text, actions):
        chat = [{"role": "user", "content": build_prompt(goal, hist, text, actions, env, response_format)}]
        return tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + prefill,
                   add_special_tokens=False).input_ids
    out = ids(history, obs, admissible)
    if limit is None or len(out) <= limit:
        return out, False
    history = list(history)
    while history and len(out) > limit:
        history.pop(0)
        out = ids(history, obs, admissible)
    if len(out) > limit:   # keep the observation's head and tail, the longest that fits
        lo, hi = 0, len(obs)
        while lo < hi:
            keep = (lo + hi + 1) // 2
            text = obs[:keep // 2] + " [...] " + obs[len(obs) - keep // 2:]
            lo, hi = (keep, hi) if len(ids(history, text, admissible)) <= limit else (lo, keep - 1)
        obs = obs[:lo // 2] + " [...] " + obs[len(obs) - lo // 2:]
        out = ids(history, obs, admissible)
    admissible = list(admissible)
    while len(out) > limit and len(admissible) > 1:
        admissible.pop()
        out = ids(history, obs, admissible)
    return out[-limit:], True


def trim_response(ids, tok, end_ids):
    """The sampled tokens of one generated row. A finished row is filled with pad (= eos for many
    models). It ends at its first end token (eos or pad), which was sampled unless the row had
    already stopped at '</action>' (then it is padding and must not be trained on)."""
    end = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    if end == len(ids) or ACTION_END in tok.decode(ids[:end]):
        return ids[:end]
    return ids[:end + 1]
