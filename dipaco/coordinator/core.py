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

import errno
import json
import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dipaco.config import SchedulerSection, SecuritySection, ValidationSection
from dipaco.coordinator import tickets
from dipaco.coordinator.access import AccessPolicy
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.scheduler import Lease, Scheduler
from dipaco.coordinator.store import ModuleStore
from dipaco.coordinator.validation import KeyScores, NormTracker, delta_norm
from dipaco.errors import CorruptFileError, DipacoError, RejectedError, WireError
from dipaco.faults import fault_point
from dipaco.fileio import file_info, write_json_atomic
from dipaco.model.topology import Topology
from dipaco.protocols import auth, codecs
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
        identity: auth.Identity | None = None,
        scheduler_key: str | None = None,
        security: SecuritySection | None = None,
        is_scheduler: bool = True,
        codec: str = "lossless",
        files: dict[str, Path] | None = None,
        phase_rounds: list[int] | tuple[int, ...] = (),
        validation: ValidationSection | None = None,
        heldout_loss: Callable[[int, dict[str, dict[str, torch.Tensor]]], float] | None = None,
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
        # Our Ed25519 key signs replies, tickets, releases and the manifest; the scheduler's key
        # is the one whose tickets an owner accepts (our own, on the scheduler).
        self.identity = identity or auth.Identity.load_or_create(self.root / "signing.key")
        self.scheduler_key = self.identity.public_key if is_scheduler else scheduler_key
        if self.scheduler_key is None:
            raise ValueError("a module owner needs the scheduler's public key (scheduler_key)")
        self.security = security or SecuritySection()
        self.access = AccessPolicy(
            self.root,
            self.security,
            self_keys=(self.identity.public_key, self.scheduler_key),
            metrics=self.metrics,
            clock=clock,
        )
        self.guard = auth.ReplayGuard(self.security.clock_skew_seconds)
        self.owner_keys: dict[str, str] = {owner_id: self.identity.public_key}
        self._caller: str | None = None  # the key of the request being handled (under the lock)
        self.max_request_bytes = 64 << 20  # set from the modules' size by start()
        if is_scheduler:
            self.peer_config["coordinator_key"] = self.identity.public_key
        self.owners: dict[str, str] = {}
        self.addresses: dict[str, list[str]] = {}  # owner id -> how peers reach it
        self.remote: dict[str, dict[str, Any]] = {}  # other owners' modules, from their reports
        # scheduler: remote modules it holds a checked copy of at their final version (gathered
        # after the run); owner: what the scheduler's last ReportAck said of ours
        self.gathered: set[str] = set()
        # scheduler: fetches other owners' current modules (module ids -> tensors) for the
        # per-round evaluation; None: not possible on this transport
        self.fetch_remote: Callable[[list[str]], dict[str, dict[str, torch.Tensor]]] | None = None
        self.eval_note: str | None = None  # why there is no per-round validation, if there is none
        self.owner_seen: dict[str, float] = {}  # other owners: when they last reported
        self.handing: dict[str, tuple[str, float]] = {}  # module -> (new owner, since)
        self.done: set[tuple[int, int]] = set()  # (path, round) whose task every owner acked
        # (path, round) whose task ran past the deadline: rounds may close without them.
        self.overdue: set[tuple[int, int]] = set()
        self.void: dict[str, int] = {}  # an owner's copy of the scheduler's ended leases
        self.files = files or {}
        # Routing phases (DiPaCo Algorithm 1, line 2): tasks whose base round is at or past
        # phase_rounds[k - 1] train on phase k's shards, and wait until that phase is ready.
        self.phase_rounds = sorted(phase_rounds)
        # Phases decided during the run (schedule_phase) survive a restart in this file.
        self._decided = self.root / "decided_phases.json"
        if self._decided.exists():
            try:
                decided = [int(r) for r in json.loads(self._decided.read_text())["after"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptFileError(f"{self._decided}: unreadable ({exc})") from exc
            self.phase_rounds = sorted(set(self.phase_rounds) | set(decided))
        self.phases: dict[int, dict[str, Any]] = {}
        if self.is_scheduler:
            self.phases[0] = {"prefix": "shards", "tokens": shard_tokens, "files": {}}
        self.last_round = 0
        self.changed = threading.Event()  # set on every change an owner must report
        self.unstepped: set[str] = set()  # modules whose outer step failed (disk): retried
        # Trust in a delta's content (validation.py): its norm against the module's recent ones,
        # and (optional) the path's held-out loss with it, from ``heldout_loss(path, modules)``.
        self.validation = validation or ValidationSection()
        v = self.validation
        self.norms = NormTracker(
            self.root / "validation.json",
            mode=v.norm_check,
            mads=v.norm_mads,
            ratio=v.norm_ratio,
            min_observations=v.min_observations,
            max_norm=v.max_norm,
            window=v.norm_window,
        )
        self.heldout_loss = heldout_loss
        self.key_scores = KeyScores(self.root / "key_scores.json", v.heldout_tolerance)
        # "auto" aggregation with the held-out check: the modules whose every delta is scored
        # take the paper's mean, the others the robust combiner (outer_settings_of).
        self.checked_mean = (
            v.aggregation == "auto" and v.heldout_check and outer.aggregation != "mean"
        )

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
            _check_state(state_file, saved, self.topology.module_ids())
            self.epoch = saved.get("epoch", 0) + 1
            self.scheduler.epoch = self.epoch
            self.rejections.update(saved.get("rejections", {}))
            for who, counts in saved.get("rejections_by_peer", {}).items():
                self.rejections_by_peer[who].update(counts)
        if self.is_scheduler:
            self.owners = saved.get("owners") or dict.fromkeys(
                self.topology.module_ids(), self.owner_id
            )
            self.remote = saved.get("remote", {})
            self.addresses.update(saved.get("addresses", {}))
            self.owner_keys.update(saved.get("owner_keys", {}))
            self.scheduler.ended.update(saved.get("ended", {}))
        else:
            self.owners = dict.fromkeys(self.store.owned_on_disk(), self.owner_id)
        mine = self.owned_modules()
        if initial_modules is not None:
            self.store.initialize({mid: initial_modules[mid] for mid in mine})
        else:
            self.store.load(mine)
        # No request may be larger than two copies of everything we own (a delta is one path's
        # share of it, in float32 or less) plus room for the header: bigger ones are refused
        # before they are decoded.
        owned_bytes = sum(
            t.numel() * t.element_size() for mid in mine for t in self.store.params(mid).values()
        )
        self.max_request_bytes = 2 * owned_bytes + (16 << 20)
        for mid in mine:
            # A crash may have left a module with every delta on disk but its step not committed.
            self._maybe_step(mid)
        self._report_repairs()
        self.last_round = self.round
        self._save_state(required=True)  # the epoch must be on disk: task ids are never reused
        if self.finished:
            self.finished_event.set()

    def _save_state(self, required: bool = False) -> None:
        """Write coordinator.json. Outside ``start`` a failure (a full disk) is logged, not
        raised: the file holds counters and ownership, which the next save brings up to date,
        and raising would drop the reply to a request whose deltas are already durable."""
        try:
            self._write_state()
        except OSError as exc:
            if required:
                raise
            log.error("cannot save %s: %s", self.root / "coordinator.json", exc)

    def save_counts(self) -> None:
        """Write the state now, the refusal counts with it (at shutdown: refusals since the last
        change would otherwise be lost)."""
        with self.lock:
            self._save_state()

    def _report_repairs(self) -> None:
        """Log and count what the store repaired on start: corrupt files, rolled-back heads."""
        for file in self.store.quarantined:
            self.rejections["corrupt-file"] += 1
            self.metrics({"event": "file_quarantined", "file": file})
        for mid, (bad, used) in self.store.rolled_back.items():
            self.metrics({"event": "rolled_back", "module": mid, "bad": bad, "version": used})
        self.store.quarantined.clear()
        self.store.rolled_back.clear()

    def _write_state(self) -> None:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "rejections": dict(self.rejections),
            "rejections_by_peer": {p: dict(c) for p, c in self.rejections_by_peer.items()},
            "run_id": self.run_id,
            "owner_id": self.owner_id,
        }
        if self.is_scheduler:
            state.update(
                owners=self.owners,
                remote=self.remote,
                addresses=self.addresses,
                owner_keys=self.owner_keys,
                ended=self.scheduler.ended,
            )
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

    def schedule_phase(self) -> tuple[int, int] | None:
        """Decide a routing phase now: (its number, the first base round that trains on it).

        That round is past every module's version, so no task already issued changes shards;
        the decision is written to disk before it is returned. None when no round is left.
        """
        with self.lock:
            versions = [self.version(mid) or 0 for mid in self.topology.module_ids()]
            after = max([self.round, *versions]) + 1
            if after >= self.rounds:
                return None
            if any(r >= after for r in self.phase_rounds):  # one is pending already
                return None
            self.phase_rounds = sorted({*self.phase_rounds, after})
            previous = []
            if self._decided.exists():
                previous = json.loads(self._decided.read_text())["after"]
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._decided, {"after": sorted({*previous, after})})
            phase = len(self.phase_rounds)
            self.metrics({"event": "phase_decided", "phase": phase, "after_round": after})
            return phase, after

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
        return m.Welcome(
            run_id=self.run_id,
            config=self.peer_config,
            signature=auth.sign_payload(self.identity, "manifest", self.peer_config),
        )

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
        # A path-parallel peer names the tasks it holds already: it asks for one more.
        fresh = all(lease.task_id in req.holding for lease in self.scheduler.leases_of(req.peer_id))
        if fresh and self._caller is not None and not self.access.is_owner(self._caller):
            held = [
                lease
                for lease in self.scheduler.leases.values()
                if self.access.names.get(lease.peer_id) == self._caller
            ]
            if len(held) >= self.security.max_tasks_per_key:
                self._reject(
                    req.peer_id,
                    "quota",
                    f"this key already holds {len(held)} live tasks "
                    f"(at most {self.security.max_tasks_per_key})",
                )
        lease = self.scheduler.claim(
            req.peer_id, self.open_paths(), req.prefer_path, self.inner_steps, req.holding
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
            "key": self._caller,
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
            ticket=tickets.sign_ticket(self.identity, payload),
            owners={mid: self.owners[mid] for mid in lease.module_versions},
            codec=self.codec,
            shard=shard,
            shard_files={k: v for k, v in phase["files"].items() if k.startswith(shard + ".")},
        )

    def fetch(self, req: m.FetchModules) -> m.Modules:
        self._seen(req.peer_id)
        task = self._task(req.peer_id, req.task_id, req.ticket)
        versions, hashes, tensors, signatures = {}, {}, {}, {}
        for mid in self.topology.path_modules(task["path"]):
            if not self.owns(mid):
                continue
            record = self.store.modules[mid]
            versions[mid], hashes[mid] = record.version, record.hash
            signatures[mid] = self.release_signature(mid, record.version, record.hash)
            if req.have.get(mid) != record.version:
                tensors.update({f"{mid}/{k}": v for k, v in record.params.items()})
        return m.Modules(versions=versions, hashes=hashes, tensors=tensors, signatures=signatures)

    def fetch_releases(self, req: m.FetchReleases) -> m.Modules:
        """Every named module this coordinator owns, at its latest version, signed as a release;
        modules it does not own are left out (the caller asks their owners)."""
        unknown = sorted(set(req.modules) - set(self.topology.module_ids()))
        if unknown:
            self._reject(req.peer_id, "bad-message", f"this run has no modules {unknown[:8]}")
        versions, hashes, tensors, signatures = {}, {}, {}, {}
        for mid in dict.fromkeys(req.modules):
            if not self.owns(mid):
                continue
            record = self.store.modules[mid]
            versions[mid], hashes[mid] = record.version, record.hash
            signatures[mid] = self.release_signature(mid, record.version, record.hash)
            tensors.update({f"{mid}/{k}": v for k, v in record.params.items()})
        return m.Modules(versions=versions, hashes=hashes, tensors=tensors, signatures=signatures)

    def release_signature(self, mid: str, version: int, digest: str) -> str:
        """This owner's signature of a module release, which peers check before training."""
        release = {"run": self.run_id, "module": mid, "version": version, "hash": digest}
        return auth.sign_payload(self.identity, "release", release)

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
            self._save_state()  # the ticket is void, and stays so after a restart
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
        norms, trust = self._check_content(req, path, deltas, [mid for mid, _, _ in plan])
        for mid, base, lateness in plan:
            damped = weight * trust * self.policy.stale_damping**lateness
            try:  # a full disk refuses the delta; what was stored is acked on the retry
                self.store.add_delta(
                    mid,
                    path,
                    damped,
                    req.task_id,
                    req.peer_id,
                    deltas[mid],
                    base_version=base,
                    voter=self.voter_of(req),
                )
            except OSError as exc:
                full = exc.errno == errno.ENOSPC
                self._reject(req.peer_id, "disk-full" if full else "io-error", f"{mid}: {exc}")
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
        for mid, _, _ in plan:  # only now durable: the norm statistics count it
            self.norms.record(mid, norms[mid])
        if plan:
            self.norms.save()
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
        fault_point("submit.before_ack")
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
            missing = self._unacked(task)
            if missing:
                # A task is done when its deltas are, not when its peer says so: a TaskDone
                # without them would take the path out of the round and stall its modules.
                # The lease stays: it expires, or the round's deadline re-issues it.
                self._reject(
                    req.peer_id,
                    "not-acked",
                    f"task {req.task_id}: no acknowledged delta for {', '.join(missing)} yet",
                )
            self._task_done(task, req.peer_id, req.tokens, req.losses)
            self._after_change()
        return m.Ok()

    def _unacked(self, task: dict) -> list[str]:
        """The modules of ``task``'s path holding no acknowledged delta of it: for our own
        modules, its task id among the pending, late or applied deltas; for another owner's, its
        last report shows the path pending at the task's base, or the module past that base."""
        missing = []
        for mid in self.topology.path_modules(task["path"]):
            base = task["versions"].get(mid)
            if self.owns(mid):
                record = self.store.modules[mid]
                held = [d.task_id for d in (*record.pending.values(), *record.late.values())]
                if task["task"] not in held and task["task"] not in record.applied:
                    missing.append(mid)
                continue
            version = self.version(mid)
            if version is None or base is None:
                missing.append(mid)
            elif version == base and task["path"] not in self.reported(mid):
                missing.append(mid)
        return missing

    def get_owners(self, req: m.GetOwners) -> m.Owners:
        return m.Owners(
            owners=dict(self.owners),
            addresses={o: self.addresses.get(o, []) for o in set(self.owners.values())},
            keys={o: k for o, k in self.owner_keys.items() if o in set(self.owners.values())},
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
        self._owner_proof(req.owner_id, req.proof, "report", req.modules)
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
        self.owner_seen[req.owner_id] = self.clock()
        if req.addresses:
            self.addresses[req.owner_id] = list(req.addresses)
        self._save_state()
        self._after_change()
        return m.ReportAck(
            overdue=[list(pr) for pr in sorted(self.overdue)],
            ended=dict(self.scheduler.ended),
            gathered=sorted(self.gathered),
        )

    def hand_over(self, req: m.HandOver) -> m.ModuleState:
        self._need_scheduler(req.owner_id)
        self._owner_proof(req.owner_id, req.proof, "handover", req.modules)
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
                    "voter": delta.voter,
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
        self._owner_proof(req.owner_id, req.proof, "confirm", req.hashes)
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
            proof=tickets.prove(self.identity, "report", self.owner_id, modules),
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
                "peers": self._peer_rows(now),
                "owners": self._owner_rows(now),
                "evaluation": self.eval_note,
                "rejections": dict(self.rejections),
                "rejections_by_peer": {p: dict(c) for p, c in self.rejections_by_peer.items()},
                "access": self.access.summary(),
                "key_scores": {
                    auth.fingerprint(k): v for k, v in self.key_scores.summary().items()
                },
            }
        )

    def _peer_rows(self, now: float) -> dict[str, dict[str, Any]]:
        """Peers as ``status`` shows them: module owners are not peers; a peer's task is the one
        it holds a lease for now; ``state`` is training, idle, or gone (silent longer than a
        lease: it left, or died)."""
        owners = set(self.owners.values()) | set(self.owner_seen)
        current = {lease.peer_id: t for t, lease in self.scheduler.leases.items()}
        rows = {}
        for pid, info in self.peers.items():
            if pid in owners or info.get("device") == "coordinator":  # an owner's Hello
                continue
            seen_ago = now - info["last_seen"]
            state = (
                "training"
                if pid in current
                else "gone"
                if seen_ago > self.scheduler.lease_seconds
                else "idle"
            )
            rows[pid] = {k: v for k, v in info.items() if k != "last_seen"} | {
                "seen_ago": round(seen_ago, 1),
                "task": current.get(pid),
                "state": state,
            }
        return rows

    def _owner_rows(self, now: float) -> dict[str, dict[str, Any]]:
        """Every coordinator that owns modules of the run, this one included."""
        rows: dict[str, dict[str, Any]] = {}
        for mid, owner in sorted(self.owners.items()):
            row = rows.setdefault(
                owner,
                {
                    "modules": [],
                    "addresses": self.addresses.get(owner, []),
                    "scheduler": owner == self.owner_id and self.is_scheduler,
                    "seen_ago": 0.0
                    if owner == self.owner_id
                    else round(now - self.owner_seen[owner], 1)
                    if owner in self.owner_seen
                    else None,
                },
            )
            row["modules"].append(mid)
        return rows

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
        m.FetchReleases: "fetch_releases",
        m.FetchFile: "fetch_file",
        m.OwnerReport: "owner_report",
        m.HandOver: "hand_over",
        m.ConfirmOwnership: "confirm_ownership",
    }

    def handle(self, data: bytes) -> bytes:
        """Open the signed request, admit its key, run the operation, sign the reply.

        Every refusal is an Error reply with its reason, counted once (per peer id when the
        message names one, else per key) and against the key's ban budget.
        """
        nonce, key, who = "", None, "unknown"
        try:
            nonce = auth.peek_nonce(data)
            signed = auth.open_request(data)
            nonce, key, who = signed.nonce, signed.key, f"key:{auth.fingerprint(signed.key)}"
            with self.lock:  # replays first: a replayed request costs its signer nothing
                self.guard.check(signed)
            self.access.reload()
            self.access.admit(key)
            if len(signed.body) > self.max_request_bytes:
                raise RejectedError(
                    f"a request of {len(signed.body)} bytes exceeds this coordinator's limit "
                    f"of {self.max_request_bytes}",
                    reason="too-large",
                )
            req = m.decode_message(signed.body)
            who = getattr(req, "peer_id", None) or getattr(req, "owner_id", None) or who
            reply = self._perform(key, req)
        except DipacoError as exc:
            if not exc.counted:
                with self.lock:
                    self._caller = key
                    try:
                        self._count(who, exc.reason)
                    finally:
                        self._caller = None
            log.info("rejected %s: %s (%s)", who, exc, exc.reason)
            reply = m.Error(reason=exc.reason, message=str(exc))
        sealed = auth.seal_reply(self.identity, nonce, m.encode_message(reply))
        with self.lock:  # bytes moved, for the dashboard and `dipaco status`
            peer = self.peers.get(who)
            if peer is not None:
                peer["bytes_in"] = peer.get("bytes_in", 0) + len(data)
                peer["bytes_out"] = peer.get("bytes_out", 0) + len(sealed)
        return sealed

    def act_for(self, key: str, req: m.Message) -> m.Message:
        """Run ``req`` as the holder of ``key`` would, without an envelope: for a transport that
        runs in this process and has authenticated the key itself (the Flower ServerApp claims
        and fetches for its nodes, whose keys it learned from their signed Hello). The key is
        admitted, rate-limited and bound to the request's name exactly as in :meth:`handle`;
        a refusal raises :class:`RejectedError`, counted once."""
        try:
            self.access.reload()
            self.access.admit(key)
            return self._perform(key, req)
        except DipacoError as exc:
            if not exc.counted:
                who = getattr(req, "peer_id", None) or f"key:{auth.fingerprint(key)}"
                with self.lock:
                    self._caller = key
                    try:
                        self._count(who, exc.reason)
                    finally:
                        self._caller = None
                exc.counted = True
            raise

    def refuse(self, who: str, reason: str, message: str) -> None:
        """Count a refusal a transport made before the core saw the request (a malformed
        Flower reply, say), as :meth:`handle` counts its own."""
        with self.lock:
            self._count(who, reason)
        log.info("rejected %s: %s (%s)", who, message, reason)

    def _perform(self, key: str, req: m.Message) -> m.Message:
        name = getattr(req, "peer_id", None) or getattr(req, "owner_id", None)
        op = self._OPS.get(type(req))
        if op is None:
            raise RejectedError(f"{type(req).__name__} is not a request", reason="bad-message")
        with self.lock:
            self._caller = key
            try:
                if name:
                    self.access.bind(name, key)
                self._tick()
                return getattr(self, op)(req)
            finally:
                self._caller = None

    def tick(self) -> None:
        """Expire leases and close overdue rounds; servers call this every second or so."""
        with self.lock:
            self._tick()

    # ---- helpers ------------------------------------------------------------------------------
    def _tick(self) -> None:
        gone = self.scheduler.expire()
        for lease in gone:
            self._expired(lease)
        if gone:
            self._save_state()  # their tickets are void, and stay so after a restart
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
        if not self.overdue and not self.unstepped:
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
        try:
            info = self.store.outer_step(mid, self.outer_settings_of(mid))
        except OSError as exc:  # a full disk: nothing was committed; the ticker tries again
            if mid not in self.unstepped:
                log.error("outer step of %s failed: %s; retrying every second", mid, exc)
                self.metrics({"event": "outer_step_failed", "module": mid, "error": str(exc)})
            self.unstepped.add(mid)
            return False
        self.unstepped.discard(mid)
        info["closed_by"] = "deadline" if set(info["paths"]) != paths else "all"
        self.metrics({"event": "outer_step", **info})
        for clipped in info.get("clipped", []):  # robust aggregation scaled a delta down
            self.metrics(
                {"event": "delta_clipped", "stage": "aggregation", "module": mid, **clipped}
            )
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
            # Tasks of rounds that no delta can join any more (even late) are forgotten, so that
            # a long run does not keep a record of every task it ever leased.
            horizon = self.round - self.policy.max_staleness
            self.scheduler.forget_before(horizon)
            self.done = {(p, r) for p, r in self.done if r >= horizon}
            if self.on_round is not None:
                self.on_round(self.round)
        if self.finished:
            self.finished_event.set()

    def outer_settings_of(self, mid: str) -> OuterSettings:
        """The outer step of ``mid``: ``self.outer``, except that with ``checked_mean`` (the
        "auto" aggregation of an open run with the held-out check on) a module whose every path
        this coordinator scores takes the plain mean: each delta was judged on its own already,
        and the mean costs honest runs nothing (docs/security.md has both measured)."""
        if (
            self.checked_mean
            and self.heldout_loss is not None
            and all(
                self.owns(x)
                for p in self.topology.paths_through(mid)
                for x in self.topology.path_modules(p)
            )
        ):
            return replace(self.outer, aggregation="mean")
        return self.outer

    def voter_of(self, req: m.SubmitDelta) -> str:
        """Whose vote a delta is in a robust combiner: the key that signed it (a peer id for an
        unsigned local transport). One key holding many paths of a module is one vote."""
        return self._caller or req.peer_id

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

    def _check_content(
        self,
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
        judged = {mid: self.norms.judge(mid, delta_norm(deltas[mid])) for mid in mids}
        for mid, j in judged.items():
            if j.action == "reject":
                self._reject(
                    req.peer_id,
                    "huge-norm",
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
        if self.validation.heldout_check and self.heldout_loss is not None and mids:
            trust = self._check_heldout(req, path, deltas, mids)
        for mid, j in judged.items():
            if j.action == "clip":
                self.metrics(
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

    def _check_heldout(
        self,
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
        assert self.heldout_loss is not None
        path_mids = self.topology.path_modules(path)
        if not all(self.owns(mid) for mid in path_mids):
            return 1.0
        current = {mid: self.store.params(mid) for mid in path_mids}
        proposed = dict(current)
        for mid in mids:
            proposed[mid] = {k: v - deltas[mid][k].to(v.dtype) for k, v in current[mid].items()}
        before = self.heldout_loss(path, current)
        if math.isnan(before):
            return 1.0  # no held-out documents for this path: nothing to judge by
        after = self.heldout_loss(path, proposed)
        key = self.voter_of(req)
        verdict = self.key_scores.judge(key, before, after)
        self.key_scores.save()
        self.metrics(
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
            self._reject(
                req.peer_id,
                "worse-heldout",
                f"path {path}'s held-out loss would go from {before:.4f} to {after:.4f} "
                f"(tolerance {self.validation.heldout_tolerance:g})",
            )
        if verdict.refuse == "low-score":
            self._reject(
                req.peer_id,
                "low-score",
                f"this key's deltas have made their paths worse (score {verdict.score:.4f} "
                f"after {verdict.checks} checks, below {-self.validation.heldout_tolerance / 2:g})"
                f"; this one does not improve path {path} ({before:.4f} -> {after:.4f})",
            )
        return verdict.trust

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
                    if tensor.shape != ref.shape:
                        self._reject(
                            req.peer_id,
                            "wrong-shape",
                            f"{mid}/{name}: got shape {tuple(tensor.shape)}, "
                            f"expected {tuple(ref.shape)}",
                        )
                    if tensor.dtype != ref.dtype:
                        self._reject(
                            req.peer_id,
                            "wrong-dtype",
                            f"{mid}/{name}: got {tensor.dtype}, expected {ref.dtype} "
                            "(lossless deltas carry the module's own dtype)",
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
        """The task a request acts for: from its ticket, or (scheduler) from the lease table.
        A task whose lease was released or expired acts for nothing any more."""
        ended = self.scheduler.ended if self.is_scheduler else self.void
        if task_id in ended:
            self._reject(
                peer_id,
                "lease-ended",
                f"task {task_id} was released or its lease expired; claim a new task",
            )
        if ticket:
            task = tickets.read_ticket(self.scheduler_key, ticket)
            if task is None:
                self._reject(peer_id, "bad-ticket", f"task {task_id}: ticket does not verify")
            if task.get("task") != task_id:
                self._reject(
                    peer_id, "bad-ticket", f"the ticket is for another task than {task_id}"
                )
            if task.get("peer") != peer_id or (
                self._caller is not None and task.get("key") not in (None, self._caller)
            ):
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

    def _owner_proof(self, owner_id: str, proof: str, purpose: str, payload: Any) -> None:
        """The request comes from a module owner the operator allowed, and it signed ``payload``."""
        key = self._caller
        if key is None or not self.access.is_owner(key):
            self._reject(
                owner_id,
                "not-an-owner",
                "this key may not own modules; the scheduler's operator allows owners with: "
                f"dipaco-coordinator allow --owner {key}",
            )
        if not tickets.check(key, proof, purpose, owner_id, payload):
            self._reject(owner_id, "bad-proof", f"the {purpose} is not signed by the sender's key")
        if self.owner_keys.get(owner_id) != key:
            self.owner_keys[owner_id] = key

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
        exc = RejectedError(message, reason=reason)
        exc.counted = True  # handle() must not count it again
        raise exc

    def _count(self, peer_id: str, reason: str) -> None:
        self.rejections[reason] += 1
        self.rejections_by_peer[peer_id][reason] += 1
        self.access.offence(self._caller, reason)

    def _seen(self, peer_id: str, **info: Any) -> None:
        peer = self.peers.setdefault(peer_id, {"tasks_done": 0, "tokens": 0, "task": None})
        peer["last_seen"] = self.clock()
        peer.update(info)


def _check_state(path: Path, saved: Any, module_ids: list[str]) -> None:
    """CorruptFileError unless coordinator.json has the shape ``_save_state`` writes.

    Checked before any of it is used: a damaged file must stop the restart with a clear error,
    not crash half-way or quietly hand modules to owners that never asked for them.
    """

    def mapping(value: Any, check: Callable[[Any], bool]) -> bool:
        return isinstance(value, dict) and all(
            isinstance(k, str) and check(v) for k, v in value.items()
        )

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    problem = None
    if not isinstance(saved, dict):
        problem = "not a JSON object"
    elif not count(saved.get("epoch", 0)):
        problem = "'epoch' is not a count"
    elif not mapping(saved.get("rejections", {}), count) or not mapping(
        saved.get("rejections_by_peer", {}), lambda c: mapping(c, count)
    ):
        problem = "'rejections' is not {reason: count}"
    elif not mapping(saved.get("owners") or {}, lambda v: isinstance(v, str)) or (
        saved.get("owners") and set(saved["owners"]) != set(module_ids)
    ):
        problem = "'owners' does not map each of the run's modules to an owner"
    elif not mapping(
        saved.get("remote", {}), lambda v: isinstance(v, dict) and count(v.get("version"))
    ):
        problem = "'remote' is not {module: report with a version}"
    elif not mapping(
        saved.get("addresses", {}),
        lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
    ):
        problem = "'addresses' is not {owner: [address]}"
    elif not mapping(saved.get("owner_keys", {}), lambda v: isinstance(v, str)):
        problem = "'owner_keys' is not {owner: key}"
    elif not mapping(saved.get("ended", {}), count):
        problem = "'ended' is not {task: round}"
    if problem is not None:
        raise CorruptFileError(f"{path}: damaged coordinator state: {problem}")


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
