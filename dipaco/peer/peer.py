"""The volunteer's loop: claim a task, fetch the path's modules, train H inner steps, push deltas.

DiPaCo Algorithm 1, lines 5-10, seen from one worker. The peer never holds more than one path
(promise 5), except in the path-parallel mode (``parallel`` > 1, for a local run on one device:
``Peer.run_batch``), where it claims up to ``parallel`` tasks and trains them together,
step-interleaved, each on its own CUDA stream on a GPU. Its inner AdamW state stays on the peer,
per path, in a pickle-free file, so a path it trains again continues its own optimizer (DiLoCo
does not synchronise inner state); the scheduler keeps peers on the path they trained last for
that reason.

With several module owners, the peer fetches each module from its owner and pushes each
module's delta to its owner (per-owner requests, retried until acknowledged: an owner that
restarts keeps what it acknowledged, and acknowledges a retried delta again). Deltas go out
through the run's codec with error feedback kept per path. A task is checkpointed while it
trains, so a peer restarted with the same id and state folder resumes it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dipaco.data.shards import TokenShard, window_batches
from dipaco.errors import (
    ConfigError,
    CorruptFileError,
    DataError,
    DipacoError,
    RejectedError,
    TransportError,
)
from dipaco.faults import fault_point
from dipaco.fileio import write_json_atomic
from dipaco.model.optim import (
    InnerSettings,
    fused_adamw_available,
    load_optimizer_state_tensors,
    make_optimizer,
    optimizer_state_tensors,
    param_names_in_optimizer_order,
    train_step,
)
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig
from dipaco.peer import device as devices
from dipaco.protocols import auth, codecs
from dipaco.protocols import messages as m
from dipaco.protocols.discovery import manifest_sha256
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import Frame, read_tensor_file, tensors_sha256, write_tensor_file

log = logging.getLogger(__name__)


# Refusals of a delta for what it holds (docs/security.md): the task is handed back, not retried.
JUDGED = frozenset({"huge-norm", "worse-heldout", "low-score"})


class TaskAborted(Exception):
    """The lease was lost (expired and handed to another peer); drop the work."""


class RunOver(Exception):
    """The run finished while this peer could not reach its coordinators: stop retrying."""


@dataclass(eq=False)
class TaskRun:
    """A task between its setup and its finish (``Peer._setup_task``, ``Peer._step`` and
    ``Peer._stepped`` per inner step, ``Peer._finish_task``): what its steps and its deltas need."""

    task: m.TaskOffer
    modules: dict[str, dict[str, torch.Tensor]]  # as fetched: the base its deltas are taken from
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    names: list[str]  # parameter names in the optimizer's order (its state files)
    settings: InnerSettings
    batches: Iterator[torch.Tensor]  # the task's data slice
    forward: Callable[[torch.Tensor], torch.Tensor] | None  # torch.compile'd model, or None
    progress: dict[str, Any]  # "step" (the heartbeats send it), "saved" (last checkpoint)
    lease_lost: threading.Event  # set by the heartbeats
    losses: list[float]  # the training loss of each step done
    step: int = 0  # inner steps done (a resumed task starts at its checkpoint's)
    began: float = 0.0  # when its steps began (on_progress's "elapsed")
    checkpoints: bool = True  # snapshot every checkpoint_seconds (off in path-parallel batches)
    stream: Any = None  # its own CUDA stream in a path-parallel batch on a GPU

    @property
    def finished(self) -> bool:
        return self.step >= self.task.inner_steps


def _on_stream(stream: Any) -> AbstractContextManager:
    """Issue the block's kernels on ``stream`` (a CUDA stream), or as usual when it is None."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def resolve_device(name: str) -> str:
    """``auto`` is the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def training_features(device: str, precision: str = "auto", compile: str = "auto") -> dict:
    """What the inner loop uses on this device: autocast dtype, torch.compile, fused AdamW.

    ``precision``: "auto" (bfloat16 autocast on a GPU that has it, float32 elsewhere), "fp32"
    or "bf16". ``compile``: "auto" (on a GPU), "on" or "off". The fused AdamW kernel is used
    wherever torch has one (CPU and CUDA), see ``dipaco.model.optim.make_optimizer``.
    """
    if precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision must be auto, fp32 or bf16, not {precision!r}")
    if compile not in ("auto", "on", "off"):
        raise ConfigError(f"compile must be auto, on or off, not {compile!r}")
    gpu = device.startswith("cuda") and torch.cuda.is_available()
    bf16 = precision == "bf16" or (precision == "auto" and gpu and torch.cuda.is_bf16_supported())
    return {
        "autocast": torch.bfloat16 if bf16 else None,
        "compile": compile == "on" or (compile == "auto" and gpu),
        "fused": fused_adamw_available(device),
    }


Connect = Callable[[str, list[str]], Transport]
# An owner is busy handing modules over, or its disk is full for now: try again shortly.
RETRIABLE = {"handover", "disk-full"}
TIMED = ("claim", "fetch", "train", "push", "save")


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
        connect: Connect | None = None,
        shard_source: Callable[[str, dict[str, Any]], TokenShard] | None = None,
        memory_bytes: int | None = None,
        checkpoint_seconds: float = 20.0,
        on_ack: Callable[[dict[str, Any]], None] | None = None,
        manifest_sha256: str | None = None,
        run_over: threading.Event | None = None,
        identity: auth.Identity | None = None,
        precision: str = "auto",
        compile: str = "auto",
        parallel: int = 1,
    ) -> None:
        if parallel < 1:
            raise ConfigError(f"parallel must be at least 1, got {parallel}")
        # Tasks trained at once (path-parallel, see run_batch): with more than one, the loop
        # claims up to this many tasks and trains them together, step-interleaved.
        self.parallel = parallel
        self.manifest_sha256 = manifest_sha256
        # The peer's key signs every request, to the scheduler and to every module owner alike:
        # the scheduler's tickets name it, and owners accept a task's deltas only from it.
        # Kept in the state folder, so that a restarted peer is the same party (its peer id and
        # its leases stay bound to its key).
        self.identity = (
            identity
            or transport.identity
            or auth.Identity.load_or_create(Path(state_dir) / "signing.key")
        )
        if transport.identity is not self.identity:
            transport.authenticate(self.identity, transport.server_key, transport.on_pin)
        self.owner_keys: dict[str, str] = {}
        # Set from outside (the DHT's progress record) once the run has finished.
        self.run_over = run_over or threading.Event()
        self.transport = transport
        self.peer_id = peer_id
        self.state_dir = Path(state_dir)
        self.device = resolve_device(device)
        self.features = training_features(str(self.device), precision, compile)
        self.max_tasks = max_tasks
        self.give_up_seconds, self.retry_seconds = give_up_seconds, retry_seconds
        self.stop = stop or threading.Event()
        self.on_progress = on_progress or (lambda info: None)
        self.on_ack = on_ack or (lambda info: None)
        self.connect = connect
        self.shard_source = shard_source
        self.memory_bytes = memory_bytes
        self.checkpoint_seconds = checkpoint_seconds
        self._checkpointing: threading.Thread | None = None  # a checkpoint being written
        self.cache: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.last_path: int | None = None
        self.tasks_done = 0
        # Where this peer's time went, in seconds: "claim" (asking for work, and waiting for it
        # or for a round to close, retries), "fetch", "train" (building the path's model and
        # optimizer, the inner steps), "push", and "save" (inner state, checkpoints dropped).
        self.timings: dict[str, float] = dict.fromkeys(TIMED, 0.0)
        self.tokens_trained = 0
        self.config: dict[str, Any] = {}
        self.micro_batch: int | None = None
        self.owners: dict[str, str] = {}
        self.addresses: dict[str, list[str]] = {}
        self.scheduler_id = ""
        self._links: dict[str, Transport] = {}
        self.feedback = codecs.ErrorFeedback()

    # ---- the loop -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Say hello, check the run manifest, and size micro-batches for this device."""
        welcome = self._patient(
            lambda: self.transport.request(m.Hello(peer_id=self.peer_id, device=self.device))
        )
        if self.manifest_sha256 and manifest_sha256(welcome.config) != self.manifest_sha256:
            raise ConfigError(
                "the scheduler's run manifest differs from the one announced in the DHT"
            )
        self.check_manifest(welcome)
        self.config = welcome.config
        self.model_cfg = ModelConfig(**self.config["model"])
        self.topology = Topology.from_dict(self.config["topology"])
        self.train_cfg = self.config["train"]
        self.scheduler_id = self.config.get("owner_id", "")
        tc = self.train_cfg
        devices.check_fits(
            self.model_cfg, tc["seq_len"], self.device, memory_bytes=self.memory_bytes
        )
        self.micro_batch = devices.pick_micro_batch(
            self.model_cfg,
            tc["batch_size"],
            tc["seq_len"],
            self.device,
            memory_bytes=self.memory_bytes,
        )
        if self.micro_batch < tc["batch_size"]:
            log.info(
                "peer %s: micro-batch %d, accumulating to the run's batch of %d",
                self.peer_id,
                self.micro_batch,
                tc["batch_size"],
            )

    def run(self) -> int:
        """Train tasks until the run finishes (``run_finished`` is then True), ``stop`` is set
        or ``max_tasks`` are done; the number of tasks done."""
        self.run_finished = False
        self.setup()
        began = time.monotonic()
        busy = sum(self.timings.values())
        try:
            return self._loop(began)
        finally:
            # The loop's time that no task step took: claims, waiting for work or for a round
            # to close, and retries.
            steps = sum(self.timings.values()) - busy
            self.timings["claim"] += max(0.0, time.monotonic() - began - steps)

    def _loop(self, last_contact: float) -> int:
        while not self.stop.is_set() and (
            self.max_tasks is None or self.tasks_done < self.max_tasks
        ):
            offers, reply = self._claim_batch()
            if offers or not isinstance(reply, DipacoError):
                last_contact = time.monotonic()
            if isinstance(reply, RejectedError) and reply.reason not in ("rate-limited", "quota"):
                raise reply  # revoked, banned, not on the allow-list...: the user must act
            if len(offers) > 1:
                try:
                    self.run_batch(offers)
                except RunOver:
                    log.info("peer %s: the run finished during a batch of tasks", self.peer_id)
                    self.run_finished = True
                    break
                continue
            if offers:
                offer = offers[0]
                try:
                    self.run_task(offer)
                except RunOver:
                    log.info(
                        "peer %s: the run finished during task %s", self.peer_id, offer.task_id
                    )
                    self.run_finished = True
                    break
                except (TaskAborted, TransportError, RejectedError) as exc:
                    self._task_failed(offer, exc)
                continue
            if isinstance(reply, TransportError):
                if self.run_over.is_set():
                    log.info("peer %s: the run has finished", self.peer_id)
                    self.run_finished = True
                    break
                # The coordinator may be restarting: it keeps everything it acknowledged.
                if time.monotonic() - last_contact > self.give_up_seconds:
                    raise reply
                log.warning("peer %s: %s; retrying", self.peer_id, reply)
                self.stop.wait(self.retry_seconds)
            elif isinstance(reply, RejectedError):  # rate-limited, or over the key's task quota
                log.warning("peer %s: %s; waiting", self.peer_id, reply)
                self.stop.wait(self.retry_seconds)
            elif isinstance(reply, m.NoTask):
                if reply.finished:
                    log.info("peer %s: run finished after %d tasks", self.peer_id, self.tasks_done)
                    self.run_finished = True
                    break
                self.stop.wait(reply.retry_after)
        for link in self._links.values():
            link.close()
        return self.tasks_done

    def _claim_batch(self) -> tuple[list[m.TaskOffer], m.Message | DipacoError | None]:
        """Claim up to ``parallel`` tasks (one, preferring the last path, unless path-parallel).

        Returns the offers and the reply that ended the claiming: a ``NoTask``, the transport
        error or rejection it met (the caller handles it as for a single claim when no task came),
        or None when the batch is full. A path-parallel peer asks with ``prefer_path=None`` and
        names the tasks it holds already, so that the scheduler leases it another path.
        """
        want = self.parallel
        if self.max_tasks is not None:
            want = min(want, self.max_tasks - self.tasks_done)
        offers: list[m.TaskOffer] = []
        while len(offers) < want:
            try:
                reply = self.transport.request(
                    m.ClaimTask(
                        peer_id=self.peer_id,
                        prefer_path=self.last_path if self.parallel == 1 else None,
                        holding=[offer.task_id for offer in offers],
                    )
                )
            except (TransportError, RejectedError) as exc:
                if offers:
                    log.info("peer %s: claimed %d tasks (%s)", self.peer_id, len(offers), exc)
                return offers, exc
            if not isinstance(reply, m.TaskOffer):
                return offers, reply
            offers.append(reply)
        return offers, None

    def _task_failed(self, task: m.TaskOffer, exc: DipacoError, pause: bool = True) -> None:
        """A task that could not be trained or pushed: log it; hand back an aborted one."""
        if isinstance(exc, TaskAborted):
            log.warning("peer %s: task %s aborted: %s", self.peer_id, task.task_id, exc)
            if not self.stop.is_set():  # hand it back so that it is re-issued at once
                try:
                    self.transport.request(
                        m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id)
                    )
                except DipacoError as again:
                    log.warning("peer %s: release failed: %s", self.peer_id, again)
            if pause:
                self.stop.wait(min(0.5, self.retry_seconds))  # never a hot loop of failures
        elif isinstance(exc, TransportError):
            log.warning("peer %s: task %s lost: %s", self.peer_id, task.task_id, exc)
        else:
            reason = getattr(exc, "reason", "")
            log.warning(
                "peer %s: task %s rejected: %s (%s)", self.peer_id, task.task_id, exc, reason
            )
            self._drop_checkpoint()
            if reason in JUDGED and not self.stop.is_set():
                # Its delta was judged and refused: trained again from the same base on the same
                # windows it would be refused again. Hand the path back to the scheduler.
                try:
                    self.transport.request(
                        m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id)
                    )
                except DipacoError as again:
                    log.warning("peer %s: release failed: %s", self.peer_id, again)
            if pause:
                self.stop.wait(min(0.5, self.retry_seconds))

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``self.timings[what]``."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.timings[what] += time.monotonic() - began

    def _patient(self, call: Callable[[], Any], reasons: tuple[str, ...] = ()) -> Any:
        """Retry ``call`` over transport errors, and refusals for one of ``reasons``, for up to
        ``give_up_seconds``."""
        began = time.monotonic()
        while True:
            try:
                return call()
            except (TransportError, RejectedError) as exc:
                if isinstance(exc, RejectedError) and exc.reason not in reasons:
                    raise
                if self.run_over.is_set():
                    raise RunOver() from None
                if time.monotonic() - began > self.give_up_seconds or self.stop.is_set():
                    raise
                # A refusal we expected (the scheduler has not heard another owner's ack yet)
                # is routine; a transport error is worth a warning.
                level = logging.INFO if isinstance(exc, RejectedError) else logging.WARNING
                log.log(level, "peer %s: %s; retrying", self.peer_id, exc)
                self.stop.wait(self.retry_seconds)

    # ---- one task -----------------------------------------------------------------------------
    def run_task(self, task: m.TaskOffer) -> None:
        """Fetch, train and push one task, heartbeating all along (downloads can be slow)."""
        progress: dict[str, Any] = {"step": 0}
        lease_lost = threading.Event()
        with self._heartbeating([(task, progress, lease_lost)]):
            self._run_task(task, progress, lease_lost)

    def _run_task(self, task: m.TaskOffer, progress: dict, lease_lost: threading.Event) -> None:
        run = self._setup_task(task, progress, lease_lost)
        try:
            while not run.finished:
                self._stepped(run, self._step(run))
        except TaskAborted:
            if self.stop.is_set():
                # Leave cleanly: hand the task back at once rather than let it expire.
                self.transport.request(m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id))
            self._drop_checkpoint()
            raise
        self._finish_task(run)

    def _setup_task(
        self,
        task: m.TaskOffer,
        progress: dict,
        lease_lost: threading.Event,
        *,
        resume: bool = True,
        stream: Any = None,
    ) -> TaskRun:
        """Fetch the path's modules; build its model and optimizer, with its inner state (or the
        task's checkpoint, with ``resume``); open its data slice. Returns the task's state."""
        log.info("peer %s: training %s (path P%d)", self.peer_id, task.task_id, task.path)
        if task.owners:
            self.owners.update(task.owners)
        with self._timed("fetch"):
            modules = self.fetch(task)
        with self._timed("train"):
            try:
                model = self.topology.build_path(
                    self.model_cfg,
                    task.path,
                    {
                        mid: {k: v.clone() for k, v in tensors.items()}
                        for mid, tensors in modules.items()
                    },
                ).to(self.device)
            except DataError as exc:  # the owners served modules that do not fit the model
                for mid in modules:
                    self.cache.pop(mid, None)
                raise TaskAborted(str(exc)) from None
            model.train()
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
            done_steps, losses = self._resume(task, model, optimizer, names) if resume else (0, [])
            if done_steps == 0:
                self._load_inner_state(task.path, task.round, optimizer, names)
            shard = self._shard(task)
            # The task's data slice: windows drawn by a generator seeded by (run seed, path,
            # round).
            batches = window_batches(
                shard,
                [task.seed, task.path, task.round],
                tc["batch_size"],
                tc["seq_len"],
                self.device,
            )
            for _ in range(done_steps):  # a resumed task skips the windows it already trained on
                next(batches)
            progress.update(step=done_steps, saved=time.monotonic())
            return TaskRun(
                task=task,
                modules=modules,
                model=model,
                optimizer=optimizer,
                names=names,
                settings=settings,
                batches=batches,
                forward=torch.compile(model) if self.features["compile"] else None,
                progress=progress,
                lease_lost=lease_lost,
                losses=losses,
                step=done_steps,
                began=time.monotonic(),
                checkpoints=resume,
                stream=stream,
            )

    def _step(self, run: TaskRun) -> torch.Tensor:
        """Issue one inner step of ``run`` (on its CUDA stream, if it has one); returns its loss,
        not read, so that no device sync happens here."""
        with self._timed("train"), _on_stream(run.stream):
            return train_step(
                run.model,
                run.optimizer,
                next(run.batches),
                run.settings,
                step=run.task.step_offset + run.step,
                micro_batch=self.micro_batch,
                autocast=self.features["autocast"],
                forward=run.forward,
            )

    def _stepped(self, run: TaskRun, loss: torch.Tensor) -> None:
        """After a step: abort if the peer stops or the lease was lost; else count the step,
        report it (``on_progress``) and checkpoint the task when it is time to."""
        with self._timed("train"):
            with _on_stream(run.stream):  # the loss is written on the task's stream
                value = loss.item()
            if self.stop.is_set():
                raise TaskAborted("peer is stopping")
            if run.lease_lost.is_set():
                raise TaskAborted("lease lost")
            run.step += 1
            run.progress["step"] = run.step
            run.losses.append(value)
            self.on_progress(
                {
                    "task": run.task.task_id,
                    "path": run.task.path,
                    "step": run.step,
                    "steps": run.task.inner_steps,
                    "loss": value,
                    "elapsed": time.monotonic() - run.began,
                    "tokens_per_step": self.train_cfg["batch_size"] * self.train_cfg["seq_len"],
                }
            )
            if (
                run.checkpoints
                and time.monotonic() - run.progress["saved"] > self.checkpoint_seconds
            ):
                self._checkpoint(
                    run.task, run.model, run.optimizer, run.names, run.step, run.losses
                )
                run.progress["saved"] = time.monotonic()

    def _finish_task(self, run: TaskRun) -> None:
        """The task's per-module deltas (fetched minus trained), pushed; its inner state saved."""
        task, tc = run.task, self.train_cfg
        with self._timed("train"):
            trained = self.topology.split_path_state(
                task.path, {k: v.detach().cpu() for k, v in run.model.state_dict().items()}
            )
            delta = {
                mid: {
                    name: (run.modules[mid][name] - trained[mid][name]).contiguous()
                    for name in run.modules[mid]
                }
                for mid in run.modules
            }
        tokens = task.inner_steps * tc["batch_size"] * tc["seq_len"]
        fault_point("peer.before_push")
        with self._timed("push"):
            # The inner state is written before the first delta is sent: once the owners
            # acknowledge, the round may close and another peer sharing this state folder may
            # take the path's next round at once, and it must find this round's state.
            self.push(
                task,
                delta,
                tokens,
                run.losses,
                before_send=lambda: self._save_inner_state(
                    task.path, task.round, run.optimizer, run.names
                ),
            )
        with self._timed("save"):
            self._drop_checkpoint()
        self.tasks_done += 1
        self.tokens_trained += tokens
        self.last_path = task.path
        log.info(
            "peer %s: %s done, loss %.3f -> %.3f",
            self.peer_id,
            task.task_id,
            run.losses[0],
            run.losses[-1],
        )

    # ---- several tasks at once (path-parallel) ------------------------------------------------
    def run_batch(self, tasks: list[m.TaskOffer]) -> None:
        """Train several tasks (paths) at once, step-interleaved; push each as ``run_task`` does.

        Every task is set up (fetch, model, optimizer, inner state, data), then step i of each
        task runs before step i + 1 of any, each task on its own CUDA stream on a GPU (so the
        kernels of different paths can overlap; all are synchronised before the deltas are
        taken), in plain turns on a CPU. Each task's operations are exactly those of
        ``run_task``, so its deltas are too. Then each task's deltas are pushed and its inner
        state saved, in order. One heartbeat thread keeps every lease alive.

        In-flight tasks of a batch are not checkpointed and not resumed (a restarted peer trains
        them again from their base). A task whose lease is lost is dropped and handed back, the
        others train on; a stopping peer hands every task of the batch back. Failures of one
        task (fetch, push) are handled as ``_loop`` handles a single task's.
        """
        leases = [(task, {"step": 0}, threading.Event()) for task in tasks]
        with self._heartbeating(leases):
            try:
                self._run_batch(leases)
            except TaskAborted as exc:  # the peer is stopping: hand every task back at once
                log.warning("peer %s: batch of %d aborted: %s", self.peer_id, len(tasks), exc)
                for task in tasks:
                    try:
                        self.transport.request(
                            m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id)
                        )
                    except DipacoError as again:
                        log.warning("peer %s: release failed: %s", self.peer_id, again)

    def _run_batch(self, leases: list[tuple[m.TaskOffer, dict, threading.Event]]) -> None:
        cuda = str(self.device).startswith("cuda") and torch.cuda.is_available()
        runs: list[TaskRun] = []
        for task, progress, lost in leases:
            if self.stop.is_set():
                raise TaskAborted("peer is stopping")
            try:
                runs.append(
                    self._setup_task(
                        task,
                        progress,
                        lost,
                        resume=False,  # no checkpoints in a batch (see run_batch)
                        stream=torch.cuda.Stream(device=self.device) if cuda else None,
                    )
                )
            except (TaskAborted, TransportError, RejectedError) as exc:
                self._task_failed(task, exc, pause=False)
        began = time.monotonic()
        for run in runs:
            run.began = began
            if run.stream is not None:  # models, moments and windows were made on this stream
                run.stream.wait_stream(torch.cuda.current_stream(self.device))
        active = list(runs)
        while active:
            # Step i of every task is issued before any is read: on a GPU they run at once.
            losses = [self._step(run) for run in active]
            for run, loss in zip(active, losses, strict=True):
                try:
                    self._stepped(run, loss)
                except TaskAborted as exc:
                    if self.stop.is_set():
                        raise
                    runs.remove(run)  # its lease was lost: drop it, the others train on
                    self._task_failed(run.task, exc, pause=False)
            active = [run for run in active if run in runs and not run.finished]
        if cuda:
            with self._timed("train"):
                torch.cuda.synchronize(self.device)
        for run in runs:
            try:
                self._finish_task(run)
            except (TaskAborted, TransportError, RejectedError) as exc:
                self._task_failed(run.task, exc, pause=False)

    # ---- leases -------------------------------------------------------------------------------
    @contextmanager
    def _heartbeating(
        self, leases: list[tuple[m.TaskOffer, dict, threading.Event]]
    ) -> Iterator[None]:
        """Heartbeat the leases (task, progress, lost) from one thread while the block runs."""
        done = threading.Event()
        beats = threading.Thread(
            target=self._heartbeats,
            args=(leases, done),
            name=f"{self.peer_id}-heartbeat",
            daemon=True,
        )
        beats.start()
        try:
            yield
        finally:
            done.set()
            beats.join()

    def _heartbeats(
        self, leases: list[tuple[m.TaskOffer, dict, threading.Event]], done: threading.Event
    ) -> None:
        """Keep the leases alive from a thread of its own, however long a step or a push takes.

        A lease the scheduler no longer knows as ours has its ``lost`` event set and is no longer
        renewed."""
        live = list(leases)
        while live and not done.wait(self.config["heartbeat_seconds"]):
            for lease in list(live):
                task, progress, lost = lease
                try:
                    ack = self.transport.request(
                        m.Heartbeat(
                            peer_id=self.peer_id, task_id=task.task_id, step=progress["step"]
                        )
                    )
                except DipacoError as exc:
                    log.warning("peer %s: heartbeat failed: %s", self.peer_id, exc)
                    continue
                if not ack.lease_ok:
                    lost.set()
                    live.remove(lease)

    def check_manifest(self, welcome: m.Welcome) -> None:
        """The manifest names the scheduler's key, which signed it and the reply that carried it."""
        key = welcome.config.get("coordinator_key")
        if not isinstance(key, str) or key != self.transport.server_key:
            raise ConfigError(
                "the run manifest does not name the key of the coordinator that sent it: "
                "refusing to train for it"
            )
        if not auth.check_payload(key, welcome.signature, "manifest", welcome.config):
            raise ConfigError("the run manifest's signature does not verify: refusing it")

    # ---- owners -------------------------------------------------------------------------------
    def _link(self, owner: str) -> Transport:
        """The transport to a module owner; the scheduler's own modules use the main one."""
        if owner == self.scheduler_id or self.connect is None:
            return self.transport
        if owner not in self._links:
            if owner not in self.addresses or owner not in self.owner_keys:
                self._refresh_owners()  # where it is, and the key the scheduler vouches for
            link = self.connect(owner, self.addresses.get(owner, []))
            self._links[owner] = link.authenticate(self.identity, self.owner_keys.get(owner))
        return self._links[owner]

    def _refresh_owners(self) -> None:
        reply = self._patient(lambda: self.transport.request(m.GetOwners()))
        self.owners.update(reply.owners)
        self.addresses.update(reply.addresses)
        self.owner_keys.update(reply.keys)
        for owner in list(self._links):
            if owner not in set(reply.owners.values()):
                self._links.pop(owner).close()

    def _by_owner(self, mids: list[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for mid in mids:
            groups.setdefault(self.owners.get(mid, self.scheduler_id), []).append(mid)
        return groups

    def _ask_owner(self, owner: str, make: Callable[[], m.Message]) -> m.Message:
        """One request to one owner, retried while the owner is unreachable or handing over."""
        began = time.monotonic()
        while True:
            try:
                return self._link(owner).request(make())
            except TransportError as exc:
                problem: DipacoError = exc
                # The owner may have restarted elsewhere: ask the scheduler where it is now.
                link = self._links.pop(owner, None)
                if link is not None:
                    link.close()
                    try:
                        self._refresh_owners()
                    except DipacoError as again:
                        log.warning("peer %s: cannot refresh owners: %s", self.peer_id, again)
            except RejectedError as exc:
                if exc.reason not in RETRIABLE:
                    raise
                problem = exc
            if self.run_over.is_set():
                raise RunOver() from None
            if time.monotonic() - began > self.give_up_seconds:
                raise problem
            log.warning("peer %s: owner %s: %s; retrying", self.peer_id, owner, problem)
            time.sleep(self.retry_seconds)

    # ---- modules ------------------------------------------------------------------------------
    def fetch(self, task: m.TaskOffer) -> dict[str, dict[str, torch.Tensor]]:
        """The path's modules at the task's versions, downloading only what the cache lacks."""
        have = {mid: v for mid, (v, _) in self.cache.items()}
        versions: dict[str, int] = {}
        hashes: dict[str, str] = {}
        fresh: dict[str, dict[str, torch.Tensor]] = {}
        for owner, mids in self._by_owner(list(task.module_versions)).items():
            reply = self._ask_owner(
                owner,
                lambda mids=mids: m.FetchModules(
                    peer_id=self.peer_id,
                    task_id=task.task_id,
                    have={mid: have[mid] for mid in mids if mid in have},
                    ticket=task.ticket,
                ),
            )
            self._check_releases(owner, reply)
            versions.update(reply.versions)
            hashes.update(reply.hashes)
            for key, tensor in reply.tensors.items():
                mid, _, name = key.partition("/")
                fresh.setdefault(mid, {})[name] = tensor
        modules = {}
        for mid, want in task.module_versions.items():
            version = versions.get(mid)
            if version is None:
                self._refresh_owners()
                raise TaskAborted(f"no owner served module {mid}; owners refreshed")
            if version != want:
                raise TaskAborted(
                    f"module {mid} moved to version {version} since the task was issued"
                )
            if mid in fresh:
                tensors = fresh[mid]
            elif mid in self.cache and self.cache[mid][0] == version:
                tensors = self.cache[mid][1]
            else:
                raise TaskAborted(f"module {mid} v{version} was neither sent nor cached")
            if tensors_sha256(tensors) != hashes[mid]:
                self.cache.pop(mid, None)
                raise TaskAborted(f"module {mid} v{version} failed its hash check")
            self.cache[mid] = (version, tensors)
            modules[mid] = tensors
        return modules

    def _check_releases(self, owner: str, reply: m.Modules) -> None:
        """Every module version served is signed by the owner that serves it (the key that
        signed the reply, which the scheduler vouched for), or the task is not trained."""
        link = self._link(owner)
        run_id = self.config.get("run_id")
        for mid, version in reply.versions.items():
            digest = reply.hashes.get(mid, "")
            release = {"run": run_id, "module": mid, "version": version, "hash": digest}
            if not auth.check_payload(
                link.server_key or "", reply.signatures.get(mid, ""), "release", release
            ):
                raise TaskAborted(f"module {mid} v{version}: its release signature does not verify")

    def push(
        self,
        task: m.TaskOffer,
        delta: dict[str, dict[str, torch.Tensor]],
        tokens: int,
        losses: list[float],
        before_send: Callable[[], None] | None = None,
    ) -> None:
        """Each module's delta to its owner, until every owner has acknowledged; then TaskDone.

        ``before_send`` runs once the deltas are encoded (error-feedback residuals updated) and
        before anything is sent.
        """
        codec = task.codec or "lossless"
        key = f"P{task.path}"
        log.info(
            "peer %s: pushing the deltas of %s (%s) to %d owner(s)",
            self.peer_id,
            task.task_id,
            codec,
            len(self._by_owner(list(delta))),
        )
        before = self.feedback.state_tensors()
        wire = self.feedback.compress(
            codec, key, {f"{mid}/{n}": t for mid, ts in delta.items() for n, t in ts.items()}
        )
        try:
            if before_send is not None:
                before_send()
            remaining = list(delta)
            scheduler_done = False
            while remaining:
                owner, mids = next(iter(self._by_owner(remaining).items()))
                try:
                    ack = self._ask_owner(
                        owner,
                        lambda mids=mids: m.SubmitDelta(
                            peer_id=self.peer_id,
                            task_id=task.task_id,
                            path=task.path,
                            base_versions=task.module_versions,
                            tokens=tokens,
                            losses=losses,
                            tensors={k: v for k, v in wire.items() if k.partition("/")[0] in mids},
                            ticket=task.ticket,
                            codec=codec,
                        ),
                    )
                except RejectedError as exc:
                    if exc.reason != "not-owner":
                        raise
                    self._refresh_owners()  # a module moved: regroup and push again
                    continue
                remaining = [mid for mid in remaining if mid not in mids]
                for mid in mids:
                    self.on_ack(
                        {
                            "module": mid,
                            "base_version": task.module_versions[mid],
                            "path": task.path,
                            "task": task.task_id,
                            "owner": owner,
                            "unacked": len(remaining),  # modules of the task still to push
                        }
                    )
                scheduler_done |= ack.task_done
            if not scheduler_done:
                self._patient(
                    lambda: self.transport.request(
                        m.TaskDone(
                            peer_id=self.peer_id,
                            task_id=task.task_id,
                            ticket=task.ticket,
                            tokens=tokens,
                            losses=losses,
                            modules=list(delta),
                        )
                    ),
                    # The scheduler learns another owner's acknowledgement from its next report.
                    reasons=("not-acked",),
                )
        except BaseException:
            self.feedback.load_state_tensors(before)  # nothing was sent for good: keep residuals
            raise

    # ---- data ---------------------------------------------------------------------------------
    def _shard(self, task: m.TaskOffer) -> TokenShard:
        """The task's shard: named by the offer (routing phases re-shard), else the path's."""
        name = task.shard or f"shards/P{task.path}/train"
        if self.shard_source is not None:
            return self.shard_source(name, task.shard_files)
        return TokenShard(Path(self.config["shards_dir"]).parent / name)

    # ---- a task in progress -------------------------------------------------------------------
    def _task_dir(self) -> Path:
        return self.state_dir / "task"

    def _checkpoint(self, task, model, optimizer, names, step: int, losses: list[float]) -> None:
        """Snapshot the task (a copy of the model and optimizer state), written in the background.

        Copying takes milliseconds; encoding, hashing, writing and fsync-ing the file run in a
        thread while training goes on (one write at a time; the next snapshot, dropping the
        checkpoint and leaving wait for it). A failed write is logged: the task trains on, and
        a restart would resume from the last checkpoint that was written whole.
        """
        tensors = {
            f"model/{k}": v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
        }
        tensors.update(
            {
                f"optim/{k}": v.detach().to("cpu", copy=True)
                for k, v in optimizer_state_tensors(optimizer, names).items()
            }
        )
        self._wait_checkpoint()
        frame = Frame("TaskCheckpoint", {"task_id": task.task_id, "step": step}, tensors)
        meta = {"task_id": task.task_id, "losses": list(losses)}
        self._checkpointing = threading.Thread(
            target=self._write_checkpoint, args=(frame, meta), name="checkpoint", daemon=True
        )
        self._checkpointing.start()

    def _write_checkpoint(self, frame: Frame, meta: dict) -> None:
        folder = self._task_dir()
        try:
            write_tensor_file(folder / "checkpoint.dpt", frame)
            write_json_atomic(folder / "task.json", meta)
        except OSError as exc:
            log.warning("peer %s: could not write a checkpoint: %s", self.peer_id, exc)

    def _wait_checkpoint(self) -> None:
        writer, self._checkpointing = self._checkpointing, None
        if writer is not None:
            writer.join()

    def _resume(self, task, model, optimizer, names) -> tuple[int, list[float]]:
        folder = self._task_dir()
        try:
            meta = json.loads((folder / "task.json").read_text())
            frame = read_tensor_file(folder / "checkpoint.dpt")
        except (OSError, ValueError, CorruptFileError):
            return 0, []
        if meta.get("task_id") != task.task_id or frame.fields.get("task_id") != task.task_id:
            self._drop_checkpoint()
            return 0, []
        model.load_state_dict(
            {k[6:]: v for k, v in frame.tensors.items() if k.startswith("model/")}
        )
        load_optimizer_state_tensors(
            optimizer, names, {k[6:]: v for k, v in frame.tensors.items() if k.startswith("optim/")}
        )
        step = int(frame.fields["step"])
        log.info("peer %s: resuming %s at step %d", self.peer_id, task.task_id, step)
        return step, list(meta.get("losses", []))[:step]

    def _drop_checkpoint(self) -> None:
        self._wait_checkpoint()
        for name in ("checkpoint.dpt", "task.json"):
            (self._task_dir() / name).unlink(missing_ok=True)

    # ---- inner optimizer state ----------------------------------------------------------------
    def _inner_file(self, path: int, round_: int) -> Path:
        """The path's inner state after training its round ``round_``."""
        return self.state_dir / "inner" / f"P{path}-r{round_}.dpt"

    def _inner_files(self, path: int) -> dict[int, Path]:
        found = {}
        for file in (self.state_dir / "inner").glob(f"P{path}-r*.dpt"):
            stem = file.stem.rpartition("-r")[2]
            if stem.isdigit():
                found[int(stem)] = file
        return found

    def _load_inner_state(
        self, path: int, round_: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        """The state left by the path's latest earlier round (a retried round starts where the
        first try did); a state folder written before round-named files: its ``P<path>.dpt``."""
        earlier = [r for r in self._inner_files(path) if r < round_]
        file = (
            self._inner_file(path, max(earlier))
            if earlier
            else self.state_dir / "inner" / f"P{path}.dpt"
        )
        if not file.exists():
            return
        try:
            tensors = read_tensor_file(file).tensors
            load_optimizer_state_tensors(
                optimizer, names, {k: v for k, v in tensors.items() if not k.startswith("ef|")}
            )
            residuals = {k[3:]: v for k, v in tensors.items() if k.startswith("ef|")}
            if residuals:
                self.feedback.load_state_tensors({**self._other_residuals(f"P{path}"), **residuals})
        except (CorruptFileError, KeyError, IndexError, ValueError) as exc:
            log.warning("peer %s: ignoring unusable inner state %s: %s", self.peer_id, file, exc)

    def _other_residuals(self, key: str) -> dict[str, torch.Tensor]:
        return {
            k: v for k, v in self.feedback.state_tensors().items() if not k.startswith(key + "|")
        }

    def _save_inner_state(
        self, path: int, round_: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        """This round's state; the one before it stays (a retry of this round loads it)."""
        tensors = optimizer_state_tensors(optimizer, names)
        key = f"P{path}|"
        tensors.update(
            {f"ef|{k}": v for k, v in self.feedback.state_tensors().items() if k.startswith(key)}
        )
        write_tensor_file(
            self._inner_file(path, round_),
            Frame("InnerState", {"path": path, "round": round_}, tensors),
        )
        for r, file in self._inner_files(path).items():
            if r < round_ - 1:
                file.unlink(missing_ok=True)
        (self.state_dir / "inner" / f"P{path}.dpt").unlink(missing_ok=True)
