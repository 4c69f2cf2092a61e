"""Fuzzing the module store on disk: a damaged store loads whole or raises CorruptFileError.

A coordinator restarts from its store (promise 2), so every file it reads back (head.json, the
parameter and momentum files, the pending deltas) may be cut short, bit-flipped or edited. The
load must then either give a module whose parameters match its head's hash, whose momentum fits
its parameters and whose pending deltas are well-formed, or refuse with a CorruptFileError that
names the file; never another exception, and never a record that breaks the next outer step.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from _fuzzing import FUZZ, assert_clean_error, byte_mutations, frame_mutations, json_mutations
from _tiny import tiny_coordinator
from hypothesis import given
from hypothesis import strategies as st

from dipaco.coordinator.outer import OuterSettings, nesterov_step, outer_gradient
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import DataError, DipacoError
from dipaco.protocols.wire import tensors_sha256

MID = "L0.M0"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A store at version 1 (momentum written) with one on-time and one late delta pending."""
    root = tmp_path_factory.mktemp("store") / "pristine"
    store = ModuleStore(root)
    store.initialize({MID: {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}})
    small = {"w": torch.full((2, 3), 0.1), "b": torch.full((3,), -0.1)}
    store.add_delta(MID, 0, 100.0, "P0-r0-e0-a0", "p0", small)
    store.add_delta(MID, 1, 50.0, "P1-r0-e0-a0", "p1", small)
    store.outer_step(MID, OuterSettings())
    store.add_delta(MID, 0, 100.0, "P0-r1-e0-a0", "p0", small)
    store.add_delta(MID, 1, 25.0, "P1-r0-e0-a1", "p1", small, base_version=0)
    return root


def _files(root: Path) -> list[str]:
    """The store's files."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@st.composite
def damaged(draw: st.DrawFn, root: Path) -> tuple[str, bytes]:
    """(a store file, its new content): one file of the store changed in one way."""
    name = draw(st.sampled_from(_files(root)))
    data = (root / name).read_bytes()
    if name.endswith(".json"):
        how = draw(st.sampled_from(["json", "bytes"]))
        if how == "json":
            edited = draw(json_mutations(json.loads(data)))
            return name, json.dumps(edited).encode()
        return name, draw(byte_mutations(data))
    body = data[:-32]
    if draw(st.booleans()):  # a plain corruption: the checksum no longer matches
        return name, draw(byte_mutations(data, focus=64))
    # A well-checksummed file with a different frame inside: reaches the checks behind the hash.
    new = draw(frame_mutations(body))
    return name, new + hashlib.sha256(new).digest()


def _check_loaded(store: ModuleStore) -> None:
    record = store.modules[MID]
    assert isinstance(record.version, int) and record.version >= 0
    assert tensors_sha256(record.params) == record.hash
    if record.momentum is not None:
        assert set(record.momentum) == set(record.params)
        for k, v in record.momentum.items():
            assert v.shape == record.params[k].shape and v.dtype == record.params[k].dtype
    assert all(isinstance(t, str) for t in record.applied)
    for base, paths in record.reported.items():
        assert isinstance(base, int) and all(isinstance(p, int) for p in paths)
    for table in (record.pending, record.late):
        for path, delta in table.items():
            assert isinstance(path, int) and path == delta.path
            assert isinstance(delta.weight, float) and math.isfinite(delta.weight)
            assert isinstance(delta.task_id, str) and isinstance(delta.peer_id, str)
            assert isinstance(delta.base_version, int)


@FUZZ
@given(data=st.data())
def test_a_damaged_store_loads_whole_or_raises_corrupt_file_error(pristine, data):
    name, content = data.draw(damaged(pristine))
    root = pristine.parent / "work"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(pristine, root)
    (root / name).write_bytes(content)
    store = ModuleStore(root)
    try:
        store.load([MID])
    except DipacoError as exc:
        assert isinstance(exc, DataError), type(exc).__name__  # CorruptFileError is a DataError
        assert_clean_error(exc)
        assert MID not in store.modules  # nothing half-loaded
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped ModuleStore.load ({name} damaged): {exc!r}")
    _check_loaded(store)
    # And what loaded can take its next step (computed, not written: the files' fsyncs would
    # make this test slow, and outer_step's writing is tested elsewhere).
    record = store.modules[MID]
    pending = [*record.pending.values(), *record.late.values()]
    if pending:
        deltas = [(store.delta_tensors(d), d.weight) for d in pending]
        grad = outer_gradient(deltas, OuterSettings())
        params, _ = nesterov_step(record.params, record.momentum, grad, OuterSettings())
        assert all(bool(torch.isfinite(t).all()) for t in params.values())


def test_the_pristine_store_loads(pristine):
    store = ModuleStore(pristine)
    store.load([MID])
    _check_loaded(store)
    assert store.version(MID) == 1 and set(store.modules[MID].pending) == {0}
    assert set(store.modules[MID].late) == {1}


# ---- the coordinator's own state file ----------------------------------------------------------


def _coordinator(root: Path):
    return tiny_coordinator(root, start=False, inner_steps=1, run_id="fuzz")


@pytest.fixture(scope="module")
def pristine_coordinator(tmp_path_factory) -> Path:
    from dipaco.model.topology import Topology
    from dipaco.model.transformer import ModelConfig, new_dense_model

    root = tmp_path_factory.mktemp("co-state") / "pristine"
    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, max_seq_len=8)
    _coordinator(root).start(
        Topology.parse("2x2", 2).init_modules(new_dense_model(cfg, 0).state_dict())
    )
    return root


@FUZZ
@given(data=st.data())
def test_a_damaged_coordinator_state_file_resumes_or_raises_corrupt_file_error(
    pristine_coordinator, data
):
    state = json.loads((pristine_coordinator / "coordinator.json").read_text())
    how = data.draw(st.sampled_from(["json", "bytes"]))
    if how == "json":
        content = json.dumps(data.draw(json_mutations(state))).encode()
    else:
        content = data.draw(
            byte_mutations((pristine_coordinator / "coordinator.json").read_bytes())
        )
    # start() changes nothing but coordinator.json here (no pending deltas, no step to redo), so
    # one copy of the store serves every example.
    root = pristine_coordinator.parent / "work"
    if not root.exists():
        shutil.copytree(pristine_coordinator, root)
    (root / "coordinator.json").write_bytes(content)
    co = _coordinator(root)
    try:
        co.start(None)
    except DipacoError as exc:
        assert isinstance(exc, DataError), type(exc).__name__
        assert_clean_error(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped Coordinator.start: {exc!r}")
    # What resumed is a working coordinator: it owns modules and answers a status request.
    assert co.owned_modules() and co.status().state["round"] == 0
