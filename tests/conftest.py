import shutil
from pathlib import Path

import pytest

from dipaco.config import preset_config
from dipaco.prepare.pipeline import prepare


@pytest.fixture(scope="session")
def tiny_config():
    """The tiny preset with tasks long enough to be caught mid-way, and short leases."""
    return preset_config("tiny").replace(
        train={"inner_steps": 30, "rounds": 2},
        scheduler={"lease_seconds": 5.0, "heartbeat_seconds": 0.5},
    )


@pytest.fixture(scope="session")
def prepared_tiny(tmp_path_factory, tiny_config):
    """A tiny run prepared once per session: tokenizer, pretraining, router, shards."""
    root = tmp_path_factory.mktemp("prepared") / "run"
    prepare(root, tiny_config)
    return root


@pytest.fixture
def run_copy(prepared_tiny, tmp_path):
    """A private copy of the prepared run, with no training state yet."""

    def make(name: str = "run") -> Path:
        dest = tmp_path / name
        shutil.copytree(prepared_tiny, dest)
        return dest

    return make
