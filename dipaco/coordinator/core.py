"""The coordinator core: a transport-free state machine over the module store and the scheduler.

Operations (docs/design.md, "The core is transport-free"): hello, claim a task, fetch a path's
modules, heartbeat, submit a delta, release a task, status. :meth:`Coordinator.handle` maps wire
frames to them, so every transport (local, loopback, hivemind and Flower) drives the same code.
Every rejection raises a :class:`RejectedError` with a reason and is counted.

One coordinator may own every module (the default), or several may share them: the *scheduler*
(the first coordinator of a run) leases tasks and signs a ticket for each; every *owner* accepts
the fetches and deltas of its own modules against that ticket, applies their outer steps on its
own, and reports its modules' state to the scheduler (:class:`~dipaco.protocols.messages.OwnerReport`).
A new owner takes modules over with ``HandOver``/``ConfirmOwnership``: the old owner refuses
their deltas between the two (reason ``handover``, retried by peers), so none is lost.

The class holds the operations; each part of the work is a file of functions that take the
coordinator as their first argument and are bound here as its methods:

- ``base.py``: the state and the queries every part asks (versions, rounds, ownership);
- ``service.py``: the bytes layer (envelope, key admission, dispatch, refusal counting);
- ``tasks.py``: hello, claim, fetch, heartbeat, release, run files, the task behind a request;
- ``admission.py``: a delta's admission (SubmitDelta);
- ``rounds.py``: open paths, quorum and outer steps, the ticker, finished tasks and rounds;
- ``ownership.py``: owners' reports and the hand-over of modules;
- ``phases.py``: routing phases;
- ``state.py``: saving and resuming coordinator.json;
- ``standby.py``: the state a standby scheduler copies (StandbySync);
- ``status.py``: the status snapshot.

A part calls another only through the coordinator (``core._maybe_step(mid)``), so the parts import
none of one another.
"""

from __future__ import annotations

from dipaco.coordinator import (
    admission,
    ownership,
    phases,
    rounds,
    service,
    standby,
    state,
    status,
    tasks,
)
from dipaco.coordinator.base import CoordinatorBase


class Coordinator(CoordinatorBase):
    """One coordinator of a run: the scheduler, a module owner, or both (the default)."""

    # state.py
    start = state.start
    standby_sync = standby.standby_sync
    _state_bytes = state.state_bytes
    save_counts = state.save_counts

    # phases.py
    schedule_phase = phases.schedule_phase
    add_phase = phases.add_phase

    # rounds.py
    open_paths = rounds.open_paths
    ahead_paths = rounds.ahead_paths
    free_paths = rounds.free_paths
    tick = rounds.tick
    _tick = rounds.tick_now
    step_due = rounds.step_due
    _maybe_step = rounds.maybe_step
    _after_change = rounds.after_change
    task_done = rounds.task_done
    _task_done = rounds.record_done

    # tasks.py
    hello = tasks.hello
    claim = tasks.claim
    fetch = tasks.fetch
    fetch_releases = tasks.fetch_releases
    release_signature = tasks.release_signature
    heartbeat = tasks.heartbeat
    release = tasks.release
    fetch_file = tasks.fetch_file
    keep_alive = tasks.keep_alive
    run_file = tasks.run_file
    _task = tasks.task_of
    _expired = tasks.expired

    # admission.py
    submit = admission.submit
    voter_of = admission.voter_of

    # ownership.py
    adopt = ownership.adopt
    get_owners = ownership.get_owners
    owner_report = ownership.owner_report
    hand_over = ownership.hand_over
    confirm_ownership = ownership.confirm_ownership
    report = ownership.report

    # status.py
    status = status.status  # last: from here on, ``status`` in this class is the method

    # service.py
    handle = service.handle
    act_for = service.act_for
    refuse = service.refuse
