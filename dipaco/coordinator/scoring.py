"""Scoring a whole path's delta for owners that each hold some of its modules (``ScoreDelta``).

The scheduler answers a ``ScoreDelta`` when the task's ticket says its deltas are scored first
(``Task.scored``: the run scores every delta and the path's modules are not all the
scheduler's). It decodes every module's delta against the path as it is now (its own modules,
and the others' current releases, fetched from their owners and kept per version in
``core.verdicts``), scores it as an owner of the whole path would (heldout.check_heldout:
held-out loss before and after, the key's usefulness), and answers with a signed verdict
(verdicts.py), or refuses it as that check would (``worse-heldout``, ``low-score``). Each
owner then admits its modules' deltas only with the verdict (heldout.scored_verdict).

Functions of the coordinator (the service calls ``score`` for a ScoreDelta: service.OPS).
"""

from __future__ import annotations

from dipaco.coordinator import admission, heldout, tickets, verdicts
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.leased import task_of
from dipaco.errors import DipacoError
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

Tensors = verdicts.Tensors


def score(core: CoordinatorBase, req: m.ScoreDelta) -> m.Scored:
    """Score the path's delta and sign the verdict its owners apply it with."""
    with core.lock:
        core.roster.seen(req.peer_id)
        task = task_of(core, req.peer_id, req.task_id, req.ticket)
        if req.path != task.path:
            core.refusals.refuse(
                req.peer_id,
                Reason.WRONG_PATH,
                f"task {req.task_id} is for path {task.path}, not {req.path}",
            )
        if not task.scored or core.heldout_loss is None:
            core.refusals.refuse(
                req.peer_id,
                Reason.UNSCORED,
                f"task {req.task_id}'s deltas are not scored first: send them to their owners",
            )
        key = core.voter_of(req)
    path_mids = core.topology.path_modules(task.path)
    digests = {mid: verdicts.digest(req.tensors, mid) for mid in path_mids}
    with core.lock:
        again = core.verdicts.again(task.task_id, digests)
    if again is not None:  # a retry (its reply was lost): the same verdict, judged once
        return m.Scored(verdict=again)
    current = path_now(core, req.peer_id, task.path)
    deltas, _ = admission.split_delta(core, req, path_mids, path_mids, params=current.__getitem__)
    trust = heldout.check_heldout(core, req, task.path, deltas, path_mids, current=current)
    del current, deltas
    with core.lock:
        diverging = core.key_scores.diverging()
        signed = tickets.sign_ticket(
            core.identity,
            verdicts.payload(core.run_id, task.task_id, task.path, key, trust, diverging, digests),
            tickets.VERDICT,
        )
        core.verdicts.keep(task.task_id, digests, signed)
    core.metrics(
        {
            "event": "delta_scored",
            "task": task.task_id,
            "path": task.path,
            "peer": req.peer_id,
            "trust": trust,
        }
    )
    return m.Scored(verdict=signed)


def path_now(core: CoordinatorBase, who: str, path: int) -> dict[str, Tensors]:
    """Every module of ``path`` as it is now: this coordinator's from its store, the others'
    current releases from their owners (``core.fetch_remote``), fetched again only when an
    owner reported a newer version. A module that cannot be had refuses the request as busy:
    the peer asks again."""
    mids = core.topology.path_modules(path)
    out: dict[str, Tensors] = {}
    with core.lock:
        wanted = {}
        for mid in mids:
            if core.owns(mid):
                out[mid] = core.store.params(mid)
                continue
            version = core.version(mid)
            kept = core.verdicts.fetched(mid, version)
            if kept is None:
                wanted[mid] = version
            else:
                out[mid] = kept
    if wanted:
        if core.fetch_remote is None:
            core.refusals.refuse(
                who, Reason.UNSCORED, "this scheduler cannot fetch other owners' modules to score"
            )
        assert core.fetch_remote is not None  # refuse raises
        try:
            fetched = core.fetch_remote(sorted(wanted))
        except DipacoError as exc:
            core.refusals.refuse(
                who, Reason.NOT_READY, f"cannot fetch other owners' modules to score with: {exc}"
            )
        with core.lock:
            for mid, version in wanted.items():
                out[mid] = fetched[mid]
                if version is not None:
                    core.verdicts.fetch_kept(mid, version, fetched[mid])
    return out
