"""extras/alfworld_gen.py: offline ALFWorld game generator (docs/ALGORITHM.md "Environments").
Writes games for the six ALFRED task types in the official layout,
json_2.1.1/<split>/<task>-<obj>-<mrecep>-<recep>- <scene>/<trial>/{game.tw-pddl,traj_data.json},
from what the `alfworld` wheel ships: the PDDL domain (alfworld/data/alfred.pddl), the text
grammar (alfred.twl2), the goal library (alfworld/gen/ goal_library.py) and the scene layouts
(alfworld/gen/layouts/FloorPlan*). The generator knows where it put every object, so it writes
the winning walkthrough itself; generate_games plays each one through envs.AlfWorldGame to check
it. The fast-downward planner is never called (minutes per game).

Imports envs (task types, the alfworld import, the game player) and alfworld; envs never imports
this module. train.py does, when neither --data-dir nor ALFWORLD_DATA names games (cached_games).
By hand, from the repository root: `python -m extras.alfworld_gen OUT_DIR` (--help for more)."""

import json
import os
import random
import shutil
import sys
import tempfile
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from envs import ALFWORLD_TASK_TYPES as TASK_TYPES
from envs import ALFWORLD_WARMUP_SPLIT as WARMUP_SPLIT
from envs import AlfWorldGame, import_alfworld, task_types_of

alfworld = import_alfworld()
import alfworld.gen.constants as C  # noqa: E402
import alfworld.gen.goal_library as goal_library  # noqa: E402

NUM_TRAIN, NUM_EVAL = 24, 6  # the default game set (train games, games per eval split): ~25 s

# the appliance a task needs in its scene, and the verb of the walkthrough step that uses it
APPLIANCE = {
    "clean": ("SinkBasin", "clean"),
    "heat": ("Microwave", "heat"),
    "cool": ("Fridge", "cool"),
}
LAMPS = ("DeskLamp", "FloorLamp")
LAMP_HOLDERS = (
    "Desk",
    "SideTable",
    "Dresser",
    "Shelf",
    "CoffeeTable",
    "DiningTable",
    "ArmChair",
    "Sofa",
)

_WHEEL = os.path.dirname(alfworld.__file__)
LAYOUTS = os.path.join(_WHEEL, "gen", "layouts")
DOMAIN_FILE = os.path.join(_WHEEL, "data", "alfred.pddl")
GRAMMAR_FILE = os.path.join(_WHEEL, "data", "alfred.twl2")

# object types that can be picked up: anything some receptacle type can hold (sliced parts excluded)
PICKABLE = sorted(
    {o for objs in C.VAL_RECEPTACLE_OBJECTS.values() for o in objs if "Sliced" not in o}
)
STATIC_RECEPS = sorted(C.RECEPTACLES - C.MOVABLE_RECEPTACLES_SET)


def mangle(name):
    """ALFRED's escaping of object ids for PDDL ('|' -> _bar_, '-' -> _minus_, ...), the form the
    wheel's Demangler reads back into 'mug 1'."""
    for a, b in (
        ("-", "_minus_"),
        ("|", "_bar_"),
        ("+", "_plus_"),
        (".", "_dot_"),
        (",", "_comma_"),
    ):
        name = name.replace(a, b)
    return name


def _loc(x, z, rot, horizon):
    # ALFRED's grid location: 0.25 m steps, rotation in quarter turns, camera horizon in degrees
    return f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{int(rot) // 90 % 4}|{int(horizon)}"


def _obj_id(kind, rng, suffix=""):
    xyz = "|".join(f"{rng.uniform(-3, 3):+06.2f}" for _ in range(3))
    return f"{kind}|{xyz}{suffix}"


def load_scene(num, rng):
    """A scene as plain data: static receptacles with their ids, types and locations (from the
    layout's receptacle file; types the layout lists without a position get one instance at a
    layout point), the pickable object types present, and the lamps."""
    prefix = os.path.join(LAYOUTS, f"FloorPlan{num}")
    with open(prefix + "-objects.json") as f:
        types = json.load(f)
    with open(prefix + "-openable.json") as f:
        placed = json.load(f)
    points = [tuple(p) for p in np.load(prefix + "-layout.npy").tolist()]
    receps = []
    for rid, (x, z, rot, hor) in sorted(placed.items()):
        rtype = rid.split("|")[-1] if "Basin" in rid else rid.split("|")[0]
        if rtype in STATIC_RECEPS:
            receps.append({"id": rid, "type": rtype, "loc": _loc(x, z, rot, hor)})
    have = {r["type"] for r in receps}
    for rtype in sorted(set(types) & set(STATIC_RECEPS) - have):
        x, z = rng.choice(points)
        suffix = "|" + rtype if rtype.endswith("Basin") else ""
        kind = rtype[:-5] if suffix else rtype  # "Sink|...|SinkBasin" like ALFRED's ids
        receps.append(
            {
                "id": _obj_id(kind, rng, suffix),
                "type": rtype,
                "loc": _loc(x, z, rng.choice([0, 90, 180, 270]), 30),
            }
        )
    objects = sorted(
        t
        for t in set(types)
        if t in PICKABLE and any(t in C.VAL_RECEPTACLE_OBJECTS[r["type"]] for r in receps)
    )
    lamps = sorted(t for t in set(types) if t in LAMPS)
    return {"num": num, "receptacles": receps, "objects": objects, "lamps": lamps, "points": points}


def _holders(scene, otype, exclude_type=None):
    return [
        r
        for r in scene["receptacles"]
        if otype in C.VAL_RECEPTACLE_OBJECTS[r["type"]] and r["type"] != exclude_type
    ]


def sample_task(scene, short, rng):
    """Choose the targets of one task in one scene and place every object; None when the scene
    cannot host this task type. No target object starts in a target-type receptacle, so the goal
    is never true at the start."""
    receps = scene["receptacles"]
    rtypes = sorted({r["type"] for r in receps})
    toggle = None
    if short == "look":
        if not scene["lamps"]:
            return None
        toggle = rng.choice(scene["lamps"])
        lamp_spots = [r for r in receps if r["type"] in LAMP_HOLDERS]
        if not lamp_spots:
            return None
    if short in APPLIANCE and APPLIANCE[short][0] not in rtypes:
        return None
    need = {"clean": "Cleanable", "heat": "Heatable", "cool": "Coolable"}.get(short)
    appliance = APPLIANCE.get(short, (None, None))[0]
    options = []
    for otype in scene["objects"]:
        if need and otype not in C.VAL_ACTION_OBJECTS[need]:
            continue
        if short == "look":
            options.append((otype, toggle))
            continue
        for rtype in rtypes:
            # the target must fit in rtype, start somewhere else, and not be the appliance
            if (
                otype in C.VAL_RECEPTACLE_OBJECTS[rtype]
                and _holders(scene, otype, rtype)
                and rtype != appliance
            ):
                options.append((otype, rtype))
    if not options:
        return None
    otype, rtype = rng.choice(options)
    avoid = rtype if short != "look" else None
    # one instance of every pickable type, 2-3 of the target for pick2, sometimes a second copy
    objects = []
    for kind in scene["objects"]:
        count = rng.randint(2, 3) if (short == "pick2" and kind == otype) else rng.choice([1, 1, 2])
        spots = _holders(scene, kind, avoid if kind == otype else None)
        for _ in range(count):
            objects.append({"id": _obj_id(kind, rng), "type": kind, "in": rng.choice(spots)["id"]})
    lamps = []
    if short == "look":
        lamps.append(
            {
                "id": _obj_id(toggle, rng),
                "type": toggle,
                "in": rng.choice([r for r in receps if r["type"] in LAMP_HOLDERS])["id"],
            }
        )
    ids = [r["id"] for r in receps] + [t["id"] for t in objects + lamps]
    if len(set(ids)) != len(ids):
        return None  # two random ids collided (rare): the caller draws again
    # the agent starts on a grid point where no receptacle is ("You are in the middle of a room")
    used = {tuple(r["loc"].split("|")[1:3]) for r in receps}
    free = [
        p for p in scene["points"] if tuple(_loc(p[0], p[1], 0, 30).split("|")[1:3]) not in used
    ]
    x, z = rng.choice(free or scene["points"])
    agent = _loc(x, z, rng.choice([0, 90, 180, 270]), 30)
    return {
        "short": short,
        "task_type": TASK_TYPES[short],
        "scene": scene["num"],
        "object_target": otype,
        "parent_target": "" if short == "look" else rtype,
        "toggle_target": toggle or "",
        "receptacles": receps,
        "objects": objects,
        "lamps": lamps,
        "agent": agent,
    }


def task_sentence(spec, rng):
    """The goal sentence from the goal library's templates, as ALFWorld's add_task_to_grammar
    fills it (lower-case type names)."""
    template = rng.choice(goal_library.gdict[spec["task_type"]]["templates"])
    return template.format(
        obj=spec["object_target"].lower(),
        recep=spec["parent_target"].lower(),
        toggle=spec["toggle_target"].lower(),
        mrecep="",
    )


def build_problem(spec, name):
    """The PDDL problem of a game: every receptacle, object and location, the facts the domain's
    actions read (types, canContain, pickupable, openable, the property flags, placement), and the
    goal from the goal library."""
    receps, things = spec["receptacles"], spec["objects"] + spec["lamps"]
    loc_of = {r["id"]: r["loc"] for r in receps}
    locations = sorted({r["loc"] for r in receps} | {spec["agent"]})
    otypes = sorted({t["type"] for t in things})
    rtypes = sorted({r["type"] for r in receps})
    decl = ["agent1 - agent"] + [f"{t}Type - otype" for t in otypes]
    decl += [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{mangle(t['id'])} - object" for t in things]
    decl += [f"{mangle(r['id'])} - receptacle" for r in receps]
    decl += [f"{mangle(loc)} - location" for loc in locations]
    init = ["(= (total-cost) 0)", f"(atLocation agent1 {mangle(spec['agent'])})"]
    for r in receps:
        rid = mangle(r["id"])
        init += [
            f"(receptacleType {rid} {r['type']}Type)",
            f"(receptacleAtLocation {rid} {mangle(r['loc'])})",
        ]
        if r["type"] in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {rid})")
    for t in things:
        tid = mangle(t["id"])
        init += [
            f"(objectType {tid} {t['type']}Type)",
            f"(inReceptacle {tid} {mangle(t['in'])})",
            f"(objectAtLocation {tid} {mangle(loc_of[t['in']])})",
        ]
        if t["type"] in PICKABLE:
            init.append(f"(pickupable {tid})")
        if t["type"] in C.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {tid})")
        for flag, group in (
            ("cleanable", "Cleanable"),
            ("heatable", "Heatable"),
            ("coolable", "Coolable"),
            ("toggleable", "Toggleable"),
            ("sliceable", "Sliceable"),
        ):
            if t["type"] in C.VAL_ACTION_OBJECTS[group]:
                init.append(f"({flag} {tid})")
    init += [
        f"(canContain {rt}Type {ot}Type)"
        for rt in rtypes
        for ot in otypes
        if ot in C.VAL_RECEPTACLE_OBJECTS.get(rt, ())
    ]
    goal = (
        goal_library.gdict[spec["task_type"]]["pddl"]
        .format(
            obj=spec["object_target"],
            recep=spec["parent_target"],
            toggle=spec["toggle_target"],
            mrecep="",
        )
        .replace("#", "-")
    )
    objects = "\n    ".join(decl)
    facts = "\n    ".join(init)
    return (
        f"(define (problem {name})\n(:domain alfred)\n(:objects\n    {objects}\n    )\n"
        f"(:init\n    {facts}\n    )\n{goal.strip()}"
    )


def entity_names(spec):
    """id -> the name the player sees ('mug 2'), computed with the wheel's Demangler exactly as
    ALFWorld's AlfredDemangler does on load (fast-downward lower-cases PDDL names)."""
    from alfworld.agents.utils.misc import Demangler  # lazy: it pulls in textworld (~1 s)

    ids = [mangle(t["id"]).lower() for t in spec["objects"] + spec["lamps"]] + [
        mangle(r["id"]).lower() for r in spec["receptacles"]
    ]
    demangler = Demangler(game_infos={i: SimpleNamespace(id=i) for i in ids})
    return {
        raw["id"]: demangler.demangle_alfred_name(mangle(raw["id"]).lower()).strip()
        for raw in spec["objects"] + spec["lamps"] + spec["receptacles"]
    }


def walkthrough(spec):
    """The winning command sequence; the generator knows every placement, so no planner."""
    names = entity_names(spec)
    recep = {r["id"]: r for r in spec["receptacles"]}
    opened, plan, here = set(), [], [spec["agent"]]

    def go(rid):
        # "go to" a receptacle at the agent's own location is not admissible: the agent is there
        if recep[rid]["loc"] != here[0]:
            plan.append(f"go to {names[rid]}")
            here[0] = recep[rid]["loc"]

    def go_open(rid):
        go(rid)
        if recep[rid]["type"] in C.OPENABLE_CLASS_SET and rid not in opened:
            plan.append(f"open {names[rid]}")
            opened.add(rid)

    short, otype = spec["short"], spec["object_target"]
    targets = [o for o in spec["objects"] if o["type"] == otype][: 2 if short == "pick2" else 1]
    goal_recep = None
    if short != "look":
        goal_recep = next(
            r["id"] for r in spec["receptacles"] if r["type"] == spec["parent_target"]
        )
    for obj in targets:
        go_open(obj["in"])
        plan.append(f"take {names[obj['id']]} from {names[obj['in']]}")
        if short in APPLIANCE:
            rtype, verb = APPLIANCE[short]
            tool = next(r["id"] for r in spec["receptacles"] if r["type"] == rtype)
            go(tool)
            plan.append(f"{verb} {names[obj['id']]} with {names[tool]}")
        if short == "look":
            lamp = spec["lamps"][0]
            go(lamp["in"])
            plan.append(f"use {names[lamp['id']]}")
        else:
            go_open(goal_recep)
            plan.append(f"move {names[obj['id']]} to {names[goal_recep]}")
    return plan


def _scenes(split, max_receptacles=None):
    # valid_unseen: ALFRED's held-out test scenes; train and valid_seen: its training scenes
    nums = sorted(C.TEST_SCENE_NUMBERS if split == "valid_unseen" else C.TRAIN_SCENE_NUMBERS)
    if max_receptacles is None:
        return nums
    return [
        n
        for n in nums
        if len(load_scene(n, random.Random(f"scene-{n}"))["receptacles"]) <= max_receptacles
    ]


def _scene_kind(num):
    return next(kind for kind, nums in C.SCENE_TYPE.items() if num in nums)


def generate(
    out_dir,
    num_train=NUM_TRAIN,
    num_eval=NUM_EVAL,
    seed=0,
    task_types=tuple(TASK_TYPES),
    max_receptacles=None,
    num_warmup=0,
):
    """Write num_train games to json_2.1.1/train, num_eval to each of valid_seen and
    valid_unseen, and num_warmup to warmup (games of the training scenes that only train.py's
    warm start plays: neither trained nor evaluated on) under out_dir, the given task types
    round-robin (with all six, any count >= 6 covers every type), in scenes with at most
    max_receptacles receptacles (None: any scene; a small scene means few places to go, so few
    admissible actions). Deterministic for a seed and these settings: the splits draw from
    separate streams, so adding warmup games changes no other game. A generator: yields
    (split, game path, walkthrough) as each game is written, so the caller can show progress and
    play the walkthrough (generate_games does both)."""
    if min(num_train, num_eval, num_warmup) < 0:
        raise ValueError("generate: num_train, num_eval and num_warmup must be >= 0")
    unknown = sorted(set(task_types) - set(TASK_TYPES))
    if unknown or not task_types:
        raise ValueError(f"generate: unknown task types {unknown}: use some of {list(TASK_TYPES)}")
    with open(GRAMMAR_FILE) as f:
        grammar = f.read()
    with open(DOMAIN_FILE) as f:
        domain = f.read()
    root = os.path.join(out_dir, "json_2.1.1")
    for split, count in (
        ("train", num_train),
        ("valid_seen", num_eval),
        ("valid_unseen", num_eval),
        (WARMUP_SPLIT, num_warmup),
    ):
        rng = random.Random(f"{seed}-{split}")
        scenes = _scenes(split, max_receptacles)
        shorts = [t for t in TASK_TYPES if t in task_types]
        made = attempts = 0
        while made < count:
            attempts += 1
            short = shorts[made % len(shorts)]
            ok_kinds = C.GOALS_VALID[TASK_TYPES[short]]
            hosts = [n for n in scenes if _scene_kind(n) in ok_kinds]
            if not hosts or attempts > 50 * count + 100:
                raise ValueError(
                    f"generate: no scene of {split} with <= {max_receptacles} "
                    f"receptacles hosts {short} tasks: allow larger scenes"
                )
            num = rng.choice(hosts)
            spec = sample_task(load_scene(num, random.Random(f"scene-{num}")), short, rng)
            if spec is None:
                continue
            goal_text = task_sentence(spec, rng)
            trial = f"trial_T{seed % 10**8:08d}_{made:06d}_{rng.randrange(10**6):06d}"
            folder = "-".join(
                [
                    spec["task_type"],
                    spec["object_target"],
                    "None",
                    spec["parent_target"] or spec["toggle_target"],
                    str(num),
                ]
            )
            game_dir = os.path.join(root, split, folder, trial)
            os.makedirs(game_dir, exist_ok=True)
            game = {
                "pddl_domain": domain,
                "grammar": grammar.replace("UNKNOWN GOAL", goal_text),
                "pddl_problem": build_problem(spec, f"plan_{trial}"),
                "solvable": True,
                "walkthrough": walkthrough(spec),
            }
            traj = {
                "task_type": spec["task_type"],
                "task_id": trial,
                "scene": {"floor_plan": f"FloorPlan{num}", "scene_num": num},
                "pddl_params": {
                    "object_target": spec["object_target"],
                    "parent_target": spec["parent_target"],
                    "toggle_target": spec["toggle_target"],
                    "mrecep_target": "",
                    "object_sliced": False,
                },
                "turk_annotations": {"anns": [{"task_desc": goal_text + "."}]},
                "generator": "tigpo alfworld_gen (offline, no planner)",
            }
            path = os.path.join(game_dir, "game.tw-pddl")
            with open(path, "w") as f:
                json.dump(game, f)
            with open(os.path.join(game_dir, "traj_data.json"), "w") as f:
                json.dump(traj, f, indent=1)
            made += 1
            yield split, path, game["walkthrough"]


# ---------------------------------------------------------------------------------------------
# Checked game sets: in a folder (generate_games, the command line), or the default set in the
# user cache that train.py plays when no data is given (cached_games)
# ---------------------------------------------------------------------------------------------
def generate_games(
    out_dir,
    num_train=NUM_TRAIN,
    num_eval=NUM_EVAL,
    seed=0,
    task_types=tuple(TASK_TYPES),
    max_receptacles=None,
    verify=True,
    progress=True,
    num_warmup=0,
):
    """Generate ALFWorld games into out_dir/json_2.1.1 (generate) with a progress bar, and play
    each game's walkthrough through envs.AlfWorldGame: every step must be admissible and the last
    one must win (the solvability check; the planner is never called). Returns the written game
    paths."""
    written, player = [], None  # one game replays every walkthrough (see AlfWorldGame.load)
    total = num_train + 2 * num_eval + num_warmup
    bar = tqdm(
        total=total,
        desc="generating games",
        unit="game",
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    )
    try:
        for _, path, steps in generate(
            out_dir, num_train, num_eval, seed, task_types, max_receptacles, num_warmup
        ):
            if verify:
                player = _play_walkthrough(player, path, steps)
            written.append(path)
            bar.update()
    finally:
        bar.close()
        if player is not None:
            player.close()
    return written


def _play_walkthrough(player, path, steps):
    """Play a generated game's walkthrough: every step admissible, the last one wins."""
    if player is None:
        player = AlfWorldGame(path)
    else:
        player.load(path)
    player.max_steps = len(steps) + 1
    player.reset()
    for i, command in enumerate(steps):
        _, _, done, info = player.step(command)
        if not info["valid"]:
            raise RuntimeError(
                f"generator bug: walkthrough step {i} {command!r} is not admissible in {path}"
            )
    if not info["won"]:
        raise RuntimeError(f"generator bug: walkthrough does not win {path}")
    return player


def _cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tigpo")


def cached_games(
    seed=0,
    num_train=NUM_TRAIN,
    num_eval=NUM_EVAL,
    task_types=None,
    max_receptacles=None,
    num_warmup=0,
):
    """The json_2.1.1 folder of generated games in the user cache, made once, keyed by seed,
    counts, task types and scene size: what a run plays when no ALFWorld data is given (and,
    with num_warmup, the games only its warm start plays)."""
    types = task_types_of(task_types)
    name = f"alfworld-{seed}-{num_train}-{num_eval}"
    if types != tuple(TASK_TYPES):
        name += "-" + "-".join(types)
    if max_receptacles:
        name += f"-r{max_receptacles}"
    if num_warmup:
        name += f"-w{num_warmup}"
    target = os.path.join(_cache_dir(), name)
    root = os.path.join(target, "json_2.1.1")
    if not os.path.isdir(root):
        os.makedirs(_cache_dir(), exist_ok=True)
        warmup = f" (+{num_warmup} for the warm start)" if num_warmup else ""
        print(
            f"tigpo: no ALFWORLD_DATA; generating {num_train}+{num_eval}+{num_eval}{warmup} "
            f"ALFWorld games once into {target}",
            file=sys.stderr,
        )
        tmp = tempfile.mkdtemp(prefix="alfworld-tmp-", dir=_cache_dir())
        try:
            generate_games(
                tmp, num_train, num_eval, seed, types, max_receptacles, num_warmup=num_warmup
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.rename(tmp, target)  # atomic: a concurrent generator may have won the race
        except OSError:
            if not os.path.isdir(root):
                raise
            shutil.rmtree(tmp)
    return root


def main(argv=None):
    """`python -m extras.alfworld_gen OUT_DIR ...`: a game set for ALFWORLD_DATA / --data-dir."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m extras.alfworld_gen",
        description=(
            "Generate ALFWorld games offline (official json_2.1.1 layout), each with a walkthrough "
            "checked to win. Point ALFWORLD_DATA (or train.py --data-dir) at OUT_DIR."
        ),
    )
    parser.add_argument(
        "out_dir", help="folder that receives json_2.1.1/{train,valid_seen,valid_unseen}"
    )
    parser.add_argument("--num-train", type=int, default=NUM_TRAIN, help="games in train")
    parser.add_argument(
        "--num-eval", type=int, default=NUM_EVAL, help="games in each of valid_seen, valid_unseen"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="generation seed (same seed, same games)"
    )
    parser.add_argument(
        "--task-types",
        default=",".join(TASK_TYPES),
        help="comma-separated task types, taken in turn (default: all six)",
    )
    parser.add_argument(
        "--max-receptacles",
        type=int,
        default=None,
        help="only scenes with at most this many receptacles (default: any)",
    )
    parser.add_argument(
        "--num-warmup",
        type=int,
        default=0,
        help="games in warmup: only train.py's warm start plays them (--warmup-games)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip playing each walkthrough")
    args = parser.parse_args(argv)
    try:
        paths = generate_games(
            args.out_dir,
            args.num_train,
            args.num_eval,
            args.seed,
            tuple(args.task_types.split(",")),
            args.max_receptacles,
            verify=not args.no_verify,
            num_warmup=args.num_warmup,
        )
    except ValueError as e:
        parser.error(str(e))
    print(f"wrote {len(paths)} games under {os.path.join(args.out_dir, 'json_2.1.1')}")


if __name__ == "__main__":
    main()
