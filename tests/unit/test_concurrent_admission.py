"""Concurrent admission (issue 20): a delta's decoding, checks and durable write run outside the
coordinator's lock, a module's outer step runs outside it, and the small state files are written
by group commit. What a user would notice: one module's step does not hold up the deltas of
others, a retried delta racing its first copy is acknowledged and applied once, and a burst of
requests costs one state write, not one each. bench/soak.py measures the speed.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from _tiny import constant_delta, delta_message, tiny_coordinator

from dipaco.coordinator import admission
from dipaco.coordinator import store as store_module
from dipaco.coordinator.durable import GroupWriter, deferring
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.state import snapshot_state, state_bytes
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import ConfigError
from dipaco.fileio import compact_json_bytes
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


def claim_all(tr):
    tasks = {}
    for i in range(4):
        task = tr.request(m.ClaimTask(peer_id=f"p{i}", prefer_path=i))
        tasks[task.path] = task
    return tasks


def submit(co, tr, task):
    return tr.request(delta_message(task, f"p{task.path}", constant_delta(co, task)))


def test_an_outer_step_does_not_hold_up_the_deltas_of_other_modules(tmp_path, monkeypatch):
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    tasks = claim_all(tr)
    # L0.M0's step (paths 0 and 1 reported) is held until we let it go.
    release, stepping = threading.Event(), threading.Event()
    run_step = co.store.run_step

    def held(plan, *args, **kwargs):
        if plan.mid == "L0.M0":
            stepping.set()
            assert release.wait(30)
        return run_step(plan, *args, **kwargs)

    monkeypatch.setattr(co.store, "run_step", held)
    assert isinstance(submit(co, tr, tasks[0]), m.DeltaAck)
    acks = {}
    first = threading.Thread(target=lambda: acks.update(one=submit(co, tr, tasks[1])))
    first.start()
    assert stepping.wait(30)
    # Path 2 (L0.M1, L1.M0 and the shared modules) is admitted while L0.M0 steps.
    began = time.monotonic()
    ack = submit(co, tr, tasks[2])
    assert isinstance(ack, m.DeltaAck) and len(ack.accepted) == 4
    assert time.monotonic() - began < 10
    assert first.is_alive() and co.store.version("L0.M0") == 0 and "L0.M0" in co.steps.stepping
    release.set()
    first.join(30)
    assert "L0.M0" in acks["one"].closed and co.store.version("L0.M0") == 1
    assert isinstance(submit(co, tr, tasks[3]), m.DeltaAck)
    assert {co.store.version(mid) for mid in co.topology.module_ids()} == {1}


def test_a_delta_racing_its_own_retry_is_acknowledged_twice_and_applied_once(tmp_path, monkeypatch):
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    tasks = claim_all(tr)
    stage = co.store.stage_delta

    def slow(*args, **kwargs):  # the first copy is still being written when the second comes
        time.sleep(0.3)
        return stage(*args, **kwargs)

    monkeypatch.setattr(co.store, "stage_delta", slow)
    msg = delta_message(tasks[0], "p0", constant_delta(co, tasks[0]))
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(tr.request(msg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [type(r) for r in replies] == [m.DeltaAck, m.DeltaAck]
    assert all(sorted(r.accepted) == sorted(co.topology.path_modules(0)) for r in replies)
    for mid in co.topology.path_modules(0):
        assert list(co.store.modules[mid].pending) == [0]
        assert sorted(p.name for p in (tmp_path / "deltas" / mid / "v0").iterdir()) == ["P0.dpt"]
        assert not list((tmp_path / "deltas" / mid / "incoming").iterdir())  # nothing left over
    for p in (1, 2, 3):
        submit(co, tr, tasks[p])
    for mid in co.topology.path_modules(0):  # every module stepped with it, once
        assert co.store.version(mid) == 1
        assert co.store.modules[mid].applied.count(tasks[0].task_id) == 1


def test_a_burst_of_changes_is_one_state_write(tmp_path):
    lock, state = threading.RLock(), {"n": 0}
    writer = GroupWriter(lock, lambda: json.dumps(state).encode(), tmp_path / "state.json")
    ready = threading.Barrier(16)
    on_disk_after_flush: list[int] = []  # what each request read back once its flush returned

    def request():
        with deferring():
            with lock:
                state["n"] += 1
                writer.save()  # marks only, inside a request
            ready.wait(30)
        writer.flush()  # every change marked so far is on disk when this returns
        on_disk_after_flush.append(json.loads((tmp_path / "state.json").read_text())["n"])

    threads = [threading.Thread(target=request) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert on_disk_after_flush == [16] * 16
    assert writer.writes == 1
    assert json.loads((tmp_path / "state.json").read_text()) == {"n": 16}
    writer.save()  # outside a request: written at once
    assert writer.writes == 2


def test_a_step_not_yet_on_disk_is_redone_the_same_with_the_deltas_acked_meanwhile(
    tmp_path, monkeypatch
):
    module = {"w": torch.linspace(-1, 1, 1000), "b": torch.ones(10)}
    store = ModuleStore(tmp_path)
    store.initialize({"m": module})
    for p in range(2):
        store.add_delta(
            "m", p, 1.0 + p, f"t0-{p}", "peer", {k: v * 0.01 * (p + 1) for k, v in module.items()}
        )
    settings = OuterSettings()
    # The process dies before the step's background write: nothing of v1 reaches the disk.
    monkeypatch.setattr(store_module, "persist_step", lambda *args: None)
    store.outer_step("m", settings, background=True)
    stepped = {k: v.clone() for k, v in store.params("m").items()}
    assert store.version("m") == 1
    # A peer fetched v1, trained, and its delta against v1 was acknowledged.
    store.add_delta("m", 0, 1.0, "t1-0", "peer", {k: v * 0.02 for k, v in module.items()})
    monkeypatch.undo()
    assert json.loads((tmp_path / "modules" / "m" / "head.json").read_text())["version"] == 0
    again = ModuleStore(tmp_path)
    again.load(["m"])
    assert again.version("m") == 0 and sorted(again.modules["m"].pending) == [0, 1]
    again.outer_step("m", settings)  # what the coordinator's start does: redo the step
    assert again.version("m") == 1
    assert all(torch.equal(again.params("m")[k], stepped[k]) for k in stepped)
    assert [d.task_id for d in again.modules["m"].pending.values()] == ["t1-0"]


def test_deltas_are_written_two_at_a_time_and_long_polls_hold_no_slot(tmp_path, monkeypatch):
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    tasks = claim_all(tr)  # every path leased: a new claim waits for one (a long poll)
    polls = [
        threading.Thread(target=tr.request, args=(m.ClaimTask(peer_id=f"w{i}", wait=2.0),))
        for i in range(2)
    ]
    for t in polls:
        t.start()
    deadline = time.monotonic() + 10
    while co.polls.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert co.polls.waiting == 2
    free = [co.gate.slots.acquire(blocking=False) for _ in range(2)]
    assert free == [True, True]  # the waiting claims hold no slot
    for _ in free:
        co.gate.slots.release()
    inside, most, count = [0], [0], threading.Lock()
    stage = co.store.stage_delta

    def slow_stage(*args, **kwargs):  # a delta's durable write, outside the lock
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.1)
        try:
            return stage(*args, **kwargs)
        finally:
            with count:
                inside[0] -= 1

    monkeypatch.setattr(co.store, "stage_delta", slow_stage)
    acks = {}
    submits = [
        threading.Thread(target=lambda t=t: acks.update({t.path: submit(co, tr, t)}))
        for t in tasks.values()
    ]
    for t in submits:
        t.start()
    for t in submits:
        t.join(30)
    # The two waiting claims took no slot; the four deltas were written two at a time.
    assert most[0] == 2
    assert all(isinstance(a, m.DeltaAck) and len(a.accepted) == 4 for a in acks.values())
    for t in polls:
        t.join(30)
    assert co.gate.slots.acquire(blocking=False) and co.gate.slots.acquire(blocking=False)


def test_outer_steps_are_written_and_the_store_reopens_the_same(tmp_path):
    co = tiny_coordinator(tmp_path, rounds=3)
    tr = LocalTransport(co.handle)
    for _ in range(3):
        for task in claim_all(tr).values():
            assert isinstance(submit(co, tr, task), m.DeltaAck)
    co.store.sync_all()
    assert co.finished
    reopened = ModuleStore(tmp_path)
    reopened.load(co.topology.module_ids())
    for mid in co.topology.module_ids():
        assert reopened.version(mid) == 3
        for name, tensor in co.store.params(mid).items():
            assert torch.equal(reopened.params(mid)[name], tensor)
    assert json.loads((tmp_path / "coordinator.json").read_text())["run_id"] == "test"


def test_deltas_admitted_for_a_transport_hold_one_slot_each(tmp_path, monkeypatch):
    """``act_for`` (how the Flower ServerApp runs its nodes' requests) takes a request's slot
    in ``perform``; the admission inside must use that one, not take a second: three deltas
    at once, two slots, each request holding one and waiting for another, would never end."""
    co = tiny_coordinator(tmp_path)
    keys = [auth.Identity.generate().public_key for _ in range(3)]
    tasks = [
        co.act_for(key, m.ClaimTask(peer_id=f"p{i}", prefer_path=i)) for i, key in enumerate(keys)
    ]
    stage = co.store.stage_delta

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return stage(*args, **kwargs)

    monkeypatch.setattr(co.store, "stage_delta", slow)
    acks = {}

    def push(i):
        delta = delta_message(tasks[i], f"p{i}", constant_delta(co, tasks[i]))
        acks[i] = co.act_for(keys[i], delta)

    threads = [threading.Thread(target=push, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "admission waited for a second slot"
    assert sorted(acks) == [0, 1, 2]
    assert all(isinstance(a, m.DeltaAck) and len(a.accepted) == 4 for a in acks.values())


def test_the_number_of_request_slots_is_set_or_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("DIPACO_REQUEST_SLOTS", "3")
    co = tiny_coordinator(tmp_path / "three", start=False)
    assert [co.gate.slots.acquire(blocking=False) for _ in range(4)] == [True] * 3 + [False]
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("DIPACO_REQUEST_SLOTS", bad)
        with pytest.raises(ConfigError, match="DIPACO_REQUEST_SLOTS must be a whole number"):
            tiny_coordinator(tmp_path / f"bad{bad}", start=False)


def test_coordinator_json_keeps_each_entrys_encoding_and_writes_the_same_bytes(tmp_path):
    """coordinator.json's long sections (remembered tasks, live leases, attempts, paces, who
    trained each path's rounds), and validation.json's norms per module, have each entry
    encoded once and kept (statetext.py); the file
    must be exactly what encoding the whole state gives, whatever changed in between, and an
    entry is encoded again only when it changed."""
    now = [1000.0]
    co = tiny_coordinator(tmp_path, rounds=3, clock=lambda: now[0])
    tr = LocalTransport(co.handle)
    texts = co.scheduler.texts

    def same() -> None:
        with co.lock:
            assert state_bytes(co) == compact_json_bytes(snapshot_state(co))
            assert co.norms.snapshot_bytes() == compact_json_bytes(co.norms.snapshot())

    same()
    for _ in range(2):
        tasks = claim_all(tr)
        now[0] += 1.25  # the clock moves: the leases' times are kept as they are, not rebased
        same()
        live = texts.live.encoded
        for _ in range(3):
            same()  # nothing changed: nothing encoded again
        assert texts.live.encoded == live
        tr.request(m.Heartbeat(peer_id="p0", task_id=tasks[0].task_id))  # one lease renewed
        same()
        assert texts.live.encoded == live + 1
        for task in tasks.values():
            now[0] += 0.5
            assert isinstance(submit(co, tr, task), m.DeltaAck)
            same()
    assert co.scheduler.paces and co.scheduler.attempts and co.book.trained_by and co.norms.norms
    assert json.loads((tmp_path / "validation.json").read_text()) == co.norms.snapshot()
    # A remembered task changed (its module versions replaced, its steps): encoded anew, once.
    issued = texts.issued.encoded
    with co.lock:
        lease = next(iter(co.scheduler.issued.values()))
        first = next(iter(lease.module_versions))
        lease.module_versions = {**lease.module_versions, first: lease.module_versions[first] + 7}
        lease.steps += 1
    same()
    assert texts.issued.encoded == issued + 1
    # Pruned (rounds that can take no delta any more): every remembered task encoded again.
    with co.lock:
        co.scheduler.forget_before(1)
    same()
    assert texts.issued.encoded == issued + 1 + len(co.scheduler.issued)
    saved = json.loads((tmp_path / "coordinator.json").read_text())
    assert len(saved["scheduler"]["issued"]) == len(co.scheduler.issued) > 0
    assert saved["scheduler"]["clock"] == now[0]


def test_a_delta_planned_again_is_judged_once_and_acknowledged(tmp_path, monkeypatch):
    """A module that steps while a delta is being written makes its admission plan again
    (admission.write returns False); the norm and held-out verdicts are kept, not redone."""
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    tasks = claim_all(tr)
    judged = []
    check_content = admission.check_content

    def counted(*args):
        judged.append(args[4])
        return check_content(*args)

    monkeypatch.setattr(admission, "check_content", counted)
    staged, moved = [], []
    stage, version = co.store.stage_delta, co.store.version

    def stage_delta(*args, **kwargs):
        staged.append(args[0])
        return stage(*args, **kwargs)

    def seen_moved(mid):  # the first check after the writes sees a module one version on
        if staged and not moved:
            moved.append(mid)
            return version(mid) + 1
        return version(mid)

    monkeypatch.setattr(co.store, "stage_delta", stage_delta)
    monkeypatch.setattr(co.store, "version", seen_moved)
    ack = submit(co, tr, tasks[0])
    path = sorted(co.topology.path_modules(0))
    assert isinstance(ack, m.DeltaAck) and sorted(ack.accepted) == path
    assert moved and sorted(staged) == sorted(path * 2)  # planned and written twice
    assert [sorted(mids) for mids in judged] == [path]  # judged once
    for mid in path:
        assert list(co.store.modules[mid].pending) == [0]
