"""Module ownership across coordinators: owners' reports to the scheduler, the hand-over of
modules to a new owner (HandOver, adopt, ConfirmOwnership), the owner table for peers, and the
proof that an owner's request is signed by a key the operator allowed.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dipaco.coordinator import rounds, tickets
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.records import ReportedModule
from dipaco.coordinator.store import delta_meta
from dipaco.errors import CorruptFileError
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.wire import tensors_sha256

log = logging.getLogger(__name__)


def adopt(core: CoordinatorBase, state: m.ModuleState) -> dict[str, str]:
    """Write modules handed over by their previous owner; returns their hashes."""
    hashes = {}
    with core.lock:
        for mid, info in state.modules.items():
            prefix = f"{mid}/"
            params = _strip(state.tensors, prefix + "params/")
            momentum = _strip(state.tensors, prefix + "momentum/") or None
            if tensors_sha256(params) != info["hash"]:
                raise CorruptFileError(f"handed-over {mid} does not match its hash")
            deltas = [
                (meta, _strip(state.tensors, f"{prefix}delta/{i}/"))
                for i, meta in enumerate(info["deltas"])
            ]
            core.store.adopt(mid, info["version"], params, momentum, deltas)
            core.owners[mid] = core.owner_id
            hashes[mid] = info["hash"]
        core.journal.save()
        core.changed.set()
    return hashes


def get_owners(core: CoordinatorBase, req: m.GetOwners) -> m.Owners:
    return m.Owners(
        owners=dict(core.owners),
        addresses={o: core.addresses.get(o, []) for o in set(core.owners.values())},
        keys={o: k for o, k in core.owner_keys.items() if o in set(core.owners.values())},
    )


def owner_report(core: CoordinatorBase, req: m.OwnerReport) -> m.ReportAck:
    scheduler = core.need_scheduler(req.owner_id)
    owner_proof(core, req.owner_id, req.proof, "report", req.modules)
    for mid in req.modules:
        if core.owners.get(mid) != req.owner_id:
            core.refusals.refuse(
                req.owner_id,
                Reason.NOT_OWNER,
                f"{req.owner_id} reports {mid}, which it does not own",
            )
    reported: dict[str, ReportedModule] = {}
    for mid, info in req.modules.items():
        module = ReportedModule.of(info)
        if module is None:
            core.refusals.refuse(
                req.owner_id,
                Reason.BAD_MESSAGE,
                f"report for {mid} is not {{version, hash, pending paths}}",
            )
        reported[mid] = module
    core.remote.update(reported)
    core.owner_seen[req.owner_id] = core.clock()
    if req.addresses:
        core.addresses[req.owner_id] = list(req.addresses)
    core.journal.save()
    rounds.after_change(core)
    return m.ReportAck(
        overdue=core.book.overdue_list(),
        ended=dict(scheduler.ended),
        gathered=sorted(core.gathered),
    )


def hand_over(core: CoordinatorBase, req: m.HandOver) -> m.ModuleState:
    core.need_scheduler(req.owner_id)
    owner_proof(core, req.owner_id, req.proof, "handover", req.modules)
    modules, tensors = {}, {}
    for mid in req.modules:
        if not core.owns(mid):
            core.refusals.refuse(
                req.owner_id,
                Reason.NOT_OWNER,
                f"{mid} is owned by {core.owners.get(mid)!r}, not by this coordinator",
            )
    for mid in req.modules:
        record = core.store.modules[mid]
        core.handing[mid] = (req.owner_id, core.clock())
        deltas = []
        held = [*record.pending.values(), *record.late.values(), *record.ahead.values()]
        for i, delta in enumerate(held):
            frame_fields = delta_meta(
                delta.path,
                delta.weight,
                delta.task_id,
                delta.peer_id,
                delta.base_version,
                delta.voter,
                delta.for_round,
            )
            deltas.append(frame_fields)
            tensors.update(_prefixed(core.store.delta_tensors(delta), f"{mid}/delta/{i}/"))
        modules[mid] = {"version": record.version, "hash": record.hash, "deltas": deltas}
        tensors.update(_prefixed(record.params, f"{mid}/params/"))
        if record.momentum is not None:
            tensors.update(_prefixed(record.momentum, f"{mid}/momentum/"))
    return m.ModuleState(modules=modules, tensors=tensors)


def confirm_ownership(core: CoordinatorBase, req: m.ConfirmOwnership) -> m.Ok:
    core.need_scheduler(req.owner_id)
    owner_proof(core, req.owner_id, req.proof, "confirm", req.hashes)
    for mid, digest in req.hashes.items():
        if core.handing.get(mid, ("",))[0] != req.owner_id:
            core.refusals.refuse(
                req.owner_id, Reason.NOT_OWNER, f"{mid} was not being handed to you"
            )
        if core.store.modules[mid].hash != digest:
            core.refusals.refuse(
                req.owner_id, Reason.HASH_MISMATCH, f"{mid}: adopted a different version"
            )
    for mid in req.hashes:
        record = core.store.modules.pop(mid)
        del core.handing[mid]
        core.owners[mid] = req.owner_id
        core.remote[mid] = ReportedModule(
            record.version, record.hash, tuple(sorted(record.pending))
        )
        log.info("module %s now owned by %s", mid, req.owner_id)
        core.metrics({"event": "owner_changed", "module": mid, "owner": req.owner_id})
    core.journal.save()
    return m.Ok()


def report(core: CoordinatorBase) -> m.OwnerReport:
    """This owner's state for the scheduler (idempotent: the whole state every time)."""
    with core.lock:
        modules = {
            mid: {
                "version": core.store.version(mid),
                "hash": core.store.modules[mid].hash,
                "pending": sorted(core.store.modules[mid].pending),
                "ahead": sorted(core.store.modules[mid].ahead),
            }
            for mid in core.owned_modules()
        }
    return m.OwnerReport(
        owner_id=core.owner_id,
        proof=tickets.prove(core.identity, "report", core.owner_id, modules),
        modules=modules,
        addresses=core.addresses.get(core.owner_id, []),
    )


def owner_proof(
    core: CoordinatorBase, owner_id: str, proof: str, purpose: str, payload: Any
) -> None:
    """The request comes from a module owner the operator allowed, and it signed ``payload``."""
    key = core._caller
    if key is None or not core.access.is_owner(key):
        core.refusals.refuse(
            owner_id,
            Reason.NOT_AN_OWNER,
            "this key may not own modules; the scheduler's operator allows owners with: "
            f"dipaco-coordinator allow --owner {key}",
        )
    if not tickets.check(key, proof, purpose, owner_id, payload):
        core.refusals.refuse(
            owner_id, Reason.BAD_PROOF, f"the {purpose} is not signed by the sender's key"
        )
    if core.owner_keys.get(owner_id) != key:
        core.owner_keys[owner_id] = key


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
