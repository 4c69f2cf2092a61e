"""The coordinator core: a transport-free state machine over the module store and the scheduler.

Operations (DESIGN.md, "The core is transport-free"): hello, claim a task, fetch a path's
modules, heartbeat, submit a delta, release a task, status. :meth:`Coordinator.handle` maps wire
frames to them, so every transport (local, loopback, and later hivemind and Flower) drives the
same code. Every rejection raises a :class:`RejectedError` with a reason and is counted.

One coordinator may own every module (the default), or several may share them: the *scheduler*
(the first coordinator of a run) leases tasks and signs a ticket for each; every *owner* accepts
the fetches and deltas of its own modules against that ticket, applies their outer steps on its
own, and reports its modules' state to the scheduler (:class:`~dipaco.protocols.messages.OwnerReport`).
A new owner takes modules over with ``HandOver``/``ConfirmOwnership``: the old owner refuses
their deltas between the two (reason ``handover``, retried by peers), so none is lost.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.config import SchedulerSection
from dipaco.coordinator import tickets
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.scheduler import Lease, Scheduler
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import CorruptFileError, DipacoError, RejectedError, WireError
from dipaco.fileio import file_info, write_json_atomic
from dipaco.model.topology import Topology
from dipaco.protocols import codecs
from dipaco.protocols import messages as m
from dipaco.protocols.wire import tensors_sha256

FILE_CHUNK = 4 << 20

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        root: str | Path,
        topology: Topology,
        *,
        rounds: int,
        inner_steps: int,
        step_offset: int,
        total_steps: int,
        seed: int,
        outer: OuterSettings,
        lease_seconds: float,
        run_id: str,
        peer_config: dict[str, Any],
        shard_tokens: list[int] | None = None,
        on_round: Callable[[int], None] | None = None,
        metrics: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulerSection | None = None,
        owner_id: str = "local",
        secret: bytes | None = None,
        is_scheduler: bool = True,
        codec: str = "lossless",
        files: dict[str, Path] | None = None,
        phase_rounds: list[int] | tuple[int, ...] = (),
    ) -> None:
        self.root = Path(root)
        self.topology = topology
        self.rounds, self.inner_steps = rounds, inner_steps
        self.step_offset, self.total_steps, self.seed = step_offset, total_steps, seed
        self.outer = outer
        self.run_id = run_id
        self.peer_config = {**peer_config, "owner_id": owner_id}
        # Outer-step weights: each path's shard size (paper eq. 2-3); without it, trained tokens.
        self.shard_tokens = shard_tokens
        self.on_round, self.metrics = on_round, metrics or (lambda event: None)
        self.policy = policy or SchedulerSection(lease_seconds=lease_seconds)
        self.store = ModuleStore(self.root)
        self.scheduler = Scheduler(lease_seconds, clock)
        for name in (
            "deadline_mads",
            "deadline_slack",
            "deadline_floor",
            "min_observations",
            "min_step_fraction",
        ):
            setattr(self.scheduler, name, getattr(self.policy, name))
        self.lock = threading.RLock()
        self.clock = clock
        self.rejections: Counter[str] = Counter()
        self.rejections_by_peer: dict[str, Counter[str]] = defaultdict(Counter)
        self.peers: dict[str, dict[str, Any]] = {}
        self.epoch = 0
        self.finished_event = threading.Event()
        self.failure: str | None = None  # set when the run cannot go on (finished_event too)
        # Ownership: module id -> owner id. The scheduler knows every module's owner; an owner
        # that is not the scheduler lists only its own modules.
        self.owner_id, self.is_scheduler, self.codec = owner_id, is_scheduler, codec
        self.secret = secret if secret is not None else b"dipaco-local-" + run_id.encode()
        self.owners: dict[str, str] = {}
        self.addresses: dict[str, list[str]] = {}  # owner id -> how peers reach it
        self.remote: dict[str, dict[str, Any]] = {}  # other owners' modules, from their reports
        self.handing: dict[str, tuple[str, float]] = {}  # module -> (new owner, since)
        self.done: set[tuple[int, int]] = set()  # (path, round) whose task every owner acked
        # (path, round) whose task ran past the deadline: rounds may close without them.
        self.overdue: set[tuple[int, int]] = set()
        self.files = files or {}
        # Routing phases (DiPaCo Algorithm 1, line 2): tasks whose base round is at or past
        # phase_rounds[k - 1] train on phase k's shards, and wait until that phase is ready.
        self.phase_rounds = sorted(phase_rounds)
        self.phases: dict[int, dict[str, Any]] = {}
        if self.is_scheduler:
            self.phases[0] = {"prefix": "shards", "tokens": shard_tokens, "files": {}}
        self.last_round = 0
        self.changed = threading.Event()  # set on every change an owner must report

    # ---- start and resume ---------------------------------------------------------------------
    def start(self, initial_modules: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """Open the store (creating version 0 from ``initial_modules`` if new) and resume."""
        state_file = self.root / "coordinator.json"
        saved: dict[str, Any] = {}
        if state_file.exists():
            try:
                saved = json.loads(state_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CorruptFileError(
                    f"{state_file}: not readable coordinator state: {exc}"
                ) from None
            self.epoch = saved.get("epoch", 0) + 1
            self.scheduler.epoch = self.epoch
            self.rejections.update(saved.get("rejections", {}))
        if self.is_scheduler:
            self.owners = saved.get("owners") or dict.fromkeys(
                self.topology.module_ids(), self.owner_id
            )
            self.remote = saved.get("remote", {})
            self.addresses.update(saved.get("addresses", {}))
        else:
            self.owners = dict.fromkeys(self.store.owned_on_disk(), self.owner_id)
        mine = self.owned_modules()
        if initial_modules is not None:
            self.store.initialize({mid: initial_modules[mid] for mid in mine})
        else:
            self.store.load(mine)
        for mid in mine:
            # A crash may have left a module with every delta on disk but its step not committed.
            self._maybe_step(mid)
        self.last_round = self.round
        self._save_state()
        if self.finished:
            self.finished_event.set()

    def _save_state(self) -> None:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "rejections": dict(self.rejections),
            "run_id": self.run_id,
            "owner_id": self.owner_id,
        }
        if self.is_scheduler:
            state.update(owners=self.owners, remote=self.remote, addresses=self.addresses)
        write_json_atomic(self.root / "coordinator.json", state)

    def adopt(self, state: m.ModuleState) -> dict[str, str]:
        """Write modules handed over by their previous owner; returns their hashes."""
        hashes = {}
        with self.lock:
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
                self.store.adopt(mid, info["version"], params, momentum, deltas)
                self.owners[mid] = self.owner_id
                hashes[mid] = info["hash"]
            self._save_state()
            self.changed.set()
        return hashes

    # ---- state --------------------------------------------------------------------------------
    def owned_modules(self) -> list[str]:
        return [mid for mid in self.topology.module_ids() if self.owners.get(mid) == self.owner_id]

    def owns(self, mid: str) -> bool:
        return self.owners.get(mid) == self.owner_id

    def version(self, mid: str) -> int | None:
        """A module's version; None for another owner's module not yet reported."""
        if self.owns(mid):
            return self.store.version(mid)
        info = self.remote.get(mid)
        return info["version"] if info else None

    def reported(self, mid: str) -> set[int]:
        if self.owns(mid):
            return set(self.store.modules[mid].pending)
        return set(self.remote.get(mid, {}).get("pending", []))

    def path_round(self, path: int) -> int:
        return min(self.version(mid) or 0 for mid in self.topology.path_modules(path))

    @property
    def round(self) -> int:
        """Rounds completed by every module (that this coordinator knows of)."""
        mids = self.topology.module_ids() if self.is_scheduler else self.owned_modules()
        return min((self.version(mid) or 0 for mid in mids), default=0)

    @property
    def finished(self) -> bool:
        return self.round >= self.rounds

    def phase_of(self, base_round: int) -> int:
        """The routing phase whose shards a task of this base round trains on."""
        return sum(1 for r in self.phase_rounds if r <= base_round)

    def add_phase(self, phase: int, prefix: str, tokens: list[int], files: dict[str, Path]) -> None:
        """Make a routing phase's shards available: its tasks open and its files are served."""
        with self.lock:
            infos = {name: file_info(path) for name, path in files.items()}
            self.files.update(files)
            self.phases[phase] = {"prefix": prefix, "tokens": tokens, "files": infos}
            self.metrics({"event": "phase_ready", "phase": phase, "shard_tokens": tokens})

    def _weight(self, path: int, base_round: int) -> float | None:
        tokens = self.phases.get(self.phase_of(base_round), {}).get("tokens") or self.shard_tokens
        return float(tokens[path]) if tokens else None

    def open_paths(self) -> dict[int, int]:
        out = {}
        for p in range(self.topology.num_paths):
            mids = self.topology.path_modules(p)
            versions = {self.version(mid) for mid in mids}
            if len(versions) != 1 or None in versions:
                continue  # some module of the path is still waiting for other paths
            (v,) = versions
            reported = (p, v) in self.done or all(p in self.reported(mid) for mid in mids)
            if v < self.rounds and not reported and self.phase_of(v) in self.phases:
                out[p] = v
        return out

    # ---- operations ---------------------------------------------------------------------------
    def hello(self, req: m.Hello) -> m.Welcome:
        self._seen(req.peer_id, device=req.device, capabilities=req.capabilities)
        return m.Welcome(run_id=self.run_id, config=self.peer_config)

    def claim(self, req: m.ClaimTask) -> m.TaskOffer | m.NoTask:
        self._need_scheduler(req.peer_id)
        self._seen(req.peer_id)
        if self.finished:
            return m.NoTask(reason="run finished", retry_after=0.0, finished=True)
        for held in self.scheduler.leases_of(req.peer_id):
            # A peer back from a restart gets its task again, unless its round has moved on
            # without it: then the task cannot be trained from its base any more; drop it.
            if any(self.version(mid) != v for mid, v in held.module_versions.items()):
                self.scheduler.release(held.task_id, req.peer_id)
                self.metrics({"event": "task_dropped", "task": held.task_id, "peer": req.peer_id})
        fresh = not self.scheduler.leases_of(req.peer_id)
        lease = self.scheduler.claim(
            req.peer_id, self.open_paths(), req.prefer_path, self.inner_steps
        )
        if lease is None:
            return m.NoTask(
                reason="every open path is leased or waiting for its modules",
                retry_after=0.5,
                finished=False,
            )
        if fresh:
            lease.module_versions = {
                mid: self.version(mid) for mid in self.topology.path_modules(lease.path)
            }
            self.metrics(
                {
                    "event": "task_issued",
                    "task": lease.task_id,
                    "peer": req.peer_id,
                    "path": lease.path,
                    "round": lease.round,
                    "steps": lease.steps,
                    "phase": self.phase_of(lease.round),
                }
            )
        self.peers[req.peer_id]["task"] = lease.task_id
        step_offset = self.step_offset + lease.round * self.inner_steps
        phase = self.phases[self.phase_of(lease.round)]
        payload = {
            "task": lease.task_id,
            "peer": req.peer_id,
            "path": lease.path,
            "round": lease.round,
            "versions": lease.module_versions,
            "weight": self._weight(lease.path, lease.round),
        }
        shard = f"{phase['prefix']}/P{lease.path}/train"
        return m.TaskOffer(
            task_id=lease.task_id,
            path=lease.path,
            round=lease.round,
            module_versions=lease.module_versions,
            inner_steps=lease.steps,
            step_offset=step_offset,
            total_steps=self.total_steps,
            lease_seconds=self.scheduler.lease_seconds,
            seed=self.seed,
            ticket=tickets.sign_ticket(self.secret, payload),
            owners={mid: self.owners[mid] for mid in lease.module_versions},
            codec=self.codec,
            shard=shard,
            shard_files={k: v for k, v in phase["files"].items() if k.startswith(shard + ".")},
        )

    def fetch(self, req: m.FetchModules) -> m.Modules:
        self._seen(req.peer_id)
        task = self._task(req.peer_id, req.task_id, req.ticket)
        versions, hashes, tensors = {}, {}, {}
        for mid in self.topology.path_modules(task["path"]):
            if not self.owns(mid):
                continue
            record = self.store.modules[mid]
            versions[mid], hashes[mid] = record.version, record.hash
            if req.have.get(mid) != record.version:
                tensors.update({f"{mid}/{k}": v for k, v in record.params.items()})
        return m.Modules(versions=versions, hashes=hashes, tensors=tensors)

    def heartbeat(self, req: m.Heartbeat) -> m.HeartbeatAck:
        self._need_scheduler(req.peer_id)
        self._seen(req.peer_id, step=req.step)
        if req.task_id is None:
            return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
        lease = self.scheduler.heartbeat(req.task_id, req.peer_id, req.step)
        if lease is None:
            return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
        return m.HeartbeatAck(lease_ok=True, deadline_in=lease.deadline - self.clock())

    def release(self, req: m.ReleaseTask) -> m.Ok:
        self._need_scheduler(req.peer_id)
        self._seen(req.peer_id)
        if self.scheduler.release(req.task_id, req.peer_id):
            self.metrics({"event": "task_released", "task": req.task_id, "peer": req.peer_id})
        return m.Ok()

    def submit(self, req: m.SubmitDelta) -> m.DeltaAck:
        self._seen(req.peer_id)
        task = self._task(req.peer_id, req.task_id, req.ticket)
        path = task["path"]
        if req.path != path:
            self._reject(
                req.peer_id, "wrong-path", f"task {req.task_id} is for path {path}, not {req.path}"
            )
        if req.tokens <= 0:
            self._reject(
                req.peer_id, "bad-tokens", f"token count must be positive, got {req.tokens}"
            )
        path_mids = self.topology.path_modules(path)
        mids = [mid for mid in path_mids if self.owns(mid)]
        deltas = self._split_delta(req, path_mids, mids)
        for mid in mids:
            if mid in self.handing:
                self._reject(
                    req.peer_id, "handover", f"{mid} is moving to another owner; retry shortly"
                )
        weight = task.get("weight") or (self.shard_tokens[path] if self.shard_tokens else None)
        weight = weight or req.tokens
        plan, already = [], []
        for mid in mids:
            record = self.store.modules[mid]
            base = task["versions"].get(mid)
            if base is None or req.base_versions.get(mid) != base:
                self._reject(
                    req.peer_id,
                    "wrong-base",
                    f"delta for {mid} claims base {req.base_versions.get(mid)}, "
                    f"the task was issued against {base}",
                )
            if req.task_id in record.applied:
                already.append(mid)  # applied in an earlier step; its ack was lost: ack again
                continue
            if record.version >= self.rounds:
                # The module made its last step without this delta: nothing would apply it, so
                # acknowledging it would be a lie.
                self._reject(
                    req.peer_id,
                    "finished",
                    f"{mid} has made all its {self.rounds} rounds; late deltas are not applied",
                )
            lateness = record.version - base
            if not 0 <= lateness <= self.policy.max_staleness:
                if self.is_scheduler:  # the task can never be applied: free its path
                    self.scheduler.release(req.task_id, req.peer_id)
                self._reject(
                    req.peer_id,
                    "stale",
                    f"delta for {mid} is against version {base}, module is at "
                    f"{record.version} (at most {self.policy.max_staleness} late is applied)",
                )
            if path in record.reported.get(base, []):
                self._reject(
                    req.peer_id,
                    "duplicate",
                    f"path {path} already reported for {mid} version {base} (another task)",
                )
            table = record.pending if lateness == 0 else record.late
            if path in table:
                if table[path].task_id == req.task_id:
                    already.append(mid)  # a retry of an acknowledged delta: ack it again
                    continue
                self._reject(
                    req.peer_id,
                    "duplicate",
                    f"path {path} already reported for {mid} version {base}",
                )
            plan.append((mid, base, lateness))
        for mid, base, lateness in plan:
            damped = weight * self.policy.stale_damping**lateness
            self.store.add_delta(
                mid, path, damped, req.task_id, req.peer_id, deltas[mid], base_version=base
            )
            if lateness > 0:
                self.metrics(
                    {
                        "event": "late_delta",
                        "module": mid,
                        "task": req.task_id,
                        "path": path,
                        "late_by": lateness,
                        "weight": damped,
                    }
                )
        for mid, base, _ in plan:
            self.metrics(
                {
                    "event": "delta_acked",
                    "module": mid,
                    "base_version": base,
                    "path": path,
                    "task": req.task_id,
                    "peer": req.peer_id,
                }
            )
        covers_path = set(mids) == set(path_mids)
        if plan and covers_path and self.is_scheduler:
            self._task_done(task, req.peer_id, req.tokens, req.losses)
        closed = [mid for mid in mids if self._maybe_step(mid)]
        self._save_state()
        self._after_change()
        return m.DeltaAck(
            accepted=[mid for mid, _, _ in plan] + already,
            closed=closed,
            task_done=covers_path and self.is_scheduler,
        )

    def task_done(self, req: m.TaskDone) -> m.Ok:
        self._need_scheduler(req.peer_id)
        self._seen(req.peer_id)
        task = self._task(req.peer_id, req.task_id, req.ticket)
        if (task["path"], task["round"]) not in self.done:
            self._task_done(task, req.peer_id, req.tokens, req.losses)
            self._after_change()
        return m.Ok()

    def get_owners(self, req: m.GetOwners) -> m.Owners:
        return m.Owners(
            owners=dict(self.owners),
            addresses={o: self.addresses.get(o, []) for o in set(self.owners.values())},
        )

    def fetch_file(self, req: m.FetchFile) -> m.FileChunk:
        self._seen(req.peer_id)
        path = self.files.get(req.name)
        if path is None:
            self._reject(req.peer_id, "unknown-file", f"{req.name!r} is not one of the run's files")
        size = path.stat().st_size
        if req.offset < 0 or req.offset > size or not 0 < req.length <= FILE_CHUNK:
            self._reject(
                req.peer_id,
                "bad-range",
                f"{req.name}: range {req.offset}+{req.length} outside 0..{size} "
                f"(chunks of at most {FILE_CHUNK} bytes)",
            )
        with open(path, "rb") as f:
            f.seek(req.offset)
            data = f.read(req.length)
        return m.FileChunk(
            name=req.name,
            size=size,
            sha256=self.peer_config.get("files", {}).get(req.name, {}).get("sha256", ""),
            offset=req.offset,
            tensors={"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
            if data
            else {"data": torch.zeros(0, dtype=torch.uint8)},
        )

    def owner_report(self, req: m.OwnerReport) -> m.ReportAck:
        self._need_scheduler(req.owner_id)
        if not tickets.check(self.secret, req.proof, "report", req.owner_id, req.modules):
            self._reject(req.owner_id, "bad-proof", "owner report not signed with the run's key")
        for mid, info in req.modules.items():
            if self.owners.get(mid) != req.owner_id:
                self._reject(
                    req.owner_id,
                    "not-owner",
                    f"{req.owner_id} reports {mid}, which it does not own",
                )
            if not isinstance(info, dict) or not isinstance(info.get("version"), int):
                self._reject(req.owner_id, "bad-message", f"report for {mid} lacks a version")
        self.remote.update(req.modules)
        if req.addresses:
            self.addresses[req.owner_id] = list(req.addresses)
        self._save_state()
        self._after_change()
        return m.ReportAck(overdue=[list(pr) for pr in sorted(self.overdue)])

    def hand_over(self, req: m.HandOver) -> m.ModuleState:
        self._need_scheduler(req.owner_id)
        if not tickets.check(self.secret, req.proof, "handover", req.owner_id, req.modules):
            self._reject(
                req.owner_id, "bad-proof", "handover request not signed with the run's key"
            )
        modules, tensors = {}, {}
        for mid in req.modules:
            if not self.owns(mid):
                self._reject(
                    req.owner_id,
                    "not-owner",
                    f"{mid} is owned by {self.owners.get(mid)!r}, not by this coordinator",
                )
        for mid in req.modules:
            record = self.store.modules[mid]
            self.handing[mid] = (req.owner_id, self.clock())
            deltas = []
            for i, delta in enumerate([*record.pending.values(), *record.late.values()]):
                frame_fields = {
                    "path": delta.path,
                    "weight": delta.weight,
                    "task_id": delta.task_id,
                    "peer_id": delta.peer_id,
                    "base_version": delta.base_version,
                }
                deltas.append(frame_fields)
                tensors.update(_prefixed(self.store.delta_tensors(delta), f"{mid}/delta/{i}/"))
            modules[mid] = {"version": record.version, "hash": record.hash, "deltas": deltas}
            tensors.update(_prefixed(record.params, f"{mid}/params/"))
            if record.momentum is not None:
                tensors.update(_prefixed(record.momentum, f"{mid}/momentum/"))
        return m.ModuleState(modules=modules, tensors=tensors)

    def confirm_ownership(self, req: m.ConfirmOwnership) -> m.Ok:
        self._need_scheduler(req.owner_id)
        if not tickets.check(self.secret, req.proof, "confirm", req.owner_id, req.hashes):
            self._reject(req.owner_id, "bad-proof", "confirmation not signed with the run's key")
        for mid, digest in req.hashes.items():
            if self.handing.get(mid, ("",))[0] != req.owner_id:
                self._reject(req.owner_id, "not-owner", f"{mid} was not being handed to you")
            if self.store.modules[mid].hash != digest:
                self._reject(req.owner_id, "hash-mismatch", f"{mid}: adopted a different version")
        for mid in req.hashes:
            record = self.store.modules.pop(mid)
            del self.handing[mid]
            self.owners[mid] = req.owner_id
            self.remote[mid] = {
                "version": record.version,
                "hash": record.hash,
                "pending": sorted(record.pending),
            }
            log.info("module %s now owned by %s", mid, req.owner_id)
            self.metrics({"event": "owner_changed", "module": mid, "owner": req.owner_id})
        self._save_state()
        return m.Ok()

    def report(self) -> m.OwnerReport:
        """This owner's state for the scheduler (idempotent: the whole state every time)."""
        with self.lock:
            modules = {
                mid: {
                    "version": self.store.version(mid),
                    "hash": self.store.modules[mid].hash,
                    "pending": sorted(self.store.modules[mid].pending),
                }
                for mid in self.owned_modules()
            }
        return m.OwnerReport(
            owner_id=self.owner_id,
            proof=tickets.prove(self.secret, "report", self.owner_id, modules),
            modules=modules,
            addresses=self.addresses.get(self.owner_id, []),
        )

    def status(self, req: m.GetStatus | None = None) -> m.Status:
        now = self.clock()
        modules = {
            mid: {
                "version": r.version,
                "pending": sorted(r.pending),
                "late": sorted(r.late),
                "hash": r.hash,
                "owner": self.owner_id,
            }
            for mid, r in self.store.modules.items()
        }
        for mid, info in self.remote.items():
            if not self.owns(mid):
                modules[mid] = {**info, "owner": self.owners.get(mid)}
        return m.Status(
            state={
                "run_id": self.run_id,
                "owner_id": self.owner_id,
                "scheduler": self.is_scheduler,
                "round": self.round,
                "rounds": self.rounds,
                "phase": max(self.phases, default=0),
                "finished": self.finished,
                "modules": modules,
                "leases": {
                    t: {
                        "path": lease.path,
                        "round": lease.round,
                        "peer": lease.peer_id,
                        "steps": lease.steps,
                        "deadline_in": round(lease.deadline - now, 1),
                    }
                    for t, lease in self.scheduler.leases.items()
                },
                "expired_leases": self.scheduler.expired,
                "task_deadline": self.scheduler.task_deadline(),
                "overdue": sorted(self.overdue),
                "peers": {
                    pid: {k: v for k, v in info.items() if k != "last_seen"}
                    | {"seen_ago": round(now - info["last_seen"], 1)}
                    for pid, info in self.peers.items()
                },
                "rejections": dict(self.rejections),
                "rejections_by_peer": {p: dict(c) for p, c in self.rejections_by_peer.items()},
            }
        )

    # ---- the wire -----------------------------------------------------------------------------
    _OPS = {
        m.Hello: "hello",
        m.ClaimTask: "claim",
        m.FetchModules: "fetch",
        m.Heartbeat: "heartbeat",
        m.SubmitDelta: "submit",
        m.ReleaseTask: "release",
        m.GetStatus: "status",
        m.TaskDone: "task_done",
        m.GetOwners: "get_owners",
        m.FetchFile: "fetch_file",
        m.OwnerReport: "owner_report",
        m.HandOver: "hand_over",
        m.ConfirmOwnership: "confirm_ownership",
    }

    def handle(self, data: bytes) -> bytes:
        """Decode a request frame, run the operation, encode the reply (or an Error)."""
        try:
            req = m.decode_message(data)
            op = self._OPS.get(type(req))
            if op is None:
                raise RejectedError(f"{type(req).__name__} is not a request", reason="bad-message")
            with self.lock:
                self._tick()
                reply = getattr(self, op)(req)
        except DipacoError as exc:
            if not isinstance(exc, RejectedError) or exc.reason == "bad-message":
                self._count("unknown", exc.reason)  # undecodable: no peer id to blame
            log.info("rejected: %s (%s)", exc, exc.reason)
            reply = m.Error(reason=exc.reason, message=str(exc))
        return m.encode_message(reply)

    def tick(self) -> None:
        """Expire leases and close overdue rounds; servers call this every second or so."""
        with self.lock:
            self._tick()

    # ---- helpers ------------------------------------------------------------------------------
    def _tick(self) -> None:
        for lease in self.scheduler.expire():
            self._expired(lease)
        now = self.clock()
        for mid, (owner, since) in list(self.handing.items()):
            if now - since > 120:  # the new owner never confirmed: keep the module
                log.warning("handover of %s to %s timed out; keeping it", mid, owner)
                del self.handing[mid]
        if self.is_scheduler:
            # Once overdue, a (path, round) stays skipped until the round is over everywhere: a
            # module that closed without it must not leave the path's other modules waiting.
            self.overdue |= self.scheduler.overdue()
            self.overdue = {(p, r) for p, r in self.overdue if r >= self.round}
        if not self.overdue:
            return
        stepped = False
        for mid in self.owned_modules():
            if mid not in self.handing:
                stepped |= self._maybe_step(mid)
        if stepped:
            self._save_state()
            self._after_change()

    def _maybe_step(self, mid: str) -> bool:
        """Step when every path has reported, or when the missing ones are overdue (a quorum)."""
        record = self.store.modules[mid]
        if record.version >= self.rounds:
            return False
        paths = set(self.topology.paths_through(mid))
        if set(record.pending) != paths:
            missing = {(p, record.version) for p in paths - set(record.pending)}
            need = math.ceil(self.policy.quorum * len(paths))
            if not (missing <= self.overdue and len(record.pending) >= need):
                return False
        info = self.store.outer_step(mid, self.outer)
        info["closed_by"] = "deadline" if set(info["paths"]) != paths else "all"
        self.metrics({"event": "outer_step", **info})
        log.info(
            "outer step %s -> v%d (paths %s, late %s, %s)",
            mid,
            info["version"],
            info["paths"],
            info["late_paths"],
            info["closed_by"],
        )
        self.changed.set()
        return True

    def _after_change(self) -> None:
        """Notice a finished round (the scheduler) and wake the reporter (other owners)."""
        self.changed.set()
        if self.round > self.last_round:
            for rnd in range(self.last_round + 1, self.round + 1):
                self.metrics({"event": "round", "round": rnd})
            self.last_round = self.round
            if self.on_round is not None and all(self.owns(mid) for mid in self.owners):
                self.on_round(self.round)
        if self.finished:
            self.finished_event.set()

    def _task_done(self, task: dict, peer_id: str, tokens: int, losses: list[float]) -> None:
        self.done.add((task["path"], task["round"]))
        self.scheduler.finish(task["task"])
        peer = self.peers.setdefault(peer_id, {"tasks_done": 0, "tokens": 0, "task": None})
        peer["tasks_done"] = peer.get("tasks_done", 0) + 1
        peer["tokens"] = peer.get("tokens", 0) + tokens
        peer["task"] = None
        self.metrics(
            {
                "event": "delta",
                "task": task["task"],
                "peer": peer_id,
                "path": task["path"],
                "round": task["round"],
                "tokens": tokens,
                "step_offset": self.step_offset + task["round"] * self.inner_steps,
                "train_losses": losses,
            }
        )

    def _split_delta(
        self, req: m.SubmitDelta, path_mids: list[str], mids: list[str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        wire: dict[str, dict[str, torch.Tensor]] = {mid: {} for mid in mids}
        for key, tensor in req.tensors.items():
            mid, _, name = key.partition("/")
            if mid in path_mids and mid not in wire:
                self._reject(
                    req.peer_id,
                    "not-owner",
                    f"{mid} is owned by {self.owners.get(mid)!r}, not by {self.owner_id!r}; "
                    "ask the scheduler for the current owners",
                )
            if mid not in wire:
                self._reject(
                    req.peer_id,
                    "unknown-module",
                    f"tensor {key} is for a module outside path {req.path}",
                )
            wire[mid][name] = tensor
        if req.codec not in codecs.CODECS:
            self._reject(req.peer_id, "bad-codec", f"unknown codec {req.codec!r}")
        deltas = {}
        for mid in mids:
            params = self.store.params(mid)
            got = wire[mid]
            if not got:
                self._reject(
                    req.peer_id,
                    "wrong-tensors",
                    f"the delta lacks module {mid} of path {req.path}, which this coordinator owns",
                )
            if req.codec == "lossless":
                if set(got) != set(params):
                    missing, extra = sorted(set(params) - set(got)), sorted(set(got) - set(params))
                    self._reject(
                        req.peer_id,
                        "wrong-tensors",
                        f"delta for {mid}: missing {missing[:3]}, unexpected {extra[:3]}",
                    )
                for name, tensor in got.items():
                    ref = params[name]
                    if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
                        self._reject(
                            req.peer_id,
                            "wrong-shape",
                            f"{mid}/{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                            f"expected {tuple(ref.shape)} {ref.dtype}",
                        )
                decoded = got
            else:
                try:
                    decoded = codecs.decode(req.codec, got, params)
                except WireError as exc:
                    self._reject(req.peer_id, "bad-encoding", f"delta for {mid}: {exc}")
            for name, tensor in decoded.items():
                if not torch.isfinite(tensor).all():
                    self._reject(req.peer_id, "non-finite", f"{mid}/{name} contains NaN or inf")
            deltas[mid] = decoded
        return deltas

    def _task(self, peer_id: str, task_id: str, ticket: str) -> dict[str, Any]:
        """The task a request acts for: from its ticket, or (scheduler) from the lease table."""
        if ticket:
            task = tickets.read_ticket(self.secret, ticket)
            if task is None:
                self._reject(peer_id, "bad-ticket", f"task {task_id}: ticket does not verify")
            if task.get("task") != task_id:
                self._reject(
                    peer_id, "bad-ticket", f"the ticket is for another task than {task_id}"
                )
            if task.get("peer") != peer_id:
                self._reject(peer_id, "not-your-task", f"task {task_id} is leased to another peer")
            return task
        if not self.is_scheduler:
            self._reject(peer_id, "bad-ticket", f"task {task_id}: owners need the task's ticket")
        lease = self._issued_to(task_id, peer_id)
        return {
            "task": lease.task_id,
            "peer": lease.peer_id,
            "path": lease.path,
            "round": lease.round,
            "versions": lease.module_versions,
            "weight": self._weight(lease.path, lease.round),
        }

    def _need_scheduler(self, who: str) -> None:
        if not self.is_scheduler:
            self._reject(
                who, "not-scheduler", "this coordinator owns modules but does not lease tasks"
            )

    def _issued_to(self, task_id: str, peer_id: str) -> Lease:
        lease = self.scheduler.issued.get(task_id)
        if lease is None:
            self._reject(
                peer_id, "unknown-task", f"task {task_id} was not issued by this coordinator"
            )
        if lease.peer_id != peer_id:
            self._reject(peer_id, "not-your-task", f"task {task_id} is leased to another peer")
        return lease

    def _expired(self, lease: Lease) -> None:
        log.warning(
            "lease %s of peer %s expired; path P%d is open again",
            lease.task_id,
            lease.peer_id,
            lease.path,
        )
        self.metrics(
            {
                "event": "lease_expired",
                "task": lease.task_id,
                "peer": lease.peer_id,
                "path": lease.path,
            }
        )

    def _reject(self, peer_id: str, reason: str, message: str):
        self._count(peer_id, reason)
        raise RejectedError(message, reason=reason)

    def _count(self, peer_id: str, reason: str) -> None:
        self.rejections[reason] += 1
        self.rejections_by_peer[peer_id][reason] += 1

    def _seen(self, peer_id: str, **info: Any) -> None:
        peer = self.peers.setdefault(peer_id, {"tasks_done": 0, "tokens": 0, "task": None})
        peer["last_seen"] = self.clock()
        peer.update(info)


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
