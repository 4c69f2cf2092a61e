"""The peer's operations on the scheduler and the owners, but the delta: hello, claim a task
(lease, quota and signed ticket), fetch a path's modules (signed releases), heartbeat, release,
fetch a run file; and the task a request acts for, from its ticket or the lease table.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

import torch

from dipaco.coordinator import rounds, tickets
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.leased import lease_task, task_of
from dipaco.coordinator.leases import Lease
from dipaco.coordinator.records import Task
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

FILE_CHUNK = 4 << 20

log = logging.getLogger(__name__)


def hello(core: CoordinatorBase, req: m.Hello) -> m.Welcome:
    asked_clock = bool(req.capabilities.get("clock"))  # a question, not a capability to show
    capabilities = {k: v for k, v in req.capabilities.items() if k != "clock"}
    core.roster.hello(req.peer_id, req.device, capabilities)
    # A peer saying Hello has (re)started: it no longer holds where its paths ended (overlap),
    # so it can train no path ahead, nor resume such a task: its delta would repeat the move of
    # the round before. Those tasks are handed back.
    forgot = core.book.forget_trainer(req.peer_id)
    if core.scheduler is not None:
        for lease in core.scheduler.leases_of(req.peer_id):
            if any(v < lease.round for v in lease.module_versions.values()):
                core.scheduler.release(lease.task_id, req.peer_id)
                core.metrics({"event": "task_dropped", "task": lease.task_id, "peer": req.peer_id})
                forgot = True
    if forgot:  # on disk before the Welcome: a restarted scheduler must not send it ahead again
        core.journal.save()
    return m.Welcome(
        run_id=core.run_id,
        config=core.peer_config,
        signature=auth.sign_payload(core.identity, "manifest", core.peer_config),
        rotations=list(core.keys.rotations),
        clock=(
            {
                "now": time.time(),
                "window": core.security.clock_skew_seconds,
            }  # as the guard reads it
            if asked_clock
            else {}
        ),
        # told only to a peer that says its own: an older peer's decoder lacks the field
        protocol=m.PROTOCOL if "protocol" in req.capabilities else 0,
    )


def claim(core: CoordinatorBase, req: m.ClaimTask) -> m.TaskOffer | m.NoTask:
    scheduler = core.need_scheduler(req.peer_id)
    core.roster.seen(req.peer_id)
    if core.finished:
        return m.NoTask(reason="run finished", retry_after=0.0, finished=True)
    for held in scheduler.leases_of(req.peer_id):
        # A peer back from a restart gets its task again, unless its round has moved on
        # without it: then the task cannot be trained from its base any more; drop it. (An
        # ahead task's modules may move on to its round: overlap.) A task the claim names as
        # held is in hand, not to be trained again (a delta being sent behind: a late one).
        if held.task_id in req.holding:
            continue
        if any(core.version(mid) not in (v, held.round) for mid, v in held.module_versions.items()):
            scheduler.release(held.task_id, req.peer_id)
            core.metrics({"event": "task_dropped", "task": held.task_id, "peer": req.peer_id})
    # A path-parallel peer names the tasks it holds already: it asks for one more.
    fresh = all(lease.task_id in req.holding for lease in scheduler.leases_of(req.peer_id))
    if fresh and core._caller is not None and not core.access.is_owner(core._caller):
        live = sum(len(scheduler.leases_of(p)) for p in core.access.ids_of(core._caller))
        if live >= core.security.max_tasks_per_key:
            core.refusals.refuse(
                req.peer_id,
                Reason.QUOTA,
                f"this key already holds {live} live tasks "
                f"(at most {core.security.max_tasks_per_key})",
            )
    lease = lease_open_or_ahead(core, req)
    if lease is None and req.wait > 0 and not req.holding:
        lease = wait_for_work(core, req)
    if core.finished:
        return m.NoTask(reason="run finished", retry_after=0.0, finished=True)
    if lease is None:
        return m.NoTask(
            reason="every open path is leased or waiting for its modules",
            retry_after=core.polls.retry_after(core._caller or req.peer_id),
            finished=False,
        )
    core.polls.served(core._caller or req.peer_id)
    if fresh:
        if not lease.hedge_of:  # a copy keeps the base of the task it copies
            lease.module_versions = base_versions(core, lease.path)
        # The lease must be on disk before the offer goes out, so that a peer never trains a
        # task a restarted coordinator does not know: marked here, written (group commit,
        # durable.py) before the reply leaves the service; written now outside a request.
        core.journal.save()
        core.metrics(
            {
                "event": "task_issued",
                "task": lease.task_id,
                "peer": req.peer_id,
                "path": lease.path,
                "round": lease.round,
                "steps": lease.steps,
                "phase": core.phases.of(lease.round),
            }
        )
    core.roster.given(req.peer_id, lease.task_id)
    step_offset = core.step_offset + lease.round * core.inner_steps
    phase = core.phases.ready[core.phases.of(lease.round)]
    task = lease_task(core, lease, core._caller)
    return m.TaskOffer(
        task_id=lease.task_id,
        path=lease.path,
        round=lease.round,
        module_versions=lease.module_versions,
        inner_steps=lease.steps,
        step_offset=step_offset,
        total_steps=core.total_steps,
        lease_seconds=scheduler.lease_seconds,
        seed=core.seed,
        ticket=tickets.sign_ticket(core.identity, task.ticket_payload()),
        owners={mid: core.owners[mid] for mid in lease.module_versions},
        codec=core.codec,
        shard=phase.shard(lease.path),
        shard_files=phase.shard_files(lease.path),
        score_first=task.scored,
    )


def fetch(core: CoordinatorBase, req: m.FetchModules) -> m.Modules:
    """The task's modules this coordinator owns. If one of them has moved past the task's base,
    the peer gives the task up on the versions alone (peer/modules.fetch_modules: a version
    other than the base, unless newer but no later than the task's round): the reply carries
    the versions and no tensors, which the peer would download for nothing."""
    core.roster.seen(req.peer_id)
    task = task_of(core, req.peer_id, req.task_id, req.ticket)
    mids = [mid for mid in core.topology.path_modules(task.path) if core.owns(mid)]
    return _releases(core, mids, req.have, tensors=not moved_past(core, task, mids))


def moved_past(core: CoordinatorBase, task: Task, mids: Iterable[str]) -> bool:
    """Whether a module of ``mids`` is at a version the peer cannot train ``task`` from."""
    for mid in mids:
        want, now = task.versions.get(mid), core.store.modules[mid].version
        if want is not None and m.trains_from(want, task.round, now) is None:
            return True
    return False


def fetch_releases(core: CoordinatorBase, req: m.FetchReleases) -> m.Modules:
    """Every named module this coordinator owns, at its latest version, signed as a release;
    modules it does not own are left out (the caller asks their owners)."""
    unknown = sorted(set(req.modules) - set(core.topology.module_ids()))
    if unknown:
        core.refusals.refuse(
            req.peer_id, Reason.BAD_MESSAGE, f"this run has no modules {unknown[:8]}"
        )
    return _releases(core, dict.fromkeys(req.modules), {})


def _releases(
    core: CoordinatorBase, mids: Iterable[str], have: Mapping[str, int], tensors: bool = True
) -> m.Modules:
    """The modules ``mids`` that this coordinator owns, at their latest versions, signed; the
    tensors of those whose version is not the one the caller ``have``s (none without
    ``tensors``)."""
    versions, hashes, sent, signatures = {}, {}, {}, {}
    for mid in mids:
        if not core.owns(mid):
            continue
        record = core.store.modules[mid]
        versions[mid], hashes[mid] = record.version, record.hash
        signatures[mid] = release_signature(core, mid, record.version, record.hash)
        if tensors and have.get(mid) != record.version:
            sent.update({f"{mid}/{k}": v for k, v in record.params.items()})
    return m.Modules(versions=versions, hashes=hashes, tensors=sent, signatures=signatures)


def release_signature(core: CoordinatorBase, mid: str, version: int, digest: str) -> str:
    """This owner's signature of a module release, which peers check before training."""
    release = auth.release_payload(core.run_id, mid, version, digest)
    return auth.sign_payload(core.identity, "release", release)


def heartbeat(core: CoordinatorBase, req: m.Heartbeat) -> m.HeartbeatAck:
    core.need_scheduler(req.peer_id)
    core.roster.heartbeat(req.peer_id, req.step)
    if req.task_id is None:
        return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
    lease = core.need_scheduler(req.peer_id).heartbeat(req.task_id, req.peer_id, req.step)
    if lease is None:
        return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
    return m.HeartbeatAck(lease_ok=True, deadline_in=lease.deadline - core.clock())


def release(core: CoordinatorBase, req: m.ReleaseTask) -> m.Ok:
    scheduler = core.need_scheduler(req.peer_id)
    core.roster.seen(req.peer_id)
    if scheduler.release(req.task_id, req.peer_id):
        core.metrics({"event": "task_released", "task": req.task_id, "peer": req.peer_id})
        core.journal.save()  # the ticket is void, and stays so after a restart
        core._work_changed()  # its path is free: a waiting claim may take it
    return m.Ok()


def fetch_file(core: CoordinatorBase, req: m.FetchFile) -> m.FileChunk:
    core.roster.seen(req.peer_id)
    path = core.files.get(req.name)
    if path is None:
        core.refusals.refuse(
            req.peer_id, Reason.UNKNOWN_FILE, f"{req.name!r} is not one of the run's files"
        )
    size = path.stat().st_size
    if req.offset < 0 or req.offset > size or not 0 < req.length <= FILE_CHUNK:
        core.refusals.refuse(
            req.peer_id,
            Reason.BAD_RANGE,
            f"{req.name}: range {req.offset}+{req.length} outside 0..{size} "
            f"(chunks of at most {FILE_CHUNK} bytes)",
        )
    with open(path, "rb") as f:
        f.seek(req.offset)
        data = f.read(req.length)
    return m.FileChunk(
        name=req.name,
        size=size,
        sha256=core.peer_config.get("files", {}).get(req.name, {}).get("sha256", ""),
        offset=req.offset,
        tensors={"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
        if data
        else {"data": torch.zeros(0, dtype=torch.uint8)},
    )


def lease_open_or_ahead(core: CoordinatorBase, req: m.ClaimTask) -> Lease | None:
    """Lease an open path; with overlap, else the next round of a path the peer trained
    (rounds.ahead_paths) rather than wait for this round to close; with hedging, else a copy
    of a straggler's task (Scheduler.hedge). None if none of these."""
    scheduler = core.need_scheduler(req.peer_id)
    open_paths = rounds.open_paths(core)
    lease = scheduler.claim(
        req.peer_id,
        open_paths,
        req.prefer_path,
        core.inner_steps,
        req.holding,
        lambda p: core.book.trainer(p, open_paths[p] - 1),
    )
    if lease is None and core.policy.overlap:
        lease = scheduler.claim(
            req.peer_id,
            rounds.ahead_paths(core, req.peer_id),
            req.prefer_path,
            core.inner_steps,
            req.holding,
        )
    if lease is None and hedging(core) and not req.holding:
        lease = scheduler.hedge(req.peer_id, core.book.done, lambda x: moved_on(core, x))
        if lease is not None:
            core.metrics(
                {
                    "event": "task_hedged",
                    "task": lease.task_id,
                    "copies": lease.hedge_of,
                    "peer": req.peer_id,
                }
            )
    return lease


def moved_on(core: CoordinatorBase, lease: Lease) -> bool:
    """Whether a module of ``lease``'s path moved past the base a copy would train from."""
    return any(
        m.trains_from(v, lease.round, core.version(mid) or 0) is None
        for mid, v in lease.module_versions.items()
    )


def hedging(core: CoordinatorBase) -> bool:
    """Whether an idle peer may copy a straggler's task now (``scheduler.hedge``): always with
    true; with "last", once the run's last round is the one open (no path can be trained ahead
    of it, and the run's end waits for its slowest task)."""
    hedge = core.policy.hedge
    return hedge is True or (hedge == "last" and core.round >= core.rounds - 1)


def base_versions(core: CoordinatorBase, path: int) -> dict[str, int]:
    """The versions of ``path``'s modules now: the base a fresh task of it trains from. Each
    is known: a path is offered, open or ahead, only when all its modules' versions are
    (rounds.path_rounds); RuntimeError names the module otherwise."""
    versions = {}
    for mid in core.topology.path_modules(path):
        version = core.version(mid)
        if version is None:
            raise RuntimeError(f"path {path} was leased while module {mid}'s version is unknown")
        versions[mid] = version
    return versions


def wait_for_work(core: CoordinatorBase, req: m.ClaimTask) -> Lease | None:
    """A long poll: wait, without the lock, for a path to open (an outer step, a report, a
    lease ended: every change wakes one, polls.LongPolls.changed), up to ``req.wait`` seconds
    (at most polls.LONG_POLL_SECONDS), and lease it. Only ``core.polls.slots`` - 1 claims wait at once
    (a hivemind server's handler threads are few; the last slot is kept for TaskDone's long
    poll, rounds.await_reports); the others get their NoTask at once.

    A change wakes one waiting claim; one that leases a path wakes the next (a round's close
    opens many paths, an admitted delta most often none). Every waiting claim also looks
    again every polls.LOOK_AGAIN_SECONDS, so a claim woken for a path it may not take (another
    peer's preference) delays the others by at most that."""
    with core.polls.slot(keep=1) as waiting:
        if not waiting:
            return None
        return core.polls.wait_for_change(
            req.wait, lambda: core.finished, lambda: lease_open_or_ahead(core, req)
        )


def keep_alive(core: CoordinatorBase, held: list[tuple[str, str]]) -> None:
    """Renew the leases of ``(task id, peer id)`` pairs, as their peers' heartbeats would: for an
    in-process adapter that waits for its nodes' replies (Flower's ServerApp)."""
    with core.lock:
        if core.scheduler is None:  # an owner holds no leases to renew
            return
        for task_id, peer_id in held:
            core.scheduler.heartbeat(task_id, peer_id)


def run_file(core: CoordinatorBase, name: str) -> bytes | None:
    """The bytes of one of the run's files (tokenizer, shards) by its manifest name; None if the
    run has no such file."""
    path = core.files.get(name)
    return None if path is None else path.read_bytes()
