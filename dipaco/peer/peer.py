"""The volunteer's loop: claim a task, fetch the path's modules, train H inner steps, push deltas.

DiPaCo Algorithm 1, lines 5-10, seen from one worker. The peer never holds more than one path
(promise 5), except in the path-parallel mode (``parallel`` > 1, for a local run on one device:
``train_batch``), where it claims up to ``parallel`` tasks and trains them together, as
one stacked model (``batching="stacked"``, :mod:`~dipaco.peer.stacking`) or step-interleaved,
each on its own CUDA stream on a GPU (``batching="streams"``); and with ``push_behind``, where the task
whose deltas are being sent stays leased while the next one trains (:mod:`~dipaco.peer.behind`).
Its inner AdamW state stays on the peer,
per path, so a path it trains again continues its own optimizer; the scheduler keeps peers on
the path they trained last for that reason.

``Peer`` keeps the loop and delegates its parts: links to the scheduler and the module owners
(:mod:`~dipaco.peer.links`), module fetch and checks (:mod:`~dipaco.peer.modules`), a task's
training (:mod:`~dipaco.peer.training`), the push with the codec and error feedback
(:mod:`~dipaco.peer.push`), and the task checkpoint and inner-state files
(:mod:`~dipaco.peer.state`). A task is checkpointed while it trains, so a peer restarted with
the same id and state folder resumes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from dipaco.data.shards import TokenShard
from dipaco.errors import ConfigError, DipacoError, RejectedError, TransportError
from dipaco.peer import ddp
from dipaco.peer import device as devices
from dipaco.peer.ahead import Ahead
from dipaco.peer.behind import Behind
from dipaco.peer.checks import hello_with_clock
from dipaco.peer.links import (
    RETRY_SECONDS,
    Connect,
    Lease,
    OwnerLinks,
    Patience,
    RunOver,
    claim_tasks,
    heartbeating,
)
from dipaco.peer.modules import (
    Cache,
    Starts,
    TaskAborted,
    check_manifest,
    check_releases,
    fetch_modules,
)
from dipaco.peer.push import Pusher, Tensors, codec_settings
from dipaco.peer.seeds import SeedFetcher
from dipaco.peer.stacking import batching_of
from dipaco.peer.state import InnerState, TaskCheckpoint
from dipaco.peer.training import PathTrainer, TaskRun, timed, train_together
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.feedback import ErrorFeedback
from dipaco.protocols.linkwatch import GaveUp, gist
from dipaco.protocols.reasons import JUDGED, Reason
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)

# Refusals of a claim that pass by themselves: the peer waits and asks again.
PASSING = frozenset({Reason.RATE_LIMITED, Reason.QUOTA})
# Where a peer's time goes, in seconds (``Peer.timings``): "claim" (asking for work, and waiting
# for it or for a round to close, retries), "fetch", "train" (building the path's model and
# optimizer, the inner steps), "push", and "save" (inner state, checkpoints dropped).
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
        retry_seconds: float = RETRY_SECONDS,
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
        batching: str = "stacked",
        capabilities: dict[str, Any] | None = None,
        inner_dir: str | Path | None = None,
        shard_group: ddp.Group | None = None,
        seeds: SeedFetcher | None = None,
        push_behind: bool = False,
        fetch_ahead: bool = False,
        address: str | None = None,
    ) -> None:
        if parallel < 1:
            raise ConfigError(f"parallel must be at least 1, got {parallel}")
        if (push_behind or fetch_ahead) and (parallel > 1 or shard_group is not None):
            raise ConfigError("push behind and fetch ahead train one path at a time on one device")
        self.parallel = parallel  # tasks trained at once (path-parallel, see train_batch)
        # A finished task's model and optimizer kept for the next task of the same path
        # (training.Kept); one task at a time only. Off: every task builds and loads.
        self.keep_path = parallel == 1
        self.batching = batching_of(batching)  # one stacked model, or interleaved (CUDA streams)
        self.manifest_sha256 = manifest_sha256
        # The peer's key signs every request, to the scheduler and to every module owner alike.
        # Kept in the state folder, so that a restarted peer is the same party (its peer id and
        # its leases stay bound to its key).
        self.identity = (
            identity
            or transport.identity
            or auth.Identity.load_or_create(Path(state_dir) / "signing.key")
        )
        if transport.identity is not self.identity:
            transport.authenticate(self.identity, transport.server_key, transport.on_pin)
        self.transport, self.peer_id, self.state_dir = transport, peer_id, Path(state_dir)
        self.stop = stop or threading.Event()
        self.run_over = run_over or threading.Event()  # set from outside (the DHT) at the end
        self.device = devices.resolve_device(device)
        self.features = devices.training_features(str(self.device), precision, compile)
        self.max_tasks, self.memory_bytes = max_tasks, memory_bytes
        self.on_progress = on_progress or (lambda info: None)
        self.shard_source, self.checkpoint_seconds = shard_source, checkpoint_seconds
        self.cache: Cache = {}
        self.last_path: int | None = None
        self.starts = Starts()  # overlap: where a path's next task starts
        self.tasks_done, self.tokens_trained = 0, 0
        self.timings: dict[str, float] = dict.fromkeys(TIMED, 0.0)  # see TIMED
        self.config: dict[str, Any] = {}
        self.micro_batch: int | None = None
        # address: the one the peer joined, named in the advice when the retries end
        self.patience = Patience(
            peer_id, give_up_seconds, retry_seconds, self.stop, self.run_over, address
        )
        self.links = OwnerLinks(transport, self.identity, self.patience, connect)
        self.feedback = ErrorFeedback()
        self.pusher = Pusher(self.links, self.feedback, peer_id, on_ack or (lambda info: None))
        self.checkpoint = TaskCheckpoint(self.state_dir / "task", peer_id)
        # A machine's workers share one inner-state folder (dipaco.peer.workers): a path's AdamW
        # continues whichever worker trains it next.
        inner = Path(inner_dir) if inner_dir is not None else self.state_dir / "inner"
        self.inner = InnerState(inner, self.feedback, peer_id)
        self.capabilities = capabilities or {}  # said in Hello (a machine's worker: which one)
        self.shard_group = shard_group  # rank 0 of a machine training each path over its devices
        self.seeds = seeds  # modules peer to peer (peer/seeds.py): fetched from, served to peers
        self.clock_offset: tuple[float, float] | None = None  # see hello_with_clock
        self.on_setup: Callable[[Peer], None] = lambda peer: None  # after Hello, before training
        # Push behind (behind.py): a task's deltas sent while the next task trains.
        self.push_behind = push_behind
        self.behind = Behind(f"{peer_id}-push")
        # Fetch ahead (ahead.py): the next task claimed and downloaded near this one's end.
        self.fetch_ahead = fetch_ahead
        self.ahead = Ahead(f"{peer_id}-fetch")
        # The exception that ended the last run() (None when it returned): whoever started the
        # peer on a thread reads it there, where nothing else would see the peer stop.
        self.error: BaseException | None = None

    # ---- the loop -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Say hello, check the run manifest, and size micro-batches for this device."""
        hello = m.Hello(peer_id=self.peer_id, device=self.device, capabilities=self.capabilities)
        welcome, self.clock_offset = self.patience.call(
            lambda: hello_with_clock(self.transport, hello)
        )
        self.check_manifest(welcome)
        self.config = welcome.config
        self.feedback.decay, self.feedback.density = codec_settings(self.config)
        self.links.welcomed(welcome)
        self.trainer = trainer = make_trainer(self)
        self.model_cfg, self.topology = trainer.model_cfg, trainer.topology
        self.train_cfg, self.micro_batch = trainer.train_cfg, trainer.micro_batch
        self.on_setup(self)

    def check_manifest(self, welcome: m.Welcome) -> None:
        """The manifest is the one announced, and names and is signed by the scheduler's key."""
        check_manifest(welcome, self.transport.server_key, self.manifest_sha256)

    def run(self) -> int:
        """Train tasks until the run finishes (``run_finished`` is then True), ``stop`` is set
        or ``max_tasks`` are done; the number of tasks done. Whatever else stops it (a rejection
        the user must act on, an unexpected error) is recorded as ``error``, and raised."""
        self.run_finished, self.error = False, None
        try:
            self.setup()
            return self._timed_loop()
        except Exception as exc:
            self.error = exc
            raise

    def _timed_loop(self) -> int:
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
        try:
            self._tasks(last_contact)
        except RunOver:  # a push behind the training met the run's end
            self.run_finished = True
        finally:  # the last task's deltas go out before the peer leaves
            self.run_finished |= self.behind.drain()
            self.ahead.hand_back(self._release)  # a task fetched ahead
            self.links.close()
        return self.tasks_done

    def _tasks(self, last_contact: float) -> None:
        while not self.stop.is_set():
            self.behind.poll()  # a send that ended: its outcome
            pending = len(self.behind.holding)
            if self.max_tasks is not None and self.tasks_done + pending >= self.max_tasks:
                if not pending:
                    break
                self.behind.wait()  # it may fail: the task is then claimed again
                continue
            ahead = self.ahead.take()  # the task fetched ahead, if any, rather than a claim
            offers, reply = ([ahead[0]], None) if ahead is not None else self._claim_batch()
            if offers or not isinstance(reply, DipacoError):
                last_contact = time.monotonic()
            if offers or not isinstance(reply, TransportError):
                self.patience.watch.ok()  # the scheduler answered
            if isinstance(reply, RejectedError) and reply.reason not in PASSING:
                raise reply  # revoked, banned, not on the allow-list...: the user must act
            if offers:
                one = len(offers) == 1 and self.parallel == 1  # else a batch, even of one
                try:
                    fetched = ahead[1] if ahead is not None else None
                    self.run_task(offers[0], fetched) if one else train_batch(self, offers)
                except RunOver:
                    what = f"task {offers[0].task_id}" if one else "a batch of tasks"
                    log.info("peer %s: the run finished during %s", self.peer_id, what)
                    self.run_finished = True
                    break
                except (TaskAborted, TransportError, RejectedError) as exc:
                    if not one:  # train_batch handles each task's failures
                        raise
                    task_failed(self, offers[0], exc)
                continue
            if isinstance(reply, DipacoError):
                if self.patience.claim_failed(reply, last_contact):
                    self.run_finished = True
                    break
            elif isinstance(reply, m.NoTask):
                if reply.finished:
                    log.info("peer %s: run finished after %d tasks", self.peer_id, self.tasks_done)
                    self.run_finished = True
                    break
                self.stop.wait(reply.retry_after)

    def _claim_batch(self) -> tuple[list[m.TaskOffer], m.Message | DipacoError | None]:
        """Claim up to ``parallel`` tasks (one, preferring the last path, unless path-parallel:
        then the scheduler leases another path for each); see ``links.claim_tasks``."""
        want = self.parallel
        held = self.behind.holding  # a task being pushed: the scheduler leases another path
        if self.max_tasks is not None:
            want = min(want, self.max_tasks - self.tasks_done - len(held))
        prefer = self.last_path if self.parallel == 1 else None
        return claim_tasks(self.transport, self.peer_id, want, prefer, held)

    def heartbeating(self, leases: list[Lease]) -> AbstractContextManager[None]:
        """Heartbeat ``leases`` from a thread of their own while the block runs (links.py)."""
        every = self.config["heartbeat_seconds"]
        return heartbeating(self.transport, self.peer_id, leases, every, self.patience.watch)

    def _release(self, task: m.TaskOffer) -> None:
        try:
            self.transport.request(m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id))
        except DipacoError as again:
            log.warning("peer %s: release failed: %s", self.peer_id, again)

    # ---- one task -----------------------------------------------------------------------------
    def run_task(self, task: m.TaskOffer, fetched: dict | Exception | None = None) -> None:
        """Fetch, train and push one task, heartbeating all along (downloads can be slow);
        ``fetched``: its modules fetched ahead (or what that fetch raised)."""
        lease: Lease = (task, {"step": 0}, threading.Event())
        with self.heartbeating([lease]):
            run = self._setup_task(*lease, fetched=fetched)
            try:
                self.trainer.train(
                    run, (lambda r: fetch_next_ahead(self, r)) if self.fetch_ahead else None
                )
            except TaskAborted:
                if self.stop.is_set():  # leave cleanly: hand it back rather than let it expire
                    self.transport.request(
                        m.ReleaseTask(peer_id=self.peer_id, task_id=task.task_id)
                    )
                self.checkpoint.drop()
                raise
            if self.push_behind:
                return push_behind(self, run, lease)
            self._finish_task(run)

    def _setup_task(
        self,
        task: m.TaskOffer,
        progress: dict,
        lost: threading.Event,
        *,
        resume: bool = True,
        stream: Any = None,
        fetched: dict | Exception | None = None,
    ) -> TaskRun:
        """Fetch the path's modules (unless ``fetched`` ahead); build its model and optimizer,
        with its inner state (or the task's checkpoint, with ``resume``); open its data slice.
        Returns the task's state."""
        log.info("peer %s: training %s (path P%d)", self.peer_id, task.task_id, task.path)
        self.behind.wait(task.path)  # the path's last task is still being pushed: its state
        self.trainer.let_go(task.path)  # another path's kept model goes before this one comes
        self.links.owners.update(task.owners)  # who owns each module, as the scheduler says
        with timed(self.timings, "fetch"):
            if isinstance(fetched, Exception):
                raise fetched
            fetch = self.fetch if fetched is None else (lambda _: fetched)
            modules = self.starts.fetch(task, fetch, self.cache, self.config, self.topology)
        with timed(self.timings, "train"):
            model = self.trainer.build(task, modules, self.cache)
            run = self.trainer.open(
                task, modules, model, progress, lost, resume=resume, stream=stream
            )
        if run.step:
            log.info("peer %s: resuming %s at step %d", self.peer_id, task.task_id, run.step)
        return run

    def _finish_task(self, run: TaskRun) -> None:
        """The task's per-module deltas (fetched minus trained), pushed; its inner state saved."""
        tokens = self.trainer.finish(run, self.push)
        self._pushed(run.task, run.taken_delta(), tokens, run.losses)

    def _pushed(self, task: m.TaskOffer, delta: Tensors, tokens: int, losses: list[float]) -> None:
        self.tasks_done += 1
        self.tokens_trained += tokens
        self.last_path = task.path
        if self.parallel == 1:
            self.starts.keep(task, delta, self.config)
        log.info(
            "peer %s: %s done, loss %.3f -> %.3f", self.peer_id, task.task_id, losses[0], losses[-1]
        )

    def fetch(self, task: m.TaskOffer) -> Tensors:
        """The path's modules at the task's versions, downloading only what the cache lacks."""
        run_id = self.config.get("run_id")
        return fetch_modules(self.links, task, self.peer_id, run_id, self.cache, self.seeds)

    def _check_releases(self, owner: str, reply: m.Modules) -> None:
        """Every module version served is signed by the owner that serves it."""
        check_releases(self.links.link(owner).server_key, reply, self.config.get("run_id"))

    def push(
        self,
        task: m.TaskOffer,
        delta: Tensors,
        tokens: int,
        losses: list[float],
        before_send: Callable[[], None] | None = None,
    ) -> None:
        """Each module's delta to its owner, then TaskDone (see ``Pusher.push``)."""
        self.pusher.push(task, delta, tokens, losses, before_send)


def task_failed(
    peer: Peer, task: m.TaskOffer, exc: Exception, pause: bool = True, checkpoint: bool = True
) -> None:
    """A task that could not be trained or pushed: log it; hand back an aborted one, and one
    whose delta was judged and refused (trained again, it would be refused again); the
    checkpoint dropped unless not ``checkpoint`` (a push behind: it is the next task's)."""
    reason = getattr(exc, "reason", "")
    if isinstance(exc, TaskAborted):
        log.warning("peer %s: task %s aborted: %s", peer.peer_id, task.task_id, exc)
    elif isinstance(exc, TransportError):
        if not isinstance(exc, GaveUp):  # a failure its watch has not heard of
            peer.patience.watch.failed(exc)
        why = exc if isinstance(exc, GaveUp) else gist(exc)
        log.warning("peer %s: task %s lost: %s", peer.peer_id, task.task_id, why)
        return
    else:
        log.warning("peer %s: task %s rejected: %s (%s)", peer.peer_id, task.task_id, exc, reason)
        if checkpoint:
            peer.checkpoint.drop()
    if (isinstance(exc, TaskAborted) or reason in JUDGED) and not peer.stop.is_set():
        peer._release(task)  # re-issued at once
    if pause:
        peer.stop.wait(min(0.5, peer.patience.retry_seconds))  # never a hot loop of failures


def train_batch(peer: Peer, tasks: list[m.TaskOffer]) -> None:
    """Train several tasks (paths) at once; push each as ``run_task`` does.

    Every task is set up (fetch, model, optimizer, inner state, data), then trained with the
    others (``training.train_together``): as one stacked model (``peer.batching`` "stacked": every
    step of every task one batched step, its deltas equal to ``run_task``'s up to float rounding)
    or step-interleaved ("streams": each on its own CUDA stream on a GPU, in plain turns on a
    CPU; each task's operations, so its deltas, exactly those of ``run_task``). Then each
    task's deltas are pushed and its inner state saved, in order. One heartbeat thread keeps
    every lease alive.

    In-flight tasks of a batch are not checkpointed and not resumed (a restarted peer trains
    them again from their base). A task whose lease is lost is dropped and handed back, the
    others train on; a stopping peer hands every task of the batch back. Failures of one task
    (fetch, push) are handled as ``_loop`` handles a single task's.
    """
    leases = [(task, {"step": 0}, threading.Event()) for task in tasks]
    with peer.heartbeating(leases):
        try:
            _train_batch(peer, leases)
        except TaskAborted as exc:  # the peer is stopping: hand every task back at once
            log.warning("peer %s: batch of %d aborted: %s", peer.peer_id, len(tasks), exc)
            for task in tasks:
                peer._release(task)


def _train_batch(peer: Peer, leases: list[Lease]) -> None:
    # Streams only for interleaving: a stacked batch is one model on the current stream.
    cuda = (
        peer.batching == "streams"
        and str(peer.device).startswith("cuda")
        and torch.cuda.is_available()
    )
    runs: list[TaskRun] = []
    for lease in leases:
        if peer.stop.is_set():
            raise TaskAborted("peer is stopping")
        stream = torch.cuda.Stream(device=peer.device) if cuda else None
        try:  # no checkpoints in a batch (see train_batch)
            runs.append(peer._setup_task(*lease, resume=False, stream=stream))
        except (TaskAborted, TransportError, RejectedError) as exc:
            task_failed(peer, lease[0], exc, pause=False)
    train_together(
        peer.trainer, runs, lambda run, exc: task_failed(peer, run.task, exc, False), peer.batching
    )
    for run in runs:
        try:
            peer._finish_task(run)
        except (TaskAborted, TransportError, RejectedError) as exc:
            task_failed(peer, run.task, exc, pause=False)


def make_trainer(peer: Peer) -> PathTrainer:
    """The peer's trainer for the run its Welcome described (``peer.config``): a
    :class:`PathTrainer`, or rank 0's :class:`~dipaco.peer.ddp.ShardedTrainer` when the peer
    trains each path over a machine's devices."""
    kwargs: dict[str, Any] = dict(
        device=peer.device,
        features=peer.features,
        memory_bytes=peer.memory_bytes,
        timings=peer.timings,
        checkpoint=peer.checkpoint,
        inner=peer.inner,
        checkpoint_seconds=peer.checkpoint_seconds,
        on_progress=peer.on_progress,
        stop=peer.stop,
        shard_source=peer.shard_source,
    )
    if peer.shard_group is not None:
        trainer: PathTrainer = ddp.ShardedTrainer(peer.shard_group, peer.config, **kwargs)
    else:
        trainer = PathTrainer(peer.config, **kwargs)
        trainer.keep_path = peer.keep_path and peer.parallel == 1
    if trainer.micro_batch < trainer.train_cfg["batch_size"]:
        log.info(
            "peer %s: micro-batch %d, accumulating to the run's batch of %d",
            peer.peer_id,
            trainer.micro_batch,
            trainer.train_cfg["batch_size"],
        )
    return trainer


def push_behind(peer: Peer, run: TaskRun, lease: Lease) -> None:
    """Encode and save here (``trainer.finish_behind``), send on the push thread (behind.py)."""
    peer.behind.wait()  # one send at a time
    wire, undo, tokens = peer.trainer.finish_behind(run, peer.pusher.encode)
    task, delta, losses = run.task, run.taken_delta(), run.losses
    peer.behind.start(
        task,
        lambda: peer.pusher.send(task, wire, list(delta), tokens, losses),
        beating=lambda: peer.heartbeating([lease]),
        undo=undo,
        failed=lambda exc: task_failed(peer, task, exc, pause=False, checkpoint=False),
        done=lambda: peer._pushed(task, delta, tokens, losses),
    )


def fetch_next_ahead(peer: Peer, run: TaskRun) -> None:
    """Fetch ahead: near the task's end, claim the next task and fetch its modules."""
    per_step = (time.monotonic() - run.began) / max(1, run.step)
    room = peer.max_tasks is None or (
        peer.tasks_done + 2 + len(peer.behind.holding) <= peer.max_tasks
    )
    if (
        not room
        or peer.stop.is_set()
        or not peer.ahead.due(run.task.inner_steps - run.step, per_step)
    ):
        return
    holding = [run.task.task_id, *peer.behind.holding]
    claim = m.ClaimTask(peer_id=peer.peer_id, holding=holding, wait=0.0)
    peer.ahead.start(
        lambda: peer.transport.request(claim),
        peer.fetch,
        lambda offer: peer.heartbeating([(offer, {"step": 0}, threading.Event())]),
    )
