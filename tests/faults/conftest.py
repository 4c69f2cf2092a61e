"""Fixtures of the fault scenarios: the harness's run, prepared once, and its reference run."""

import shutil

import pytest
from fault_harness import Cluster, local_run, prepare_run


@pytest.fixture(scope="session")
def prepared_faults(tmp_path_factory):
    """The harness's run (tiny preset, 2 rounds of 6 steps), prepared once per session."""
    return prepare_run(tmp_path_factory.mktemp("faults") / "prepared")


@pytest.fixture
def cluster(prepared_faults, tmp_path):
    """Make a :class:`Cluster` on a private copy of the prepared run."""

    def make(name: str = "run", **kwargs) -> Cluster:
        root = tmp_path / name
        shutil.copytree(prepared_faults, root)
        # The scenarios stop the peers once the coordinator has exited, and look at nothing a
        # peer does after the run finished: the coordinator need not linger for them.
        kwargs.setdefault("linger", 0.5)
        return Cluster(root, tmp_path / f"{name}-work", **kwargs)

    return make


@pytest.fixture(scope="module")
def reference(prepared_faults, tmp_path_factory):
    """The fault-free run of the same config, once per module: what exact scenarios must match.
    Its two peers are threads of this process: a run's modules do not depend on the transport or
    on which peer trained which path, and peer processes would add only their start-up."""
    return local_run(prepared_faults, tmp_path_factory.mktemp("reference") / "run", peers=2)
