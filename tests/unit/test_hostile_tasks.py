"""Issue 17, breaks 1 and 2: one key cannot take a path out of a round with a bare TaskDone,
and a ticket dies with its lease. A real coordinator core, driven through its wire handler."""

import pytest
from _tiny import constant_delta, delta_message, tiny_coordinator

from dipaco.errors import RejectedError
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def claim(tr, peer, path=None):
    offer = tr.request(m.ClaimTask(peer_id=peer, prefer_path=path))
    assert isinstance(offer, m.TaskOffer), offer
    return offer


def done(task, peer):
    return m.TaskDone(
        peer_id=peer, task_id=task.task_id, ticket=task.ticket, tokens=100, losses=[1.0],
        modules=list(task.module_versions),
    )  # fmt: skip


def test_a_task_done_without_its_deltas_is_refused_and_the_round_still_closes(tmp_path):
    clock = Clock()
    co = tiny_coordinator(tmp_path, clock=clock, lease_seconds=10.0)
    hostile, honest = LocalTransport(co.handle), LocalTransport(co.handle)
    stolen = claim(hostile, "mallory", path=0)
    with pytest.raises(RejectedError) as err:
        hostile.request(done(stolen, "mallory"))
    assert err.value.reason == "not-acked"
    assert co.rejections_by_peer["mallory"]["not-acked"] == 1
    assert (0, 0) not in co.book.done  # path 0 is still part of round 0
    # Honest peers train the other paths; path 0 comes back when mallory's lease runs out.
    for p in (1, 2, 3):
        task = claim(honest, f"h{p}", path=p)
        honest.request(delta_message(task, f"h{p}", constant_delta(co, task)))
    clock.now += 11.0
    co.tick()
    task = claim(honest, "h0", path=0)
    assert task.path == 0
    ack = honest.request(delta_message(task, "h0", constant_delta(co, task)))
    assert ack.task_done
    assert all(co.store.version(mid) == 1 for mid in co.topology.module_ids())  # round closed


def test_a_task_done_after_its_deltas_is_accepted(tmp_path):
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    task = claim(tr, "p0", path=0)
    tr.request(delta_message(task, "p0", constant_delta(co, task)))
    assert isinstance(tr.request(done(task, "p0")), m.Ok)  # a peer's TaskDone after its acks


def test_a_released_tasks_ticket_cannot_pre_empt_the_paths_next_holder(tmp_path):
    """Break 2: one key claimed and released every path in turn, kept each ticket, and later
    beat the honest holders to their paths (whose deltas were then refused as duplicates)."""
    co = tiny_coordinator(tmp_path)
    hostile, honest = LocalTransport(co.handle), LocalTransport(co.handle)
    kept = []
    for p in range(co.topology.num_paths):
        task = claim(hostile, "mallory", path=p)
        hostile.request(m.ReleaseTask(peer_id="mallory", task_id=task.task_id))
        kept.append(task)
    mine = [claim(honest, f"h{p}", path=p) for p in range(co.topology.num_paths)]
    for task in kept:
        with pytest.raises(RejectedError) as err:
            hostile.request(delta_message(task, "mallory", constant_delta(co, task)))
        assert err.value.reason == "lease-ended"
    for p, task in enumerate(mine):
        ack = honest.request(delta_message(task, f"h{p}", constant_delta(co, task)))
        assert ack.task_done
    assert all(co.store.version(mid) == 1 for mid in co.topology.module_ids())
    assert co.rejections_by_peer["mallory"]["lease-ended"] == len(kept)


def test_void_tickets_survive_a_restart(tmp_path):
    co = tiny_coordinator(tmp_path)
    tr = LocalTransport(co.handle)
    task = claim(tr, "mallory", path=0)
    tr.request(m.ReleaseTask(peer_id="mallory", task_id=task.task_id))
    again = tiny_coordinator(tmp_path)  # the same folder: a restart
    with pytest.raises(RejectedError) as err:
        LocalTransport(again.handle).request(
            delta_message(task, "mallory", constant_delta(again, task))
        )
    assert err.value.reason == "lease-ended"
