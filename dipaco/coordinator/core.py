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
- ``service.py``: the bytes layer (envelope, key admission, dispatch by ``OPS``, refusal counting);
- ``tasks.py``: hello, claim, fetch, heartbeat, release, run files;
- ``leased.py``: the task behind a request (its ticket or lease), a lease's end;
- ``admission.py``: a delta's admission (SubmitDelta);
- ``heldout.py``: a delta judged by its path's held-out loss, and the verdicts of scoring.py;
- ``scoring.py``: a whole path's delta scored for its several owners (ScoreDelta);
- ``rounds.py``: open paths, quorum and outer steps, the ticker, finished tasks and rounds;
- ``ownership.py``: owners' reports and the hand-over of modules;
- ``phases.py``: routing phases;
- ``state.py``: saving and resuming coordinator.json;
- ``standby.py``: the state a standby scheduler copies (StandbySync);
- ``status.py``: the status snapshot.

A part calls another directly (``rounds.maybe_step(core, mid)``), through an import graph
without circles (import-linter checks); the service maps each request to the part's function
that answers it (``service.OPS``). The type checker (``make lint``) checks every part against the
coordinator's fields.
"""

from __future__ import annotations

from typing import Any

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
from dipaco.coordinator.durable import GroupWriter, Journal


class Coordinator(CoordinatorBase):
    """One coordinator of a run: the scheduler, a module owner, or both (the default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # coordinator.json and validation.json: group commit (durable.py)
        self.journal = Journal(
            GroupWriter(self.lock, lambda: state.state_bytes(self), self.root / "coordinator.json"),
            GroupWriter(self.lock, self.norms.snapshot_bytes, self.root / "validation.json"),
        )

    # state.py
    start = state.start
    standby_sync = standby.standby_sync
    save_counts = state.save_counts

    # phases.py
    schedule_phase = phases.schedule_phase
    add_phase = phases.add_phase

    # rounds.py
    open_paths = rounds.open_paths
    free_paths = rounds.free_paths
    tick = rounds.tick
    task_done = rounds.task_done

    # tasks.py
    hello = tasks.hello
    claim = tasks.claim
    fetch = tasks.fetch
    fetch_releases = tasks.fetch_releases
    heartbeat = tasks.heartbeat
    release = tasks.release
    fetch_file = tasks.fetch_file
    keep_alive = tasks.keep_alive
    run_file = tasks.run_file

    # admission.py
    submit = admission.submit

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
