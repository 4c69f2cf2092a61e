"""Admission of a delta (SubmitDelta): the task and its base, the split into this owner's modules,
shapes, dtypes and codec, finiteness, staleness, duplicates, norms and the optional held-out
check; then the durable write of each module's delta and the acknowledgement. A refusal raises
a counted :class:`~dipaco.errors.RejectedError` with its :class:`~dipaco.protocols.reasons.Reason`
and leaves no trace in the store.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dipaco.coordinator import heldout, rounds, verdicts
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.copies import Sketches
from dipaco.coordinator.gate import RequestSlot
from dipaco.coordinator.leased import task_of
from dipaco.coordinator.records import Task
from dipaco.coordinator.store import delta_meta
from dipaco.coordinator.validation import delta_norm, nonfinite
from dipaco.errors import RejectedError, WireError
from dipaco.faults import fault_point
from dipaco.fileio import fsync_path
from dipaco.protocols import codecs
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import JUDGED, Reason

log = logging.getLogger(__name__)


class Slot(NamedTuple):
    """Where a delta goes in one module: its base version, how many versions stale it will be
    at the step it joins (its weight is damped per version), the module's version when this was
    planned, and the round it reports for (its task's)."""

    mid: str
    base: int
    stale: int
    seen: int
    round: int


@dataclass
class Plan:
    """A delta's admission planned under the lock: the modules to store it for (:class:`Slot`),
    those that already hold it, and the reservations (``core.steps``) that keep another
    delta of the path out meanwhile."""

    store: list[Slot] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # modules the delta is not for
    keys: list[tuple[str, int, int]] = field(default_factory=list)


def submit(core: CoordinatorBase, req: m.SubmitDelta) -> m.DeltaAck:
    """Admit a delta. Only the state transitions take the coordinator's lock: decoding, the
    content checks and the durable write run outside it, many requests at once (the promise of
    docs/design.md holds: a delta is durable before it is acknowledged, and never applied twice)."""
    with core.lock:
        core.roster.seen(req.peer_id)
        task = task_of(core, req.peer_id, req.task_id, req.ticket)
        path = task.path
        if req.path != path:
            core.refusals.refuse(
                req.peer_id,
                Reason.WRONG_PATH,
                f"task {req.task_id} is for path {path}, not {req.path}",
            )
        if req.tokens <= 0:
            core.refusals.refuse(
                req.peer_id, Reason.BAD_TOKENS, f"token count must be positive, got {req.tokens}"
            )
        path_mids = core.topology.path_modules(path)
        mids = [mid for mid in path_mids if core.owns(mid)]
    slot = core.gate.slot()  # held since the request was decoded (service.py)
    try:
        plan = admit(core, req, task, path_mids, mids, slot)
    finally:
        slot.give()  # the outer steps below may wait for one another: never in a slot
    fault_point("submit.before_ack")
    covers_path = set(mids) == set(path_mids)
    stored = [s.mid for s in plan.store]
    with core.lock:
        if stored and covers_path and core.is_scheduler:
            rounds.record_done(core, task, req.peer_id, req.tokens, req.losses)
    closed = [mid for mid in mids if rounds.maybe_step(core, mid)]  # outside the lock
    with core.lock:
        core.journal.save()
        rounds.after_change(core)
    return m.DeltaAck(
        accepted=stored + plan.already,
        closed=closed,
        task_done=covers_path and core.is_scheduler,
        dropped=plan.dropped,
    )


def admit(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    task: Task,
    path_mids: list[str],
    mids: list[str],
    slot: RequestSlot,
) -> Plan:
    """Decode, check, reserve and durably store the delta; its plan once committed."""
    slot.take()
    scored = heldout.scored_verdict(core, req, task, mids)  # None: not scored first
    deltas, measured = split_delta(core, req, path_mids, mids)  # decoding, norms: no lock
    weight = delta_weight(core, task, req.tokens)
    checked: dict[tuple[str, ...], Checked] = {}  # judged once; a retry reuses the verdicts
    for _attempt in range(8):
        with core.lock:
            plan = reserve(core, req, task, mids)
        try:
            if write(core, req, plan, deltas, measured, checked, weight, slot, scored):
                return plan
        finally:
            with core.lock:
                core.steps.release(plan.keys)
    # the modules stepped under this delta eight times: the run is racing ahead of it
    core.refusals.refuse(req.peer_id, Reason.STALE, f"the modules of path {task.path} keep moving")


class Checked(NamedTuple):
    """A delta's modules as judged (clipped where the norm check clips), their norms as they
    will be stored, and the factor of its weight (its key's trust)."""

    deltas: dict[str, dict[str, torch.Tensor]]
    norms: dict[str, float]
    trust: float
    sketches: Sketches  # copies.py's, kept once the delta is stored


def reserve(core: CoordinatorBase, req: m.SubmitDelta, task, mids: list[str]) -> Plan:
    """Check the delta against the modules' state and reserve its (module, base, path) slots.

    Under the lock. A retry of a delta that is being admitted right now waits for that one's
    outcome (then it is acknowledged as already held, or admitted afresh); a delta of the same
    path from another task is a duplicate.
    """
    while True:
        plan = check_state(core, req, task, mids)
        held = core.steps.holders(plan.keys)
        if not held:
            break
        taken = list(held)
        if any(task_id != req.task_id for task_id in held.values()):
            core.refusals.refuse(
                req.peer_id,
                Reason.DUPLICATE,
                f"path {task.path} is being reported for {taken[0][0]} version {taken[0][1]} "
                "by another task",
            )
        core.steps.wait(timeout=1.0)
    core.steps.reserve(plan.keys, req.task_id)
    return plan


def check_state(core: CoordinatorBase, req: m.SubmitDelta, task, mids: list[str]) -> Plan:
    path, plan = task.path, Plan()
    for mid in mids:
        if mid in core.handing:
            core.refusals.refuse(
                req.peer_id, Reason.HANDOVER, f"{mid} is moving to another owner; retry shortly"
            )
    for mid in mids:
        record = core.store.modules[mid]
        issued, base = task.versions.get(mid), req.base_versions.get(mid)
        # The task's base; or, for an ahead task (overlap) whose module reached the task's
        # round before the peer fetched it, that newer version (messages.trains_from).
        newer = type(base) is int and issued is not None and issued < base <= task.round
        if (
            issued is None
            or type(base) is not int
            or m.trains_from(issued, task.round, base) is None
            or base > record.version
        ):
            core.refusals.refuse(
                req.peer_id,
                Reason.WRONG_BASE,
                f"delta for {mid} claims base {base}, the task was issued against {issued}"
                + (f" (the module is at {record.version})" if newer else ""),
            )
        if req.task_id in record.applied:
            plan.already.append(mid)  # applied in an earlier step; its ack was lost: ack again
            continue
        if record.version >= core.rounds or base > task.round:
            # The module made its last step without this delta, or closed the task's round
            # without its path before the task was issued (the path was offered again for its
            # other modules: rounds.open_paths). Nothing would apply the delta, so it is
            # dropped, and the ack says so (acknowledging it would be a lie); the path's other
            # modules, which wait for it, admit theirs.
            plan.dropped.append(mid)
            continue
        # Late (the module stepped past the task's round), on time, or ahead (-1: an overlap
        # task's delta, for the step after the module's next).
        rnd = task.round
        lateness = record.version - rnd
        if lateness > core.policy.max_staleness:
            if core.scheduler is not None:  # the task can never be applied: free its path
                core.scheduler.release(req.task_id, req.peer_id)
            core.refusals.refuse(
                req.peer_id,
                Reason.STALE,
                f"delta for {mid} is against version {base}, module is at "
                f"{record.version} (at most {core.policy.max_staleness} late is applied)",
            )
        table = record.table_for(rnd)
        if path in table and table[path].task_id == req.task_id:
            plan.already.append(mid)  # a retry of an acknowledged delta: ack it again
            continue
        if record.holds_path(path, rnd):
            # An earlier task of the path reported this round here (applied, or held for the
            # step), and its lease ended before every owner had its delta: the path was offered
            # again for the modules that lack it. This module keeps the first; the new one is
            # dropped, and the ack says so, so that the other owners' modules can take theirs.
            # Two deltas of one path never join one step.
            plan.dropped.append(mid)
            continue
        stale = max(record.version, rnd) - base  # versions behind the step it joins
        plan.store.append(Slot(mid, base, stale, record.version, rnd))
        plan.keys.append((mid, rnd, path))
    finished = [mid for mid in plan.dropped if core.store.modules[mid].version >= core.rounds]
    if finished and not plan.store and not plan.already:
        core.refusals.refuse(
            req.peer_id,
            Reason.FINISHED,
            f"{finished[0]} has made all its {core.rounds} rounds; late deltas are not applied",
        )
    return plan


def write(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    plan: Plan,
    deltas: dict[str, dict[str, torch.Tensor]],
    measured: dict[str, float],
    checked: dict[tuple[str, ...], Checked],
    weight: float,
    slot: RequestSlot,
    scored: verdicts.ScoredVerdict | None = None,
) -> bool:
    """Judge the planned deltas (once: ``checked`` keeps the verdicts for a retry), write them
    durably (outside the lock, in the request's ``slot``), then commit them (under the lock, the
    slot given back: the commit may wait for a module's step). False, with nothing committed, if
    a module stepped meanwhile: the caller plans again, for the delta is now late."""
    staged, folders = {}, set()
    try:
        slot.take()
        mids = tuple(s.mid for s in plan.store)
        if mids not in checked:
            judged = dict(deltas)  # check_content replaces a clipped module's delta here
            rnd = plan.store[0].round if plan.store else None  # the task's, every slot's
            try:
                checked[mids] = Checked(
                    judged,
                    *check_content(core, req, req.path, judged, list(mids), measured, scored, rnd),
                )
            except RejectedError as exc:
                if exc.reason in JUDGED and rnd is not None:
                    judged_out(core, req, rnd, exc.reason)
                raise
        deltas, norms, trust, sketches = checked[mids]
        for mid, base, stale, _, rnd in plan.store:
            damped = weight * trust * core.policy.stale_damping**stale
            meta = delta_meta(
                req.path,
                damped,
                req.task_id,
                req.peer_id,
                base,
                core.voter_of(req),
                rnd,
                scored=scored is not None,
            )
            staged[mid] = (core.store.stage_delta(mid, req.task_id, meta, deltas[mid]), meta)
        slot.give()
        with core.lock:
            while core.steps.any_stepping(staged):
                core.steps.wait(timeout=1.0)
            if any(core.store.version(s.mid) != s.seen for s in plan.store):
                return False
            folders = {
                core.store.commit_delta(mid, *staged.pop(mid), deltas[mid]) for mid in list(staged)
            }
            for s in plan.store:  # only now durable: the norms count it
                core.norms.record(s.mid, norms[s.mid], s.round)
            core.copies.keep(req.task_id, req.peer_id, {m: sketches.get(m) for m in mids})
            if plan.store:
                core.journal.norms.save()
    except OSError as exc:  # a full disk refuses the delta; what was stored is acked on the retry
        full = exc.errno == errno.ENOSPC
        core.refusals.refuse(req.peer_id, Reason.DISK_FULL if full else Reason.IO_ERROR, str(exc))
    finally:
        for file, _ in staged.values():  # not committed: never acknowledged, never applied
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)
    for folder in folders:
        fsync_path(folder)
    if folders:
        fault_point("submit.committed")  # durable, not yet acknowledged
    for mid, base, stale, seen, rnd in plan.store:
        damped = weight * trust * core.policy.stale_damping**stale
        if seen > rnd:
            core.metrics(
                {
                    "event": "late_delta",
                    "module": mid,
                    "task": req.task_id,
                    "path": req.path,
                    "late_by": stale,
                    "weight": damped,
                }
            )
        core.metrics(
            {
                "event": "delta_acked",
                "module": mid,
                "base_version": base,
                "path": req.path,
                "task": req.task_id,
                "peer": req.peer_id,
                "tokens": req.tokens,
                "weight": damped,
                **({"round": rnd} if rnd != base else {}),
            }
        )
    return True


def delta_weight(core: CoordinatorBase, task: Task, tokens: int) -> float:
    """The delta's outer-step weight before trust and staleness: its task's (the path's shard
    tokens, times the share of H the task was given), else the shard's, else the tokens; scaled
    down when the peer reports fewer tokens than the task's steps train, never up (a delta
    weighs what was trained, and a peer cannot buy weight by claiming more)."""
    weight = task.weight or (core.shard_tokens[task.path] if core.shard_tokens else None)
    if task.tokens is None:
        return weight or float(tokens)
    trained = min(tokens, task.tokens)
    return weight * trained / task.tokens if weight else float(trained)


def split_delta(
    core: CoordinatorBase,
    req: m.SubmitDelta | m.ScoreDelta,
    path_mids: list[str],
    mids: list[str],
    params: Callable[[str], dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
    """This owner's modules of the delta, decoded and checked (names, shapes, dtypes, codec,
    finiteness), and each module's norm (validation.delta_norm: measured once, here; the norm
    is not finite exactly when a value is not). ``params``: each module's parameters to decode
    against (the store's; the scorer's include other owners' modules)."""
    params_of = params or core.store.params
    wire: dict[str, dict[str, torch.Tensor]] = {mid: {} for mid in mids}
    for key, tensor in req.tensors.items():
        mid, _, name = key.partition("/")
        if mid in path_mids and mid not in wire:
            core.refusals.refuse(
                req.peer_id,
                Reason.NOT_OWNER,
                f"{mid} is owned by {core.owners.get(mid)!r}, not by {core.owner_id!r}; "
                "ask the scheduler for the current owners",
            )
        if mid not in wire:
            core.refusals.refuse(
                req.peer_id,
                Reason.UNKNOWN_MODULE,
                f"tensor {key} is for a module outside path {req.path}",
            )
        wire[mid][name] = tensor
    if req.codec not in codecs.CODECS:
        core.refusals.refuse(req.peer_id, Reason.BAD_CODEC, f"unknown codec {req.codec!r}")
    deltas, norms = {}, {}
    for mid in mids:
        ref_params = params_of(mid)
        got = wire[mid]
        if not got:
            core.refusals.refuse(
                req.peer_id,
                Reason.WRONG_TENSORS,
                f"the delta lacks module {mid} of path {req.path}, which this coordinator owns",
            )
        if req.codec == "lossless":
            if set(got) != set(ref_params):
                missing = sorted(set(ref_params) - set(got))
                extra = sorted(set(got) - set(ref_params))
                core.refusals.refuse(
                    req.peer_id,
                    Reason.WRONG_TENSORS,
                    f"delta for {mid}: missing {missing[:3]}, unexpected {extra[:3]}",
                )
            for name, tensor in got.items():
                ref = ref_params[name]
                if tensor.shape != ref.shape:
                    core.refusals.refuse(
                        req.peer_id,
                        Reason.WRONG_SHAPE,
                        f"{mid}/{name}: got shape {tuple(tensor.shape)}, "
                        f"expected {tuple(ref.shape)}",
                    )
                if tensor.dtype != ref.dtype:
                    core.refusals.refuse(
                        req.peer_id,
                        Reason.WRONG_DTYPE,
                        f"{mid}/{name}: got {tensor.dtype}, expected {ref.dtype} "
                        "(lossless deltas carry the module's own dtype)",
                    )
            decoded = got
        else:
            try:
                decoded = codecs.decode(req.codec, got, ref_params)
            except WireError as exc:
                core.refusals.refuse(req.peer_id, Reason.BAD_ENCODING, f"delta for {mid}: {exc}")
        norms[mid] = delta_norm(decoded)  # the module at once, in NumPy
        if not math.isfinite(norms[mid]):
            bad = nonfinite(decoded) or "a tensor"
            core.refusals.refuse(req.peer_id, Reason.NON_FINITE, f"{mid}/{bad} contains NaN or inf")
        deltas[mid] = decoded
    return deltas, norms


def judged_out(core: CoordinatorBase, req: m.SubmitDelta, rnd: int, reason: str) -> None:
    """Count a refusal of the task's delta for what it held against its path's round; skip the
    round (RoundBook.judged) once enough of its tasks were refused so."""
    with core.lock:
        if core.book.judged(req.path, rnd, req.task_id):
            log.warning(
                "path %d's round %d is skipped: the deltas of its last tasks were all refused "
                "(%s); its modules close without it",
                req.path,
                rnd,
                reason,
            )
            core.metrics({"event": "path_judged_out", "path": req.path, "round": rnd})
            core._work_changed()


def check_content(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    path: int,
    deltas: dict[str, dict[str, torch.Tensor]],
    mids: list[str],
    measured: dict[str, float],
    scored: verdicts.ScoredVerdict | None = None,
    rnd: int | None = None,
) -> tuple[dict[str, float], float, Sketches]:
    """Judge the deltas about to be stored by their norms (and, optionally, held-out loss):
    against the norms of deltas trained for round ``rnd`` (their task's) and before it.

    Every module is judged before anything is stored or clipped, so a rejection leaves no
    trace but its count (and, with the held-out check, its key's usefulness score). Clipped
    deltas are replaced in ``deltas``. Returns each module's norm as it will be stored, for
    the statistics once the delta is durable, the factor of the delta's weight (its key's
    trust; 1 without the held-out check), and its sketches (copies.py), kept once stored.
    With the scheduler's verdict (``scored``: the path's delta was scored whole, scoring.py),
    its weight factor is the verdict's, and a copy is let through where the verdict says the
    run was diverging.
    """
    with core.lock:  # the norms were measured once, in split_delta
        judged = {mid: core.norms.judge(mid, measured[mid], rnd) for mid in mids}
    for mid, j in judged.items():
        if j.action == "reject":
            core.refusals.refuse(
                req.peer_id,
                Reason.HUGE_NORM,
                f"delta for {mid} has norm {j.norm:.4g}, {j.why}",
            )
    copied, sketches = core.copies.judge(req.task_id, {mid: deltas[mid] for mid in mids})
    if copied is not None:
        heldout.let_through(core, req, path, copied, scored.diverging if scored else None)
    norms = {}
    for mid, j in judged.items():
        norms[mid] = j.norm
        if j.action == "clip" and j.limit is not None:
            factor = j.limit / j.norm
            deltas[mid] = {k: v * factor for k, v in deltas[mid].items()}
            norms[mid] = j.limit
    trust = 1.0
    if scored is not None:
        trust = scored.trust
    elif core.heldout_loss is not None and mids:
        trust = heldout.check_heldout(core, req, path, deltas, mids)
    for mid, j in judged.items():
        if j.action == "clip":
            core.metrics(
                {
                    "event": "delta_clipped",
                    "stage": "norm-check",
                    "module": mid,
                    "path": path,
                    "task": req.task_id,
                    "peer": req.peer_id,
                    "norm": j.norm,
                    "clipped_to": j.limit,
                }
            )
    return norms, trust, sketches
