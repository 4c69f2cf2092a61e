"""The task behind a request: read from its ticket, or (the scheduler) from the lease table; and
what a lease's end does. Below both rounds.py and tasks.py, which each ask it.
"""

from __future__ import annotations

import logging

from dipaco.coordinator import heldout
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.leases import Lease
from dipaco.coordinator.records import Task
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)


def task_of(core: CoordinatorBase, peer_id: str, task_id: str, ticket: str) -> Task:
    """The task a request acts for: from its ticket, or (scheduler) from the lease table.
    A task whose lease was released or expired acts for nothing any more."""
    ended = core.scheduler.ended if core.scheduler is not None else core.book.void
    if task_id in ended:
        core.refusals.refuse(
            peer_id,
            Reason.LEASE_ENDED,
            f"task {task_id} was released or its lease expired; claim a new task",
        )
    if ticket:
        payload = core.keys.read(ticket)
        task = None if payload is None else Task.of_ticket(payload)
        if task is None:
            core.refusals.refuse(
                peer_id, Reason.BAD_TICKET, f"task {task_id}: ticket does not verify"
            )
        if task.task_id != task_id:
            core.refusals.refuse(
                peer_id, Reason.BAD_TICKET, f"the ticket is for another task than {task_id}"
            )
        if task.peer != peer_id or (
            core._caller is not None and task.key not in (None, core._caller)
        ):
            core.refusals.refuse(
                peer_id, Reason.NOT_YOUR_TASK, f"task {task_id} is leased to another peer"
            )
        return task
    if not core.is_scheduler:
        core.refusals.refuse(
            peer_id, Reason.BAD_TICKET, f"task {task_id}: owners need the task's ticket"
        )
    lease = issued_to(core, task_id, peer_id)
    return lease_task(core, lease)


def lease_task(core: CoordinatorBase, lease: Lease, key: str | None = None) -> Task:
    """The task a lease is, weighed by its shard and by the share of H it was given (a slow
    peer's shorter task weighs in proportion to the tokens it trains)."""
    train = core.peer_config.get("train", {})
    return Task.of_lease(
        lease,
        core.weight(lease.path, lease.round),
        key,
        full_steps=core.inner_steps,
        tokens_per_step=train.get("batch_size", 0) * train.get("seq_len", 0),
        scored=heldout.scores_first(core, lease.path),
    )


def issued_to(core: CoordinatorBase, task_id: str, peer_id: str) -> Lease:
    lease = core.need_scheduler(peer_id).issued.get(task_id)
    if lease is None:
        core.refusals.refuse(
            peer_id, Reason.UNKNOWN_TASK, f"task {task_id} was not issued by this coordinator"
        )
    if lease.peer_id != peer_id:
        core.refusals.refuse(
            peer_id, Reason.NOT_YOUR_TASK, f"task {task_id} is leased to another peer"
        )
    return lease


def expired(core: CoordinatorBase, lease: Lease) -> None:
    log.warning(
        "lease %s of peer %s expired; path P%d is open again",
        lease.task_id,
        lease.peer_id,
        lease.path,
    )
    core.metrics(
        {
            "event": "lease_expired",
            "task": lease.task_id,
            "peer": lease.peer_id,
            "path": lease.path,
        }
    )
    core._work_changed()
