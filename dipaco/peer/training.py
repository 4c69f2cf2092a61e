"""One task's training on the peer: its path's model and optimizer, data slice and inner steps.

DiPaCo Algorithm 1, lines 6-8, for one task: the path's model is built from the fetched modules,
its inner AdamW continues the path's own state (or the task's checkpoint, when a restarted peer
resumes the task), the task's data slice is drawn from its shard, and each inner step is issued
(on the task's own CUDA stream in a path-parallel batch) then counted, reported and, every
``checkpoint_seconds``, checkpointed. ``PathTrainer.finish`` takes the per-module deltas and
pushes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dipaco.data.shards import TokenShard, shard_name, window_batches
from dipaco.errors import ConfigError, DataError
from dipaco.faults import fault_point
from dipaco.model.optim import (
    InnerSettings,
    make_optimizer,
    param_names_in_optimizer_order,
    train_step,
)
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig
from dipaco.peer.device import fit_micro_batch, hold_heap, trim_heap
from dipaco.peer.modules import Cache, TaskAborted
from dipaco.peer.push import Tensors, module_deltas
from dipaco.peer.stacking import BATCHINGS, Stack, stackable
from dipaco.peer.state import InnerState, TaskCheckpoint
from dipaco.protocols import messages as m

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TaskRun:
    """A task between its setup and its finish (``PathTrainer.open``, ``PathTrainer.step`` and
    ``PathTrainer.stepped`` per inner step, ``PathTrainer.deltas``): what its steps and its
    deltas need."""

    task: m.TaskOffer
    modules: Tensors  # as fetched: the base its deltas are taken from
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
    delta: Tensors | None = None  # per module (CPU), once taken (``PathTrainer.deltas``)

    @property
    def finished(self) -> bool:
        return self.step >= self.task.inner_steps

    def taken_delta(self) -> Tensors:
        """``delta``, once ``PathTrainer.deltas`` took it (``finish``, ``finish_behind``)."""
        if self.delta is None:
            raise RuntimeError(f"the deltas of {self.task.task_id} were not taken")
        return self.delta


@dataclass(eq=False)
class Kept:
    """A finished task's model and optimizer, kept for the next task of the same path: that
    task copies its modules into the model instead of building one, and continues the AdamW
    state in memory instead of reading it back, when the file it would read is the one this
    state was saved as (``stamp``)."""

    path: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    names: list[str]
    forward: Callable[[torch.Tensor], torch.Tensor] | None
    stamp: tuple[int, ...] | None  # InnerState.stamp of the file saved from this state


def on_stream(stream: Any) -> AbstractContextManager:
    """Issue the block's kernels on ``stream`` (a CUDA stream), or as usual when it is None."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


@contextmanager
def timed(timings: dict[str, float], what: str) -> Iterator[None]:
    """Add the time spent in the ``with`` block to ``timings[what]``."""
    began = time.monotonic()
    try:
        yield
    finally:
        timings[what] += time.monotonic() - began


class PathTrainer:
    """Trains tasks with the run's model and training settings (from its manifest, ``config``)
    and this device's features, in micro-batches that fit the device (``memory_bytes``
    replaces the probe of its free memory).

    ``timings`` is the peer's (its "train" entry grows here); ``checkpoint`` and ``inner`` are
    the peer's task state files; ``on_progress`` hears of every step; ``stop`` aborts a task at
    its next step. Shards come from ``shard_source`` (name, files), else from ``shards_dir``.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        device: str,
        features: dict[str, Any],
        memory_bytes: int | None,
        timings: dict[str, float],
        checkpoint: TaskCheckpoint,
        inner: InnerState,
        checkpoint_seconds: float,
        on_progress: Callable[[dict[str, Any]], None],
        stop: threading.Event,
        shard_source: Callable[[str, dict[str, Any]], TokenShard] | None = None,
    ) -> None:
        self.model_cfg = ModelConfig(**config["model"])
        self.topology = Topology.from_dict(config["topology"])
        self.train_cfg = config["train"]
        self.shards_dir: str | None = config.get("shards_dir")
        self.device, self.features = device, features
        self.micro_batch = fit_micro_batch(
            self.model_cfg,
            self.train_cfg,
            device,
            memory_bytes,
            bf16=features.get("autocast") == torch.bfloat16,
        )
        self.timings = timings
        self.checkpoint, self.inner = checkpoint, inner
        self.checkpoint_seconds = checkpoint_seconds
        self.on_progress = on_progress
        self.stop = stop
        self.shard_source = shard_source
        # One task at a time (no path-parallel batch, no sharding): keep the last task's path
        # for the next task of the same path (Kept). ``counts``: built, reused; state loaded,
        # state kept (tests and bench/task_costs.py).
        self.keep_path = False
        self._kept: Kept | None = None  # the last finished task's
        self._taking: Kept | None = None  # what the task being set up took (build -> open)
        self.counts = dict.fromkeys(("built", "reused", "state loaded", "state kept"), 0)

    def let_go(self, path: int) -> None:
        """Before a task of ``path`` fetches its modules: drop the kept model and optimizer
        unless they are that path's (two paths are never held at once), and give what the last
        task freed back to the system (``trim_heap``)."""
        if self._kept is not None and self._kept.path != path:
            self._kept = None
        trim_heap()

    def build(self, task: m.TaskOffer, modules: Tensors, cache: Cache) -> torch.nn.Module:
        """The path's model on this device, from copies of the fetched modules (into the kept
        model of the last task, when it trained this path); ``TaskAborted`` when the modules do
        not fit the model (they leave ``cache`` then)."""
        kept, self._kept = self._kept, None  # the task owns it now: an aborted one keeps none
        self._taking = kept if kept is not None and kept.path == task.path else None
        del kept  # another path's goes before this one is built
        try:
            if self._taking is not None:
                self.topology.load_path(self._taking.model, task.path, modules)
                self.counts["reused"] += 1
                return self._taking.model
            self.counts["built"] += 1
            return self.topology.build_path(
                self.model_cfg,
                task.path,
                {
                    mid: {k: v.clone() for k, v in tensors.items()}
                    for mid, tensors in modules.items()
                },
            ).to(self.device)
        except DataError as exc:  # the owners served modules that do not fit the model
            self._taking = None
            for mid in modules:
                cache.pop(mid, None)
            raise TaskAborted(str(exc)) from None

    def open(
        self,
        task: m.TaskOffer,
        modules: Tensors,
        model: torch.nn.Module,
        progress: dict,
        lease_lost: threading.Event,
        *,
        resume: bool = True,
        stream: Any = None,
    ) -> TaskRun:
        """The task ready to step: ``model`` in training mode, its optimizer with the path's
        inner state (or the task's checkpoint, with ``resume``), its data slice (past the windows
        a resumed task trained on already)."""
        model.train()
        tc = self.train_cfg
        settings = InnerSettings.of_train(tc, task.total_steps)
        taking, self._taking = self._taking, None
        if taking is not None and taking.model is not model:
            taking = None
        same = (
            taking is not None
            and taking.stamp is not None
            and taking.stamp == self.inner.stamp(task.path, task.round)
        )
        if taking is not None and same:
            optimizer, names = taking.optimizer, taking.names
        else:
            optimizer = make_optimizer(model, settings)
            names = param_names_in_optimizer_order(model)
        done_steps, losses = (
            self.checkpoint.resume(task.task_id, model, optimizer, names) if resume else (0, [])
        )
        if done_steps == 0 and not same:
            self.counts["state loaded"] += 1
            self.inner.load(task.path, task.round, optimizer, names)
        elif done_steps == 0:
            self.counts["state kept"] += 1
        # The task's data slice: windows drawn by a generator seeded by (run seed, path, round).
        batches = window_batches(
            self.shard(task),
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
            forward=(
                taking.forward
                if taking is not None
                else torch.compile(model)
                if self.features["compile"]
                else None
            ),
            progress=progress,
            lease_lost=lease_lost,
            losses=losses,
            step=done_steps,
            began=time.monotonic(),
            checkpoints=resume,
            stream=stream,
        )

    def shard(self, task: m.TaskOffer) -> TokenShard:
        """The task's shard: named by the offer (routing phases re-shard), else the path's; from
        ``shard_source``, else from the run folder next to the manifest's ``shards_dir``."""
        name = task.shard or shard_name(task.path)
        if self.shard_source is not None:
            return self.shard_source(name, task.shard_files)
        if self.shards_dir is None:
            raise ConfigError("the run's manifest names no shards_dir, and no shard source is set")
        return TokenShard(Path(self.shards_dir).parent / name)

    def step(self, run: TaskRun) -> torch.Tensor:
        """Issue one inner step of ``run`` (on its CUDA stream, if it has one); returns its loss,
        not read, so that no device sync happens here."""
        with timed(self.timings, "train"), on_stream(run.stream):
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

    def stepped(self, run: TaskRun, loss: torch.Tensor) -> None:
        """After a step: abort if the peer stops or the lease was lost; else count the step,
        report it (``on_progress``) and checkpoint the task when it is time to."""
        with timed(self.timings, "train"):
            with on_stream(run.stream):  # the loss is written on the task's stream
                value = loss.item()
            fault_point("peer.inner_step")  # sleep:S makes a slow peer (a task to catch mid-way)
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
                self.checkpoint.save(
                    run.task.task_id, run.model, run.optimizer, run.names, run.step, run.losses
                )
                run.progress["saved"] = time.monotonic()

    def train(self, run: TaskRun, after_step: Callable[[TaskRun], None] | None = None) -> None:
        """Every inner step of ``run`` left to do; ``after_step(run)`` after each (fetch ahead)."""
        while not run.finished:
            self.stepped(run, self.step(run))
            if after_step is not None:
                after_step(run)

    def finish(self, run: TaskRun, push: Callable[..., None]) -> int:
        """Push the task's deltas (``push``, as ``Peer.push``), its inner state saved just before
        they are sent, then drop its checkpoint; the tokens it trained."""
        task = run.task
        delta = self.deltas(run)
        tokens = self.tokens(task)
        fault_point("peer.before_push")
        with timed(self.timings, "push"):
            # The inner state is written before the first delta is sent: once the owners
            # acknowledge, the round may close and another peer sharing this state folder may
            # take the path's next round at once, and it must find this round's state.
            push(
                task,
                delta,
                tokens,
                run.losses,
                before_send=lambda: self.inner.save(
                    task.path, task.round, run.optimizer, run.names
                ),
            )
        with timed(self.timings, "save"):
            self.checkpoint.drop()
        self._keep(run)
        return tokens

    def finish_behind(
        self, run: TaskRun, encode: Callable[..., tuple[dict, Callable[[], None]]]
    ) -> tuple[dict, Callable[[], None], int]:
        """:meth:`finish` up to the sending (push behind): the deltas encoded (``encode``, as
        ``Pusher.encode``), the inner state written, the checkpoint dropped (the next task's
        goes in its place). Returns what ``encode`` returned, and the tokens trained."""
        task = run.task
        delta = self.deltas(run)
        fault_point("peer.before_push")
        with timed(self.timings, "push"):
            wire, undo = encode(task, delta)
            try:
                self.inner.save(task.path, task.round, run.optimizer, run.names)
            except BaseException:
                undo()
                raise
        with timed(self.timings, "save"):
            self.checkpoint.drop()
        self._keep(run)
        return wire, undo, self.tokens(task)

    def _keep(self, run: TaskRun) -> None:
        """Keep a finished task's model and optimizer for the next task of its path (Kept)."""
        if self.keep_path:
            task = run.task
            stamp = self.inner.stamp(task.path, task.round + 1)  # the file just saved
            self._kept = Kept(task.path, run.model, run.optimizer, run.names, run.forward, stamp)

    def tokens(self, task: m.TaskOffer) -> int:
        """The tokens a task trains."""
        return task.inner_steps * self.train_cfg["batch_size"] * self.train_cfg["seq_len"]

    def deltas(self, run: TaskRun) -> Tensors:
        """The task's per-module deltas (fetched minus trained), on the CPU: written over the
        trained parameters (on a CPU; on a GPU over their copy in host memory), which nothing
        reads after this (a kept model gets its next task's modules copied in first)."""
        with timed(self.timings, "train"):
            trained = self.topology.split_path_state(
                run.task.path, {k: v.detach().cpu() for k, v in run.model.state_dict().items()}
            )
            run.delta = module_deltas(run.modules, trained, in_place=True)
            return run.delta


def train_interleaved(
    trainer: PathTrainer, runs: list[TaskRun], dropped: Callable[[TaskRun, TaskAborted], None]
) -> None:
    """Train ``runs`` together: step i of each before step i + 1 of any (on a GPU, each on
    its stream, so that their kernels overlap; all synchronised at the end). A run whose
    lease is lost leaves ``runs`` and goes to ``dropped``; the others train on. A stopping
    peer's ``TaskAborted`` is raised."""
    began = time.monotonic()
    for run in runs:
        run.began = began
        if run.stream is not None:  # models, moments and windows were made on this stream
            run.stream.wait_stream(torch.cuda.current_stream(trainer.device))
    active = list(runs)
    while active:
        # Step i of every task is issued before any is read: on a GPU they run at once.
        losses = [trainer.step(run) for run in active]
        for run, loss in zip(active, losses, strict=True):
            try:
                trainer.stepped(run, loss)
            except TaskAborted as exc:
                if trainer.stop.is_set():
                    raise
                runs.remove(run)  # its lease was lost: drop it, the others train on
                dropped(run, exc)
        active = [run for run in active if run in runs and not run.finished]
    if str(trainer.device).startswith("cuda") and torch.cuda.is_available():
        with timed(trainer.timings, "train"):
            torch.cuda.synchronize(trainer.device)


def train_together(
    trainer: PathTrainer,
    runs: list[TaskRun],
    dropped: Callable[[TaskRun, TaskAborted], None],
    batching: str = "stacked",
) -> None:
    """Train ``runs`` at once: as one stacked model (``batching`` "stacked", see
    :func:`train_stacked`) where they can be, else step-interleaved (:func:`train_interleaved`)."""
    if batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {BATCHINGS}, not {batching!r}")
    why = (
        stackable(runs, trainer.micro_batch, trainer.train_cfg["batch_size"])
        if runs and batching == "stacked"
        else "streams"
    )
    if why is None:
        train_stacked(trainer, runs, dropped)
    else:
        if batching == "stacked" and runs:
            log.info("training %d paths interleaved, not stacked: %s", len(runs), why)
        train_interleaved(trainer, runs, dropped)


def train_stacked(
    trainer: PathTrainer, runs: list[TaskRun], dropped: Callable[[TaskRun, TaskAborted], None]
) -> None:
    """:func:`train_interleaved`'s contract, trained as one stacked model (``peer/stacking.py``):
    a task whose lease is lost leaves ``runs`` and goes to ``dropped`` (the others are stacked
    again without it), a task that has done its steps leaves the stack; a stopping peer's
    ``TaskAborted`` is raised. Each task's model and optimizer hold its own parameters and
    moments when this returns or raises."""
    began = time.monotonic()
    for run in runs:
        run.began = began
    hold_heap()  # a step's large blocks are not faulted in again every step
    active = [run for run in runs if not run.finished]
    while active:
        with timed(trainer.timings, "train"):
            stack = Stack(trainer.model_cfg, trainer.device, trainer.features, active)
        try:
            while all(run in runs and not run.finished for run in active):
                with timed(trainer.timings, "train"):
                    losses = stack.step()
                for i, run in enumerate(active):
                    try:
                        trainer.stepped(run, losses[i])
                    except TaskAborted as exc:
                        if trainer.stop.is_set():
                            raise
                        runs.remove(run)  # its lease was lost: the others train on
                        dropped(run, exc)
        finally:
            with timed(trainer.timings, "train"):
                stack.write_back()
        active = [run for run in active if run in runs and not run.finished]
