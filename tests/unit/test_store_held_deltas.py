"""A running coordinator steps from the deltas it admitted, held in memory (within a budget),
not from reading back the files it wrote; a restart steps from the files, to the same bits."""

import shutil

import torch

from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.store import ModuleStore

MODULE = {"w": torch.linspace(-1, 1, 4096), "b": torch.ones(64)}
NBYTES = sum(t.nbytes for t in MODULE.values())


def deltas(p):
    return {k: torch.sin(v * (p + 1)) * 0.01 for k, v in MODULE.items()}


def admit(store, paths, round_=0):
    for p in range(paths):
        store.add_delta("m", p, 1.0 + p, f"t{round_}-{p}", "peer", deltas(p))


def test_held_deltas_step_to_the_same_bits_as_a_restart_that_reads_their_files(tmp_path):
    running = ModuleStore(tmp_path / "run")
    running.initialize({"m": MODULE})
    admit(running, 3)
    assert running.held == 3 * NBYTES
    assert all(d.tensors is not None for d in running.modules["m"].pending.values())
    shutil.copytree(tmp_path / "run", tmp_path / "restarted")  # a crash right here
    restarted = ModuleStore(tmp_path / "restarted")
    restarted.load(["m"])
    assert restarted.held == 0
    assert all(d.tensors is None for d in restarted.modules["m"].pending.values())
    for store in (running, restarted):
        store.outer_step("m", OuterSettings(rescale="norm"))
    for name in MODULE:
        assert torch.equal(running.params("m")[name], restarted.params("m")[name])
    assert running.version("m") == restarted.version("m") == 1
    assert running.held == 0  # let go with the step


def test_deltas_beyond_the_memory_budget_are_read_from_their_files(tmp_path):
    store = ModuleStore(tmp_path / "run")
    store.held_budget = 2 * NBYTES  # room for two deltas of three
    store.initialize({"m": MODULE})
    admit(store, 3)
    held = [d.tensors is not None for _, d in sorted(store.modules["m"].pending.items())]
    assert held == [True, True, False] and store.held == 2 * NBYTES
    reference = ModuleStore(tmp_path / "ref")
    reference.held_budget = 0
    reference.initialize({"m": MODULE})
    admit(reference, 3)
    for s in (store, reference):
        s.outer_step("m", OuterSettings())
    for name in MODULE:
        assert torch.equal(store.params("m")[name], reference.params("m")[name])
    admit(store, 1, round_=1)  # the budget is free again after the step
    assert store.held == NBYTES
