"""Judging a delta by what it does to its path's held-out loss (validation.heldout_check):
scoring the path before and after it (``check_heldout``), the copies let through in a diverging
run (``let_through``), and, for a path whose modules several owners hold, the scheduler's
verdict each owner admits its share with (``scored_verdict``; the scoring itself is
scoring.py's).

Functions of the coordinator, called by admission.py and scoring.py.
"""

from __future__ import annotations

import math

import torch

from dipaco.coordinator import tickets, verdicts
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.copies import Copied
from dipaco.coordinator.records import Task
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason


def scores_first(core: CoordinatorBase, path: int) -> bool:
    """Whether this scheduler scores ``path``'s deltas whole before their owners take them
    (scoring.py): it scores deltas (the held-out check is on, with documents) and does not
    own every module of the path, so no single owner could."""
    return (
        core.heldout_loss is not None
        and core.is_scheduler
        and not all(core.owns(mid) for mid in core.topology.path_modules(path))
    )


def scored_verdict(
    core: CoordinatorBase, req: m.SubmitDelta, task: Task, mids: list[str]
) -> verdicts.ScoredVerdict | None:
    """The scheduler's verdict on the delta, where the task's ticket says its path is scored
    whole before its owners take it (``Task.scored``); refused (``unscored``) without a verdict
    that the scheduler signed for this run, task, path and key over these very tensors. None
    for a task whose deltas each owner judges alone."""
    if not task.scored:
        return None
    with core.lock:
        signed = core.keys.read(req.verdict, tickets.VERDICT) if req.verdict else None
        key = core.voter_of(req)
    got = verdicts.check(signed, core.run_id, task.task_id, task.path, key, req.tensors, mids)
    if isinstance(got, str):
        core.refusals.refuse(
            req.peer_id,
            Reason.UNSCORED,
            f"task {task.task_id}'s path is scored whole by the scheduler first (ScoreDelta), "
            f"and {got}",
        )
    assert not isinstance(got, str)  # refuse raises
    return got


def path_params(core: CoordinatorBase, path: int) -> dict[str, dict[str, torch.Tensor]] | None:
    """Every module of the path as it is now, to score it with; None where this coordinator
    does not own them all. Read under the lock; they stay valid outside it while held (the
    store does not reuse their buffers for a later step: store.spare_buffers)."""
    path_mids = core.topology.path_modules(path)
    with core.lock:
        if not all(core.owns(mid) for mid in path_mids):
            return None
        return {mid: core.store.params(mid) for mid in path_mids}


def let_through(
    core: CoordinatorBase,
    req: m.SubmitDelta,
    path: int,
    copied: Copied,
    diverging: bool | None = None,
) -> None:
    """A copy of an earlier delta is refused (``copied``), unless the held-out check says the
    run is diverging (half its paths or more, this one scored now, worse than where they
    started), when honest deltas copy one another: then it goes on to be judged as any other,
    with a ``copy_let_through`` event. The path is scored here, before the refusal: the deltas
    of a round that diverged copy each other from its second delta on, before their own paths
    were scored again; each copy refused meanwhile scores one more path. ``diverging``: what
    the scheduler's verdict said (a path scored whole elsewhere), instead of scoring it here."""
    if diverging is None and core.heldout_loss is not None:
        current = path_params(core, path)
        if current is not None:  # the path as it is now, scored (as check_heldout's "before")
            before = core.heldout_loss(path, current)
            del current
            with core.lock:
                core.key_scores.scored(path, before)
                diverging = core.key_scores.diverging()
    if not diverging:
        core.refusals.refuse(
            req.peer_id,
            Reason.COPIED,
            f"delta for {copied.module} copies task {copied.task}'s (cosine {copied.cosine:.4f} "
            "on a sample of its coordinates)",
        )
    core.metrics(
        {
            "event": "copy_let_through",
            "why": "diverging",
            "module": copied.module,
            "path": path,
            "task": req.task_id,
            "peer": req.peer_id,
            "copies": copied.task,
            "cosine": copied.cosine,
        }
    )


def check_heldout(
    core: CoordinatorBase,
    req: m.SubmitDelta | m.ScoreDelta,
    path: int,
    deltas: dict[str, dict[str, torch.Tensor]],
    mids: list[str],
    current: dict[str, dict[str, torch.Tensor]] | None = None,
) -> float:
    """Score the delta's usefulness and its key's (keyscores.KeyScores); refuse or weight it.

    The path is scored as it is now and with the proposed update (current parameters minus
    the delta: for a late delta an approximation, as its base is gone). Needs every module
    of the path (``current``: the scorer's, scoring.py; else this owner's, if it owns them
    all). Returns the delta's weight factor, its key's trust.

    A late delta (a module of the path has moved on since its base) that would make the path
    worse is refused all the same (applied, it would), but not held against its key: that
    says as much about the peer's speed as its delta. It counts toward neither the key's score
    nor its ban budget (``security.ban_after``), so a slow honest peer is not cut off.

    The two evaluations (forward passes over the held-out documents) run outside the
    coordinator's lock, which every other request needs. The parameters read under it stay
    valid meanwhile: while this holds them, the store does not reuse their buffers for a later
    step (store.spare_buffers). Only the key's score, shared state, is judged under the lock.
    """
    assert core.heldout_loss is not None
    current = current if current is not None else path_params(core, path)
    if current is None:
        return 1.0
    proposed = dict(current)
    for mid in mids:
        proposed[mid] = {k: v - deltas[mid][k].to(v.dtype) for k, v in current[mid].items()}
    before = core.heldout_loss(path, current)
    if math.isnan(before):
        return 1.0  # no held-out documents for this path: nothing to judge by
    after = core.heldout_loss(path, proposed)
    foreign = math.nan  # its gain on other paths' documents (foreign_loss), where measured
    if core.foreign_loss is not None:
        foreign = core.foreign_loss(path, current) - core.foreign_loss(path, proposed)
    del current, proposed  # the store may reuse those buffers again
    with core.lock:  # the key's score is shared state
        trained_in = min(req.base_versions.values(), default=0)
        late = any((core.version(mid) or 0) > base for mid, base in req.base_versions.items())
        verdict = core.key_scores.judge(
            core.voter_of(req), before, after, trained_in, path, foreign, late
        )
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
                "foreign_gain": foreign,
                "key_score": verdict.score,
                "relative": verdict.relative,
                "useful": verdict.useful,
                "trust": verdict.trust,
                "refused": verdict.refuse,
                "late": late,
            }
        )
    if verdict.refuse == "worse-heldout":
        core.refusals.refuse(
            req.peer_id,
            Reason.WORSE_HELDOUT,
            f"path {path}'s held-out loss would go from {before:.4f} to {after:.4f} "
            f"(tolerance {core.validation.heldout_tolerance:g})"
            + (": the delta is late, its base gone (not held against this key)" if late else ""),
            blame=not late,
        )
    if verdict.refuse == "useless":
        core.refusals.refuse(
            req.peer_id,
            Reason.LOW_SCORE,
            f"this key's deltas help their paths next to nothing: this one takes path {path} "
            f"from {before:.4f} to {after:.4f}, {verdict.relative or 0.0:.3f} of what other "
            "keys' deltas typically gain",
        )
    if verdict.refuse == "off-shard":
        core.refusals.refuse(
            req.peer_id,
            Reason.LOW_SCORE,
            f"this key's deltas help other paths' documents more than their own: this one "
            f"gains {verdict.gain:.4f} on path {path}'s held-out documents and {foreign:.4f} on "
            "other paths' (trained on another shard?)",
        )
    if verdict.refuse == "low-score":
        core.refusals.refuse(
            req.peer_id,
            Reason.LOW_SCORE,
            f"this key's deltas have made their paths worse (score {verdict.score:.4f} "
            f"after {verdict.checks} checks, below {-core.validation.heldout_tolerance / 2:g})"
            f"; this one does not improve path {path} ({before:.4f} -> {after:.4f})",
        )
    return verdict.trust
