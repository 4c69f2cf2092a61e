"""Admission of a delta (SubmitDelta): the task and its base, the split into this owner's modules,
shapes, dtypes and codec, finiteness, staleness, duplicates, norms and the optional held-out
check; then the durable write of each module's delta and the acknowledgement. A refusal raises
a counted :class:`~dipaco.errors.RejectedError` with its :class:`~dipaco.protocols.reasons.Reason`
and leaves no trace in the store.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import errno
import logging
import math

import torch

from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.validation import delta_norm
from dipaco.errors import WireError
from dipaco.faults import fault_point
from dipaco.protocols import codecs
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)


def submit(core: CoordinatorBase, req: m.SubmitDelta) -> m.DeltaAck:
    core._seen(req.peer_id)
    task = core._task(req.peer_id, req.task_id, req.ticket)
    path = task.path
    if req.path != path:
        core._reject(
            req.peer_id, Reason.WRONG_PATH, f"task {req.task_id} is for path {path}, not {req.path}"
        )
    if req.tokens <= 0:
        core._reject(
            req.peer_id, Reason.BAD_TOKENS, f"token count must be positive, got {req.tokens}"
        )
    path_mids = core.topology.path_modules(path)
    mids = [mid for mid in path_mids if core.owns(mid)]
    deltas = split_delta(core, req, path_mids, mids)
    for mid in mids:
        if mid in core.handing:
            core._reject(
                req.peer_id, Reason.HANDOVER, f"{mid} is moving to another owner; retry shortly"
            )
    weight = task.weight or (core.shard_tokens[path] if core.shard_tokens else None)
    weight = weight or req.tokens
    plan, already = [], []
    for mid in mids:
        record = core.store.modules[mid]
        base = task.versions.get(mid)
        if base is None or req.base_versions.get(mid) != base:
            core._reject(
                req.peer_id,
                Reason.WRONG_BASE,
                f"delta for {mid} claims base {req.base_versions.get(mid)}, "
                f"the task was issued against {base}",
            )
        if req.task_id in record.applied:
            already.append(mid)  # applied in an earlier step; its ack was lost: ack again
            continue
        if record.version >= core.rounds:
            # The module made its last step without this delta: nothing would apply it, so
            # acknowledging it would be a lie.
            core._reject(
                req.peer_id,
                Reason.FINISHED,
                f"{mid} has made all its {core.rounds} rounds; late deltas are not applied",
            )
        lateness = record.version - base
        if not 0 <= lateness <= core.policy.max_staleness:
            if core.is_scheduler:  # the task can never be applied: free its path
                core.scheduler.release(req.task_id, req.peer_id)
            core._reject(
                req.peer_id,
                Reason.STALE,
                f"delta for {mid} is against version {base}, module is at "
                f"{record.version} (at most {core.policy.max_staleness} late is applied)",
            )
        if path in record.reported.get(base, []):
            core._reject(
                req.peer_id,
                Reason.DUPLICATE,
                f"path {path} already reported for {mid} version {base} (another task)",
            )
        table = record.pending if lateness == 0 else record.late
        if path in table:
            if table[path].task_id == req.task_id:
                already.append(mid)  # a retry of an acknowledged delta: ack it again
                continue
            core._reject(
                req.peer_id,
                Reason.DUPLICATE,
                f"path {path} already reported for {mid} version {base}",
            )
        plan.append((mid, base, lateness))
    norms, trust = check_content(core, req, path, deltas, [mid for mid, _, _ in plan])
    for mid, base, lateness in plan:
        damped = weight * trust * core.policy.stale_damping**lateness
        try:  # a full disk refuses the delta; what was stored is acked on the retry
            core.store.add_delta(
                mid,
                path,
                damped,
                req.task_id,
                req.peer_id,
                deltas[mid],
                base_version=base,
                voter=core.voter_of(req),
            )
        except OSError as exc:
            full = exc.errno == errno.ENOSPC
            core._reject(
                req.peer_id, Reason.DISK_FULL if full else Reason.IO_ERROR, f"{mid}: {exc}"
            )
        if lateness > 0:
            core.metrics(
                {
                    "event": "late_delta",
                    "module": mid,
                    "task": req.task_id,
                    "path": path,
                    "late_by": lateness,
                    "weight": damped,
                }
            )
    for mid, _, _ in plan:  # only now durable: the norm statistics count it
        core.norms.record(mid, norms[mid])
    if plan:
        core.norms.save()
    for mid, base, _ in plan:
        core.metrics(
            {
                "event": "delta_acked",
                "module": mid,
                "base_version": base,
                "path": path,
                "task": req.task_id,
                "peer": req.peer_id,
            }
        )
    fault_point("submit.before_ack")
    covers_path = set(mids) == set(path_mids)
    if plan and covers_path and core.is_scheduler:
        core._task_done(task, req.peer_id, req.tokens, req.losses)
    closed = [mid for mid in mids if core._maybe_step(mid)]
    core._save_state()
    core._after_change()
    return m.DeltaAck(
        accepted=[mid for mid, _, _ in plan] + already,
        closed=closed,
        task_done=covers_path and core.is_scheduler,
    )


def voter_of(core: CoordinatorBase, req: m.SubmitDelta) -> str:
    """Whose vote a delta is in a robust combiner: the key that signed it (a peer id for an
    unsigned local transport). One key holding many paths of a module is one vote."""
    return core._caller or req.peer_id


def split_delta(
    core: CoordinatorBase, req: m.SubmitDelta, path_mids: list[str], mids: list[str]
) -> dict[str, dict[str, torch.Tensor]]:
    wire: dict[str, dict[str, torch.Tensor]] = {mid: {} for mid in mids}
    for key, tensor in req.tensors.items():
        mid, _, name = key.partition("/")
        if mid in path_mids and mid not in wire:
            core._reject(
                req.peer_id,
                Reason.NOT_OWNER,
                f"{mid} is owned by {core.owners.get(mid)!r}, not by {core.owner_id!r}; "
                "ask the scheduler for the current owners",
            )
        if mid not in wire:
            core._reject(
                req.peer_id,
                Reason.UNKNOWN_MODULE,
                f"tensor {key} is for a module outside path {req.path}",
            )
        wire[mid][name] = tensor
    if req.codec not in codecs.CODECS:
        core._reject(req.peer_id, Reason.BAD_CODEC, f"unknown codec {req.codec!r}")
    deltas = {}
    for mid in mids:
        params = core.store.params(mid)
        got = wire[mid]
        if not got:
            core._reject(
                req.peer_id,
                Reason.WRONG_TENSORS,
                f"the delta lacks module {mid} of path {req.path}, which this coordinator owns",
            )
        if req.codec == "lossless":
            if set(got) != set(params):
                missing, extra = sorted(set(params) - set(got)), sorted(set(got) - set(params))
                core._reject(
                    req.peer_id,
                    Reason.WRONG_TENSORS,
                    f"delta for {mid}: missing {missing[:3]}, unexpected {extra[:3]}",
                )
            for name, tensor in got.items():
                ref = params[name]
                if tensor.shape != ref.shape:
                    core._reject(
                        req.peer_id,
                        Reason.WRONG_SHAPE,
                        f"{mid}/{name}: got shape {tuple(tensor.shape)}, "
                        f"expected {tuple(ref.shape)}",
                    )
                if tensor.dtype != ref.dtype:
                    core._reject(
                        req.peer_id,
                        Reason.WRONG_DTYPE,
                        f"{mid}/{name}: got {tensor.dtype}, expected {ref.dtype} "
                        "(lossless deltas carry the module's own dtype)",
                    )
            decoded = got
        else:
            try:
                decoded = codecs.decode(req.codec, got, params)
            except WireError as exc:
                core._reject(req.peer_id, Reason.BAD_ENCODING, f"delta for {mid}: {exc}")
        for name, tensor in decoded.items():
            if not torch.isfinite(tensor).all():
                core._reject(req.peer_id, Reason.NON_FINITE, f"{mid}/{name} contains NaN or inf")
        deltas[mid] = decoded
    return deltas


def check_content(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    path: int,
    deltas: dict[str, dict[str, torch.Tensor]],
    mids: list[str],
) -> tuple[dict[str, float], float]:
    """Judge the deltas about to be stored by their norms (and, optionally, held-out loss).

    Every module is judged before anything is stored or clipped, so a rejection leaves no
    trace but its count (and, with the held-out check, its key's usefulness score). Clipped
    deltas are replaced in ``deltas``. Returns each module's norm as it will be stored, for
    the statistics once the delta is durable, and the factor of the delta's weight (its
    key's trust; 1 without the held-out check).
    """
    judged = {mid: core.norms.judge(mid, delta_norm(deltas[mid])) for mid in mids}
    for mid, j in judged.items():
        if j.action == "reject":
            core._reject(
                req.peer_id,
                Reason.HUGE_NORM,
                f"delta for {mid} has norm {j.norm:.4g}, {j.why}",
            )
    norms = {}
    for mid, j in judged.items():
        norms[mid] = j.norm
        if j.action == "clip" and j.limit is not None:
            factor = j.limit / j.norm
            deltas[mid] = {k: v * factor for k, v in deltas[mid].items()}
            norms[mid] = j.limit
    trust = 1.0
    if core.validation.heldout_check and core.heldout_loss is not None and mids:
        trust = check_heldout(core, req, path, deltas, mids)
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
    return norms, trust


def check_heldout(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    path: int,
    deltas: dict[str, dict[str, torch.Tensor]],
    mids: list[str],
) -> float:
    """Score the delta's usefulness and its key's (validation.KeyScores); refuse or weight it.

    The path is scored as it is now and with the proposed update (current parameters minus
    the delta: for a late delta an approximation, as its base is gone). Needs every module
    of the path: an owner of only some modules skips the check. Returns the delta's weight
    factor, its key's trust.
    """
    assert core.heldout_loss is not None
    path_mids = core.topology.path_modules(path)
    if not all(core.owns(mid) for mid in path_mids):
        return 1.0
    current = {mid: core.store.params(mid) for mid in path_mids}
    proposed = dict(current)
    for mid in mids:
        proposed[mid] = {k: v - deltas[mid][k].to(v.dtype) for k, v in current[mid].items()}
    before = core.heldout_loss(path, current)
    if math.isnan(before):
        return 1.0  # no held-out documents for this path: nothing to judge by
    after = core.heldout_loss(path, proposed)
    key = core.voter_of(req)
    verdict = core.key_scores.judge(key, before, after)
    core.key_scores.save()
    core.metrics(
        {
            "event": "heldout_check",
            "path": path,
            "task": req.task_id,
            "peer": req.peer_id,
            "before": before,
            "after": after,
            "gain": verdict.gain,
            "key_score": verdict.score,
            "trust": verdict.trust,
            "refused": verdict.refuse,
        }
    )
    if verdict.refuse == "worse-heldout":
        core._reject(
            req.peer_id,
            Reason.WORSE_HELDOUT,
            f"path {path}'s held-out loss would go from {before:.4f} to {after:.4f} "
            f"(tolerance {core.validation.heldout_tolerance:g})",
        )
    if verdict.refuse == "low-score":
        core._reject(
            req.peer_id,
            Reason.LOW_SCORE,
            f"this key's deltas have made their paths worse (score {verdict.score:.4f} "
            f"after {verdict.checks} checks, below {-core.validation.heldout_tolerance / 2:g})"
            f"; this one does not improve path {path} ({before:.4f} -> {after:.4f})",
        )
    return verdict.trust
