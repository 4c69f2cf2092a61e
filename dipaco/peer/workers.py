"""One peer for a whole machine: a worker process per GPU (or per share of the CPU), one identity.

``dipaco-peer join --gpus all|0,1,...|cpu:N`` starts a :class:`Machine`: it spawns one worker per
device, each an ordinary peer process (``dipaco-peer join`` with ``--machine``) bound to its
device, and watches them. The workers share the machine's key (one party for the coordinator's
access rules), its pinned coordinator key and its per-path inner state (``<state-dir>/inner``:
the scheduler may give worker 1 the path worker 0 trained last round, and AdamW continues);
each keeps its own task checkpoint under ``<state-dir>/workers/w<i>``. Their peer ids are
``<peer-id>-w<i>``, and their Hello says ``{"machine", "worker", "workers"}``, so that
``dipaco status`` shows one peer with N workers.

Each worker trains its own path at once (a lab's 8 GPUs train 8 paths in a round). A worker
that dies (killed, out of memory, a driver reset) costs only its task: the others train on, and
the machine starts it again after ``restart_seconds`` (same id and folder, so it resumes its
task from its checkpoint while its lease lives). A worker that exits with an error of its own
(a device that cannot hold the path, say) is not restarted: its last lines say why. Ctrl-C
stops every worker; each hands its task back, as a single peer does.

Workers print JSON lines (``--log-format json``); the machine hands each line to ``on_event``
with the worker's index, for one panel of all of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dipaco.errors import ConfigError
from dipaco.procs import STOPPED, free_port

log = logging.getLogger(__name__)

RESTART_SECONDS = 2.0  # pause before a dead worker is started again
MAX_RESTARTS = 5  # per worker; past it the worker stays down and the machine says so
# The time a worker's plain log line starts with (cli/common.py's format): the machine prints
# the line with its own.
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)? ")
STOP_SECONDS = 3.0  # a stopping worker hands its task back within this, or is killed


def parse_gpus(spec: str, cuda_count: int | None = None) -> list[str]:
    """The devices ``--gpus`` names: ``all`` (every CUDA GPU), ``0,2`` (those GPUs), or
    ``cpu:N`` (N workers sharing the CPU, for machines without a GPU and for tests)."""
    spec = spec.strip()
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if spec.startswith("cpu"):
        _, _, n = spec.partition(":")
        try:
            workers = int(n or "1")
        except ValueError:
            raise ConfigError(f"--gpus {spec}: expected cpu:N with N a number") from None
        if not 1 <= workers <= 64:
            raise ConfigError(f"--gpus {spec}: N must be between 1 and 64")
        return ["cpu"] * workers
    if spec == "all":
        if count == 0:
            raise ConfigError("--gpus all: this machine has no CUDA GPU (try --gpus cpu:2)")
        return [f"cuda:{i}" for i in range(count)]
    try:
        ids = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--gpus {spec}: expected all, cpu:N or GPU numbers like 0,1") from None
    if not ids or len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus {spec}: name each GPU once")
    missing = [i for i in ids if not 0 <= i < count]
    if missing:
        raise ConfigError(
            f"--gpus {spec}: no GPU {missing[0]} (this machine has {count} CUDA GPU"
            f"{'s' * (count != 1)})"
        )
    return [f"cuda:{i}" for i in ids]


@dataclass
class Worker:
    """One worker process and what the machine knows of it."""

    index: int
    device: str
    peer_id: str
    state_dir: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    state: str = "starting"  # starting, running, restarting, done, failed, stopped
    last_lines: list[str] = field(default_factory=list)
    returncode: int | None = None
    died_at: float = 0.0  # when it was last found dead (its restart waits restart_seconds)


class Machine:
    """Spawn a worker per device with ``command(worker)`` (its argv) and watch them until every
    worker is done, or ``stop`` is set. ``on_event(worker, event)`` hears each line a worker
    prints (a dict: its JSON, or ``{"message": line}``) and the machine's own events
    (``worker_started``, ``worker_died``, ``worker_failed``, ``worker_done``)."""

    def __init__(
        self,
        name: str,
        devices: list[str],
        state_dir: Path,
        command: Callable[[Worker], list[str]],
        on_event: Callable[[Worker, dict[str, Any]], None],
        stop: threading.Event,
        *,
        restart_seconds: float = RESTART_SECONDS,
        max_restarts: int = MAX_RESTARTS,
        together: bool = False,
    ) -> None:
        # ``together``: the workers are one torch.distributed group (--shard-path); when one
        # dies the others cannot go on, so all are started again, at a fresh rendezvous.
        self.together = together
        self.rendezvous = ""
        self.name, self.state_dir = name, state_dir
        self.command, self.on_event, self.stop = command, on_event, stop
        self.restart_seconds, self.max_restarts = restart_seconds, max_restarts
        self.workers = [
            Worker(i, dev, f"{name}-w{i}", state_dir / "workers" / f"w{i}")
            for i, dev in enumerate(devices)
        ]
        self._readers: list[threading.Thread] = []

    def environment(self, worker: Worker) -> dict[str, str]:
        """The worker's environment: CPU workers split the cores between them (torch's threads),
        a GPU worker sees its GPU only (as cuda:0, so nothing lands on another card)."""
        env = dict(os.environ)
        n = len(self.workers)
        if worker.device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        elif worker.device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = worker.device.partition(":")[2]
        return env

    def start(self, worker: Worker) -> None:
        worker.state_dir.mkdir(parents=True, exist_ok=True)
        worker.proc = subprocess.Popen(
            self.command(worker),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(worker),
            text=True,
            bufsize=1,
        )
        worker.state, worker.returncode = "running", None
        reader = threading.Thread(
            target=self._read, args=(worker, worker.proc), daemon=True, name=f"worker{worker.index}"
        )
        reader.start()
        self._readers.append(reader)
        self.on_event(worker, {"event": "worker_started", "pid": worker.proc.pid})

    def _read(self, worker: Worker, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict):  # a log line: the machine stamps it, once
                event = {"message": _STAMP.sub("", line, count=1)}
            worker.last_lines = (worker.last_lines + [str(event.get("message", line))])[-5:]
            self.on_event(worker, event)

    def run(self) -> int:
        """Start every worker and watch them; 0 when every worker finished (or was stopped),
        1 when one failed for good."""
        self._start_all()
        try:
            while not self.stop.wait(0.2):
                if all(w.state in ("done", "failed") for w in self.workers):
                    break
                for worker in self.workers:
                    self._watch(worker)
        finally:
            self.close()
        return 1 if any(w.state == "failed" for w in self.workers) else 0

    def _start_all(self) -> None:
        self.rendezvous = f"tcp://127.0.0.1:{free_port()}"
        for worker in self.workers:
            self.start(worker)

    def _watch(self, worker: Worker) -> None:
        """Start a dead worker again when its pause is over; notice one that just ended. A
        group's workers (``together``) end together, and a death restarts the whole group."""
        if worker.state == "restarting":
            due = time.monotonic() >= worker.died_at + self.restart_seconds
            if due and not self.together:
                worker.restarts += 1
                self.start(worker)
            elif due and worker.index == 0:  # one restart of the group, through worker 0
                for w in self.workers:
                    w.restarts += 1
                self._start_all()
            return
        proc = worker.proc
        if proc is None or worker.state != "running" or proc.poll() is None:
            return
        worker.returncode = code = proc.returncode
        if code == STOPPED:  # Ctrl-C reached it too (the terminal's process group): it left
            worker.state = "stopped"
            self.on_event(worker, {"event": "worker_stopped"})
            return
        if code == 0 or (self.together and any(w.state == "done" for w in self.workers)):
            # A group's rank that dies once another ended normally (the run is over) was on its
            # way out (gloo's threads may abort an exiting process): nothing is left to redo.
            worker.state = "done"
            self.on_event(worker, {"event": "worker_done"})
            return
        # Killed by a signal (SIGKILL, the OOM killer): only its task is lost; start it again.
        # An exit with an error of its own is for the user to read, not to repeat.
        again = code < 0 and worker.restarts < self.max_restarts
        if self.together:
            self.close()  # the others wait on the dead one inside the group: stop them too
        for w in self.workers if self.together else [worker]:
            w.state, w.died_at = ("restarting" if again else "failed"), time.monotonic()
        event = {"event": "worker_died", "signal": -code} if code < 0 else {}
        self.on_event(worker, event if again else {"event": "worker_failed", "code": code})

    def close(self) -> None:
        """Stop every live worker: SIGINT (it hands its task back), then SIGKILL after
        ``STOP_SECONDS``."""
        live = [(w, w.proc) for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for _, proc in live:
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_SECONDS
        for w, proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if w.state == "running":
                w.state = "stopped"
        for reader in self._readers:
            reader.join(1.0)


def watch_parent(stop: threading.Event) -> None:
    """In a machine's worker: set ``stop`` (the worker hands its task back and exits) once the
    machine's process is gone, even when it was killed outright: no worker trains on, orphaned."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent:
                log.warning("the machine's process is gone: this worker stops")
                stop.set()

    threading.Thread(target=watch, daemon=True, name="watch-machine").start()
