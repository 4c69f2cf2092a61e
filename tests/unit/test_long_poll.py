"""Claims that wait for a path to open (``ClaimTask.wait``, a long poll): answered as soon as
the round that holds every path closes, not a retry interval later; bounded in time and in how
many wait at once; ended by the run's end."""

from __future__ import annotations

import threading
import time

from _tiny import constant_delta, delta_message, tiny_coordinator
from _waiting import wait_for

from dipaco.coordinator import polls, tasks
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

KEYS: dict[str, Identity] = {}


def peer(co, name):
    """A transport to ``co`` that signs with ``name``'s key (a peer id belongs to one key)."""
    return LocalTransport(co.handle).authenticate(KEYS.setdefault(name, Identity.generate()))


# Where a test needs a claim answered only by a wake-up, its own looks come this late: an answer
# well before it was woken (a loaded machine may take seconds to wake it; never this long).
NEVER_ON_ITS_OWN = 60.0
# What a user notices: a claim answered within seconds of the change, not at its own next look.
SOON = 10.0


def only_wake_ups_answer(monkeypatch):
    monkeypatch.setattr(polls, "LONG_POLL_SECONDS", NEVER_ON_ITS_OWN)
    monkeypatch.setattr(polls, "LOOK_AGAIN_SECONDS", NEVER_ON_ITS_OWN)


def claim_in_background(co, name, wait):
    """Claim from a thread; returns (the thread, a list that receives (reply, the seconds the
    claim took, the time.monotonic() of its answer))."""
    out: list = []

    def run():
        began = time.monotonic()
        reply = peer(co, name).request(m.ClaimTask(peer_id=name, wait=wait))
        ended = time.monotonic()
        out.append((reply, ended - began, ended))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def lease_every_path(co):
    tasks = [
        peer(co, f"p{p}").request(m.ClaimTask(peer_id=f"p{p}", prefer_path=p)) for p in range(4)
    ]
    assert [t.path for t in tasks] == [0, 1, 2, 3]
    return tasks


def test_a_waiting_claim_gets_the_next_rounds_path_as_soon_as_it_opens(tmp_path, monkeypatch):
    only_wake_ups_answer(monkeypatch)
    co = tiny_coordinator(tmp_path)
    tasks = lease_every_path(co)
    # Without a wait, the answer is a NoTask at once, with its retry interval.
    now = peer(co, "late").request(m.ClaimTask(peer_id="late"))
    assert isinstance(now, m.NoTask) and now.retry_after > 0 and not now.finished
    thread, out = claim_in_background(co, "late", wait=NEVER_ON_ITS_OWN)
    wait_for(lambda: co.polls.waiting == 1, 30, "the claim to wait")
    assert out == []  # waiting, not polling
    for p, task in enumerate(tasks):
        peer(co, f"p{p}").request(delta_message(task, f"p{p}", constant_delta(co, task)))
    closed = time.monotonic()
    thread.join(NEVER_ON_ITS_OWN)
    ((reply, _, answered),) = out
    assert isinstance(reply, m.TaskOffer) and reply.module_versions == {
        mid: 1 for mid in reply.module_versions
    }
    assert answered - closed < SOON and co.polls.waiting == 0


def test_a_wait_is_bounded_and_only_so_many_claims_wait(tmp_path, monkeypatch):
    co = tiny_coordinator(tmp_path)
    lease_every_path(co)
    co.polls.limit(2)  # one for claims; the last is kept for a TaskDone's wait
    began = time.monotonic()
    big = peer(co, "c").request(m.ClaimTask(peer_id="c", wait=3600.0))  # capped: LONG_POLL_SECONDS
    assert isinstance(big, m.NoTask)
    assert polls.LONG_POLL_SECONDS <= time.monotonic() - began < 60
    only_wake_ups_answer(monkeypatch)
    first, first_out = claim_in_background(co, "a", wait=3.0)
    wait_for(lambda: co.polls.waiting == 1, 30, "the first claim to wait")
    second, second_out = claim_in_background(co, "b", wait=NEVER_ON_ITS_OWN)
    second.join(NEVER_ON_ITS_OWN)
    assert isinstance(second_out[0][0], m.NoTask) and second_out[0][1] < SOON  # no slot: at once
    first.join(NEVER_ON_ITS_OWN)
    reply, seconds, _ = first_out[0]
    assert isinstance(reply, m.NoTask) and 3.0 <= seconds < 3.0 + SOON  # its 3 s, then NoTask


def test_a_released_lease_wakes_a_waiting_claim_with_its_path(tmp_path, monkeypatch):
    only_wake_ups_answer(monkeypatch)
    co = tiny_coordinator(tmp_path)
    tasks = lease_every_path(co)
    thread, out = claim_in_background(co, "late", wait=NEVER_ON_ITS_OWN)
    wait_for(lambda: co.polls.waiting == 1, 30, "the claim to wait")
    peer(co, "p2").request(m.ReleaseTask(peer_id="p2", task_id=tasks[2].task_id))
    released = time.monotonic()
    thread.join(NEVER_ON_ITS_OWN)
    reply, _, answered = out[0]
    assert isinstance(reply, m.TaskOffer) and reply.path == 2 and answered - released < SOON


def test_a_closing_round_wakes_every_waiting_claim_and_a_delta_that_opens_nothing_wakes_one(
    tmp_path, monkeypatch
):
    # Waits long enough that only wake-ups (not a claim's own look again) lease a path in time.
    monkeypatch.setattr(polls, "LONG_POLL_SECONDS", 30.0)
    monkeypatch.setattr(polls, "LOOK_AGAIN_SECONDS", 30.0)
    looks = []
    real = tasks.lease_open_or_ahead

    def counted(core, req):
        lease = real(core, req)
        looks.append(lease is not None)
        return lease

    monkeypatch.setattr(tasks, "lease_open_or_ahead", counted)
    co = tiny_coordinator(tmp_path)
    leased = lease_every_path(co)
    waiting = [claim_in_background(co, f"late{i}", wait=30.0) for i in range(4)]
    wait_for(lambda: co.polls.waiting == 4, 30, "four claims to wait")
    changes = co.polls.generation
    looks.clear()  # the claims' first looks, before they waited
    for p, task in enumerate(leased):
        peer(co, f"p{p}").request(delta_message(task, f"p{p}", constant_delta(co, task)))
    for thread, _ in waiting:
        thread.join(10)
    assert all(out for _, out in waiting), "a waiting claim had no answer 10 s after the close"
    offers = [out[0][0] for _, out in waiting]
    # The round's close opened four paths: each of the four waiting claims leased one.
    assert all(isinstance(o, m.TaskOffer) for o in offers), offers
    assert sorted(o.path for o in offers) == [0, 1, 2, 3]
    # Each change woke one claim (plus one per lease, for the next): not every waiting claim.
    assert looks.count(True) == 4
    assert len(looks) <= (co.polls.generation - changes) + 4, (len(looks), co.polls.generation)


def test_idle_polls_back_off_as_pollers_grow_and_one_key_counts_once(tmp_path, monkeypatch):
    """With every path leased, each NoTask's retry_after keeps the idle claims near
    POLLS_PER_SECOND in all: 0.5 s for a few pollers, longer for many (at most
    MAX_RETRY_AFTER); a key that polls under many peer ids counts once; a poller that gets a
    task, or is silent for POLL_WINDOW, no longer counts."""
    monkeypatch.setattr(polls, "POLLS_PER_SECOND", 4.0)  # 4 polls a second: 40 pollers = 10 s
    co = tiny_coordinator(tmp_path, rounds=3)
    leased = lease_every_path(co)

    def idle(name, key=None):
        tr = LocalTransport(co.handle).authenticate(
            KEYS.setdefault(key or name, Identity.generate())
        )
        reply = tr.request(m.ClaimTask(peer_id=name))
        assert isinstance(reply, m.NoTask) and not reply.finished
        return reply.retry_after

    assert idle("idle0") == polls.RETRY_AFTER  # one poller: the usual interval
    waits = [idle(f"idle{i}") for i in range(1, 40)]
    assert waits[-1] == 40 / 4.0 and waits == sorted(waits)  # 40 pollers at 4 a second
    # One key behind 10 more peer ids is one poller more, not 10.
    assert [idle(f"sybil{i}", key="mallory") for i in range(10)][-1] == 41 / 4.0
    assert max(idle(f"more{i}") for i in range(200)) == polls.MAX_RETRY_AFTER  # capped
    # Pollers silent for the window are forgotten; the retry interval comes back down.
    stale = time.monotonic() - polls.POLL_WINDOW - 1
    for who in list(co.polls.pollers):
        co.polls.pollers[who] = stale
    assert idle("fresh") == polls.RETRY_AFTER
    # A poller that gets a task leaves the count: the round's paths open, idle0 takes one.
    for p, task in enumerate(leased):
        peer(co, f"p{p}").request(delta_message(task, f"p{p}", constant_delta(co, task)))
    assert isinstance(peer(co, "fresh").request(m.ClaimTask(peer_id="fresh")), m.TaskOffer)
    assert KEYS["fresh"].public_key not in co.polls.pollers
