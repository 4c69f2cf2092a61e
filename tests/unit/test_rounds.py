"""Rounds under a fake clock: deadlines, quorums, late deltas, tickets, slow peers, hand-over.

Every request goes through :class:`LocalTransport`, so through the wire encoding, as a transport
would drive the coordinator.
"""

import math
import statistics
import threading
import time

import pytest
import torch
from _tiny import delta_message

from dipaco.config import SchedulerSection
from dipaco.coordinator import rounds as rounds_module
from dipaco.coordinator import tickets
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.owner import take_over
from dipaco.coordinator.scheduler import robust_deadline
from dipaco.errors import DipacoError, RejectedError, TransportError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.net import hivemind
from dipaco.peer.links import OwnerLinks, Patience
from dipaco.peer.modules import TaskAborted, fetch_modules
from dipaco.protocols import discovery
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
TOPO = Topology.parse("2x2", 2)
INIT = TOPO.init_modules(new_dense_model(CFG, 0).state_dict())
SHARDS = [1000, 2000, 3000, 4000]
KEY = Identity.generate()  # every coordinator of these tests signs with it
LEASE = 10.0
# Path 3 is S.embed, L0.M1, L1.M1, S.head; the other two modules never see it.
PATH3 = set(TOPO.path_modules(3))
NOT_PATH3 = set(TOPO.module_ids()) - PATH3


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(
    root,
    clock=None,
    *,
    inner_steps=5,
    lease=LEASE,
    events=None,
    rounds=4,
    validation=None,
    heldout_loss=None,
    peer_config=None,
    **policy,
):
    co = Coordinator(
        root,
        TOPO,
        rounds=rounds,
        inner_steps=inner_steps,
        step_offset=0,
        total_steps=100,
        seed=0,
        outer=OuterSettings(),
        lease_seconds=lease,
        run_id="test",
        peer_config=peer_config or {},
        shard_tokens=SHARDS,
        metrics=events.append if events is not None else None,
        clock=clock or Clock(),
        policy=SchedulerSection(lease_seconds=lease, **policy),
        owner_id="a",
        identity=KEY,
        validation=validation,
        heldout_loss=heldout_loss,
    )
    co.start(INIT)
    return co


def make_owner(root, owner_id="b"):
    co = Coordinator(
        root,
        TOPO,
        rounds=4,
        inner_steps=5,
        step_offset=0,
        total_steps=100,
        seed=0,
        outer=OuterSettings(),
        lease_seconds=LEASE,
        run_id="test",
        peer_config={},
        shard_tokens=SHARDS,
        owner_id=owner_id,
        identity=KEY,
        scheduler_key=KEY.public_key,
        is_scheduler=False,
    )
    co.start(None)
    return co


def claim(tr, peer, prefer=None):
    return tr.request(m.ClaimTask(peer_id=peer, prefer_path=prefer))


def delta_for(task, peer, mids=None, scale=0.01, **override):
    """A delta for ``task``'s modules (all of the path's, or ``mids``), shaped like version 0."""
    tensors = {
        f"{mid}/{k}": torch.full_like(v, scale)
        for mid in (mids or TOPO.path_modules(task.path))
        for k, v in INIT[mid].items()
    }
    return delta_message(
        task, peer, tensors, **{"base_versions": dict(task.module_versions), **override}
    )


def versions(co):
    return {mid: co.store.version(mid) for mid in TOPO.module_ids()}


def rejected(call):
    with pytest.raises(RejectedError) as err:
        call()
    return err.value.reason


def full_round(tr, clock, seconds=10.0):
    """Every path trained by its own peer p<i>, each taking ``seconds`` of fake time."""
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    assert [t.path for t in tasks] == [0, 1, 2, 3]
    clock.now += seconds
    for p, task in enumerate(tasks):
        tr.request(delta_for(task, f"p{p}"))


def straggling_round(co, tr, clock):
    """Round 0 in full (4 durations of 10 s: deadline 10 + 0.5 * 10 = 15 s); then in round 1
    paths 0-2 report after 2 s while p3 keeps heartbeating its task. Returns p3's task; the
    clock is at 24 s, 14 s after round 1's tasks were issued: not yet past the deadline."""
    full_round(tr, clock)
    assert set(versions(co).values()) == {1}
    assert co.scheduler.task_deadline() == pytest.approx(15.0)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    assert [(t.path, t.round) for t in tasks] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    clock.now += 2
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    clock.now = 20.0
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=tasks[3].task_id, step=3)).lease_ok
    clock.now = 24.0
    tr.request(m.GetStatus())
    assert co.scheduler.task_deadline() == pytest.approx(15.0)
    assert {mid: v for mid, v in versions(co).items() if mid in PATH3} == dict.fromkeys(PATH3, 1)
    return tasks[3]


def closed_without_path3(tmp_path, clock, **kw):
    """``straggling_round``, then the tick at 26 s (past the 15 s deadline) that closes round 1
    without path 3 where it was not needed. Returns the coordinator, its transport and p3's
    task."""
    co = make(tmp_path, clock, **kw)
    tr = LocalTransport(co.handle)
    task3 = straggling_round(co, tr, clock)
    clock.now = 26.0
    co.tick()
    return co, tr, task3


# ---- 1. the deadline rule ---------------------------------------------------------------------


def test_robust_deadline_is_median_plus_the_larger_of_mads_and_slack():
    sample = [10.0, 12.0, 11.0, 30.0, 9.0]  # median 11, MAD 1
    assert robust_deadline(sample, mads=4.0, slack=0.5, min_observations=6) is None
    assert robust_deadline(sample[:3], mads=4.0, slack=0.5, min_observations=4) is None
    assert robust_deadline(sample, 4.0, 0.5, 5) == pytest.approx(11 + 5.5)  # slack wins
    assert robust_deadline(sample, 10.0, 0.5, 5) == pytest.approx(11 + 10)  # MADs win
    assert robust_deadline(sample, 0.0, 0.0, 1) == pytest.approx(11)
    # An even sample: median 2.5, MAD median(1.5, .5, .5, 1.5) = 1.
    assert robust_deadline([1.0, 2.0, 3.0, 4.0], 3.0, 0.1, 4) == pytest.approx(2.5 + 3)


def test_before_enough_observations_a_round_waits_for_every_path(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock, min_observations=8)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    assert len(co.scheduler.durations) == 7 and co.scheduler.task_deadline() is None
    for _ in range(20):  # 100 s of a straggler that keeps its lease alive
        clock.now += 5
        assert tr.request(m.Heartbeat(peer_id="p3", task_id=tasks[3].task_id, step=1)).lease_ok
        co.tick()
    assert {versions(co)[mid] for mid in PATH3} == {1}
    assert co.status().state["overdue"] == []
    assert sorted(tr.request(delta_for(tasks[3], "p3")).closed) == sorted(PATH3)
    assert co.scheduler.task_deadline() is not None  # the 8th duration


# ---- 2. quorum at the deadline, late deltas -----------------------------------------------------


@pytest.mark.parametrize("poke", ["status", "heartbeat", "tick"])
def test_deadline_closes_the_rounds_a_straggler_is_missing_from(tmp_path, poke):
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events, stale_damping=0.25)
    tr = LocalTransport(co.handle)
    task3 = straggling_round(co, tr, clock)
    # Paths 0-2 were all of L0.M0's and L1.M0's paths: those closed without a deadline.
    assert {mid: versions(co)[mid] for mid in NOT_PATH3} == dict.fromkeys(NOT_PATH3, 2)
    clock.now = 26.0  # 16 s after issue: past the 15 s deadline (the lease lives until 30 s)
    if poke == "status":
        tr.request(m.GetStatus())
    elif poke == "heartbeat":
        assert tr.request(m.Heartbeat(peer_id="p3", task_id=task3.task_id, step=4)).lease_ok
    else:
        co.tick()
    assert set(versions(co).values()) == {2}
    steps = {e["module"]: e for e in events if e["event"] == "outer_step" and e["version"] == 2}
    assert {mid: e["closed_by"] for mid, e in steps.items()} == {
        **dict.fromkeys(PATH3, "deadline"),
        **dict.fromkeys(NOT_PATH3, "all"),
    }
    assert steps["S.embed"]["paths"] == [0, 1, 2] and steps["L0.M1"]["paths"] == [2]
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2]
    status = tr.request(m.GetStatus()).state
    assert status["round"] == 2 and status["overdue"] == []  # round 1 is over everywhere: forgotten

    # p3's delta against version 1 arrives late: kept for version 2's step, damped once.
    ack = tr.request(delta_for(task3, "p3"))
    assert sorted(ack.accepted) == sorted(PATH3) and ack.closed == []
    for mid in PATH3:
        record = co.store.modules[mid]
        assert list(record.late) == [3] and not record.pending
        late = record.late[3]
        assert late.weight == pytest.approx(SHARDS[3] * 0.25**1)
        assert late.base_version == 1 and late.task_id == task3.task_id and late.file.exists()
    late_events = [e for e in events if e["event"] == "late_delta"]
    assert sorted(e["module"] for e in late_events) == sorted(PATH3)
    assert all(e["late_by"] == 1 and e["weight"] == SHARDS[3] * 0.25 for e in late_events)
    assert tr.request(m.GetStatus()).state["modules"]["S.embed"]["late"] == [3]

    # The late delta finished p3's task: path 3 is open for round 2 again.
    assert co.open_paths() == {0: 2, 1: 2, 2: 2, 3: 2}
    again = claim(tr, "p3", prefer=3)
    assert (again.path, again.round) == (3, 2), "path 3 must be trained again for round 2"
    assert again.module_versions == dict.fromkeys(TOPO.path_modules(3), 2)

    # The late delta joins version 2's step (it is listed there, not as path 3's report).
    others = [claim(tr, f"p{p}", prefer=p) for p in range(3)]
    for p, task in enumerate([*others, again]):
        tr.request(delta_for(task, f"p{p}" if p < 3 else "p3"))
    step3 = {e["module"]: e for e in events if e["event"] == "outer_step" and e["version"] == 3}
    assert step3["S.embed"]["late_paths"] == [3] and step3["S.embed"]["paths"] == [0, 1, 2, 3]
    assert step3["L0.M0"]["late_paths"] == []
    assert task3.task_id in step3["L1.M1"]["tasks"]


def test_with_quorum_one_the_round_waits_for_the_straggler(tmp_path):
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events, quorum=1.0)
    tr = LocalTransport(co.handle)
    task3 = straggling_round(co, tr, clock)
    for now in (26.0, 29.0, 38.0, 47.0):
        clock.now = now
        assert tr.request(m.Heartbeat(peer_id="p3", task_id=task3.task_id, step=4)).lease_ok
        co.tick()
        assert {versions(co)[mid] for mid in PATH3} == {1}, f"closed early at {now} s"
    assert tr.request(m.GetStatus()).state["overdue"] == [[3, 1]]
    ack = tr.request(delta_for(task3, "p3"))
    assert sorted(ack.closed) == sorted(PATH3)
    assert set(versions(co).values()) == {2}
    closed_by = {e["closed_by"] for e in events if e["event"] == "outer_step"}
    assert closed_by == {"all"}
    assert not any(e["event"] == "late_delta" for e in events)


def test_a_path_handed_back_and_issued_again_is_overdue_from_its_first_task(tmp_path):
    """A path whose tasks are handed back one after another (peers that stop, a task refused
    for what its delta held) is issued again each time: judged by the newest lease's age, each
    a few seconds old, it was never overdue and its modules waited for it (bench/schedules.py
    met it). Its round is as late as its first task: past the deadline, the modules close at
    their quorum without it."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)  # the task deadline is 15 s
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]  # at 10 s
    clock.now += 2
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    task, holder, attempts = tasks[3], "p3", 0
    while {versions(co)[mid] for mid in PATH3} == {1}:
        assert attempts < 6, "path 3's modules still wait for it after 6 tasks handed back"
        clock.now += 4
        tr.request(m.ReleaseTask(peer_id=holder, task_id=task.task_id))
        co.tick()
        attempts, holder = attempts + 1, f"q{attempts}"
        task = claim(tr, holder, prefer=3)
    assert clock.now - 10.0 > 15.0 and attempts == 4  # past the deadline from its first task
    assert set(versions(co).values()) == {2}
    steps = [e for e in events if e["event"] == "outer_step" and e["version"] == 2]
    assert {e["module"]: e["closed_by"] for e in steps if e["module"] in PATH3} == dict.fromkeys(
        PATH3, "deadline"
    )
    assert (task.path, task.round) == (3, 2)  # the path trains again from the next round


def test_a_path_whose_deltas_are_refused_twice_is_not_waited_for_even_with_quorum_one(tmp_path):
    """With quorum 1 a round waits for every path, and a path whose delta is refused for what
    it holds would hold it for ever: each new task of it trains the same delta. Once two of its
    tasks were refused so, its round is skipped (judged out) and its modules close without it."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events, quorum=1.0)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    first = tasks[3]
    assert rejected(lambda: tr.request(delta_for(first, "p3", scale=100.0))) == "huge-norm"
    assert rejected(lambda: tr.request(delta_for(first, "p3", scale=100.0))) == "huge-norm"
    co.tick()  # the same task twice is one task's refusal: the round still waits
    assert {versions(co)[mid] for mid in PATH3} == {1}
    tr.request(m.ReleaseTask(peer_id="p3", task_id=first.task_id))
    second = claim(tr, "p9", prefer=3)
    assert (second.path, second.round) == (3, 1)
    assert rejected(lambda: tr.request(delta_for(second, "p9", scale=100.0))) == "huge-norm"
    co.tick()
    assert set(versions(co).values()) == {2}
    assert [e["path"] for e in events if e["event"] == "path_judged_out"] == [3]
    steps = [e for e in events if e["event"] == "outer_step" and e["version"] == 2]
    assert {e["module"]: e["paths"] for e in steps if e["module"] in ("S.embed", "L0.M1")} == {
        "S.embed": [0, 1, 2],
        "L0.M1": [2],
    }
    task = claim(tr, "p9", prefer=3)
    assert (task.path, task.round) == (3, 2)  # the path trains again from the next round
    assert sorted(tr.request(delta_for(task, "p9")).accepted) == sorted(PATH3)


def test_a_module_whose_every_path_is_judged_out_carries_over_and_the_round_goes_on(tmp_path):
    """L0.M1 has two paths, 2 and 3. When both are judged out in one round, the module has no
    delta for its step: it moves to the next version unchanged (before, the step raised in
    the ticker and the request threads, and the run hung: bench/schedules.py met it), and the
    run goes on with every module at the next version."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events, quorum=1.0)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)
    before = {k: v.clone() for k, v in co.store.params("L0.M1").items()}
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    for p in range(2):
        tr.request(delta_for(tasks[p], f"p{p}"))
    for p in (2, 3):
        first = tasks[p]
        assert rejected(lambda t=first, p=p: tr.request(delta_for(t, f"p{p}", scale=100.0))) == (
            "huge-norm"
        )
        tr.request(m.ReleaseTask(peer_id=f"p{p}", task_id=first.task_id))
        again = claim(tr, f"q{p}", prefer=p)
        assert (again.path, again.round) == (p, 1)
        assert rejected(lambda t=again, p=p: tr.request(delta_for(t, f"q{p}", scale=100.0))) == (
            "huge-norm"
        )
        tr.request(m.ReleaseTask(peer_id=f"q{p}", task_id=again.task_id))  # as a peer does
    co.tick()
    assert co.failure is None
    assert set(versions(co).values()) == {2}
    after = co.store.params("L0.M1")
    assert all(torch.equal(after[k], before[k]) for k in before)
    steps = {e["module"]: e for e in events if e["event"] == "outer_step" and e["version"] == 2}
    assert steps["L0.M1"]["paths"] == [] and steps["L0.M1"]["outer_grad_norm"] == 0.0
    assert steps["L0.M0"]["paths"] == [0, 1]
    claimed = {(t.path, t.round) for t in (claim(tr, f"r{p}", prefer=p) for p in range(4))}
    assert claimed == {(p, 2) for p in range(4)}  # the run goes on, every path with it


def path3_short_of_quorum(tmp_path, clock, rounds=4, events=None):
    """quorum 0.75: round 1 closes at the deadline for the modules with 3 of 4 paths (S.embed,
    S.head) and those that missed nothing; L0.M1 and L1.M1 (1 of 2 reported) still wait for
    path 3. Returns the coordinator, its transport and p3's task."""
    co = make(tmp_path, clock, rounds=rounds, quorum=0.75, events=events)
    tr = LocalTransport(co.handle)
    task3 = straggling_round(co, tr, clock)
    clock.now = 26.0
    co.tick()
    assert versions(co) == {
        "S.embed": 2,
        "S.head": 2,
        "L0.M0": 2,
        "L0.M1": 1,
        "L1.M0": 2,
        "L1.M1": 1,
    }
    assert not co.finished
    return co, tr, task3


def test_a_quorum_is_counted_per_module(tmp_path):
    """quorum 0.75: S.embed (3 of 4 paths reported) closes at the deadline, L0.M1 (1 of 2) not."""
    co, tr, task3 = path3_short_of_quorum(tmp_path, Clock())
    assert claim(tr, "p9").path == 0  # only path 0 has all its modules at one version
    ack = tr.request(delta_for(task3, "p3"))  # late for the shared modules, on time for the rest
    assert sorted(ack.closed) == ["L0.M1", "L1.M1"]
    assert list(co.store.modules["S.embed"].late) == [3]
    assert set(versions(co).values()) == {2}


def test_a_round_closes_only_when_every_missing_path_is_overdue(tmp_path):
    """Round 1: p0 straggles from 10 s; path 3 is only claimed at 20 s. At 26 s path 0 is
    overdue, path 3 is not: only the modules missing nothing but path 0 may close."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(3)]
    clock.now = 12.0
    for p in (1, 2):
        tr.request(delta_for(tasks[p], f"p{p}"))
    clock.now = 20.0
    assert tr.request(m.Heartbeat(peer_id="p0", task_id=tasks[0].task_id, step=1)).lease_ok
    task3 = claim(tr, "p3", prefer=3)
    clock.now = 26.0
    co.tick()
    assert tr.request(m.GetStatus()).state["overdue"] == [[0, 1]]
    assert versions(co) == {
        "S.embed": 1,  # missing paths 0 and 3; 3 is not overdue
        "S.head": 1,
        "L0.M0": 2,  # missing path 0 only
        "L0.M1": 1,  # missing path 3
        "L1.M0": 2,  # missing path 0 only
        "L1.M1": 1,  # missing path 3
    }
    # p0's delta is late for L0.M0 and L1.M0, on time for the shared modules.
    tr.request(delta_for(tasks[0], "p0"))
    assert list(co.store.modules["L0.M0"].late) == [0] and not co.store.modules["L0.M0"].pending
    assert sorted(co.store.modules["S.embed"].pending) == [0, 1, 2]
    assert sorted(e["module"] for e in events if e["event"] == "late_delta") == [
        "L0.M0",
        "L1.M0",
    ]
    clock.now = 28.0
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=task3.task_id, step=1)).lease_ok
    clock.now = 36.0  # 16 s after path 3's task was issued
    co.tick()
    assert set(versions(co).values()) == {2}
    steps = [e for e in events if e["event"] == "outer_step" and e["version"] == 2]
    assert {e["module"]: e["closed_by"] for e in steps} == dict.fromkeys(
        TOPO.module_ids(), "deadline"
    )


def test_a_path_skipped_by_one_module_is_not_waited_for_by_the_others(tmp_path):
    """Round 1: p0 straggles; L0.M0 and L1.M0 close without it at the deadline while S.embed
    and S.head still wait for path 3. p0 then gives its task up (its modules moved on). The
    shared modules must not wait for path 0 forever: it stays skipped for round 1."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events)
    tr = LocalTransport(co.handle)
    full_round(tr, clock)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(3)]
    clock.now = 12.0
    for p in (1, 2):
        tr.request(delta_for(tasks[p], f"p{p}"))
    clock.now = 20.0
    tr.request(m.Heartbeat(peer_id="p0", task_id=tasks[0].task_id, step=1))
    task3 = claim(tr, "p3", prefer=3)
    clock.now = 26.0
    co.tick()
    assert versions(co)["L0.M0"] == 2 and versions(co)["S.embed"] == 1
    tr.request(m.ReleaseTask(peer_id="p0", task_id=tasks[0].task_id))  # p0 gives up
    clock.now = 27.0
    tr.request(delta_for(task3, "p3"))
    co.tick()
    assert set(versions(co).values()) == {2}, versions(co)
    assert claim(tr, "p9", prefer=0).round == 2  # path 0 goes on with round 2


# ---- 3. stale and wrong-base deltas ------------------------------------------------------------


def test_a_delta_more_than_max_staleness_late_is_rejected_stale(tmp_path):
    clock, events = Clock(), []
    co, tr, task3 = closed_without_path3(tmp_path, clock, events=events, max_staleness=0)
    assert set(versions(co).values()) == {2}
    assert rejected(lambda: tr.request(delta_for(task3, "p3"))) == "stale"
    assert all(not r.late and not r.pending for r in co.store.modules.values())
    assert not any(e["event"] == "late_delta" for e in events)
    assert co.status().state["rejections_by_peer"]["p3"] == {"stale": 1}


def test_a_late_delta_cannot_claim_the_current_version_as_its_base(tmp_path):
    clock = Clock()
    co, tr, task3 = closed_without_path3(tmp_path, clock)
    forged = dict.fromkeys(task3.module_versions, 2)  # pretend it trained on version 2
    assert rejected(lambda: tr.request(delta_for(task3, "p3", base_versions=forged))) == (
        "wrong-base"
    )
    one_off = {**task3.module_versions, "L0.M1": 0}
    assert rejected(lambda: tr.request(delta_for(task3, "p3", base_versions=one_off))) == (
        "wrong-base"
    )
    assert all(not r.late and not r.pending for r in co.store.modules.values())
    tr.request(delta_for(task3, "p3"))  # the honest base is accepted
    assert all(list(co.store.modules[mid].late) == [3] for mid in PATH3)


def test_a_two_versions_late_delta_is_stale_with_max_staleness_one(tmp_path):
    """Round 1 closes without p3, whose lease then expires; p4 takes path 3 for round 2 and
    straggles too; round 2 closes at its deadline; p3's round-1 delta is then 2 versions late."""
    clock = Clock()
    co, tr, task3 = closed_without_path3(tmp_path, clock)
    clock.now = 41.0  # p3's lease (last heartbeat at 20 s) has expired
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(3)] + [claim(tr, "p4", prefer=3)]
    assert [(t.path, t.round) for t in tasks] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    # Durations 10, 10, 10, 10, 2, 2, 2, 0, 0, 0: median 2, MAD 2, deadline 2 + 4 * 2 = 10 s.
    assert co.scheduler.task_deadline() == pytest.approx(10.0)
    clock.now = 50.0
    assert tr.request(m.Heartbeat(peer_id="p4", task_id=tasks[3].task_id, step=1)).lease_ok
    clock.now = 52.0
    co.tick()
    assert set(versions(co).values()) == {3}
    assert rejected(lambda: tr.request(delta_for(task3, "p3"))) == "stale"
    tr.request(delta_for(tasks[3], "p4"))  # one version late: accepted
    assert all(list(co.store.modules[mid].late) == [3] for mid in PATH3)


# ---- 4. tickets --------------------------------------------------------------------------------


def tampered(ticket):
    """Forgeries of a genuine ticket: none verifies under the scheduler's key."""
    body, _, mac = ticket.partition(".")
    payload = tickets.read_ticket(KEY.public_key, ticket)
    forged = tickets.sign_ticket(Identity.generate(), {**payload, "path": 1})
    return [
        body + "." + ("A" if mac[0] != "A" else "B") + mac[1:],  # the signature changed
        forged.partition(".")[0] + "." + mac,  # another payload under the genuine MAC
        forged,  # signed with another key
        "garbage",
    ]


def test_tampered_or_borrowed_tickets_are_refused(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    mine, theirs = claim(tr, "a", prefer=0), claim(tr, "b", prefer=1)
    for bad in tampered(mine.ticket):
        fetch = m.FetchModules(peer_id="a", task_id=mine.task_id, ticket=bad)
        assert rejected(lambda fetch=fetch: tr.request(fetch)) == "bad-ticket"
        submit = delta_for(mine, "a", ticket=bad)
        assert rejected(lambda submit=submit: tr.request(submit)) == "bad-ticket"
    # A valid ticket for another task than the one named.
    fetch = m.FetchModules(peer_id="a", task_id=mine.task_id, ticket=theirs.ticket)
    assert rejected(lambda: tr.request(fetch)) == "bad-ticket"
    # Another peer's valid ticket, for that peer's task.
    fetch = m.FetchModules(peer_id="a", task_id=theirs.task_id, ticket=theirs.ticket)
    assert rejected(lambda: tr.request(fetch)) == "not-your-task"
    borrowed = delta_for(theirs, "a")
    assert rejected(lambda: tr.request(borrowed)) == "not-your-task"
    assert all(not r.pending for r in co.store.modules.values())
    # The genuine tickets still work.
    got = tr.request(m.FetchModules(peer_id="a", task_id=mine.task_id, ticket=mine.ticket))
    assert set(got.versions) == set(TOPO.path_modules(0))
    assert tr.request(delta_for(mine, "a")).accepted


def test_an_owner_that_is_not_the_scheduler_needs_tickets_and_leases_nothing(tmp_path):
    primary = make(tmp_path / "a")
    owner = make_owner(tmp_path / "b")
    take_over(owner, LocalTransport(primary.handle), ["L1.M0"])
    me = Identity.generate()  # one peer: the same key towards the scheduler and the owner
    tr = LocalTransport(owner.handle).authenticate(me)
    task = claim(LocalTransport(primary.handle).authenticate(me), "p0", prefer=0)
    no_ticket = m.FetchModules(peer_id="p0", task_id=task.task_id)
    assert rejected(lambda: tr.request(no_ticket)) == "bad-ticket"
    unsigned = delta_for(task, "p0", mids=["L1.M0"], ticket="")
    assert rejected(lambda: tr.request(unsigned)) == "bad-ticket"
    assert rejected(lambda: claim(tr, "p0")) == "not-scheduler"
    beat = m.Heartbeat(peer_id="p0", task_id=task.task_id)
    assert rejected(lambda: tr.request(beat)) == "not-scheduler"
    # With the scheduler's ticket the owner serves and accepts its own module of the path.
    got = tr.request(m.FetchModules(peer_id="p0", task_id=task.task_id, ticket=task.ticket))
    assert got.versions == {"L1.M0": 0}
    ack = tr.request(delta_for(task, "p0", mids=["L1.M0"]))
    assert ack.accepted == ["L1.M0"] and ack.task_done is False
    assert list(owner.store.modules["L1.M0"].pending) == [0]


def test_a_path_one_owner_holds_is_trained_again_for_the_other_and_its_round_closes(tmp_path):
    """p0 pushed path 0's delta to the scheduler's modules and died before the other owner's
    (a kill between two uploads; CI once hung here for five minutes, every new task of the
    path refused as a duplicate). Its lease expires and the path is offered again: the next
    task's delta is kept by the owner that lacks it and dropped by the one that holds it, the
    task ends, and the path's round closes with one delta per module."""
    clock = Clock()
    primary = make(tmp_path / "a", clock)
    second = make_owner(tmp_path / "b")
    take_over(second, LocalTransport(primary.handle), ["L1.M0"])
    sched = LocalTransport(primary.handle).authenticate(KEY)
    owner = LocalTransport(second.handle).authenticate(KEY)
    mine = [mid for mid in TOPO.path_modules(0) if mid != "L1.M0"]
    first = claim(sched, "p0", prefer=0)
    ack = sched.request(delta_for(first, "p0", mids=mine))
    assert sorted(ack.accepted) == sorted(mine) and ack.task_done is False
    clock.now = LEASE + 1
    primary.tick()  # p0 is gone: its lease expires with L1.M0 still owed path 0's delta
    again = claim(sched, "p1", prefer=0)
    assert (again.path, again.round) == (0, 0) and again.task_id != first.task_id
    ack = sched.request(delta_for(again, "p1", mids=mine, scale=0.5))
    assert ack.accepted == [] and sorted(ack.dropped) == sorted(mine)
    assert owner.request(delta_for(again, "p1", mids=["L1.M0"])).accepted == ["L1.M0"]
    sched.request(second.report())
    assert isinstance(sched.request(task_done(again, "p1")), m.Ok)
    assert 0 not in primary.open_paths()
    for mid in mine:  # the first task's delta, once; the second's is not held
        held = primary.store.modules[mid].pending[0]
        assert held.task_id == first.task_id
    assert primary.rejections["duplicate"] == 0


def task_done(task, peer, wait=0.0):
    return m.TaskDone(
        peer_id=peer,
        task_id=task.task_id,
        ticket=task.ticket,
        tokens=100,
        losses=[1.0],
        modules=list(task.module_versions),
        wait=wait,
    )


def test_a_task_done_waits_for_the_other_owners_report_rather_than_being_refused(
    tmp_path, monkeypatch
):
    """The peer and the owner both tell the scheduler, and the owner's report often comes
    second. A TaskDone with ``wait`` is held until the report arrives, even while claims wait
    in every slot they may: no `not-acked` refusal, no retry seconds later. Without ``wait``,
    with the scheduler's own module's delta missing, or with no report coming, it is refused
    as before."""
    # Waits far longer than a loaded machine takes to answer: "at once" and "until the report"
    # are then seconds, against a wait of a minute.
    monkeypatch.setattr(rounds_module, "REPORT_WAIT_SECONDS", 60.0)
    primary = make(tmp_path / "a")
    second = make_owner(tmp_path / "b")
    take_over(second, LocalTransport(primary.handle), ["L1.M0"])
    sched = LocalTransport(primary.handle).authenticate(KEY)
    owner = LocalTransport(second.handle).authenticate(KEY)
    path, other = TOPO.paths_through("L1.M0")[:2]
    mine = [mid for mid in TOPO.path_modules(path) if mid != "L1.M0"]
    task = claim(sched, "p0", prefer=path)
    assert task.path == path
    # The scheduler's own modules lack the delta: refused at once, whatever the wait.
    began = time.monotonic()
    assert rejected(lambda: sched.request(task_done(task, "p0", wait=60.0))) == "not-acked"
    assert time.monotonic() - began < 10
    sched.request(delta_for(task, "p0", mids=mine))
    assert owner.request(delta_for(task, "p0", mids=["L1.M0"])).accepted == ["L1.M0"]
    assert rejected(lambda: sched.request(task_done(task, "p0"))) == "not-acked"  # no wait
    refused = primary.rejections["not-acked"]
    # Idle peers' claims hold every long-poll slot they may: the last is the TaskDone's.
    primary.polls.waiting = primary.polls.slots - 1
    reporter = LocalTransport(primary.handle).authenticate(KEY)
    timer = threading.Timer(0.3, lambda: reporter.request(second.report()))
    began = time.monotonic()
    timer.start()
    assert isinstance(sched.request(task_done(task, "p0", wait=60.0)), m.Ok)
    timer.join()
    assert 0.3 <= time.monotonic() - began < 10  # held until the report, not for the wait
    assert primary.rejections["not-acked"] == refused and path not in primary.open_paths()
    assert primary.polls.waiting == primary.polls.slots - 1
    primary.polls.waiting = 0
    # No report comes for the other path's task: refused once the wait is over.
    late = claim(sched, "p1", prefer=other)
    sched.request(
        delta_for(late, "p1", mids=[mid for mid in TOPO.path_modules(other) if mid != "L1.M0"])
    )
    began = time.monotonic()
    assert rejected(lambda: sched.request(task_done(late, "p1", wait=1.0))) == "not-acked"
    assert 1.0 <= time.monotonic() - began < 11  # its wait, then at once


# ---- 5. a restarted peer ----------------------------------------------------------------------


def test_a_peer_claiming_again_with_a_live_lease_gets_the_same_task(tmp_path):
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events)
    tr = LocalTransport(co.handle)
    first = claim(tr, "a", prefer=2)
    clock.now = 9.0
    again = claim(tr, "a", prefer=0)  # it restarted and prefers another path now
    assert again.task_id == first.task_id and again.path == 2
    assert again.ticket == first.ticket and again.module_versions == first.module_versions
    assert [e["task"] for e in events if e["event"] == "task_issued"] == [first.task_id]
    # The claim renewed the lease: at 15 s (past the first 10 s) it is still alive.
    clock.now = 15.0
    assert tr.request(m.Heartbeat(peer_id="a", task_id=first.task_id)).lease_ok
    assert claim(tr, "b", prefer=2).path != 2


# ---- 6. slow peers get fewer steps --------------------------------------------------------------


def paced_round(tr, clock, paces):
    """Peer p<i> trains path i at ``paces[i]`` seconds a step (heartbeating its progress) and
    reports when done; the rounds wait for every path. Returns the offers."""
    start = clock.now
    offers = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    for p in sorted(range(4), key=lambda p: paces[p] * offers[p].inner_steps):
        task = offers[p]
        clock.now = start + paces[p] * task.inner_steps
        beat = m.Heartbeat(peer_id=f"p{p}", task_id=task.task_id, step=task.inner_steps)
        assert tr.request(beat).lease_ok
        tr.request(delta_for(task, f"p{p}"))
    return offers


def test_slow_peers_are_offered_fewer_inner_steps(tmp_path):
    H, clock = 8, Clock()
    floor = math.ceil(0.25 * H)
    co = make(
        tmp_path, clock, inner_steps=H, lease=1000.0, quorum=1.0, deadline_mads=0.0
    )  # deadline = 1.5 x the median task duration
    tr = LocalTransport(co.handle)
    paces = [1.0, 1.0, 4.0, 20.0]  # seconds a step: two fast peers, a slow one, a very slow one
    first = paced_round(tr, clock, paces)
    assert [o.inner_steps for o in first] == [H] * 4  # no durations known yet: everybody gets H
    second = paced_round(tr, clock, paces)
    assert [o.inner_steps for o in second[:2]] == [H, H]
    offers = {p: claim(tr, f"p{p}", prefer=p) for p in range(4)}
    deadline = co.scheduler.task_deadline()
    assert deadline is not None and 4.0 * H > deadline > 1.0 * H
    assert offers[0].inner_steps == offers[1].inner_steps == H, "fast peers get H"
    typical = statistics.median(co.scheduler.durations)  # the round's tasks end together
    assert offers[2].inner_steps == int(typical / 4.0) < int(deadline / 4.0), (
        "a slow peer gets what it trains in a typical task's time, not up to the deadline"
    )
    assert floor < offers[2].inner_steps < H
    assert offers[3].inner_steps == floor, "a very slow peer gets the floor, not fewer"
    assert {o.step_offset for o in offers.values()} == {2 * H}  # the offset follows the round


# ---- 7. hand-over ------------------------------------------------------------------------------


def test_hand_over_moves_a_module_with_its_pending_delta(tmp_path):
    events = []
    primary = make(tmp_path / "a", events=events)
    sched = LocalTransport(primary.handle)
    task0 = claim(sched, "p0", prefer=0)
    sched.request(delta_for(task0, "p0"))
    assert list(primary.store.modules["L1.M0"].pending) == [0]

    second = make_owner(tmp_path / "b")
    assert second.owned_modules() == []
    assert take_over(second, sched, ["L1.M0"]) == ["L1.M0"]
    moved = second.store.modules["L1.M0"]
    assert moved.version == 0 and list(moved.pending) == [0]
    assert moved.pending[0].file.exists() and tmp_path / "b" in moved.pending[0].file.parents
    assert moved.pending[0].weight == SHARDS[0] and moved.pending[0].task_id == task0.task_id
    assert primary.owners["L1.M0"] == "b" and "L1.M0" not in primary.store.modules
    assert primary.remote["L1.M0"].pending == (0,)
    assert [e for e in events if e["event"] == "owner_changed"] == [
        {"event": "owner_changed", "module": "L1.M0", "owner": "b"}
    ]
    assert take_over(second, sched, ["L1.M0"]) == []  # already owned: nothing to do

    # The primary refuses L1.M0's deltas now; the new owner accepts them with the ticket.
    task2 = claim(sched, "p2", prefer=2)
    assert task2.owners["L1.M0"] == "b" and task2.owners["S.embed"] == "a"
    assert rejected(lambda: sched.request(delta_for(task2, "p2"))) == "not-owner"
    rest = [mid for mid in TOPO.path_modules(2) if mid != "L1.M0"]
    ack = sched.request(delta_for(task2, "p2", mids=rest))
    assert sorted(ack.accepted) == sorted(rest) and ack.task_done is False
    ack = (
        LocalTransport(second.handle)
        .authenticate(KEY)
        .request(delta_for(task2, "p2", mids=["L1.M0"]))
    )
    assert ack.closed == ["L1.M0"]  # paths 0 and 2 both reported: the new owner stepped
    assert second.store.version("L1.M0") == 1
    sched.request(second.report())
    assert primary.version("L1.M0") == 1

    # A restarted owner finds its module on disk, at the same version.
    again = make_owner(tmp_path / "b")
    assert again.owned_modules() == ["L1.M0"]
    assert again.store.version("L1.M0") == 1
    assert again.store.modules["L1.M0"].hash == second.store.modules["L1.M0"].hash


class LosesFirstReplies:
    """A link to the scheduler that loses its first reply to each message type in ``kinds`` on
    the way back (a hivemind stream cut short), after the scheduler carried the request out."""

    def __init__(self, transport, kinds):
        self.transport, self.kinds, self.lost = transport, set(kinds), []

    def request(self, msg):
        reply = self.transport.request(msg)
        if type(msg).__name__ in self.kinds:
            self.kinds.discard(type(msg).__name__)
            self.lost.append(type(msg).__name__)
            raise TransportError("reply truncated: got 0 of 174647 bytes", reason="truncated")
        return reply

    def __getattr__(self, name):
        return getattr(self.transport, name)


def test_a_hand_over_whose_replies_are_lost_is_sent_again_and_moves_the_module_once(tmp_path):
    """A fresh-clone run under load once lost the HandOver's reply over hivemind, and the
    joining owner exited. Each step is sent again: the HandOver repeats harmlessly, and a
    ConfirmOwnership already carried out is recognised from the scheduler's owners."""
    events = []
    primary = make(tmp_path / "a", events=events)
    sched = LocalTransport(primary.handle)
    task0 = claim(sched, "p0", prefer=0)
    sched.request(delta_for(task0, "p0"))
    second = make_owner(tmp_path / "b")
    link = LosesFirstReplies(LocalTransport(primary.handle), ["HandOver", "ConfirmOwnership"])
    assert take_over(second, link, ["L1.M0"]) == ["L1.M0"]
    assert link.lost == ["HandOver", "ConfirmOwnership"]
    assert primary.owners["L1.M0"] == "b" and "L1.M0" not in primary.store.modules
    assert second.owned_modules() == ["L1.M0"]
    assert list(second.store.modules["L1.M0"].pending) == [0]  # the pending delta moved with it
    assert [e["owner"] for e in events if e["event"] == "owner_changed"] == ["b"]
    # A refusal is not a lost reply: raised at once.
    third = make_owner(tmp_path / "c", owner_id="c")
    with pytest.raises(RejectedError) as err:
        take_over(third, LocalTransport(primary.handle), ["L1.M0"])
    assert err.value.reason == "not-owner"


class ClosesFirstStream(LocalTransport):
    """A link whose first stream ends without a reply (seen once in CI: an owner joined through
    the scheduler's relay, and its Hello's stream closed a second after it joined the DHT)."""

    closed = 0

    def _roundtrip(self, data):
        if not self.closed:
            self.closed += 1
            raise TransportError("QmScheduler closed the stream without a reply")
        return super()._roundtrip(data)


class OneRunDHT:  # the DHT's run record and manifest; the real DHT is in tests/integration
    def __init__(self, entry, manifest):
        self.records = {"dipaco.runs": {"test": entry}, discovery.key("test", "manifest"): manifest}
        self.links = []

    def get(self, key):
        return self.records.get(key)

    def transport(self, target, addresses):
        self.links.append(target)
        return self.link


def test_an_owner_whose_first_hello_gets_no_reply_says_it_again(tmp_path):
    """An owner's first request to the scheduler is sent again after a transport error, as
    every later one of its start is (take_over), instead of ending the owner with it."""
    primary = make(tmp_path / "a", peer_config={"run_id": "test"})
    manifest = primary.peer_config  # with the scheduler's key and its owner id
    entry = {"scheduler": "QmScheduler", "manifest": discovery.manifest_sha256(manifest)}
    node = OneRunDHT(entry, manifest)
    node.peer_id = "b"
    node.link = ClosesFirstStream(primary.handle)
    run_id, got, scheduler = hivemind.contact_scheduler(node, KEY, None, KEY.public_key)
    assert (run_id, got, node.link.closed) == ("test", manifest, 1)
    assert isinstance(scheduler.request(m.GetOwners()), m.Owners)  # the link stays usable
    # A refusal is not a lost reply: raised at once (here the owner's own: the reply to the
    # Hello sent again is signed by another key than the one it pinned for the scheduler).
    node.link = ClosesFirstStream(primary.handle)
    with pytest.raises(DipacoError, match="reply refused: signed by"):
        hivemind.contact_scheduler(node, KEY, None, Identity.generate().public_key)
    assert node.link.closed == 1


def test_a_restarted_new_owner_keeps_the_handed_over_pending_delta(tmp_path):
    primary = make(tmp_path / "a")
    sched = LocalTransport(primary.handle)
    task0 = claim(sched, "p0", prefer=0)
    sched.request(delta_for(task0, "p0"))
    second = make_owner(tmp_path / "b")
    take_over(second, sched, ["L1.M0"])
    digest = second.store.modules["L1.M0"].hash
    again = make_owner(tmp_path / "b")
    assert again.owned_modules() == ["L1.M0"] and again.epoch == 1
    record = again.store.modules["L1.M0"]
    assert record.version == 0 and record.hash == digest
    assert list(record.pending) == [0] and record.pending[0].task_id == task0.task_id
    assert take_over(again, sched, ["L1.M0"]) == []  # no second hand-over after a restart


def test_owner_reports_and_hand_overs_need_a_valid_proof_and_ownership(tmp_path):
    primary = make(tmp_path / "a")
    sched = LocalTransport(primary.handle)
    second = make_owner(tmp_path / "b")
    take_over(second, sched, ["L1.M0"])

    report = second.report()
    assert isinstance(sched.request(report), m.ReportAck)
    forged = m.OwnerReport(owner_id="b", proof="0" * 64, modules=report.modules)
    assert rejected(lambda: sched.request(forged)) == "bad-proof"
    other_key = tickets.prove(Identity.generate(), "report", "b", report.modules)
    forged = m.OwnerReport(owner_id="b", proof=other_key, modules=report.modules)
    assert rejected(lambda: sched.request(forged)) == "bad-proof"
    # "b" signs a report about L0.M0, which the primary still owns.
    claim_l0 = {"L0.M0": {"version": 9, "hash": "x", "pending": [0, 1]}}
    grab = m.OwnerReport(
        owner_id="b", proof=tickets.prove(KEY, "report", "b", claim_l0), modules=claim_l0
    )
    assert rejected(lambda: sched.request(grab)) == "not-owner"
    assert primary.version("L0.M0") == 0

    bad = m.HandOver(owner_id="c", proof="f" * 64, modules=["L0.M0"])
    assert rejected(lambda: sched.request(bad)) == "bad-proof"
    wrong_purpose = m.HandOver(
        owner_id="c", proof=tickets.prove(KEY, "report", "c", ["L0.M0"]), modules=["L0.M0"]
    )
    assert rejected(lambda: sched.request(wrong_purpose)) == "bad-proof"
    assert primary.handing == {}  # nothing is held for a refused hand-over
    task = claim(sched, "p0", prefer=0)
    rest = [mid for mid in TOPO.path_modules(0) if mid != "L1.M0"]
    assert sorted(sched.request(delta_for(task, "p0", mids=rest)).accepted) == sorted(rest)
    # A module another owner holds cannot be handed over by the primary.
    stolen = m.HandOver(
        owner_id="c", proof=tickets.prove(KEY, "handover", "c", ["L1.M0"]), modules=["L1.M0"]
    )
    assert rejected(lambda: sched.request(stolen)) == "not-owner"


# ---- a straggler's lease outliving its round ----------------------------------------------------


def peer_attempt(tr, peer):
    """What dipaco.peer does with an offer: claim, fetch, and abort (without releasing the task)
    when the modules are no longer at the task's versions. Returns the offer."""
    offer = claim(tr, peer, prefer=3)
    got = tr.request(m.FetchModules(peer_id=peer, task_id=offer.task_id, ticket=offer.ticket))
    return offer, got.versions == offer.module_versions


def test_a_stale_rejected_task_gives_its_path_back(tmp_path):
    """After "stale", the task can never be accepted; its path must be trainable for the current
    round again: otherwise the peer's next claim would return the same dead task, path 3 would
    never be trained for round 2 and its modules would never close round 2."""
    clock = Clock()
    co, tr, task3 = closed_without_path3(tmp_path, clock, max_staleness=0)
    assert rejected(lambda: tr.request(delta_for(task3, "p3"))) == "stale"
    offer = claim(tr, "p3", prefer=3)
    assert (offer.path, offer.round) == (3, 2), (
        f"after its delta was rejected as stale, p3 is offered {offer.task_id} "
        f"(round {offer.round}, modules at {versions(co)}) again instead of round 2 of path 3"
    )


def test_a_restarted_straggler_is_not_stuck_on_a_closed_round(tmp_path):
    """Round 1 closed at its deadline while p3 held path 3's task; p3 restarts (dipaco.peer
    fetches before it resumes from a checkpoint). Its dead round-1 task must be dropped, not
    given back on every claim (a fetch for it serves version 2, so the peer could never train
    it, and round 2 of S.embed, S.head, L0.M1, L1.M1 would never close)."""
    clock = Clock()
    co = make(tmp_path, clock)
    tr = LocalTransport(co.handle)
    straggling_round(co, tr, clock)
    clock.now = 26.0
    co.tick()
    others = [claim(tr, f"p{p}", prefer=p) for p in range(3)]
    for p, task in enumerate(others):
        tr.request(delta_for(task, f"p{p}"))
    offers = []
    for i in range(30):  # p3 is back at 27 s (its lease lives until 30 s), retries every 5 s
        clock.now = 27.0 + 5 * i
        offer, usable = peer_attempt(tr, "p3")
        offers.append((offer.task_id, offer.round, usable))
        if usable:
            break
    assert offers[-1][2], (
        f"p3 was offered only tasks whose modules have moved on: {sorted(set(offers))}; "
        f"modules at {versions(co)}, round 2 never closes"
    )


def test_a_late_delta_after_the_last_round_is_refused_not_acknowledged(tmp_path):
    """rounds=2: round 1 (the last) closes at the deadline without path 3; p3's delta must be
    refused ("finished"), since no later step would ever apply it."""
    clock = Clock()
    co = make(tmp_path, clock, rounds=2)
    assert co.rounds == 2
    tr = LocalTransport(co.handle)
    task3 = straggling_round(co, tr, clock)
    clock.now = 26.0
    co.tick()
    assert {co.store.version(mid) for mid in PATH3} == {2}
    assert rejected(lambda: tr.request(delta_for(task3, "p3"))) == "finished"
    assert not any(r.late or r.pending for r in co.store.modules.values())


def test_after_its_last_round_a_module_drops_a_delta_the_others_still_wait_for(tmp_path):
    """Once S.embed and S.head made all their rounds, p3's delta cannot be applied to them, but
    L0.M1 and L1.M1 wait for it: refusing the whole delta left them waiting for ever."""
    clock, events = Clock(), []
    co, tr, task3 = path3_short_of_quorum(tmp_path, clock, rounds=2, events=events)
    ack = tr.request(delta_for(task3, "p3"))
    assert sorted(ack.accepted) == ["L0.M1", "L1.M1"] == sorted(ack.closed)
    assert sorted(ack.dropped) == ["S.embed", "S.head"]
    assert co.finished and set(versions(co).values()) == {2}
    assert not co.store.modules["S.embed"].late and not co.store.modules["S.embed"].pending
    last = {e["module"]: e for e in events if e["event"] == "outer_step" and e["version"] == 2}
    assert task3.task_id in last["L1.M1"]["tasks"] and task3.task_id not in last["S.embed"]["tasks"]


def test_a_last_round_whose_straggler_vanished_offers_its_path_again(tmp_path):
    """p3 dies in the last round: its lease expires. Path 3's modules are at versions 2 (done)
    and 1 (waiting): the path is offered again for the waiting ones, at the versions they are."""
    clock = Clock()
    co, tr, task3 = path3_short_of_quorum(tmp_path, clock, rounds=2)
    clock.now = 41.0  # p3's lease (last heartbeat at 20 s) has expired
    co.tick()
    assert co.open_paths() == {3: 1}
    again = claim(tr, "p4")
    assert (again.path, again.round) == (3, 1)
    assert again.module_versions == {"S.embed": 2, "L0.M1": 1, "L1.M1": 1, "S.head": 2}
    ack = tr.request(delta_for(again, "p4"))
    assert sorted(ack.accepted) == ["L0.M1", "L1.M1"] and sorted(ack.dropped) == [
        "S.embed",
        "S.head",
    ]
    assert co.finished and set(versions(co).values()) == {2}
    assert co.open_paths() == {}


def test_a_path_whose_straggler_vanished_after_its_round_closed_elsewhere_is_offered_again(
    tmp_path,
):
    """quorum 0.75, mid-run: S.embed and S.head close round 1 without path 3; L0.M1 and L1.M1
    (1 of 2) wait for it; then p3 dies. Path 3 is offered again for round 1 (at the versions
    its modules are at); its delta feeds the waiting modules, the shared ones drop it. Before,
    no path but 0 was ever offered again and S.embed's round 2 waited for ever."""
    clock = Clock()
    co, tr, _ = path3_short_of_quorum(tmp_path, clock)
    clock.now = 41.0  # p3's lease (last heartbeat at 20 s) has expired
    co.tick()
    assert co.open_paths() == {0: 2, 3: 1}  # paths 1 and 2 wait on L1.M1 and L0.M1
    again = claim(tr, "p4", prefer=3)
    assert (again.path, again.round) == (3, 1)
    assert again.module_versions == {"S.embed": 2, "L0.M1": 1, "L1.M1": 1, "S.head": 2}
    ack = tr.request(delta_for(again, "p4"))
    assert sorted(ack.accepted) == ["L0.M1", "L1.M1"] == sorted(ack.closed)
    assert sorted(ack.dropped) == ["S.embed", "S.head"]
    assert set(versions(co).values()) == {2}
    assert not co.store.modules["S.embed"].pending  # path 3 still owes S.embed its round 2
    # Round 2 in full: path 3 reports to S.embed once, with no duplicate refused.
    assert co.open_paths() == {0: 2, 1: 2, 2: 2, 3: 2}
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    for p, task in enumerate(tasks):
        assert tr.request(delta_for(task, f"p{p}")).dropped == []
    assert set(versions(co).values()) == {3}
    assert co.status().state["rejections_by_peer"] == {}


# ---- the kept answer of which paths owe their round a delta -------------------------------------


class Checked:
    """A transport that, after every request, compares the coordinator's kept answer of each
    path's round (what claims and long polls read) with one computed afresh."""

    def __init__(self, co):
        self.co, self.inner, self.checks = co, LocalTransport(co.handle), 0

    def request(self, msg):
        try:
            return self.inner.request(msg)
        finally:
            kept = rounds_module.path_rounds(self.co)  # as a claim would read it now
            assert kept == rounds_module._path_rounds(self.co), type(msg).__name__
            self.checks += 1


def test_the_kept_answer_of_each_paths_round_is_the_fresh_one_through_deadlines_and_late_deltas(
    tmp_path,
):
    """Claims and long polls reuse ``path_rounds`` until its inputs change: after every request
    of a run with a straggler, a deadline, a late delta and a path offered again, the kept
    answer equals a fresh computation."""
    clock = Clock()
    co = make(tmp_path, clock, stale_damping=0.25)
    tr = Checked(co)
    task3 = straggling_round(co, tr, clock)
    clock.now = 26.0
    co.tick()
    tr.request(m.GetStatus())
    tr.request(delta_for(task3, "p3"))  # late: path 3 is open for round 2 again
    assert co.open_paths() == {0: 2, 1: 2, 2: 2, 3: 2}
    for _ in range(2):
        full_round(tr, clock)
    assert set(versions(co).values()) == {4} and co.finished
    assert tr.checks > 30


def test_a_task_being_sent_behind_is_kept_when_its_round_closes_without_it(tmp_path):
    """Push behind: p3 has trained its round-1 task and claims its next one while it sends the
    delta (``ClaimTask.holding`` names the task being sent). The round closed at its deadline
    meanwhile. The task is not dropped as a restarted peer's would be: its lease lives, and its
    delta is admitted late, not refused as a task whose lease ended."""
    clock = Clock()
    co, tr, sent = closed_without_path3(tmp_path, clock)
    moved = {mid for mid in PATH3 if co.store.version(mid) == 2}
    assert moved, versions(co)  # the round closed without path 3 where it was not needed
    offer = tr.request(m.ClaimTask(peer_id="p3", holding=[sent.task_id]))
    assert isinstance(offer, m.TaskOffer) and offer.task_id != sent.task_id
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=sent.task_id)).lease_ok
    ack = tr.request(delta_for(sent, "p3"))
    assert isinstance(ack, m.DeltaAck) and sorted(ack.accepted) == sorted(PATH3), ack
    # Without ``holding`` (a peer back from a restart), the same claim drops the dead task.
    clock2 = Clock()
    co2 = make(tmp_path / "restart", clock2)
    tr2 = LocalTransport(co2.handle)
    dead = straggling_round(co2, tr2, clock2)
    clock2.now = 26.0
    co2.tick()
    tr2.request(m.ClaimTask(peer_id="p3"))
    assert not tr2.request(m.Heartbeat(peer_id="p3", task_id=dead.task_id)).lease_ok


def test_a_fetch_for_a_task_whose_module_moved_past_its_base_sends_no_tensors(tmp_path):
    """p3's round-1 task straggled and its round closed without it where it was not needed: a
    module of its path moved past its base, and the peer would give the task up on the versions
    (peer/modules.fetch_modules). Its fetch says the versions and sends no tensors (a hedged
    copy's peer downloaded the path's modules for nothing), and the peer gives the task up as
    moved; a task on the current versions still gets its modules."""
    clock = Clock()
    co, tr, sent = closed_without_path3(tmp_path, clock)
    assert any(co.store.version(mid) == 2 for mid in PATH3), versions(co)
    fetch = m.FetchModules(peer_id="p3", task_id=sent.task_id, ticket=sent.ticket)
    got = tr.request(fetch)
    assert got.versions == {mid: co.store.version(mid) for mid in PATH3} and got.tensors == {}
    # quorum 0.75: S.embed and S.head moved, L0.M1 and L1.M1 wait for path 3. No tensors come
    # either, and the peer gives the task up as moved whichever module it looks at first.
    co, tr, task3 = path3_short_of_quorum(tmp_path / "quorum", Clock())
    got = tr.request(m.FetchModules(peer_id="p3", task_id=task3.task_id, ticket=task3.ticket))
    assert got.versions["L0.M1"] == 1 and got.versions["S.embed"] == 2 and got.tensors == {}
    tr.server_key = KEY.public_key  # the releases are signed with the coordinator's key
    patience = Patience("p3", 5.0, 0.1, threading.Event(), threading.Event())
    links = OwnerLinks(tr, Identity.generate(), patience)
    task3.module_versions = dict(sorted(task3.module_versions.items(), key=lambda kv: "S" in kv[0]))
    assert next(iter(task3.module_versions)) == "L0.M1"  # unmoved, and not sent
    with pytest.raises(TaskAborted, match="S.embed moved to version 2 since the task was"):
        fetch_modules(links, task3, "p3", "test", {})
    fresh = claim(tr, "p0", prefer=0)
    assert isinstance(fresh, m.TaskOffer) and fresh.module_versions == {
        mid: co.store.version(mid) for mid in TOPO.path_modules(fresh.path)
    }
    got = tr.request(m.FetchModules(peer_id="p0", task_id=fresh.task_id, ticket=fresh.ticket))
    assert {k.partition("/")[0] for k in got.tensors} == set(TOPO.path_modules(fresh.path))


def test_an_outer_step_that_raises_ends_the_run_with_its_error_rather_than_hanging(
    tmp_path, monkeypatch
):
    """A fault in a step's own code (not a full disk, which is retried) used to kill the
    request thread or the ticker that ran it and leave the run waiting for ever. The run now
    fails with the error, and the peer that delivered the last delta still gets its reply."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events)
    tr = LocalTransport(co.handle)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(co.store, "run_step", broken)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    replies = [tr.request(delta_for(t, f"p{p}")) for p, t in enumerate(tasks)]
    assert all(isinstance(r, m.DeltaAck) for r in replies)
    assert co.failure is not None and "boom" in co.failure
    assert co.finished_event.is_set()
    assert any(e["event"] == "outer_step_failed" and "boom" in e["error"] for e in events)
