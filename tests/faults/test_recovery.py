"""Crash recovery of the module store, and the fault points themselves (fast, in-process); and
the scheduler's leases across a real coordinator process killed and restarted."""

import errno
import logging
import time

import pytest
import torch
from fault_harness import CONFIG, check_run

from dipaco import faults
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import CorruptFileError
from dipaco.fileio import write_atomic

SETTINGS = OuterSettings()


def two_steps(root):
    """A store with module A stepped twice (v2), from one path's deltas."""
    store = ModuleStore(root)
    store.initialize({"A": {"w": torch.zeros(4), "b": torch.zeros(2)}})
    for v in range(2):
        delta = {"w": torch.full((4,), 0.1 * (v + 1)), "b": torch.ones(2)}
        store.add_delta("A", 0, 1.0, f"P0-r{v}-e0-a0", "peer", delta)
        store.outer_step("A", SETTINGS)
    return store


def test_a_truncated_version_falls_back_to_the_last_good_one_and_redoes_its_step(tmp_path, caplog):
    store = two_steps(tmp_path)
    expected = {k: v.clone() for k, v in store.params("A").items()}
    bad = tmp_path / "modules" / "A" / "v2.dpt"
    bad.write_bytes(bad.read_bytes()[:40])  # a write cut short by a dying disk
    again = ModuleStore(tmp_path)
    with caplog.at_level(logging.ERROR):
        again.load(["A"])
    assert str(bad) in caplog.text and "last good version v1" in caplog.text
    assert again.version("A") == 1 and again.rolled_back == {"A": (2, 1)}
    assert (bad.parent / "v2.dpt.corrupt").exists() and not bad.exists()
    assert [d.task_id for d in again.modules["A"].pending.values()] == ["P0-r1-e0-a0"]
    again.outer_step("A", SETTINGS)  # the step is redone from the kept deltas: same result
    for name, tensor in expected.items():
        assert torch.equal(again.params("A")[name], tensor)


def test_a_corrupt_momentum_file_also_falls_back(tmp_path):
    two_steps(tmp_path)
    m2 = tmp_path / "modules" / "A" / "m2.dpt"
    raw = bytearray(m2.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    m2.write_bytes(bytes(raw))
    again = ModuleStore(tmp_path)
    again.load(["A"])
    assert again.version("A") == 1 and (m2.parent / "m2.dpt.corrupt").exists()


def test_without_a_good_version_the_error_names_the_file(tmp_path):
    store = ModuleStore(tmp_path)
    store.initialize({"A": {"w": torch.zeros(4)}})
    v0 = tmp_path / "modules" / "A" / "v0.dpt"
    v0.write_bytes(b"junk")
    with pytest.raises(CorruptFileError, match=str(v0)):
        ModuleStore(tmp_path).load(["A"])


def test_a_corrupt_pending_delta_is_quarantined_not_fatal(tmp_path, caplog):
    store = two_steps(tmp_path)
    store.add_delta("A", 1, 1.0, "P1-r2-e0-a0", "peer", {"w": torch.ones(4), "b": torch.ones(2)})
    store.add_delta("A", 0, 1.0, "P0-r2-e0-a0", "peer", {"w": torch.ones(4), "b": torch.ones(2)})
    bad = tmp_path / "deltas" / "A" / "v2" / "P1.dpt"
    bad.write_bytes(bad.read_bytes()[:-7])
    again = ModuleStore(tmp_path)
    with caplog.at_level(logging.ERROR):
        again.load(["A"])
    assert str(bad) in caplog.text
    assert sorted(again.modules["A"].pending) == [0]
    assert again.quarantined == [str(bad) + ".corrupt"]


def test_temporary_files_of_interrupted_writes_are_removed(tmp_path):
    two_steps(tmp_path)
    folder = tmp_path / "modules" / "A"
    leftovers = [folder / ".v3.dpt.k2j4h5", tmp_path / "deltas" / "A" / "v1" / ".P0.dpt.x81a"]
    for f in leftovers:
        f.write_bytes(b"half")
    ModuleStore(tmp_path).load(["A"])
    assert not any(f.exists() for f in leftovers)


def test_fault_rules_parse():
    rules = faults.parse("a.b=kill@3; c=enospc@if:/tmp/full, d=sleep:0.5@2-,e=enospc@4-6")
    assert (rules["a.b"][0].action, rules["a.b"][0].first, rules["a.b"][0].last) == ("kill", 3, 3)
    assert rules["c"][0].trigger == "/tmp/full"
    assert (rules["d"][0].seconds, rules["d"][0].first, rules["d"][0].last) == (0.5, 2, None)
    assert [rules["e"][0].due(h) for h in range(3, 8)] == [False, True, True, True, False]
    with pytest.raises(ValueError, match="unknown action"):
        faults.parse("x=explode")


def test_an_injected_full_disk_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("DIPACO_FAULTS", "atomic.write=enospc@2")
    monkeypatch.setenv("DIPACO_FAULTS_LOG", str(tmp_path / "faults.jsonl"))
    faults.reset()
    try:
        write_atomic(tmp_path / "one", b"1")
        with pytest.raises(OSError) as exc:
            write_atomic(tmp_path / "two", b"2")
        assert exc.value.errno == errno.ENOSPC
        write_atomic(tmp_path / "three", b"3")
    finally:
        monkeypatch.delenv("DIPACO_FAULTS")
        faults.reset()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faults.jsonl", "one", "three"]


def test_a_corrupt_rule_tells_its_caller_at_the_hits_it_names(monkeypatch):
    monkeypatch.setenv("DIPACO_FAULTS", "flower.reply=corrupt@2")
    faults.reset()
    try:
        assert [faults.fault_point("flower.reply") for _ in range(3)] == [False, True, False]
        assert faults.fault_point("flower.train") is False
    finally:
        monkeypatch.delenv("DIPACO_FAULTS")
        faults.reset()


def test_clock_skew(monkeypatch):
    monkeypatch.setenv("DIPACO_CLOCK_SKEW", "-120")
    faults.reset()
    try:
        assert abs(faults.now() - (time.time() - 120)) < 1
    finally:
        monkeypatch.delenv("DIPACO_CLOCK_SKEW")
        faults.reset()


@pytest.mark.slow
def test_a_coordinator_killed_while_peers_hold_leases_takes_their_tasks_back(cluster):
    """SIGKILL the coordinator while both peers are in the middle of a task, held there (SIGSTOP)
    until the coordinator is back: their heartbeats keep their restored leases, and their
    deltas are accepted; no path of theirs is issued again."""
    c = cluster(config=CONFIG.replace("lease_seconds = 4.0", "lease_seconds = 8.0"))
    held: dict[str, dict] = {}

    def in_flight(events):
        acked = {e["task"] for e in events if e["event"] == "delta_acked"}
        issued = [e for e in events if e["event"] == "task_issued"]
        return {e["task"]: e for e in issued if e["task"] not in acked}

    def kill_while_training(c):
        if held or {e["peer"] for e in in_flight(c.events()).values()} != {"peer0", "peer1"}:
            return
        c.pause_peers()
        time.sleep(0.3)  # a request already on its way is answered
        held.update(in_flight(c.events()))
        c.kill_coordinator()
        c.coordinator.wait()
        assert not c.step()  # restarted from its folder, listening again
        c.resume_peers()

    c.run(during=kill_while_training)
    assert held and c.coordinator_kills == 1
    events = c.events()
    acked = {e["task"] for e in events if e["event"] == "delta_acked"}
    assert set(held) <= acked  # every task in flight was taken back after the restart
    issued = [e for e in events if e["event"] == "task_issued"]
    for task, e in held.items():  # and none of their paths was leased to anyone else
        again = [x["task"] for x in issued if (x["path"], x["round"]) == (e["path"], e["round"])]
        assert again == [task]
    lost = {e["task"] for e in events if e["event"] in ("lease_expired", "task_dropped")}
    assert not lost & set(held)
    check = check_run(c.root, c.workdir / "peers")
    assert check.ok, check
