"""Hedging (``scheduler.hedge``): a peer with nothing to train gets a copy of a straggler's task;
the path's first delta for its round is applied, exactly once, and the other holder's lease
ends (docs/operations.md)."""

from test_rounds import TOPO, Clock, claim, delta_for, make, rejected, versions

from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


def three_done_one_straggling(tmp_path, clock, events):
    """Hedging on; paths 0-2 reported after a second each (the typical task); p3 trains on."""
    co = make(tmp_path, clock, events=events, hedge=True, min_observations=3)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    clock.now = 1.0
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    return co, tr, tasks


def test_an_idle_peer_copies_a_stragglers_task_and_the_first_delta_wins(tmp_path):
    clock, events = Clock(), []
    co, tr, tasks = three_done_one_straggling(tmp_path, clock, events)
    straggler = tasks[3]
    assert isinstance(claim(tr, "p0"), m.NoTask)  # p3 has not run longer than typical yet
    clock.now = 2.5
    copy = claim(tr, "p0")
    assert (copy.path, copy.round) == (3, 0) and copy.task_id != straggler.task_id
    assert copy.module_versions == straggler.module_versions  # the same base
    assert copy.inner_steps == straggler.inner_steps
    assert isinstance(claim(tr, "p1"), m.NoTask)  # one copy per task
    ack = tr.request(delta_for(copy, "p0", scale=0.02))
    assert sorted(ack.accepted) == sorted(TOPO.path_modules(3)) and ack.task_done
    assert set(versions(co).values()) == {1}  # the round closed without the straggler
    # The straggler's lease ended: its heartbeat says so, and its delta is refused.
    beat = tr.request(m.Heartbeat(peer_id="p3", task_id=straggler.task_id, step=3))
    assert not beat.lease_ok
    assert rejected(lambda: tr.request(delta_for(straggler, "p3"))) == "lease-ended"
    # Each module's step applied path 3's delta once: the copy's.
    steps = [e for e in events if e["event"] == "outer_step"]
    for step in steps:
        assert straggler.task_id not in step["tasks"]
        if 3 in step["paths"]:
            assert step["tasks"].count(copy.task_id) == 1
    assert [e["copies"] for e in events if e["event"] == "task_hedged"] == [straggler.task_id]


def test_without_hedging_or_a_late_task_nobody_copies(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock, min_observations=3)  # hedge off (the default)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    clock.now = 1.0
    for p in range(3):
        tr.request(delta_for(tasks[p], f"p{p}"))
    clock.now = 10.0
    assert isinstance(claim(tr, "p0"), m.NoTask)


def test_a_straggler_about_to_finish_is_not_copied(tmp_path):
    """A copy is made only where it is expected to end first: by the steps the straggler's
    heartbeats report, one nearly done is left alone (a copy would only waste its work), one
    far from done is copied."""
    clock = Clock()
    co = make(tmp_path, clock, hedge=True, min_observations=3)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    clock.now = 1.0
    for p in range(3):  # a second for 5 steps: the typical task, and p0's pace
        tr.request(delta_for(tasks[p], f"p{p}"))
    straggler = tasks[3]
    clock.now = 2.0  # 4 of 5 steps in 2 s: it ends at about 2.5 s, a copy would at 3.1 s
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=straggler.task_id, step=4)).lease_ok
    clock.now = 2.1
    assert isinstance(claim(tr, "p0"), m.NoTask)
    clock.now = 2.2  # now it says 1 of 5 in 2.2 s: it ends near 11 s, a copy at 3.2 s
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=straggler.task_id, step=1)).lease_ok
    copy = claim(tr, "p0")
    assert (copy.path, copy.round) == (3, 0) and copy.task_id != straggler.task_id


def test_hedging_in_the_last_round_only_copies_no_earlier_straggler(tmp_path):
    """``scheduler.hedge = "last"``: a straggler of an earlier round is waited for (with overlap
    the others train ahead meanwhile, and a copy would only waste its work); in the run's last
    round, which nothing can be trained ahead of, an idle peer copies it."""
    clock = Clock()
    co = make(tmp_path, clock, hedge="last", rounds=2, min_observations=3)
    tr = LocalTransport(co.handle)
    for rnd in (0, 1):
        start = clock.now
        # path 3's peer: one whose pace nothing tells yet (its last task's would say it ends on time)
        names = ["p0", "p1", "p2", f"s{rnd}"]
        tasks = [claim(tr, name, prefer=p) for p, name in enumerate(names)]
        assert {t.round for t in tasks} == {rnd}
        clock.now = start + 1.0
        for p in range(3):  # three tasks of a second each: the typical task
            tr.request(delta_for(tasks[p], f"p{p}"))
        straggler = tasks[3]
        clock.now = start + 2.5  # it has run longer than typical: a copy would end first
        offer = claim(tr, "p0")
        if rnd == 0:
            assert isinstance(offer, m.NoTask), offer  # not the last round: no copy
            clock.now = start + 3.0
            ack = tr.request(delta_for(straggler, "s0"))
            assert ack.task_done and set(versions(co).values()) == {1}
        else:
            assert (offer.path, offer.round) == (3, 1), offer  # the last round: a copy
            assert offer.task_id != straggler.task_id
            assert offer.module_versions == straggler.module_versions


def test_a_straggler_whose_modules_moved_on_is_not_copied(tmp_path):
    """Round 0 closes at its deadline without path 3 while p3 still trains it. A copy of that
    task would train from the base the modules have left: its peer would fetch them, find them
    moved and give the copy up. Nobody gets one."""
    clock, events = Clock(), []
    co = make(tmp_path, clock, events=events, hedge=True, min_observations=3)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"p{p}", prefer=p) for p in range(4)]
    clock.now = 1.0
    for p in range(3):  # three tasks of a second each: the typical task
        tr.request(delta_for(tasks[p], f"p{p}"))
    clock.now = 9.0
    assert tr.request(m.Heartbeat(peer_id="p3", task_id=tasks[3].task_id, step=1)).lease_ok
    clock.now = 11.0  # past the deadline (10 s, the floor): round 0 closes without path 3
    co.tick()
    assert set(versions(co).values()) == {1}
    others = [claim(tr, f"p{p}", prefer=p) for p in range(3)]
    assert [(t.path, t.round) for t in others] == [(0, 1), (1, 1), (2, 1)]
    assert isinstance(claim(tr, "p9"), m.NoTask)  # path 3 is p3's; its round 0 is not copied
    assert not [e for e in events if e["event"] == "task_hedged"]
