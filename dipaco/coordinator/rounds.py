"""Rounds and quorum: which paths are open, closing a module's round when every path reported or
the missing ones are overdue (DiLoCo's outer step, through the store), the ticker that expires
leases, and what follows a finished round or task.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import logging
import math
import time

from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.leased import expired, task_of
from dipaco.coordinator.records import Task
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

# The longest a TaskDone waits for another owner's report of the task's deltas (TaskDone.wait):
# as long as a claim's long poll (polls.LONG_POLL_SECONDS), within every transport's timeout.
REPORT_WAIT_SECONDS = 2.0

log = logging.getLogger(__name__)


def path_rounds(core: CoordinatorBase) -> list[tuple[int, int, bool]]:
    """Each path whose modules' versions are known, as (path, its round, whether it has
    reported for that round).

    The path's round is its modules' lowest version v. Modules past it closed that round without
    the path (or made all their rounds): a task still owes a delta only to those at v. Each
    module's version and reported paths are read once, not once per path through it: every
    claim asks this, and every long poll again after each change.

    The answer is kept until what it is made of changes: each module's version and the number
    of paths reported at it (within a version that only grows; a step makes a new version),
    whether the module is this coordinator's, and the number of tasks done (which only grows
    between the rounds that prune it, and those move versions)."""
    key = (*(_module_key(core, mid) for mid in core.topology.module_ids()), len(core.book.done))
    return core.book.path_rounds(key, lambda: _path_rounds(core))


def _module_key(core: CoordinatorBase, mid: str) -> tuple[bool, int | None, int]:
    if core.owns(mid):
        record = core.store.modules[mid]
        return True, record.version, len(record.pending)
    info = core.remote.get(mid)
    return False, info.version if info else None, len(info.pending) if info else 0


def _path_rounds(core: CoordinatorBase) -> list[tuple[int, int, bool]]:
    version = {mid: core.version(mid) for mid in core.topology.module_ids()}
    done = {mid: core.reported(mid) for mid in version}
    out = []
    for p in range(core.topology.num_paths):
        mids = core.topology.path_modules(p)
        known = [x for mid in mids if (x := version[mid]) is not None]
        if len(known) < len(mids):
            continue
        v = min(known)
        waiting = [mid for mid in mids if version[mid] == v]
        out.append((p, v, (p, v) in core.book.done or all(p in done[mid] for mid in waiting)))
    return out


def open_paths(core: CoordinatorBase) -> dict[int, int]:
    """The paths that owe their round a delta (path -> round). Once no one trains a path (its
    overdue straggler vanished), it is offered again for its modules still at its round, or
    they would wait for ever; the others drop its delta (admission)."""
    rounds = path_rounds(core)
    # Each round's phase is looked up once, not once per path: every claim asks this.
    ok = {v: v < core.rounds and core.phases.ready_for(v) for v in {v for _, v, _ in rounds}}
    return {p: v for p, v, reported in rounds if ok[v] and not reported}


def ahead_paths(core: CoordinatorBase, peer_id: str) -> dict[int, int]:
    """Overlap (``scheduler.overlap``): the paths ``peer_id`` trained for their round, with the
    round after it (path -> round), for a peer that would otherwise wait for the round to
    close. Such a task trains from where the peer's last one of the path ended, against the
    versions there are now (one round stale once the round closes), and its delta is its
    path's report for the next round (admission.check_state). Only that peer holds where the
    path ended; from the release, the delta would carry the last round's move again."""
    return {
        p: v + 1
        for p, v, reported in path_rounds(core)
        if reported
        and core.book.trainer(p, v) == peer_id
        and v + 1 < core.rounds
        and (p, v + 1) not in core.book.done
        and core.phases.ready_for(v + 1)
        and core.phases.of(v + 1) == core.phases.of(v)  # a new phase may route anew
    }


def tick(core: CoordinatorBase) -> None:
    """Expire leases and close overdue rounds; servers call this every second or so. The
    outer steps run outside the lock."""
    with core.lock:
        tick_now(core, step=False)
    step_due(core)


def tick_now(core: CoordinatorBase, step: bool = True) -> None:
    """The ticker's bookkeeping under the caller's lock (every request runs it, ``step=False``:
    the steps it makes due are the ticker's)."""
    gone = core.scheduler.expire() if core.scheduler is not None else []
    for lease in gone:
        expired(core, lease)
    if gone:
        core.journal.save()  # their tickets are void, and stay so after a restart
    now = core.clock()
    for mid, (owner, since) in list(core.handing.items()):
        if now - since > 120:  # the new owner never confirmed: keep the module
            log.warning("handover of %s to %s timed out; keeping it", mid, owner)
            del core.handing[mid]
    if core.scheduler is not None:
        if core.book.add_overdue(core.scheduler.overdue(), core.round):
            core.journal.save()  # the skip survives a restart: the round does not wait again
    if step:
        step_due(core)


def step_due(core: CoordinatorBase) -> None:
    """Step every module a quorum with overdue paths (or a failed step) has made due."""
    with core.lock:
        if not core.book.overdue and not core.book.judged_out and not core.steps.failed:
            return
        mids = [mid for mid in core.owned_modules() if mid not in core.handing]
    stepped = False
    for mid in mids:
        stepped |= maybe_step(core, mid)
    if stepped:
        with core.lock:
            core.journal.save()
            after_change(core)


def maybe_step(core: CoordinatorBase, mid: str) -> bool:
    """Step when every path has reported, or when the missing ones are overdue (a quorum).

    The decision and the result's installation take the coordinator's lock; the step itself
    (reading the deltas, the arithmetic, the durable writes) runs outside it, with ``mid`` in
    ``core.steps``, so that the other modules go on admitting deltas meanwhile. A caller
    that holds the lock (a test, the start) steps under it, as before.
    """
    with core.lock:
        if mid in core.steps.stepping or not due(core, mid):
            return False
        plan = core.store.begin_step(mid)
        core.steps.begin(mid)
        settings = core.outer_settings_of(mid, plan.included)
    result = None
    try:
        # A large module's step is written on a background thread (store.py run_step), except
        # its last: the run's result is on disk when the run finishes.
        last = plan.record.version + 1 >= core.rounds
        size = sum(t.numel() * t.element_size() for t in plan.record.params.values())
        background = not last and size >= core.store.background_bytes
        paths = set(core.topology.paths_through(mid))
        result = core.store.run_step(
            plan, settings, background, on_disk=lambda info: announce(core, info, paths)
        )
    except OSError as exc:  # a full disk: nothing was committed; the ticker tries again
        with core.lock:
            if core.steps.fail(mid):
                log.error("outer step of %s failed: %s; retrying every second", mid, exc)
                core.metrics({"event": "outer_step_failed", "module": mid, "error": str(exc)})
        return False
    except Exception as exc:  # a fault in the step itself: the run ends with it, not hangs
        log.exception("outer step of %s failed", mid)
        core.metrics({"event": "outer_step_failed", "module": mid, "error": repr(exc)})
        core.fail(f"the outer step of {mid} failed: {exc!r}")
        return False
    finally:
        with core.lock:
            if result is not None:
                core.store.finish_step(result)
            core.steps.end(mid)
            core._work_changed()
    with core.lock:
        core.steps.stepped(mid)
        core.changed.set()
    return True


def announce(core: CoordinatorBase, info: dict, paths: set[int]) -> None:
    """Log an outer step once it is committed on disk (store.py calls this, on the thread that
    wrote it). Without the coordinator's lock: a thread holding it may be waiting for this
    write (the metrics sinks are thread-safe, as admission logs outside the lock too)."""
    mid = info["module"]
    info["closed_by"] = "deadline" if set(info["paths"]) != paths else "all"
    core.metrics({"event": "outer_step", **info})
    for clipped in info.get("clipped", []):  # robust aggregation scaled a delta down
        core.metrics({"event": "delta_clipped", "stage": "aggregation", "module": mid, **clipped})
    log.info(
        "outer step %s -> v%d (paths %s, late %s, %s)",
        mid,
        info["version"],
        info["paths"],
        info["late_paths"],
        info["closed_by"],
    )


def due(core: CoordinatorBase, mid: str) -> bool:
    """Whether ``mid`` should step now: every path reported, or a quorum with the rest overdue."""
    record = core.store.modules[mid]
    if record.version >= core.rounds:
        return False
    paths = set(core.topology.paths_through(mid))
    if set(record.pending) != paths:
        missing = {(p, record.version) for p in paths - set(record.pending)}
        # A path judged out (its deltas refused for what they held) is not waited for, even
        # with quorum 1: each of its tasks trains the same delta again.
        out = len(missing & core.book.judged_out)
        need = math.ceil(core.policy.quorum * (len(paths) - out))
        if not (missing <= core.book.skipped() and len(record.pending) >= need):
            return False
    return True


def after_change(core: CoordinatorBase) -> None:
    """Notice a finished round (the scheduler), wake the reporter (other owners) and the
    claims waiting for a path to open (long polls)."""
    core.changed.set()
    core._work_changed()
    try:
        horizon = core.round - core.policy.max_staleness
        closed = core.book.advance(core.round, horizon)
        if closed:
            for rnd in closed:
                core.metrics({"event": "round", "round": rnd})
            # Tasks of rounds that no delta can join any more (even late) are forgotten, so
            # that a long run does not keep a record of every task it ever leased.
            if core.scheduler is not None:
                core.scheduler.forget_before(horizon)
            if core.on_round is not None:
                core.on_round(core.round)
    finally:  # a round callback that fails must not leave the run's end unsaid
        if core.finished:  # after the last round's queued work (its validation)
            core.after_round.then(core.finished_event.set)


def task_done(core: CoordinatorBase, req: m.TaskDone) -> m.Ok:
    core.need_scheduler(req.peer_id)
    core.roster.seen(req.peer_id)
    task = task_of(core, req.peer_id, req.task_id, req.ticket)
    if (task.path, task.round) in core.book.done:
        return m.Ok()
    missing = unacked(core, task)
    if missing and req.wait > 0 and not any(core.owns(mid) for mid in missing):
        task, missing = await_reports(core, req, task, missing)
        if (task.path, task.round) in core.book.done:
            return m.Ok()
    if missing:
        # A task is done when its deltas are, not when its peer says so: a TaskDone
        # without them would take the path out of the round and stall its modules.
        # The lease stays: it expires, or the round's deadline re-issues it.
        core.refusals.refuse(
            req.peer_id,
            Reason.NOT_ACKED,
            f"task {req.task_id}: no acknowledged delta for {', '.join(missing)} yet",
        )
    record_done(core, task, req.peer_id, req.tokens, req.losses)
    after_change(core)
    return m.Ok()


def await_reports(
    core: CoordinatorBase, req: m.TaskDone, task: Task, missing: list[str]
) -> tuple[Task, list[str]]:
    """A long poll for a TaskDone whose missing acknowledgements are other owners': the peer
    and the owner both tell the scheduler, and the owner's report (sent as it acknowledges)
    often comes second. Waits, without the lock, for reports (every change wakes
    ``core.steps``) up to ``req.wait`` seconds (at most REPORT_WAIT_SECONDS), while a long-poll
    slot is free (claims share them but leave it the last one: a hivemind server's handler
    threads are few, and idle peers' claims would otherwise take them all); then the task,
    looked up again after each wake (its lease may have ended meanwhile), and what is still
    missing (``missing`` as the caller found it, if it never waited)."""
    with core.polls.slot() as waiting:
        if not waiting:
            return task, missing
        end = time.monotonic() + min(req.wait, REPORT_WAIT_SECONDS)
        while missing and not core.finished and (left := end - time.monotonic()) > 0:
            core.steps.wait(left)
            task = task_of(core, req.peer_id, req.task_id, req.ticket)
            if (task.path, task.round) in core.book.done:
                break
            missing = unacked(core, task)
        return task, missing


def unacked(core: CoordinatorBase, task: Task) -> list[str]:
    """The modules of ``task``'s path holding no acknowledged delta of it: for our own
    modules, its task id among the pending, late or applied deltas, or the path's delta for
    the task's round from an earlier task of it (this one's was dropped: admission); for
    another owner's, its last report shows the path pending at the task's base, or the module
    past that base."""
    missing = []
    for mid in core.topology.path_modules(task.path):
        base = task.versions.get(mid)
        if (core.version(mid) or 0) >= core.rounds or (base or 0) > task.round:
            continue  # no delta is awaited: it would be dropped (admission.check_state)
        if core.owns(mid):
            record = core.store.modules[mid]
            held = [
                d.task_id
                for d in (*record.pending.values(), *record.late.values(), *record.ahead.values())
            ]
            if (
                task.task_id not in held
                and task.task_id not in record.applied
                and not record.holds_path(task.path, task.round)
            ):
                missing.append(mid)
            continue
        version = core.version(mid)
        if version is None or base is None:
            missing.append(mid)
        elif version < task.round and task.path not in core.reported_ahead(mid):
            missing.append(mid)  # an ahead task's (overlap): held for the next step
        elif version == task.round and task.path not in core.reported(mid):
            missing.append(mid)
    return missing


def record_done(
    core: CoordinatorBase, task: Task, peer_id: str, tokens: int, losses: list[float]
) -> None:
    scheduler = core.need_scheduler(peer_id)
    core.book.finish(task.path, task.round, peer_id)
    scheduler.finish(task.task_id)
    # Another live task of the path's round (a hedge's copy, or the straggler it copied) can
    # add nothing now: its lease ends, so its peer stops training it at its next heartbeat.
    for other in scheduler.holders(task.path, task.round):
        scheduler.release(other.task_id, other.peer_id)
        core.metrics({"event": "task_dropped", "task": other.task_id, "peer": other.peer_id})
    core.roster.trained(peer_id, tokens)
    core.metrics(
        {
            "event": "delta",
            "task": task.task_id,
            "peer": peer_id,
            "path": task.path,
            "round": task.round,
            "tokens": tokens,
            "step_offset": core.step_offset + task.round * core.inner_steps,
            "train_losses": losses,
        }
    )


def free_paths(core: CoordinatorBase) -> set[int]:
    """The open paths no live lease holds: what an in-process adapter (Flower's ServerApp)
    may plan tasks for; the claim itself still goes through the service."""
    with core.lock:
        if core.scheduler is None:  # an owner leases nothing: no path to plan for
            return set()
        leased = core.scheduler.leased_paths()
        return {p for p in open_paths(core) if p not in leased}
