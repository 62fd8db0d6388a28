"""EnvPool (docs/ALGORITHM.md "Parallel envs"): results equal the single env's and do not depend on
the number of workers; None actions; a crashed game or a killed worker ends only its own
episodes, the
worker restarts, and close() leaves no process behind."""

import json
import os
import shutil
import signal
import time

import pytest

import envs

pytestmark = pytest.mark.slow


def plans(data, tasks):
    return [json.load(open(os.path.join(data, "json_2.1.1", t)))["walkthrough"] for t in tasks]


def play(pool, tasks, walks):
    """Reset on tasks, then step each env through its plan; None once its plan is over."""
    trace = [pool.reset(tasks)]
    for k in range(max(map(len, walks))):
        trace.append(pool.step([w[k] if k < len(w) else None for w in walks]))
    return trace


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_pool_equals_single_env_for_any_number_of_workers(alfworld_data):
    env = envs.AlfWorldEnv(split="train", data_dir=alfworld_data)
    tasks = env.tasks[:4] + env.tasks[:2]  # K rollouts of one task are separate envs
    walks = plans(alfworld_data, tasks)
    traces = []
    for workers in (1, 2):
        pool = envs.EnvPool(
            envs.AlfWorldEnv, num_workers=workers, split="train", data_dir=alfworld_data
        )
        traces.append(play(pool, tasks, walks))
        pool.close()
    assert traces[0] == traces[1]
    # the single env gives the same observations and states
    obs, infos = traces[0][0]
    for j, task in enumerate(tasks):
        single_obs, single_info = env.reset(task)
        assert (obs[j], infos[j]["state"]) == (single_obs, single_info["state"])
        for k, command in enumerate(walks[j]):
            o, r, d, info = env.step(command)
            step_obs, rewards, dones, step_infos = traces[0][k + 1]
            assert (step_obs[j], rewards[j], dones[j], step_infos[j]) == (o, r, d, info)
    # the last step of every plan won, and later None actions kept the slot done and quiet
    final_obs, final_rewards, final_dones, final_infos = traces[0][-1]
    assert all(final_dones)
    short = [j for j, w in enumerate(walks) if len(w) < len(traces[0]) - 1]
    assert short and all(
        final_obs[j] is None and final_rewards[j] == 0.0 and final_infos[j] == {} for j in short
    )
    env.close()


def test_crashed_game_and_killed_worker_end_only_their_episodes(alfworld_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(os.path.join(alfworld_data, "json_2.1.1"), data / "json_2.1.1")
    tasks = envs.AlfWorldEnv(split="train", data_dir=str(data)).tasks
    broken = data / "json_2.1.1" / tasks[0]
    broken.write_text(
        json.dumps(dict(json.loads(broken.read_text()), pddl_problem="(define (problem"))
    )
    pool = envs.EnvPool(envs.AlfWorldEnv, num_workers=2, split="train", data_dir=str(data))
    obs, infos = pool.reset(tasks[:4])
    assert "crash" in infos[0] and all("crash" not in i for i in infos[1:])
    pids = pool.pids
    os.kill(pids[1], signal.SIGKILL)  # worker 1 holds slots 2 and 3 (contiguous blocks)
    while alive(pids[1]):
        time.sleep(0.05)
    obs, rewards, dones, infos = pool.step(["look"] * 4)
    assert dones == [True, False, True, True] and rewards == [0.0] * 4
    assert infos[0] == {} and "died" in infos[2]["crash"] and "died" in infos[3]["crash"]
    assert infos[1]["valid"] and "crash" not in infos[1]
    obs, rewards, dones, infos = pool.step(["look"] * 4)  # ended episodes are not stepped
    assert obs[2] is None and infos[2] == {} and dones[2] and not dones[1]
    obs, infos = pool.reset(tasks[1:4])  # the batch goes on, worker restarted
    assert all("crash" not in i for i in infos) and pool.pids[1] not in (None, pids[1])
    with pytest.raises(envs.TaskError):
        pool.reset(["train/none/trial_T0/game.tw-pddl"])
    live = [p for p in pool.pids if p]
    pool.close()
    assert live and not any(alive(p) for p in live) and pool.pids == [None, None]


def test_hung_worker_is_killed_after_the_timeout_and_the_batch_goes_on(alfworld_data):
    # The timeout is shortened only once the workers are up and their games loaded: a reset on a
    # busy machine may take seconds, and must not count as a hang. A step of "look" takes
    # milliseconds, so 5 s is a margin that holds at any load a CI machine sees.
    pool = envs.EnvPool(envs.AlfWorldEnv, num_workers=2, split="train", data_dir=alfworld_data)
    tasks = envs.AlfWorldEnv(split="train", data_dir=alfworld_data).tasks[:2]
    obs, infos = pool.reset(tasks)
    assert all("crash" not in i for i in infos)
    pool.worker_timeout = 5.0
    hung = pool.pids[1]
    os.kill(hung, signal.SIGSTOP)  # worker 1 (slot 1) stops answering, as a hung game would
    obs, rewards, dones, infos = pool.step(["look", "look"])
    assert infos[0]["valid"] and not dones[0]
    assert dones[1] and rewards[1] == 0.0 and "hung" in infos[1]["crash"]
    assert pool.pids[1] is None and not alive(hung)
    pool.worker_timeout = 600.0
    obs, infos = pool.reset(tasks)  # restarted
    assert all("crash" not in i for i in infos) and pool.pids[1] not in (None, hung)
    pool.close()


def test_pool_rejects_unknown_env_and_misaligned_actions(alfworld_data):
    for not_a_class in ("alfworld", lambda: None):  # a name, or nothing a worker can import
        with pytest.raises(ValueError, match="env class its workers can import"):
            envs.EnvPool(not_a_class)
    pool = envs.EnvPool(envs.AlfWorldEnv, num_workers=1, data_dir=alfworld_data)
    pool.reset(envs.AlfWorldEnv(data_dir=alfworld_data).tasks[:2])
    with pytest.raises(ValueError, match="2 envs"):
        pool.step(["look"])
    pool.close()
