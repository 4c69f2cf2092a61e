"""The coordinator's records, typed: a task as a request acts for it, a routing phase, a peer as
the coordinator has seen it, and another owner's module as its last report gave it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dipaco.coordinator.leases import Lease
from dipaco.data.shards import shard_name


@dataclass(frozen=True)
class Task:
    """A leased task: what its signed ticket says, or (on the scheduler) what its lease says.

    ``versions`` are the module versions it was issued against (its base), ``weight`` its path's
    outer-step weight when known (the shard's tokens in its phase, times the fraction of H the
    task was given: a slow peer's shorter task weighs less), ``key`` the public key it was
    issued to (None for a lease read without a ticket), ``tokens`` the tokens its steps train
    (None in tickets of older schedulers)."""

    task_id: str
    peer: str
    path: int
    round: int
    versions: dict[str, int]
    weight: float | None = None
    key: str | None = None
    tokens: int | None = None
    # The path's delta is scored whole by the scheduler before its owners take it (ScoreDelta,
    # scoring.py): its owners admit it only with the scheduler's verdict.
    scored: bool = False

    @classmethod
    def of_lease(
        cls,
        lease: Lease,
        weight: float | None,
        key: str | None = None,
        *,
        full_steps: int = 0,
        tokens_per_step: int = 0,
        scored: bool = False,
    ) -> Task:
        """The task a lease is; with ``full_steps`` (H), a lease of fewer steps scales the
        weight down in proportion, and with ``tokens_per_step`` the task knows its tokens."""
        if weight is not None and full_steps > 0:
            weight *= min(1.0, lease.steps / full_steps)
        tokens = lease.steps * tokens_per_step if tokens_per_step > 0 else None
        return cls(
            lease.task_id, lease.peer_id, lease.path, lease.round,
            dict(lease.module_versions), weight, key, tokens, scored,
        )  # fmt: skip

    def ticket_payload(self) -> dict[str, Any]:
        """What the scheduler signs into the task's ticket (the wire format: docs/protocol.md)."""
        return {
            "task": self.task_id,
            "peer": self.peer,
            "path": self.path,
            "round": self.round,
            "versions": self.versions,
            "weight": self.weight,
            "key": self.key,
            "tokens": self.tokens,
            **({"scored": True} if self.scored else {}),  # absent where not: older tickets
        }

    @classmethod
    def of_ticket(cls, payload: dict[str, Any]) -> Task | None:
        """The task a verified ticket names; None when a field has the wrong type."""
        versions = payload.get("versions")
        weight, tokens = payload.get("weight"), payload.get("tokens")
        fields = (payload.get("task"), payload.get("peer"), payload.get("key"))
        if not (
            isinstance(fields[0], str)
            and isinstance(fields[1], str)
            and (fields[2] is None or isinstance(fields[2], str))
            and _count(payload.get("path"))
            and _count(payload.get("round"))
            and isinstance(versions, dict)
            and all(isinstance(k, str) and _count(v) for k, v in versions.items())
            and (weight is None or (isinstance(weight, int | float) and weight >= 0))
            and (tokens is None or (_count(tokens) and tokens > 0))
        ):
            return None
        return cls(
            fields[0], fields[1], payload["path"], payload["round"], versions, weight, fields[2],
            tokens, payload.get("scored") is True,
        )  # fmt: skip


@dataclass
class Phase:
    """A routing phase's shards: their folder's name (``shards``, ``shards_phase1``...), each
    path's tokens in it (the outer-step weights), and its files as the manifest lists them."""

    prefix: str
    tokens: list[int] | None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def shard(self, path: int) -> str:
        return shard_name(path, prefix=self.prefix)

    def shard_files(self, path: int) -> dict[str, dict[str, Any]]:
        shard = self.shard(path)
        return {k: v for k, v in self.files.items() if k.startswith(shard + ".")}


@dataclass
class PeerInfo:
    """A peer (or an owner saying Hello) as this coordinator has seen it, for ``status``."""

    tasks_done: int = 0  # tasks whose deltas every owner acknowledged
    tokens: int = 0  # tokens those tasks trained
    task: str | None = None  # the task it was last given
    last_seen: float = 0.0  # the coordinator's clock at its last request
    device: str | None = None  # from its Hello ("coordinator" for a module owner)
    capabilities: dict[str, Any] | None = None
    step: int | None = None  # from its last heartbeat
    bytes_in: int = 0  # request bytes received from it
    bytes_out: int = 0  # reply bytes sent to it

    def row(self) -> dict[str, Any]:
        """Its fields for ``status``, without the clock reading and without what it never said."""
        out = asdict(self)
        del out["last_seen"]
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class ReportedModule:
    """Another owner's module as its last signed report (or the hand-over) gave it."""

    version: int
    hash: str
    pending: tuple[int, ...] = ()  # paths whose deltas it holds for this version
    ahead: tuple[int, ...] = ()  # ... and for the next version's step (overlap)

    @classmethod
    def of(cls, info: Any) -> ReportedModule | None:
        """From a report entry or coordinator.json; None when a field has the wrong type."""
        if not isinstance(info, dict) or not _count(info.get("version")):
            return None
        digest, pending = info.get("hash", ""), info.get("pending", [])
        ahead = info.get("ahead", [])  # absent from older owners' reports
        if not isinstance(digest, str) or not all(
            isinstance(x, list | tuple) for x in (pending, ahead)
        ):
            return None
        if not all(_count(p) for p in (*pending, *ahead)):
            return None
        return cls(info["version"], digest, tuple(pending), tuple(ahead))

    def to_json(self) -> dict[str, Any]:
        out = {"version": self.version, "hash": self.hash, "pending": list(self.pending)}
        if self.ahead:
            out["ahead"] = list(self.ahead)
        return out


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
