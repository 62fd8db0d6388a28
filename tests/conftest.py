"""tests/conftest.py: shared fixtures. `alfworld_data` generates a small set of ALFWorld games once
per test session (all six task types in train, two games in each eval split) and returns the
folder that holds json_2.1.1/{train,valid_seen,valid_unseen}."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def alfworld_data(tmp_path_factory):
    import envs
    out = tmp_path_factory.mktemp("alfworld")
    envs.generate_games(str(out), num_train=6, num_eval=2, seed=0)   # 10 games, ~6-15 s
    return str(out)
