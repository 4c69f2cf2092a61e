"""The scheduler forgets tasks of rounds no delta can join, and late retries still work.

``Scheduler.issued`` answers submissions that come without a ticket; it used to keep every task
of the run (a long run's coordinator grew without bound). Completed rounds now prune it to the
rounds within ``max_staleness`` of the current one.
"""

from __future__ import annotations

import pytest
from _tiny import constant_delta, delta_message, tiny_coordinator

from dipaco.config import SchedulerSection
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.leases import Lease
from dipaco.coordinator.scheduler import Scheduler
from dipaco.errors import RejectedError
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


def _delta(co: Coordinator, offer: m.TaskOffer, peer: str, ticket: str = "") -> m.SubmitDelta:
    return delta_message(offer, peer, constant_delta(co, offer, 1e-3), ticket=ticket)


def _round(co: Coordinator, tr: LocalTransport) -> list[tuple[str, m.TaskOffer]]:
    offers = [(f"p{i}", tr.request(m.ClaimTask(peer_id=f"p{i}", prefer_path=i))) for i in range(4)]
    for peer, offer in offers:
        tr.request(_delta(co, offer, peer))  # no ticket: the scheduler looks the task up
    return offers


def test_issued_tasks_are_pruned_to_the_rounds_a_delta_can_still_join(tmp_path):
    co = tiny_coordinator(
        tmp_path,
        rounds=4,
        inner_steps=1,
        lease_seconds=100.0,
        policy=SchedulerSection(lease_seconds=100.0, max_staleness=1),
    )
    tr = LocalTransport(co.handle)
    first = _round(co, tr)
    assert co.round == 1
    assert {lease.round for lease in co.scheduler.issued.values()} == {0}  # 1 late is allowed
    # A retried delta of the last round, without its ticket, is acknowledged again.
    peer, offer = first[0]
    assert tr.request(_delta(co, offer, peer)).accepted
    second = _round(co, tr)
    assert co.round == 2
    assert {lease.round for lease in co.scheduler.issued.values()} == {1}
    assert {r for _, r in co.scheduler.attempts} <= {1, 2} and len(co.book.done) <= 8
    peer, offer = second[0]
    assert tr.request(_delta(co, offer, peer)).accepted
    # Two rounds back is beyond max_staleness: with its ticket the retry is still recognised
    # as applied; without one the coordinator no longer knows the task.
    peer, offer = first[0]
    assert tr.request(_delta(co, offer, peer, ticket=offer.ticket)).accepted
    with pytest.raises(RejectedError) as err:
        tr.request(_delta(co, offer, peer))
    assert err.value.reason == "unknown-task"
    _round(co, tr)
    _round(co, tr)
    assert co.finished and len(co.scheduler.issued) == 4


def test_forget_before_keeps_live_leases():
    s = Scheduler(lease_seconds=10.0, clock=lambda: 0.0)
    old = s.claim("a", {0: 0}, None)
    s.finish(old.task_id)
    live = s.claim("b", {1: 0}, None)
    newer = s.claim("c", {2: 3}, None)
    s.forget_before(2)
    assert set(s.issued) == {live.task_id, newer.task_id}
    # The live lease's path-round keeps its attempt count: a copy of it is numbered on.
    assert set(s.attempts) == {(1, 0), (2, 3)}


def test_a_task_issued_again_after_its_round_was_forgotten_gets_a_new_id():
    """With max_staleness 0 a round is forgotten as soon as the run moves past it, while a slow
    peer may still hold one of its tasks. A hedged copy of that task was numbered from a
    forgotten count, took the live task's very id, and replaced it in the live leases' index
    but not in the peer's: the path stayed leased for ever and its holder was offered the dead
    task again and again (bench/schedules.py, fed schedule with max_staleness 0, hung)."""
    now = [0.0]
    s = Scheduler(lease_seconds=100.0, clock=lambda: now[0])
    slow = s.claim("slow", {6: 6}, None)
    for i in range(4):  # enough finished tasks to say what a typical one takes
        s.finish(s.claim(f"f{i}", {i: 6}, None).task_id)
    s.forget_before(7)
    now[0] = 50.0  # the slow task has run far longer than the typical (0 s) one
    slow.module_versions = {"S.embed": 6}
    copy = s.hedge("fast", done=())
    assert copy is not None and copy.hedge_of == slow.task_id
    assert copy.task_id != slow.task_id
    assert {x.task_id for x in s.holders(6, 6)} == {slow.task_id, copy.task_id}
    assert s.release(copy.task_id, "fast")
    assert [x.task_id for x in s.leases_of("slow")] == [slow.task_id]
    assert s.release(slow.task_id, "slow")
    assert 6 not in s.leased_paths() and not s.leases_of("slow")


def test_the_live_leases_refuse_a_second_lease_with_a_live_tasks_id():
    s = Scheduler(lease_seconds=10.0, clock=lambda: 0.0)
    lease = s.claim("a", {0: 0}, None)
    twin = Lease(lease.task_id, 0, 0, "b", 10.0)
    with pytest.raises(ValueError, match="live already"):
        s.live.add(twin)
    assert s.leases_of("a") == [lease] and not s.leases_of("b")
