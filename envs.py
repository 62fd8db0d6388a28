"""envs.py: the environments of tigpo and what every one of them shares (docs/ALGORITHM.md,
"Environments").

  * the vocabulary of one agent step: the outcome score C of a won episode (E2, E6), the validity
    convention of an action, the step prompt in its two response formats, the reply parser;
  * ALFWorld on the real engine (the `alfworld` package, imported on first use), on a folder of
    games the caller gives;
  * the parallel env pool that steps any env class (AlfWorldEnv, or WebShopEnv of
    extras/webshop.py) in worker processes.

Imports run one way: extras/ imports this file, never the reverse. Which env a run plays, and
whether ALFWorld games must be generated first (extras/alfworld_gen.py), is chosen by the caller:
train.py's make_pool.
"""

import functools
import hashlib
import importlib
import json
import os
import re
import select
import subprocess
import sys
import weakref

# ---------------------------------------------------------------------------------------------
# The vocabulary of one step: reward, actions, the prompt, the reply parser
# ---------------------------------------------------------------------------------------------
SUCCESS_REWARD = 10.0  # C of E2/E6: the score of a won episode (ALFWorld 10/0; WebShop 10 x score)

# short name (what tigpo reports per type) -> ALFRED task type (the folder prefix of a game)
ALFWORLD_TASK_TYPES = {
    "pick": "pick_and_place_simple",
    "look": "look_at_obj_in_light",
    "clean": "pick_clean_then_place_in_recep",
    "heat": "pick_heat_then_place_in_recep",
    "cool": "pick_cool_then_place_in_recep",
    "pick2": "pick_two_obj_and_place",
}
ALFWORLD_SHORT_TYPE = {v: k for k, v in ALFWORLD_TASK_TYPES.items()}

RESPONSE_FORMATS = ("think", "action")
# The prefill of the "action" format: prompt tokens (never generated, never trained), so a reply
# in that format is the text after it, up to and including the stop string ACTION_END.
ACTION_PREFILL, ACTION_END = "<action>", "</action>"
TASK_MARK = "Your task is to:"  # where ALFWorld's first observation states the task


class TaskError(ValueError):
    """A task key the env does not have: the caller's bug, raised (also through EnvPool)."""


def normalize_action(text):
    """The validity convention: strip, lowercase, collapse runs of whitespace to one space."""
    return " ".join(str(text).strip().lower().split())


def system_prompt(env_name="alfworld"):
    """The system message of every step: what the agent is. Given, so that the chat template's
    default one ("You are a helpful AI assistant named SmolLM, ...": 21 tokens) is left out."""
    setting = {"alfworld": "a text-based household", "webshop": "a web shop"}.get(
        env_name, "a text"
    )
    return f"You are acting in {setting} environment."


def build_prompt(goal, history, obs, admissible, env_name="alfworld", response_format="think"):
    """The user message for one step (one prompt per step, not a growing chat). `history` is the
    list of earlier (observation, action) pairs of this episode; the caller passes only the last H.
    ALFWorld's first observation ends with the task ("Your task is to: ..."), stated once here.

    response_format "think" (the paper's): reason in <think>...</think>, then one
    <action>...</action>. "action" *(choice, for models too small to follow that)*: the
    admissible actions are listed as <action>...</action> lines and the caller prefills the reply
    with ACTION_PREFILL; a 135M model then names an admissible action ~80% of the time at
    temperature 0.4 (it follows neither change alone: with a plain list it starts a bulleted
    list, without the prefill it copies; after the warm start a plain list still halved its valid
    actions: docs/RESULTS.md)."""
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(
            f"unknown response_format {response_format!r}: use one of {RESPONSE_FORMATS}"
        )
    lines = [f"Your task: {goal}"]
    if history:
        lines.append(f"Your last {len(history)} step(s):")
        for past_obs, past_action in history:
            lines += [f"Observation: {without_task(past_obs)}", f"Action: {past_action}"]
    lines += [f"Current observation: {without_task(obs)}", "Admissible actions:"]
    if response_format == "think":
        lines += [f"- {a}" for a in admissible]
        lines += [
            "First reason briefly inside <think>...</think>. Then give exactly one of the "
            "admissible actions inside <action>...</action>."
        ]
    else:
        lines += [f"{ACTION_PREFILL}{a}{ACTION_END}" for a in admissible]
        lines += ["Reply with one admissible action as <action>...</action>."]
    return "\n".join(lines)


def without_task(observation):
    """An observation without ALFWorld's trailing "Your task is to: ..." (the prompt's first line
    states the task)."""
    return observation.split(TASK_MARK, 1)[0].strip()


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


def trim_reply(ids, tok, end_ids):
    """The sampled tokens of one generated row (every sampler's convention). A finished row is
    filled with pad (= eos for many models). It ends at its first end token (eos or pad), which
    was sampled unless the row had already stopped at ACTION_END (then it is padding and must not
    be trained on)."""
    end = next((i for i, t in enumerate(ids) if t in end_ids), len(ids))
    if end == len(ids) or ACTION_END in tok.decode(ids[:end]):
        return ids[:end]
    return ids[: end + 1]


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
    admissible actions from the end, then keep the last `limit` tokens. Never a crash in the
    model."""
    prefill = ACTION_PREFILL if response_format == "action" else ""

    def ids(hist, text, actions):
        chat = [
            {"role": "system", "content": system_prompt(env)},
            {
                "role": "user",
                "content": build_prompt(goal, hist, text, actions, env, response_format),
            },
        ]
        return tok(
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + prefill,
            add_special_tokens=False,
        ).input_ids

    out = ids(history, obs, admissible)
    if limit is None or len(out) <= limit:
        return out, False
    history = list(history)
    while history and len(out) > limit:
        history.pop(0)
        out = ids(history, obs, admissible)
    if len(out) > limit:  # keep the observation's head and tail, the longest that fits
        lo, hi = 0, len(obs)
        while lo < hi:
            keep = (lo + hi + 1) // 2
            text = obs[: keep // 2] + " [...] " + obs[len(obs) - keep // 2 :]
            lo, hi = (keep, hi) if len(ids(history, text, admissible)) <= limit else (lo, keep - 1)
        obs = obs[: lo // 2] + " [...] " + obs[len(obs) - lo // 2 :]
        out = ids(history, obs, admissible)
    admissible = list(admissible)
    while len(out) > limit and len(admissible) > 1:
        admissible.pop()
        out = ids(history, obs, admissible)
    return out[-limit:], True


# ---------------------------------------------------------------------------------------------
# ALFWorld on the real engine (docs/ALGORITHM.md "Environments"). The same path as ALFWorld's own
# AlfredTWEnv: textworld's PDDL backend, wrapped in AlfredDemangler (ids -> "mug 1") and
# AlfredInfos, with won and admissible commands requested. What we add: a per-process memo of
# textworld's grammar parses (the speed-up), state keys, and the 10/0 reward.
# ---------------------------------------------------------------------------------------------
SPLITS = {"alfworld": ("train", "valid_seen", "valid_unseen"), "webshop": ("train", "test")}
ALFWORLD_SPLITS = SPLITS["alfworld"]
# generated games that only the warm start plays (train.py --warmup-games), never an eval split
ALFWORLD_WARMUP_SPLIT = "warmup"
STATE_KEYS = ("facts", "obs")
BANNER = "-= Welcome to TextWorld, ALFRED! =-"
NOTHING = "Nothing happens."  # textworld's answer to a non-admissible command
# Left out of the "facts" key: bookkeeping no precondition or goal reads (look/examine mark things
# "checked"), and the negated "not_..." facts textworld keeps after a delete effect (they record
# history: leaving a place twice is not a different world state).
_NOT_STATE = ("checked", "examined", "new-axiom", "not_")


def _install_textworld_speedups():
    """Make textworld's PDDL text generation fast without changing a single output character.
    TextWorld re-parses (with TatSu) the template of every admissible command and every grammar
    condition on every step (~98% of step time): both parses are pure functions of their text,
    so we memoise them (the symbol parse is mutated by derive(), hence a deepcopy per use). Then
    most of what is left is copy_context() deep-copying the entity records of every symbol it
    touches; derivation only rebinds the two dicts it copies and never mutates the entities
    (Placeholder/Variable are hashed dict keys, EntityInfo names are set at load), so a copy of
    the dicts is equivalent. bench/env_throughput.py checks the outputs against stock textworld.
    Process-wide and installed once; the stock path in another process is untouched."""
    from copy import deepcopy

    from textworld.envs.pddl import textgen
    from textworld.logic import Rule

    if getattr(textgen, "_tigpo_memo", False):
        return
    parse_symbols = textgen._parse_and_convert
    parse_query = Rule.parse_conjunctive_query.__func__
    symbols_cache = functools.lru_cache(maxsize=None)(
        lambda text, rule_name: parse_symbols(text, rule_name=rule_name)
    )

    def cached_symbols(text, rule_name, **kwargs):
        if kwargs.get("trace"):
            return parse_symbols(text, rule_name=rule_name, **kwargs)
        return deepcopy(symbols_cache(text, rule_name))

    textgen._parse_and_convert = cached_symbols
    Rule.parse_conjunctive_query = classmethod(functools.lru_cache(maxsize=None)(parse_query))

    def copy_context(context):
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    textgen.copy_context = copy_context

    # Loading a game and every reset translate the PDDL to SAS twice (~90% of reset time), and
    # K rollouts of one task in a group translate the same text again: memoise it too (its
    # result is only read). Trap: pddl2sas overwrites sys.argv, so put it back.
    import fast_downward

    pddl2sas = fast_downward.pddl2sas

    @functools.lru_cache(maxsize=64)
    def cached_pddl2sas(domain, problem, verbose=False, optimize=False):
        argv = list(sys.argv)
        try:
            return pddl2sas(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv[:] = argv

    fast_downward.pddl2sas = cached_pddl2sas
    textgen._tigpo_memo = True


def check_state_key(state_key):
    if state_key not in STATE_KEYS:
        raise ValueError(f"state_key must be one of {STATE_KEYS}, got {state_key!r}")


def _digest(parts):
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


class AlfWorldGame:
    """One ALFWorld game file, played through textworld exactly as AlfredTWEnv plays it.
    reset() -> (obs, info); step(text) -> (obs, reward, done, info). An action is valid when its
    normalize_action form is admissible; an invalid one is still a step that changes nothing."""

    def __init__(self, gamefile, max_steps=50, state_key="facts"):
        import textworld

        import_alfworld()  # first: a plain `import alfworld` sets ALFWORLD_DATA (see there)
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        check_state_key(state_key)
        _install_textworld_speedups()
        self.gamefile, self.max_steps, self.state_key = gamefile, max_steps, state_key
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self._tw = textworld.start(
            gamefile, infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos]
        )
        self._state, self._steps, self.done = None, 0, True

    def load(self, gamefile):
        """Switch to another game file, keeping this env's copy of the fast-downward library
        (each textworld PDDL env copies the 33 MB libdownward.so and loads it for good, so a new
        env per task would leak). The stock gym env also reloads games into the same env."""
        self._tw.load(gamefile)
        self.gamefile, self._state, self._steps, self.done = gamefile, None, 0, True

    def _admissible(self):
        # "help" only prints the command list: never a useful move, so it is not offered
        return [a for a in self._state["admissible_commands"] if a != "help"]

    def _state_key(self, obs):
        facts = self._state["_facts"]  # raw PDDL facts of the current world state
        if self.state_key == "facts":
            return _digest(sorted(str(f) for f in facts if not f.name.startswith(_NOT_STATE)))
        where = sorted(str(f.arguments[1].name) for f in facts if f.name == "atlocation")
        held = sorted(str(f.arguments[1].name) for f in facts if f.name == "holds")
        return _digest([obs, "|".join(where), "|".join(held)] + sorted(self._admissible()))

    def reset(self):
        self._state = self._tw.reset()
        self._steps, self.done = 0, False
        obs = self._state["feedback"].replace(BANNER, "").strip()
        goal = obs.split(TASK_MARK, 1)[-1].strip()
        self.admissible = self._admissible()
        return obs, {
            "admissible": self.admissible,
            "state": self._state_key(obs),
            "goal": goal,
            "won": False,
        }

    def step(self, text):
        if self._state is None or self.done:
            raise RuntimeError("AlfWorldGame.step: call reset() first (the episode is over)")
        self._steps += 1
        lookup = {normalize_action(a): a for a in self.admissible}
        command = lookup.get(normalize_action(text)) if text is not None else None
        if command is None:
            obs = NOTHING  # what textworld answers; skipping its no-op step keeps the state exact
        else:
            self._state, _, _ = self._tw.step(command)
            obs = self._state["feedback"].strip()
            self.admissible = self._admissible()
        won = bool(self._state["won"])
        self.done = won or self._steps >= self.max_steps
        info = {
            "won": won,
            "valid": command is not None,
            "state": self._state_key(obs),
            "admissible": self.admissible,
        }
        return obs, SUCCESS_REWARD if won else 0.0, self.done, info

    def close(self):
        if self._tw is not None:
            # textworld never frees its library copy: free the planner state at least. Trap: do
            # not dlclose it (fast_downward.close_lib): the process then segfaults at exit.
            lib = self._tw.unwrapped.downward_lib
            self._tw.close()
            self._tw = None
            lib.cleanup()


def task_types_of(value):
    """A task-type selection as a tuple of short names: None or "all" = all six; "pick,look" or a
    sequence picks some."""
    if value in (None, "all"):
        return tuple(ALFWORLD_TASK_TYPES)
    types = tuple(t.strip() for t in value.split(",")) if isinstance(value, str) else tuple(value)
    unknown = sorted(set(types) - set(ALFWORLD_TASK_TYPES))
    if unknown or not types:
        raise ValueError(
            f"unknown ALFWorld task types {unknown}: use some of {list(ALFWORLD_TASK_TYPES)}"
        )
    return tuple(t for t in ALFWORLD_TASK_TYPES if t in types)


def given_alfworld_data(data_dir=None):
    """The json_2.1.1 folder of the games the user named: data_dir, else $ALFWORLD_DATA; None when
    neither is set (train.py then generates games, extras/alfworld_gen.py). data_dir may name the
    folder that holds json_2.1.1 or json_2.1.1 itself. A folder the user named but that holds no
    json_2.1.1 is an error, never a silent fallback."""
    given = data_dir or os.environ.get("ALFWORLD_DATA")
    if not given:
        return None
    given = os.path.abspath(os.path.expanduser(given))
    for root in (os.path.join(given, "json_2.1.1"), given):
        if os.path.basename(root) == "json_2.1.1" and os.path.isdir(root):
            return root
    raise ValueError(
        f"ALFWorld data folder {given} has no json_2.1.1/ (from "
        f"{'data_dir' if data_dir else 'ALFWORLD_DATA'}): run `alfworld-download`, "
        f"or `python -m extras.alfworld_gen {given}`, or unset it to use generated games"
    )


def scene_size(pddl_problem):
    """The number of receptacles in a game's PDDL problem (its scene size): one receptacleType
    fact each in :init (the goal's `(receptacleType ?r ...)` names a variable, not a receptacle)."""
    return len(re.findall(r"\(receptacleType [^?\s]", pddl_problem))


@functools.cache
def alfworld_tasks(root, split, task_types=None, max_receptacles=None):
    """Sorted task keys ("<split>/<folder>/<trial>/game.tw-pddl") of a split, filtered as
    AlfredTWEnv filters (the six task types, no movable/sliced variants, no game marked
    unsolvable), then to the chosen task types and scenes of at most max_receptacles."""
    types = {ALFWORLD_TASK_TYPES[t] for t in task_types_of(task_types)}
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise ValueError(
            f"ALFWorld data folder {root} has no {split}/ split (have "
            f"{sorted(os.listdir(root))}): pass split= one of {ALFWORLD_SPLITS}, or regenerate "
            f"with `python -m extras.alfworld_gen`"
        )
    keys = []
    for folder, _, files in os.walk(split_dir):
        if "traj_data.json" not in files or "game.tw-pddl" not in files:
            continue
        if "movable" in folder or "Sliced" in folder:
            continue
        with open(os.path.join(folder, "traj_data.json")) as f:
            if json.load(f).get("task_type") not in types:
                continue
        with open(os.path.join(folder, "game.tw-pddl")) as f:
            game = json.load(f)
        if game.get("solvable") is False:  # (AlfredTWEnv also drops games without the key)
            continue
        if max_receptacles and scene_size(game.get("pddl_problem", "")) > max_receptacles:
            continue
        keys.append(
            os.path.relpath(os.path.join(folder, "game.tw-pddl"), root).replace(os.sep, "/")
        )
    if not keys:
        raise ValueError(
            f"ALFWorld data folder {split_dir} holds no solvable games of the task "
            f"types {task_types_of(task_types)} in scenes of at most {max_receptacles or 'any'} "
            "receptacles: widen the selection (train.py: --task-types all --max-receptacles 0), "
            "or "
            f"re-run `alfworld-download` / `python -m extras.alfworld_gen`"
        )
    return tuple(sorted(keys))


def task_type_of(task):
    """pick, look, clean, heat, cool or pick2, read from the task key's folder name."""
    return ALFWORLD_SHORT_TYPE[task.split("/")[1].split("-")[0]]


def eval_subset(tasks, n):
    """The first n games in a round robin over task types (each type's games in sorted order): the
    same stratified subset every time; all games for n = 0."""
    if not n or n >= len(tasks):
        return list(tasks)
    by_type = {}
    for t in sorted(tasks):
        by_type.setdefault(task_type_of(t) if "/" in t else "all", []).append(t)
    rounds = [
        t for k in range(len(tasks)) for ts in by_type.values() if k < len(ts) for t in [ts[k]]
    ]
    return rounds[:n]


class AlfWorldEnv:
    """ALFWorld: the games of one split of a json_2.1.1 folder (data_dir, else $ALFWORLD_DATA: see
    given_alfworld_data), filtered to task_types and scenes of at most max_receptacles, one
    episode at a time."""

    def __init__(
        self,
        split="train",
        data_dir=None,
        max_steps=50,
        state_key="facts",
        task_types=None,
        max_receptacles=None,
    ):
        splits = (*ALFWORLD_SPLITS, ALFWORLD_WARMUP_SPLIT)
        if split not in splits:
            raise ValueError(f"split must be one of {splits}, got {split!r}")
        check_state_key(state_key)
        self.types, self.max_receptacles = task_types_of(task_types), max_receptacles
        self.root = given_alfworld_data(data_dir)
        if self.root is None:
            raise ValueError(
                "AlfWorldEnv: no ALFWorld data: pass data_dir or set ALFWORLD_DATA to a folder "
                "holding json_2.1.1/ (`alfworld-download`), or generate one with "
                "`python -m extras.alfworld_gen OUT_DIR` (train.py does when neither is given)"
            )
        self.split, self.max_steps, self.state_key = split, max_steps, state_key
        if not os.path.isdir(os.path.join(self.root, split)):
            alfworld_tasks(self.root, split)  # raises the error that names the folder
        self._game, self._task = None, None

    @property
    def tasks(self):
        # listed on first use: pool workers never need it, and the official train split means
        # reading ~3.5k game files
        return list(alfworld_tasks(self.root, self.split, self.types, self.max_receptacles))

    def reset(self, task):
        path = os.path.join(self.root, task)
        if not task.endswith("game.tw-pddl") or ".." in task.split("/") or not os.path.isfile(path):
            raise TaskError(
                f"unknown ALFWorld task {task!r} under {self.root}: pick one of env.tasks"
            )
        if self._game is None:
            self._game = AlfWorldGame(path, self.max_steps, self.state_key)
        elif task != self._task:  # loading translates the PDDL twice: skipped for the same task
            self._game.load(path)
        self._task = task
        obs, info = self._game.reset()
        with open(os.path.join(os.path.dirname(path), "traj_data.json")) as f:
            task_type = ALFWORLD_SHORT_TYPE.get(json.load(f).get("task_type"))
        info.update(task=task, task_type=task_type or task_type_of(task))
        return obs, info

    def step(self, text):
        if self._game is None:
            raise RuntimeError("AlfWorldEnv.step: call reset(task) first")
        return self._game.step(text)

    def close(self):
        if self._game is not None:
            self._game.close()
        self._game, self._task = None, None


# ---------------------------------------------------------------------------------------------
# Parallel env pool (docs/ALGORITHM.md "Parallel envs"). Each worker is a plain `python envs.py
# worker` subprocess speaking one JSON line per request on its stdin/stdout: no fork of a parent
# that holds torch threads, no re-import of the trainer's __main__ (multiprocessing's spawn would
# run a top-level train.py script again). Slots are dealt to workers in contiguous blocks, so the K
# rollouts of one task (adjacent in a batch) share a worker and its memo of the translated game;
# every env is deterministic on its own, so results do not depend on num_workers.
# ---------------------------------------------------------------------------------------------
class EnvPool:
    """B envs stepped in num_workers processes. reset(tasks) -> (obs, infos), one env per task;
    step(actions) -> (obs, rewards, dones, infos), actions aligned with the last reset. An action
    None means "do not step this env" (it is done or not wanted): that slot returns obs None,
    reward 0.0, its last done flag, info {}. A crashed game or a dead worker ends its episodes as
    failures (reward 0.0, done True, info["crash"] says why); a dead worker is restarted and the
    batch goes on. A worker that does not answer within worker_timeout seconds (a hung game) is
    killed and counted as dead."""

    def __init__(self, env_class, num_workers=2, worker_timeout=600.0, **env_kwargs):
        """env_class(**env_kwargs) makes one env in a worker (AlfWorldEnv, webshop.WebShopEnv).
        The worker imports the class by its module and name, as pickle would: the caller picks
        the env, and this file imports no env module it does not define."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        module = getattr(env_class, "__module__", None)
        found = getattr(sys.modules.get(module), getattr(env_class, "__qualname__", ""), None)
        if module == "__main__" or found is not env_class:
            raise ValueError(
                f"EnvPool takes an env class its workers can import by module and name "
                f"(envs.AlfWorldEnv, webshop.WebShopEnv), got {env_class!r}"
            )
        self.env_class, self.kwargs, self.num_workers = env_class, env_kwargs, num_workers
        self.worker_timeout = worker_timeout
        self._procs = [None] * num_workers
        self._dones, self._owner = [], []  # per slot of the last reset: done flag, worker
        # runs on close(), when the pool is garbage-collected, and at interpreter exit
        self._finalizer = weakref.finalize(self, EnvPool._kill_all, self._procs)

    @property
    def pids(self):
        return [p.pid if p is not None and p.poll() is None else None for p in self._procs]

    def _start(self, w):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "worker",
            self.env_class.__module__,
            self.env_class.__qualname__,
            json.dumps(self.kwargs),
        ]
        self._procs[w] = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def _send(self, w, msg):
        """Send one request; False when the worker is dead (it is restarted on the next reset)."""
        proc = self._procs[w]
        if proc is None or proc.poll() is not None:
            return False
        try:
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def _recv(self, w):
        """The worker's reply, or None when it died mid-request (EOF) or hung past worker_timeout.
        select on the pipe is exact here: a worker writes one line per request, so nothing is
        ever left in the reader's buffer between requests."""
        stdout = self._procs[w].stdout
        ready, _, _ = select.select([stdout], [], [], self.worker_timeout)
        line = stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def _round(self, requests):
        """Send {worker: msg} to all workers first (they run in parallel), then collect replies;
        a worker that died answers None and is killed so the next reset restarts it."""
        sent = {w: self._send(w, msg) for w, msg in requests.items()}
        replies = {}
        for w in requests:
            replies[w] = self._recv(w) if sent[w] else None
            if replies[w] is None:
                EnvPool._kill(self._procs[w])
                self._procs[w] = None
        return replies

    def reset(self, tasks):
        tasks = list(tasks)
        for w in range(self.num_workers):
            if self._procs[w] is None or self._procs[w].poll() is not None:
                self._start(w)
        self._owner = [j * self.num_workers // max(len(tasks), 1) for j in range(len(tasks))]
        requests = {
            w: {"cmd": "reset", "tasks": {j: t for j, t in enumerate(tasks) if self._owner[j] == w}}
            for w in range(self.num_workers)
        }
        replies = self._round(requests)
        obs, infos = [None] * len(tasks), [None] * len(tasks)
        for w, reply in replies.items():
            if reply is not None and "fatal" in reply:
                raise TaskError(f"EnvPool worker {w}: {reply['fatal']}")
            for j in requests[w]["tasks"]:
                if reply is None:
                    obs[j], infos[j] = (
                        "",
                        {"crash": f"env worker {w} died or hung during reset", "won": False},
                    )
                else:
                    obs[j], infos[j] = reply["results"][str(j)]
        self._dones = [bool(info.get("crash")) for info in infos]
        return obs, infos

    def step(self, actions):
        actions = list(actions)
        if len(actions) != len(self._dones):
            raise ValueError(
                f"EnvPool.step got {len(actions)} actions for {len(self._dones)} envs "
                f"of the last reset"
            )
        requests = {}
        for j, action in enumerate(actions):
            if action is not None and not self._dones[j]:
                requests.setdefault(self._owner[j], {"cmd": "step", "actions": {}})["actions"][
                    j
                ] = action
        obs, rewards = [None] * len(actions), [0.0] * len(actions)
        dones, infos = list(self._dones), [{} for _ in actions]
        for w, reply in self._round(requests).items():
            for j in requests[w]["actions"]:
                if reply is None:
                    obs[j], dones[j] = "", True
                    infos[j] = {
                        "crash": f"env worker {w} died or hung (no reply in "
                        f"{self.worker_timeout:g} s); episode ended as a failure",
                        "won": False,
                        "valid": False,
                    }
                else:
                    obs[j], rewards[j], dones[j], infos[j] = reply["results"][str(j)]
        self._dones = dones
        return obs, rewards, dones, infos

    @staticmethod
    def _kill(proc):
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream:
                    stream.close()

    @staticmethod
    def _kill_all(procs):
        for i, proc in enumerate(procs):
            if proc is not None and proc.poll() is None:
                try:  # ask first, so the worker closes its games; kill if it does not exit
                    proc.stdin.write(json.dumps({"cmd": "close"}) + "\n")
                    proc.stdin.flush()
                    proc.wait(timeout=5)
                except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                    proc.kill()
            EnvPool._kill(proc)
            procs[i] = None

    def close(self):
        self._finalizer()


class _Fatal(Exception):
    """A worker-side error that is the caller's bug: sent back and raised in the parent."""


def _worker(module, name, kwargs):
    """The loop of one pool worker, whose envs are module.name(**kwargs). A game that raises ends
    only its own episode (info["crash"])."""
    out = os.fdopen(os.dup(1), "w")  # protocol channel; anything printed goes to stderr instead
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    env_class = getattr(importlib.import_module(module), name)
    envs = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "close":
            break
        results = {}
        try:
            if msg["cmd"] == "reset":
                for j in [j for j in envs if j not in msg["tasks"]]:
                    envs.pop(j).close()  # a slot now owned by another worker
                for j, task in msg["tasks"].items():
                    if j not in envs:
                        try:
                            envs[j] = env_class(**kwargs)
                        except Exception as e:  # a bad configuration is the caller's bug: loud
                            raise _Fatal(f"{name}() failed: {type(e).__name__}: {e}") from e
                    try:
                        results[j] = envs[j].reset(task)
                    except TaskError as e:  # so is an unknown task key
                        raise _Fatal(str(e)) from e
                    except Exception as e:  # a game that crashes: only this episode fails
                        results[j] = ("", {"crash": f"{type(e).__name__}: {e}", "won": False})
            else:
                for j, action in msg["actions"].items():
                    try:
                        results[j] = envs[j].step(action)
                    except Exception as e:  # same: the episode ends as a failure
                        results[j] = (
                            "",
                            0.0,
                            True,
                            {"crash": f"{type(e).__name__}: {e}", "won": False, "valid": False},
                        )
            reply = {"results": results}
        except _Fatal as e:
            reply = {"fatal": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for env in envs.values():
        env.close()


def main(argv):
    if argv[:1] != ["worker"] or len(argv) != 4:
        print(
            "envs.py runs only as EnvPool's worker: python envs.py worker MODULE NAME KWARGS_JSON"
            " (to generate ALFWorld games: python -m extras.alfworld_gen --help)",
            file=sys.stderr,
        )
        sys.exit(2)
    _worker(argv[1], argv[2], json.loads(argv[3]))


if __name__ == "__main__":
    # Run as the module `envs`, not as __main__: extras/webshop.py imports envs, and a second copy
    # of this file would have a second TaskError that the worker loop's `except TaskError` misses.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import envs

    envs.main(sys.argv[1:])
