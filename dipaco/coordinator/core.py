"""The coordinator core: a transport-free state machine over the module store and the scheduler.

Operations (DESIGN.md, "The core is transport-free"): hello, claim a task, fetch a path's
modules, heartbeat, submit a delta, release a task, status. :meth:`Coordinator.handle` maps wire
frames to them, so every transport (local, loopback, and later hivemind and Flower) drives the
same code. Every rejection raises a :class:`RejectedError` with a reason and is counted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.scheduler import Scheduler
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import CorruptFileError, DipacoError, RejectedError
from dipaco.fileio import write_json_atomic
from dipaco.model.topology import Topology
from dipaco.protocols import messages as m

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
    ) -> None:
        self.root = Path(root)
        self.topology = topology
        self.rounds, self.inner_steps = rounds, inner_steps
        self.step_offset, self.total_steps, self.seed = step_offset, total_steps, seed
        self.outer = outer
        self.run_id, self.peer_config = run_id, peer_config
        # Outer-step weights: each path's shard size (paper eq. 2-3); without it, trained tokens.
        self.shard_tokens = shard_tokens
        self.on_round, self.metrics = on_round, metrics or (lambda event: None)
        self.store = ModuleStore(self.root)
        self.scheduler = Scheduler(lease_seconds, clock)
        self.lock = threading.RLock()
        self.clock = clock
        self.rejections: Counter[str] = Counter()
        self.rejections_by_peer: dict[str, Counter[str]] = defaultdict(Counter)
        self.peers: dict[str, dict[str, Any]] = {}
        self.epoch = 0
        self.finished_event = threading.Event()

    # ---- start and resume ---------------------------------------------------------------------
    def start(self, initial_modules: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """Open the store (creating version 0 from ``initial_modules`` if new) and resume."""
        state_file = self.root / "coordinator.json"
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
        if initial_modules is not None:
            self.store.initialize(initial_modules)
        else:
            self.store.load(self.topology.module_ids())
        # A crash may have left a module with every delta on disk but its step not committed.
        for mid in self.topology.module_ids():
            self._maybe_step(mid)
        self._save_state()
        if self.finished:
            self.finished_event.set()

    def _save_state(self) -> None:
        write_json_atomic(
            self.root / "coordinator.json",
            {"epoch": self.epoch, "rejections": dict(self.rejections), "run_id": self.run_id},
        )

    # ---- state --------------------------------------------------------------------------------
    def path_round(self, path: int) -> int:
        return min(self.store.version(mid) for mid in self.topology.path_modules(path))

    @property
    def round(self) -> int:
        """Rounds completed by every module."""
        return min(rec.version for rec in self.store.modules.values())

    @property
    def finished(self) -> bool:
        return self.round >= self.rounds

    def open_paths(self) -> dict[int, int]:
        out = {}
        for p in range(self.topology.num_paths):
            mids = self.topology.path_modules(p)
            versions = {self.store.version(mid) for mid in mids}
            if len(versions) != 1:
                continue  # some module of the path is still waiting for other paths
            (v,) = versions
            reported = all(p in self.store.modules[mid].pending for mid in mids)
            if v < self.rounds and not reported:
                out[p] = v
        return out

    # ---- operations ---------------------------------------------------------------------------
    def hello(self, req: m.Hello) -> m.Welcome:
        self._seen(req.peer_id, device=req.device, capabilities=req.capabilities)
        return m.Welcome(run_id=self.run_id, config=self.peer_config)

    def claim(self, req: m.ClaimTask) -> m.TaskOffer | m.NoTask:
        self._seen(req.peer_id)
        if self.finished:
            return m.NoTask(reason="run finished", retry_after=0.0, finished=True)
        lease = self.scheduler.claim(req.peer_id, self.open_paths(), req.prefer_path)
        if lease is None:
            return m.NoTask(
                reason="every open path is leased or waiting for its modules",
                retry_after=0.5,
                finished=False,
            )
        self.peers[req.peer_id]["task"] = lease.task_id
        self.metrics(
            {
                "event": "task_issued",
                "task": lease.task_id,
                "peer": req.peer_id,
                "path": lease.path,
                "round": lease.round,
            }
        )
        return m.TaskOffer(
            task_id=lease.task_id,
            path=lease.path,
            round=lease.round,
            module_versions={
                mid: self.store.version(mid) for mid in self.topology.path_modules(lease.path)
            },
            inner_steps=self.inner_steps,
            step_offset=self.step_offset + lease.round * self.inner_steps,
            total_steps=self.total_steps,
            lease_seconds=self.scheduler.lease_seconds,
            seed=self.seed,
        )

    def fetch(self, req: m.FetchModules) -> m.Modules:
        self._seen(req.peer_id)
        lease = self._issued_to(req.task_id, req.peer_id)
        versions, hashes, tensors = {}, {}, {}
        for mid in self.topology.path_modules(lease.path):
            record = self.store.modules[mid]
            versions[mid], hashes[mid] = record.version, record.hash
            if req.have.get(mid) != record.version:
                tensors.update({f"{mid}/{k}": v for k, v in record.params.items()})
        return m.Modules(versions=versions, hashes=hashes, tensors=tensors)

    def heartbeat(self, req: m.Heartbeat) -> m.HeartbeatAck:
        self._seen(req.peer_id, step=req.step)
        if req.task_id is None:
            return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
        lease = self.scheduler.heartbeat(req.task_id, req.peer_id)
        if lease is None:
            return m.HeartbeatAck(lease_ok=False, deadline_in=0.0)
        return m.HeartbeatAck(lease_ok=True, deadline_in=lease.deadline - self.clock())

    def release(self, req: m.ReleaseTask) -> m.Ok:
        self._seen(req.peer_id)
        if self.scheduler.release(req.task_id, req.peer_id):
            self.metrics({"event": "task_released", "task": req.task_id, "peer": req.peer_id})
        return m.Ok()

    def submit(self, req: m.SubmitDelta) -> m.DeltaAck:
        self._seen(req.peer_id)
        lease = self._issued_to(req.task_id, req.peer_id)
        if req.path != lease.path:
            self._reject(
                req.peer_id,
                "wrong-path",
                f"task {req.task_id} is for path {lease.path}, not {req.path}",
            )
        if req.tokens <= 0:
            self._reject(
                req.peer_id, "bad-tokens", f"token count must be positive, got {req.tokens}"
            )
        mids = self.topology.path_modules(lease.path)
        deltas = self._split_delta(req, mids)
        weight = self.shard_tokens[lease.path] if self.shard_tokens else req.tokens
        for mid in mids:
            current = self.store.version(mid)
            if req.base_versions.get(mid) != current:
                self._reject(
                    req.peer_id,
                    "stale",
                    f"delta for {mid} is against version {req.base_versions.get(mid)}, "
                    f"module is at {current}",
                )
            if lease.path in self.store.modules[mid].pending:
                self._reject(
                    req.peer_id,
                    "duplicate",
                    f"path {lease.path} already reported for {mid} version {current}",
                )
        for mid in mids:
            self.store.add_delta(mid, lease.path, weight, req.task_id, req.peer_id, deltas[mid])
        self.scheduler.finish(req.task_id)
        peer = self.peers[req.peer_id]
        peer["tasks_done"] = peer.get("tasks_done", 0) + 1
        peer["tokens"] = peer.get("tokens", 0) + req.tokens
        peer["task"] = None
        self.metrics(
            {
                "event": "delta",
                "task": req.task_id,
                "peer": req.peer_id,
                "path": lease.path,
                "round": lease.round,
                "tokens": req.tokens,
                "step_offset": self.step_offset + lease.round * self.inner_steps,
                "train_losses": req.losses,
            }
        )
        round_before = self.round
        closed = [mid for mid in mids if self._maybe_step(mid)]
        self._save_state()
        if self.round > round_before:
            self.metrics({"event": "round", "round": self.round})
            if self.on_round is not None:
                self.on_round(self.round)
            if self.finished:
                self.finished_event.set()
        return m.DeltaAck(accepted=mids, closed=closed)

    def status(self, req: m.GetStatus | None = None) -> m.Status:
        now = self.clock()
        return m.Status(
            state={
                "run_id": self.run_id,
                "round": self.round,
                "rounds": self.rounds,
                "finished": self.finished,
                "modules": {
                    mid: {"version": r.version, "pending": sorted(r.pending), "hash": r.hash}
                    for mid, r in self.store.modules.items()
                },
                "leases": {
                    t: {
                        "path": lease.path,
                        "round": lease.round,
                        "peer": lease.peer_id,
                        "deadline_in": round(lease.deadline - now, 1),
                    }
                    for t, lease in self.scheduler.leases.items()
                },
                "expired_leases": self.scheduler.expired,
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
    }

    def handle(self, data: bytes) -> bytes:
        """Decode a request frame, run the operation, encode the reply (or an Error)."""
        try:
            req = m.decode_message(data)
            op = self._OPS.get(type(req))
            if op is None:
                raise RejectedError(f"{type(req).__name__} is not a request", reason="bad-message")
            with self.lock:
                for lease in self.scheduler.expire():
                    self._expired(lease)
                reply = getattr(self, op)(req)
        except DipacoError as exc:
            if not isinstance(exc, RejectedError) or exc.reason == "bad-message":
                self._count("unknown", exc.reason)  # undecodable: no peer id to blame
            log.info("rejected: %s (%s)", exc, exc.reason)
            reply = m.Error(reason=exc.reason, message=str(exc))
        return m.encode_message(reply)

    # ---- helpers ------------------------------------------------------------------------------
    def _maybe_step(self, mid: str) -> bool:
        record = self.store.modules[mid]
        if record.version >= self.rounds:
            return False
        if set(record.pending) != set(self.topology.paths_through(mid)):
            return False
        info = self.store.outer_step(mid, self.outer)
        self.metrics({"event": "outer_step", **info})
        log.info("outer step %s -> v%d (paths %s)", mid, info["version"], info["paths"])
        return True

    def _split_delta(
        self, req: m.SubmitDelta, mids: list[str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        deltas: dict[str, dict[str, torch.Tensor]] = {mid: {} for mid in mids}
        for key, tensor in req.tensors.items():
            mid, _, name = key.partition("/")
            if mid not in deltas:
                self._reject(
                    req.peer_id,
                    "unknown-module",
                    f"tensor {key} is for a module outside path {req.path}",
                )
            deltas[mid][name] = tensor
        for mid in mids:
            params = self.store.params(mid)
            got = deltas[mid]
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
                if not torch.isfinite(tensor).all():
                    self._reject(req.peer_id, "non-finite", f"{mid}/{name} contains NaN or inf")
        return deltas

    def _issued_to(self, task_id: str, peer_id: str):
        lease = self.scheduler.issued.get(task_id)
        if lease is None:
            self._reject(
                peer_id, "unknown-task", f"task {task_id} was not issued by this coordinator"
            )
        if lease.peer_id != peer_id:
            self._reject(peer_id, "not-your-task", f"task {task_id} is leased to another peer")
        return lease

    def _expired(self, lease) -> None:
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
