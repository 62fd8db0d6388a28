"""train.py's checkpoints: a failed save leaves the run as it was; stray temporaries are cleaned on
the next start; a plain model saves without a GGUF quantization_config; --model is checked before
anything."""

import json
import os

import pytest

import tigpo
import train
from train import UsageError


class Args:
    def __init__(self, run_dir, updates):
        self.run_dir = run_dir
        self.updates = updates
        self.keep_checkpoints = 1


class RefusingModel:
    def save_pretrained(self, folder, state_dict=None):
        raise ValueError("The model is quantized with gguf and is not serializable")


def test_a_failed_save_leaves_no_temporary_folder_and_the_config_untouched(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setattr(dataclasses, "asdict", lambda a: {"updates": a.updates})
    (tmp_path / "config.json").write_text(json.dumps({"updates": 3}))
    memory, scheduler = tigpo.GraphMemory(), tigpo.RevisitScheduler(["t"], 1, 0, 1)
    with pytest.raises(ValueError, match="not serializable"):
        train.save_checkpoint(
            Args(str(tmp_path), 4),
            4,
            RefusingModel(),
            None,
            None,
            memory,
            scheduler,
            [train.rng_state()],
        )
    assert os.listdir(tmp_path / "checkpoints") == []
    assert json.loads((tmp_path / "config.json").read_text()) == {"updates": 3}


def test_stale_temporaries_are_removed_on_the_next_start(tmp_path):
    (tmp_path / "checkpoints" / ".tmp_update_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "update_000003").mkdir()
    (tmp_path / "checkpoints" / "update_000003.eval.json").write_text("{}")
    train.remove_stale_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "update_000003",
        "update_000003.eval.json",
    ]
    assert train.last_checkpoint(str(tmp_path)) == (
        str(tmp_path / "checkpoints" / "update_000003"),
        3,
    )


@pytest.mark.parametrize(
    "name", ["/nonexistent", "./nope", "runs/a/checkpoints/update_000001", "~/missing"]
)
def test_a_model_path_that_does_not_exist_is_named_as_such(name):
    with pytest.raises(UsageError, match="no such directory"):
        train.check_model_arg(name)


def test_a_local_model_folder_is_accepted(tmp_path):
    train.check_model_arg(str(tmp_path))
