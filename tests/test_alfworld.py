"""ALFWorld on the real engine (docs/ALGORITHM.md "Environments"): generated games of all six task
types are won by their walkthroughs through AlfWorldEnv; reward/done/won; invalid actions; state
keys; the official data layout; the clear error for a broken or missing data folder; the default
game set made once in the user cache; generator determinism."""

import json
import os
import re
import shutil

import pytest

import envs

pytestmark = pytest.mark.slow
KEY_RE = re.compile(
    r"^(train|valid_seen|valid_unseen)/[a-z_]+-[A-Za-z]+-None-[A-Za-z]+-\d+/trial_T[\d_]+/game\.tw-pddl$"
)


def walkthrough(data, task):
    with open(os.path.join(data, "json_2.1.1", task)) as f:
        return json.load(f)["walkthrough"]


@pytest.fixture(scope="module")
def env(alfworld_data):
    env = envs.AlfWorldEnv(split="train", data_dir=alfworld_data)
    yield env
    env.close()


def first_task(env, short):
    return next(t for t in env.tasks if envs.task_type_of(t) == short)


def test_every_task_type_is_generated_and_won_by_its_walkthrough(env, alfworld_data):
    assert env.tasks == sorted(env.tasks) and all(KEY_RE.match(t) for t in env.tasks)
    assert {envs.task_type_of(t) for t in env.tasks} == set(envs.ALFWORLD_TASK_TYPES)
    for task in env.tasks:
        obs, info = env.reset(task)
        assert obs.startswith("You are in the middle of a room") and "Your task is to: " in obs
        assert info["task_type"] == envs.task_type_of(task) and info["goal"].endswith(".")
        assert info["goal"] in obs and "help" not in info["admissible"]
        plan = walkthrough(alfworld_data, task)
        for i, command in enumerate(plan):
            obs, reward, done, info = env.step(command)
            assert info["valid"] and obs != envs.NOTHING, (task, command)
            last = i == len(plan) - 1
            assert (reward, done, info["won"]) == (
                (10.0, True, True) if last else (0.0, False, False)
            )


def test_invalid_action_is_a_harmless_step(env):
    obs0, info0 = env.reset(first_task(env, "pick"))
    for bad in ("dance wildly", None, "help"):
        obs, reward, done, info = env.step(bad)
        assert (obs, reward, done, info["valid"], info["won"]) == (
            envs.NOTHING,
            0.0,
            False,
            False,
            False,
        )
        assert info["state"] == info0["state"] and info["admissible"] == info0["admissible"]
    # validity is judged after normalisation: case and spaces do not matter
    target = info0["admissible"][0]
    obs, _, _, info = env.step("  " + target.upper().replace(" ", "   ") + " ")
    assert info["valid"] and obs != envs.NOTHING


def test_episode_ends_at_max_steps_without_reward(alfworld_data):
    env = envs.AlfWorldEnv(split="train", data_dir=alfworld_data, max_steps=3)
    env.reset(env.tasks[0])
    results = [env.step("look") for _ in range(3)]
    assert [r[2] for r in results] == [False, False, True]
    assert all(r[1] == 0.0 and not r[3]["won"] for r in results)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")
    env.close()


def test_facts_state_key_is_the_world_state(env, alfworld_data):
    task = first_task(env, "pick")
    plan = walkthrough(alfworld_data, task)
    _, info = env.reset(task)
    start = info["state"]
    assert env.reset(task)[1]["state"] == start  # deterministic
    for command in ("look", "inventory"):  # observing changes nothing
        assert env.step(command)[3]["state"] == start
    receptacles = [a for a in info["admissible"] if a.startswith("go to ")]
    key_a = env.step(receptacles[0])[3]["state"]
    assert key_a != start  # the agent moved
    examine = next(a for a in env.step("look")[3]["admissible"] if a.startswith("examine"))
    assert env.step(examine)[3]["state"] == key_a
    key_b = env.step(receptacles[1])[3]["state"]
    assert env.step(receptacles[0])[3]["state"] == key_a != key_b  # same state, same key
    # picking the target up (the walkthrough's first take) moves an object: a new key
    env.reset(task)
    keys = [
        env.step(c)[3]["state"]
        for c in plan[: next(i for i, c in enumerate(plan) if c.startswith("take")) + 1]
    ]
    assert keys[-1] not in keys[:-1]


def test_obs_state_key_uses_observation_location_and_held_object(alfworld_data):
    env = envs.AlfWorldEnv(split="train", data_dir=alfworld_data, state_key="obs")
    task = env.tasks[0]
    _, info = env.reset(task)
    start = info["state"]
    assert env.reset(task)[1]["state"] == start
    nothing_here = env.step("dance")[3]["state"]
    go = [a for a in info["admissible"] if a.startswith("go to ")]
    env.step(go[0])
    nothing_there = env.step("dance")[3]["state"]
    assert nothing_here != nothing_there  # "Nothing happens." at two places: two keys
    env.close()
    with pytest.raises(ValueError, match="state_key"):
        envs.AlfWorldGame(os.path.join(alfworld_data, "json_2.1.1", task), state_key="pixels")


def test_official_layout_tree_loads_splits_and_skips_what_alfworld_skips(
    alfworld_data, tmp_path, monkeypatch
):
    src = os.path.join(alfworld_data, "json_2.1.1")
    dst = tmp_path / "data" / "json_2.1.1"
    shutil.copytree(src, dst)
    # an unsolvable game and a movable-receptacle game: AlfredTWEnv skips both, so must we
    first = sorted(os.listdir(dst / "train"))[0]
    unsolvable = dst / "train" / (first + "-copy")
    shutil.copytree(dst / "train" / first, unsolvable)
    game = next(unsolvable.rglob("game.tw-pddl"))
    game.write_text(json.dumps(dict(json.loads(game.read_text()), solvable=False)))
    movable = "pick_and_place_with_movable_recep-" + first.split("-", 1)[1]
    shutil.copytree(dst / "train" / first, dst / "train" / movable)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "data"))
    expected = envs.AlfWorldEnv(split="train", data_dir=alfworld_data).tasks
    for split in envs.ALFWORLD_SPLITS:
        env = envs.AlfWorldEnv(split=split)  # found through ALFWORLD_DATA
        assert env.tasks and all(t.startswith(split + "/") and KEY_RE.match(t) for t in env.tasks)
        if split == "train":
            assert env.tasks == expected
    # data_dir may also name the json_2.1.1 folder itself
    assert envs.AlfWorldEnv(split="valid_unseen", data_dir=str(dst)).tasks


def test_broken_data_folder_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*alfworld-download"):
        envs.AlfWorldEnv(data_dir=str(tmp_path))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="ALFWORLD_DATA"):
        envs.AlfWorldEnv()
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match="no solvable games"):
        _ = envs.AlfWorldEnv(data_dir=str(tmp_path)).tasks
    with pytest.raises(ValueError, match="valid_seen"):
        envs.AlfWorldEnv(split="valid_seen", data_dir=str(tmp_path))
    monkeypatch.delenv("ALFWORLD_DATA")  # no data at all: the error says how to get some
    with pytest.raises(ValueError, match="no ALFWorld data.*alfworld-download.*alfworld_gen"):
        envs.AlfWorldEnv()


def test_unknown_task_is_an_error(env):
    with pytest.raises(envs.TaskError):
        env.reset("train/nothing-here/trial_T0/game.tw-pddl")


def test_default_data_is_generated_once_in_the_user_cache(tmp_path, monkeypatch, capsys):
    from extras import alfworld_gen

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = alfworld_gen.cached_games(seed=3, num_train=1, num_eval=0)
    assert root == str(tmp_path / "tigpo" / "alfworld-3-1-0" / "json_2.1.1")
    assert "generating" in capsys.readouterr().err
    assert alfworld_gen.cached_games(seed=3, num_train=1, num_eval=0) == root
    assert "generating" not in capsys.readouterr().err  # made once
    assert envs.AlfWorldEnv(data_dir=root).tasks  # a folder envs plays as given


def test_generator_is_deterministic_for_a_seed(tmp_path):
    from extras import alfworld_gen

    files = []
    for run in ("a", "b"):
        paths = [
            p
            for _, p, _ in alfworld_gen.generate(
                str(tmp_path / run), num_train=2, num_eval=1, seed=7
            )
        ]
        files.append([(os.path.relpath(p, tmp_path / run), open(p).read()) for p in paths])
    assert files[0] == files[1] and len(files[0]) == 4
    other = [
        p for _, p, _ in alfworld_gen.generate(str(tmp_path / "c"), num_train=2, num_eval=1, seed=8)
    ]
    assert [os.path.relpath(p, tmp_path / "c") for p in other] != [f for f, _ in files[0]]
    seen = {p.split("/")[2].rsplit("-", 1)[1] for p, _ in files[0] if "/valid_unseen/" in "/" + p}
    assert seen and all(int(s) in alfworld_gen.C.TEST_SCENE_NUMBERS for s in seen)


def test_warmup_games_are_extra_and_change_no_other_game(tmp_path):
    # --warmup-games: games only the warm start plays, in a split of their own; the train and
    # eval games of the seed stay the ones a run without them plays
    from extras import alfworld_gen

    def written(out, **kw):
        paths = alfworld_gen.generate_games(
            str(out), num_train=2, num_eval=1, seed=7, progress=False, **kw
        )
        return {os.path.relpath(p, out): open(p).read() for p in paths}

    plain, more = written(tmp_path / "a"), written(tmp_path / "b", num_warmup=2)
    extra = sorted(set(more) - set(plain))
    assert {k: more[k] for k in plain} == plain and len(extra) == 2
    assert all(k.startswith("json_2.1.1/warmup/") for k in extra)
    env = envs.AlfWorldEnv(split="warmup", data_dir=str(tmp_path / "b" / "json_2.1.1"))
    assert sorted(env.tasks) == sorted(k.split("/", 1)[1] for k in extra)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_switching_tasks_reuses_one_planner_library(alfworld_data):
    # every textworld PDDL env maps its own 33 MB copy of libdownward.so for good: one env per
    # task would leak one copy per reset
    def copies():
        with open("/proc/self/maps") as f:
            return sum("libdownward" in line for line in f)

    env = envs.AlfWorldEnv(split="train", data_dir=alfworld_data)
    env.reset(env.tasks[0])
    after_one = copies()
    for task in env.tasks[1:]:
        env.reset(task)
        env.step("look")
    assert copies() == after_one
    env.close()


def test_playing_a_game_does_not_invent_an_alfworld_data_folder(alfworld_data):
    # alfworld's own import sets ALFWORLD_DATA to an empty ~/.cache/alfworld; envs must not then
    # mistake that for the user's data folder: a run that plays a game in its own process (the
    # warm start) and then asks for the generated games again (the eval) would stop with a
    # "broken folder" error. A fresh process, so that alfworld is imported here for the first time.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    code = (
        "import os, sys, envs\n"
        "game = envs.AlfWorldGame(sys.argv[1])\n"
        "game.close()\n"
        "print(os.environ.get('ALFWORLD_DATA'))\n"
    )
    root = os.path.join(alfworld_data, "json_2.1.1")
    game = os.path.join(root, envs.alfworld_tasks(root, "train")[0])
    out = subprocess.run(
        [sys.executable, "-c", code, game],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        check=True,
    )
    assert out.stdout.strip() == "None"


def test_games_are_selected_by_task_type_and_scene_size(alfworld_data):
    root = os.path.join(alfworld_data, "json_2.1.1")
    every = envs.alfworld_tasks(root, "train")
    sizes = {}
    for key in every:
        with open(os.path.join(root, key)) as fh:
            sizes[key] = envs.scene_size(json.load(fh)["pddl_problem"])
    assert len(every) == 6 and all(s > 0 for s in sizes.values())
    picks = envs.alfworld_tasks(root, "train", task_types="pick,look")
    assert picks and set(picks) < set(every)
    assert all(
        k.split("/")[1].startswith(("pick_and_place_simple", "look_at_obj_in_light")) for k in picks
    )
    limit = sorted(sizes.values())[len(sizes) // 2]
    small = envs.alfworld_tasks(root, "train", max_receptacles=limit)
    assert list(small) == [k for k in every if sizes[k] <= limit]
    assert 0 < len(small) < len(every) or len(set(sizes.values())) == 1
    with pytest.raises(ValueError, match="unknown ALFWorld task types"):
        envs.alfworld_tasks(root, "train", task_types="pick,fly")
