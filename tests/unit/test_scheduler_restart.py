"""The scheduler's state survives a restart: leases in flight, issued tasks, overdue skips.

Each test builds a scheduler in-process, claims tasks, then drops the object as a kill would and
builds a new one from the same folder (``Coordinator`` + ``start``), with a clock that starts
elsewhere (a monotonic clock does not survive a restart).
"""

import json

import pytest
import torch
from _tiny import TOPO, constant_delta, delta_message, initial_modules

from dipaco.config import SchedulerSection
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import CorruptFileError, RejectedError
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

LEASE = 10.0
PEERS = {name: Identity.generate() for name in ("p0", "p1", "p2", "p3", "alice", "bob", "carol")}


class Clock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def make(root, clock, *, first=True, **policy):
    co = Coordinator(
        root, TOPO, rounds=4, inner_steps=5, step_offset=0, total_steps=100, seed=0,
        outer=OuterSettings(), lease_seconds=LEASE, run_id="test", peer_config={},
        shard_tokens=[1000, 2000, 3000, 4000], clock=clock,
        policy=SchedulerSection(lease_seconds=LEASE, **policy),
    )  # fmt: skip
    co.start(initial_modules() if first else None)
    return co


def restart(root, now=5000.0, **policy):
    """A new coordinator from ``root``, its clock far from the old one's."""
    clock = Clock(now)
    return make(root, clock, first=False, **policy), clock


def peer(co, name):
    return LocalTransport(co.handle).authenticate(PEERS[name])


def claim(co, name, prefer=None):
    return peer(co, name).request(m.ClaimTask(peer_id=name, prefer_path=prefer))


def submit(co, task, name, **override):
    return peer(co, name).request(delta_message(task, name, constant_delta(co, task), **override))


def test_a_task_in_flight_is_heartbeated_and_accepted_after_a_restart_exactly_once(tmp_path):
    co = make(tmp_path, Clock())
    task = claim(co, "alice")
    # Killed right after the offer went out: the claim's lease is on disk before its reply.
    co, clock = restart(tmp_path)
    beat = peer(co, "alice").request(m.Heartbeat(peer_id="alice", task_id=task.task_id, step=3))
    assert beat.lease_ok and beat.deadline_in == pytest.approx(LEASE)
    # The path is still the peer's: the others get the three other paths and then nothing.
    others = [claim(co, "bob"), claim(co, "carol"), claim(co, "p0")]
    assert sorted(t.path for t in others) == sorted({0, 1, 2, 3} - {task.path})
    assert isinstance(claim(co, "p1"), m.NoTask)
    # A peer back from its own restart gets its task again, with the very same ticket.
    again = claim(co, "alice")
    assert (again.task_id, again.ticket) == (task.task_id, task.ticket)

    ack = submit(co, task, "alice")  # the ticket signed before the restart still verifies
    assert sorted(ack.accepted) == sorted(TOPO.path_modules(task.path)) and ack.task_done
    assert sorted(submit(co, task, "alice").accepted) == sorted(ack.accepted)  # a retry: re-acked
    for t, name in zip(others, ["bob", "carol", "p0"], strict=True):
        submit(co, t, name)
    assert {co.store.version(mid) for mid in TOPO.module_ids()} == {1}
    for mid in TOPO.path_modules(task.path):
        applied = co.store.modules[mid].applied
        assert applied.count(task.task_id) == 1
    assert co.status().state["leases"] == {}


def test_a_restored_lease_keeps_its_time_left_and_expires_if_its_peer_is_gone(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock)
    first = claim(co, "alice", prefer=0)
    clock.now = 2.0
    second = claim(co, "bob", prefer=1)  # saves both leases: 8 s and 10 s left
    co, clock = restart(tmp_path)
    left = {t: lease.deadline - clock.now for t, lease in co.scheduler.leases.items()}
    assert left == {first.task_id: pytest.approx(8.0), second.task_id: pytest.approx(10.0)}
    clock.now += 9.0  # alice never came back; bob heartbeats
    assert peer(co, "bob").request(m.Heartbeat(peer_id="bob", task_id=second.task_id)).lease_ok
    gone = peer(co, "alice").request(m.Heartbeat(peer_id="alice", task_id=first.task_id))
    assert not gone.lease_ok
    retaken = claim(co, "carol", prefer=0)
    assert retaken.path == 0 and retaken.task_id not in (first.task_id, second.task_id)
    with pytest.raises(RejectedError) as err:  # the expired lease's ticket stays void
        submit(co, first, "alice")
    assert err.value.reason == "lease-ended"


def test_task_ids_are_never_reused_across_restarts(tmp_path):
    co = make(tmp_path, Clock())
    seen = []
    for name in ("alice", "bob"):
        task = claim(co, name, prefer=0)
        seen.append(task.task_id)
        peer(co, name).request(m.ReleaseTask(peer_id=name, task_id=task.task_id))
    held = claim(co, "carol", prefer=0)
    seen.append(held.task_id)
    for _ in range(2):
        co, _ = restart(tmp_path)
        peer(co, "carol").request(m.ReleaseTask(peer_id="carol", task_id=held.task_id))
        held = claim(co, "carol", prefer=0)
        assert held.path == 0 and held.task_id not in seen
        seen.append(held.task_id)
    # Path 0's fifth attempt, in the third life: the attempts were counted across restarts.
    assert held.task_id == "P0-r0-e2-a4"
    # A ticketless late submission is matched against the issued tasks, restored too.
    co, _ = restart(tmp_path)
    ack = submit(co, held, "carol", ticket="")
    assert sorted(ack.accepted) == sorted(TOPO.path_modules(0))


def full_round(co, clock, seconds=10.0):
    """Every path trained by its own peer p<i>, each taking ``seconds``: 4 durations, so the
    task deadline is 10 + 0.5 * 10 = 15 s."""
    tasks = [claim(co, f"p{p}", prefer=p) for p in range(4)]
    clock.now += seconds
    for p, task in enumerate(tasks):
        submit(co, task, f"p{p}")
    assert co.scheduler.task_deadline() == pytest.approx(15.0)


def versions(co):
    return {mid: co.store.version(mid) for mid in TOPO.module_ids()}


def test_an_overdue_skip_survives_a_restart(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock)
    full_round(co, clock)  # t = 10
    late = claim(co, "p3", prefer=3)
    early = [claim(co, f"p{p}", prefer=p) for p in (0, 1)]
    clock.now = 12.0
    for p, task in zip((0, 1), early, strict=True):
        submit(co, task, f"p{p}")
    clock.now = 20.0
    peer(co, "p3").request(m.Heartbeat(peer_id="p3", task_id=late.task_id))
    task2 = claim(co, "p2", prefer=2)
    clock.now = 26.0  # p3's task is 16 s old, past the deadline; p2's only 6 s
    peer(co, "p3").request(m.Heartbeat(peer_id="p3", task_id=late.task_id))
    assert co.book.overdue == {(3, 1)}
    assert versions(co)["S.embed"] == 1  # waits for path 2, which is not overdue

    co, clock = restart(tmp_path)
    assert co.book.overdue == {(3, 1)}  # as saved, before any time passes
    ack = submit(co, task2, "p2")
    # Path 2 was all the round still waited for: it closes at once, without path 3.
    assert sorted(ack.closed) == ["L0.M1", "L1.M0", "S.embed", "S.head"]
    assert set(versions(co).values()) == {2}


def test_a_lease_ages_across_a_restart_so_its_deadline_does_not_start_again(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock)
    full_round(co, clock)  # t = 10
    tasks = [claim(co, f"p{p}", prefer=p) for p in range(4)]
    clock.now = 12.0
    for p in range(3):
        submit(co, tasks[p], f"p{p}")

    def beat():
        peer(co, "p3").request(m.Heartbeat(peer_id="p3", task_id=tasks[3].task_id))

    clock.now = 18.0
    beat()
    clock.now = 24.0  # p3's task is 14 s old: 1 s before its deadline
    beat()
    co.save_counts()
    co, clock = restart(tmp_path)
    clock.now += 0.5
    beat()
    assert versions(co)["S.embed"] == 1  # 14.5 s old
    clock.now += 1.5
    beat()
    # 16 s old, not 2: the round closed at the deadline without path 3.
    assert set(versions(co).values()) == {2}


def saved(root):
    return json.loads((root / "coordinator.json").read_text())


def test_the_saved_scheduler_state_is_small_and_has_its_documented_shape(tmp_path):
    co = make(tmp_path, Clock())
    task = claim(co, "alice", prefer=2)
    sched = saved(tmp_path)["scheduler"]
    versions0 = dict.fromkeys(TOPO.path_modules(2), 0)
    assert sched["issued"] == [[task.task_id, 2, 0, "alice", 5, versions0]]
    assert sched["live"] == {task.task_id: [LEASE, 0.0]}  # [deadline, issued at], clock at 0
    assert sched["clock"] == 0.0
    assert sched["attempts"] == [[2, 0, 1]]
    assert len(json.dumps(sched)) < 300


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda s: s["scheduler"].update(issued=[["t", 0, 0]]), "scheduler.issued"),
        (lambda s: s["scheduler"].update(live={"nope": [1.0, 2.0]}), "scheduler.live"),
        (lambda s: s["scheduler"]["live"].update({"x": "soon"}), "scheduler.live"),
        (lambda s: s["scheduler"].update(clock="noon"), "scheduler.clock"),
        (lambda s: s["scheduler"].update(attempts=[[0, -1, 2]]), "scheduler.attempts"),
        (lambda s: s["scheduler"].update(durations=[-3.0]), "scheduler.durations"),
        # JSON allows an integer no float holds (the fuzz test found it: an OverflowError).
        (lambda s: s["scheduler"].update(durations=[10**400]), "scheduler.durations"),
        (
            lambda s: s["scheduler"]["live"].update(
                dict.fromkeys(s["scheduler"]["live"], [10**400, 0])
            ),
            "scheduler.live",
        ),
        (lambda s: s["scheduler"].update(paces={"a": "fast"}), "scheduler.paces"),
        (lambda s: s.update(scheduler=[]), "'scheduler' is not an object"),
        (lambda s: s.update(overdue=[[1]]), "overdue"),
        (lambda s: s.update(trained_by=[[0, 1]]), "trained_by"),
        (lambda s: s.update(trained_by=[[0, 1, ""]]), "trained_by"),
        (lambda s: s.update(trained_by=[[0, -1, "alice"]]), "trained_by"),
    ],
)
def test_a_damaged_saved_scheduler_state_stops_the_start_with_a_clear_error(
    tmp_path, damage, named
):
    co = make(tmp_path, Clock())
    claim(co, "alice")
    content = saved(tmp_path)
    damage(content)
    (tmp_path / "coordinator.json").write_text(json.dumps(content))
    with pytest.raises(CorruptFileError, match=named) as err:
        restart(tmp_path)
    assert "coordinator.json" in str(err.value)


def test_restored_leases_feed_the_same_deltas_as_an_uninterrupted_run(tmp_path):
    """The restart changes nothing a user could see in the modules."""
    one, two = tmp_path / "one", tmp_path / "two"
    for root in (one, two):
        co = make(root, Clock())
        tasks = [claim(co, f"p{p}", prefer=p) for p in range(4)]
        if root == two:
            co, _ = restart(root)
        for p, task in enumerate(tasks):
            submit(co, task, f"p{p}")
    a, b = make(one, Clock(), first=False), make(two, Clock(), first=False)
    for mid in TOPO.module_ids():
        assert a.store.version(mid) == b.store.version(mid) == 1
        for k, v in a.store.params(mid).items():
            assert torch.equal(v, b.store.params(mid)[k])
