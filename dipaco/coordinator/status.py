"""The status snapshot (GetStatus): modules, leases, peers, owners, refusals and access, as the
dashboard, ``dipaco status`` and /metrics show them.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import logging
from typing import Any

from dipaco.coordinator.base import CoordinatorBase
from dipaco.protocols import auth
from dipaco.protocols import messages as m

log = logging.getLogger(__name__)


def status(core: CoordinatorBase, req: m.GetStatus | None = None) -> m.Status:
    now = core.clock()
    modules = {
        mid: {
            "version": r.version,
            "pending": sorted(r.pending),
            "late": sorted(r.late),
            "ahead": sorted(r.ahead),
            "hash": r.hash,
            "owner": core.owner_id,
        }
        for mid, r in core.store.modules.items()
    }
    for mid, info in core.remote.items():
        if not core.owns(mid):
            modules[mid] = {**info.to_json(), "owner": core.owners.get(mid)}
    peers = peer_rows(core, now)
    scheduler = core.scheduler  # None on a module owner: it leases nothing
    leases = scheduler.leases if scheduler else {}
    return m.Status(
        state={
            "run_id": core.run_id,
            "owner_id": core.owner_id,
            "scheduler": core.is_scheduler,
            "round": core.round,
            "rounds": core.rounds,
            "phase": max(core.phases.ready, default=0),
            "finished": core.finished,
            "modules": modules,
            "leases": {
                t: {
                    "path": lease.path,
                    "round": lease.round,
                    "peer": lease.peer_id,
                    "steps": lease.steps,
                    "deadline_in": round(lease.deadline - now, 1),
                }
                for t, lease in leases.items()
            },
            "expired_leases": scheduler.expired if scheduler else 0,
            "task_deadline": scheduler.task_deadline() if scheduler else None,
            "overdue": sorted(core.book.overdue),
            "peers": peers,
            "machines": machines(peers),
            "owners": owner_rows(core, now),
            "evaluation": core.eval_note,
            **core.refusals.state_dict(),
            "access": core.access.summary(),
            "key_scores": {auth.fingerprint(k): v for k, v in core.key_scores.summary().items()},
        }
    )


def peer_rows(core: CoordinatorBase, now: float) -> dict[str, dict[str, Any]]:
    """Peers as ``status`` shows them: module owners are not peers; a peer's task is the one
    it holds a lease for now; ``state`` is training, idle, or gone (silent longer than a
    lease: it left, or died)."""
    owners = set(core.owners.values()) | set(core.owner_seen)
    scheduler = core.scheduler
    current = {lease.peer_id: t for t, lease in (scheduler.leases if scheduler else {}).items()}
    lease_seconds = scheduler.lease_seconds if scheduler else core.policy.lease_seconds
    rows = {}
    for pid, info in core.roster.peers.items():
        if pid in owners or info.device == "coordinator":  # an owner's Hello
            continue
        seen_ago = now - info.last_seen
        state = "training" if pid in current else "gone" if seen_ago > lease_seconds else "idle"
        rows[pid] = info.row() | {
            "seen_ago": round(seen_ago, 1),
            "task": current.get(pid),
            "state": state,
        }
        machine = machine_of(info.capabilities)
        if machine is not None:  # a worker of a multi-device peer (dipaco-peer join --gpus)
            rows[pid]["machine"], rows[pid]["worker"] = machine
    return rows


def machine_of(capabilities: dict[str, Any] | None) -> tuple[str, int] | None:
    """(machine, worker index) when a peer's Hello said it is a machine's worker; None when it
    did not, or said it in a shape that is not (a peer's words: checked, never trusted)."""
    if not isinstance(capabilities, dict):
        return None
    name, index = capabilities.get("machine"), capabilities.get("worker")
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        return None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
        return None
    return name, index


def machines(peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The multi-device peers among ``peers`` (rows of :func:`peer_rows`): per machine its
    workers (peer ids by index), their devices, tasks done and the state of the busiest."""
    out: dict[str, dict[str, Any]] = {}
    order = {"training": 0, "idle": 1, "gone": 2}
    for pid, row in sorted(peers.items(), key=lambda kv: kv[1].get("worker", 0)):
        if "machine" not in row:
            continue
        m = out.setdefault(
            row["machine"], {"workers": [], "devices": [], "tasks_done": 0, "state": "gone"}
        )
        caps = row.get("capabilities") or {}
        ranks = caps.get("workers")
        if caps.get("shard_path") is True and type(ranks) is int and 1 <= ranks <= 1024:
            m["shard_path"], m["devices_per_path"] = True, ranks  # one rank speaks for all
        m["workers"].append(pid)
        m["devices"].append(row.get("device", ""))
        m["tasks_done"] += row.get("tasks_done", 0)
        if order.get(row.get("state", "gone"), 2) < order[m["state"]]:
            m["state"] = row["state"]
    return out


def owner_rows(core: CoordinatorBase, now: float) -> dict[str, dict[str, Any]]:
    """Every coordinator that owns modules of the run, this one included."""
    rows: dict[str, dict[str, Any]] = {}
    for mid, owner in sorted(core.owners.items()):
        row = rows.setdefault(
            owner,
            {
                "modules": [],
                "addresses": core.addresses.get(owner, []),
                "scheduler": owner == core.owner_id and core.is_scheduler,
                "seen_ago": 0.0
                if owner == core.owner_id
                else round(now - core.owner_seen[owner], 1)
                if owner in core.owner_seen
                else None,
            },
        )
        row["modules"].append(mid)
    return rows
