import shutil
import sys
from pathlib import Path

import pytest
from _threads import thread_exceptions  # noqa: F401 - autouse: a thread's exception fails its test

from dipaco.config import preset_config
from dipaco.prepare.pipeline import prepare

# The capacity simulator lives with its command in bench/ (bench/sim); its tests import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


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


def copier(prepared: Path, tmp_path: Path):
    """``make(name)``: a private copy of ``prepared`` under ``tmp_path``."""

    def make(name: str = "run") -> Path:
        dest = tmp_path / name
        shutil.copytree(prepared, dest)
        return dest

    return make


@pytest.fixture
def run_copy(prepared_tiny, tmp_path):
    """A private copy of the prepared run, with no training state yet."""
    return copier(prepared_tiny, tmp_path)


@pytest.fixture(scope="session")
def short_config(tiny_config):
    """``tiny_config`` with short tasks (8 inner steps), for whole runs over real processes that
    need no task caught mid-way: there every process competes for the cores, and a step may take
    many times longer than alone."""
    return tiny_config.replace(train={"inner_steps": 8})


@pytest.fixture(scope="session")
def prepared_short(tmp_path_factory, prepared_tiny, short_config):
    """The short-task run prepared once per session (the tiny run's tokenizer and tokens)."""
    root = tmp_path_factory.mktemp("prepared-short") / "run"
    prepare(root, short_config, reuse=prepared_tiny)
    return root


@pytest.fixture
def short_copy(prepared_short, tmp_path):
    """A private copy of the short-task prepared run, with no training state yet."""
    return copier(prepared_short, tmp_path)


@pytest.fixture(scope="session")
def prepared_batch(tmp_path_factory):
    """A tiny 2x2 run for path-parallel peers (vocab 512, width 32, 2 layers, seq 64, batch 4;
    3 rounds of 3 steps), prepared once a session: ``(folder, config)``."""
    config = preset_config("tiny").replace(
        data={"max_docs": 200, "tokenizer_sample_chars": 100_000},
        train={
            "batch_size": 4,
            "inner_steps": 3,
            "rounds": 3,
            "pretrain_steps": 4,
            "warmup_steps": 2,
        },
        topology={"levels": "2x2"},
        eval={"max_docs": 8},
    )
    root = tmp_path_factory.mktemp("path-parallel") / "prepared"
    prepare(root, config)
    return root, config
