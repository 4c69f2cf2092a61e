"""The volunteer's loop: claim a task, fetch the path's modules, train H inner steps, push deltas.

DiPaCo Algorithm 1, lines 5-10, seen from one worker. The peer never holds more than one path
(promise 5). Its inner AdamW state stays on the peer, per path, in a pickle-free file, so a path
it trains again continues its own optimizer (DiLoCo does not synchronise inner state); the
scheduler keeps peers on the path they trained last for that reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.data.shards import TokenShard, window_batches
from dipaco.errors import CorruptFileError, DipacoError, RejectedError, TransportError
from dipaco.model.optim import (
    InnerSettings,
    load_optimizer_state_tensors,
    make_optimizer,
    optimizer_state_tensors,
    param_names_in_optimizer_order,
    train_steps,
)
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import Frame, read_tensor_file, tensors_sha256, write_tensor_file

log = logging.getLogger(__name__)


class TaskAborted(Exception):
    """The lease was lost (expired and handed to another peer); drop the work."""


def resolve_device(name: str) -> str:
    """``auto`` is the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class Peer:
    def __init__(
        self,
        transport: Transport,
        peer_id: str,
        state_dir: str | Path,
        *,
        device: str = "cpu",
        max_tasks: int | None = None,
        stop: threading.Event | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        give_up_seconds: float = 300.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self.transport = transport
        self.peer_id = peer_id
        self.state_dir = Path(state_dir)
        self.device = resolve_device(device)
        self.max_tasks = max_tasks
        self.give_up_seconds, self.retry_seconds = give_up_seconds, retry_seconds
        self.stop = stop or threading.Event()
        self.on_progress = on_progress or (lambda info: None)
        self.cache: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.last_path: int | None = None
        self.tasks_done = 0
        self.config: dict[str, Any] = {}

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        welcome = self.transport.request(m.Hello(peer_id=self.peer_id, device=self.device))
        self.config = welcome.config
        self.model_cfg = ModelConfig(**self.config["model"])
        self.topology = Topology.from_dict(self.config["topology"])
        self.train_cfg = self.config["train"]
        last_contact = time.monotonic()
        while not self.stop.is_set() and (
            self.max_tasks is None or self.tasks_done < self.max_tasks
        ):
            try:
                offer = self.transport.request(
                    m.ClaimTask(peer_id=self.peer_id, prefer_path=self.last_path)
                )
                last_contact = time.monotonic()
            except TransportError as exc:
                # The coordinator may be restarting: it keeps everything it acknowledged.
                if time.monotonic() - last_contact > self.give_up_seconds:
                    raise
                log.warning("peer %s: %s; retrying", self.peer_id, exc)
                self.stop.wait(self.retry_seconds)
                continue
            if isinstance(offer, m.NoTask):
                if offer.finished:
                    log.info("peer %s: run finished after %d tasks", self.peer_id, self.tasks_done)
                    break
                self.stop.wait(offer.retry_after)
                continue
            try:
                self.run_task(offer)
            except TaskAborted as exc:
                log.warning("peer %s: task %s aborted: %s", self.peer_id, offer.task_id, exc)
            except TransportError as exc:
                log.warning("peer %s: task %s lost: %s", self.peer_id, offer.task_id, exc)
            except RejectedError as exc:
                log.warning(
                    "peer %s: task %s rejected: %s (%s)",
                    self.peer_id,
                    offer.task_id,
                    exc,
                    exc.reason,
                )
        return self.tasks_done

    def run_task(self, task: m.TaskOffer) -> None:
        modules = self.fetch(task)
        model = self.topology.build_path(
            self.model_cfg,
            task.path,
            {mid: {k: v.clone() for k, v in tensors.items()} for mid, tensors in modules.items()},
        ).to(self.device)
        tc = self.train_cfg
        settings = InnerSettings(
            lr=tc["lr"],
            warmup_steps=tc["warmup_steps"],
            total_steps=task.total_steps,
            min_lr_ratio=tc["min_lr_ratio"],
            weight_decay=tc["weight_decay"],
            grad_clip=tc["grad_clip"],
        )
        optimizer = make_optimizer(model, settings)
        names = param_names_in_optimizer_order(model)
        self._load_inner_state(task.path, optimizer, names)
        shard = TokenShard(Path(self.config["shards_dir"]) / f"P{task.path}" / "train")
        # The task's data slice: windows drawn by a generator seeded by (run seed, path, round).
        batches = window_batches(
            shard, [task.seed, task.path, task.round], tc["batch_size"], tc["seq_len"], self.device
        )
        start = time.monotonic()
        progress = {"step": 0}
        lease_lost = threading.Event()

        def on_step(step: int, loss: float) -> None:
            if self.stop.is_set():
                raise TaskAborted("peer is stopping")
            if lease_lost.is_set():
                raise TaskAborted("lease lost")
            progress["step"] = step - task.step_offset + 1
            self.on_progress(
                {
                    "task": task.task_id,
                    "path": task.path,
                    "step": progress["step"],
                    "steps": task.inner_steps,
                    "loss": loss,
                    "elapsed": time.monotonic() - start,
                }
            )

        beats_done = threading.Event()
        beats = threading.Thread(
            target=self._heartbeats,
            args=(task, progress, lease_lost, beats_done),
            name=f"{self.peer_id}-heartbeat",
            daemon=True,
        )
        beats.start()
        try:
            losses = train_steps(
                model,
                optimizer,
                batches,
                settings,
                steps=task.inner_steps,
                step_offset=task.step_offset,
                on_step=on_step,
            )
        except TaskAborted:
            if self.stop.is_set():
                self.transport.request(m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id))
            raise
        finally:
            beats_done.set()
            beats.join()
        trained = self.topology.split_path_state(
            task.path, {k: v.detach().cpu() for k, v in model.state_dict().items()}
        )
        tensors = {
            f"{mid}/{name}": (modules[mid][name] - trained[mid][name]).contiguous()
            for mid in modules
            for name in modules[mid]
        }
        tokens = task.inner_steps * tc["batch_size"] * tc["seq_len"]
        self.transport.request(
            m.SubmitDelta(
                peer_id=self.peer_id,
                task_id=task.task_id,
                path=task.path,
                base_versions=task.module_versions,
                tokens=tokens,
                losses=losses,
                tensors=tensors,
            )
        )
        self._save_inner_state(task.path, optimizer, names)
        self.tasks_done += 1
        self.last_path = task.path
        log.info(
            "peer %s: %s done, loss %.3f -> %.3f", self.peer_id, task.task_id, losses[0], losses[-1]
        )

    def _heartbeats(
        self, task: m.TaskOffer, progress: dict, lost: threading.Event, done: threading.Event
    ) -> None:
        """Keep the lease alive from a thread of its own, however long a training step takes."""
        while not done.wait(self.config["heartbeat_seconds"]):
            try:
                ack = self.transport.request(
                    m.Heartbeat(peer_id=self.peer_id, task_id=task.task_id, step=progress["step"])
                )
            except DipacoError as exc:
                log.warning("peer %s: heartbeat failed: %s", self.peer_id, exc)
                continue
            if not ack.lease_ok:
                lost.set()
                return

    # ---- modules ------------------------------------------------------------------------------
    def fetch(self, task: m.TaskOffer) -> dict[str, dict[str, torch.Tensor]]:
        """The path's modules at the task's versions, downloading only what the cache lacks."""
        have = {mid: v for mid, (v, _) in self.cache.items()}
        reply = self.transport.request(
            m.FetchModules(peer_id=self.peer_id, task_id=task.task_id, have=have)
        )
        fresh: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in reply.tensors.items():
            mid, _, name = key.partition("/")
            fresh.setdefault(mid, {})[name] = tensor
        modules = {}
        for mid, version in reply.versions.items():
            if version != task.module_versions.get(mid):
                raise TaskAborted(
                    f"module {mid} moved to version {version} since the task was issued"
                )
            tensors = fresh[mid] if mid in fresh else self.cache[mid][1]
            if tensors_sha256(tensors) != reply.hashes[mid]:
                self.cache.pop(mid, None)
                raise TaskAborted(f"module {mid} v{version} failed its hash check")
            self.cache[mid] = (version, tensors)
            modules[mid] = tensors
        return modules

    # ---- inner optimizer state ----------------------------------------------------------------
    def _inner_file(self, path: int) -> Path:
        return self.state_dir / "inner" / f"P{path}.dpt"

    def _load_inner_state(
        self, path: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        file = self._inner_file(path)
        if not file.exists():
            return
        try:
            load_optimizer_state_tensors(optimizer, names, read_tensor_file(file).tensors)
        except (CorruptFileError, KeyError, IndexError) as exc:
            log.warning("peer %s: ignoring unusable inner state %s: %s", self.peer_id, file, exc)

    def _save_inner_state(
        self, path: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        write_tensor_file(
            self._inner_file(path),
            Frame("InnerState", {"path": path}, optimizer_state_tensors(optimizer, names)),
        )
