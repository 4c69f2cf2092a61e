"""``dipaco-peer join --gpus ...``: one peer for a machine's devices, in one panel.

The workers are ordinary ``dipaco-peer join`` processes (``dipaco.peer.workers``); this prints
what they say: a live table of the workers on a terminal, and their lines, each marked with its
worker, in plain or JSON output.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from rich.live import Live
from rich.table import Table

from dipaco.cli import stopping
from dipaco.cli.common import console, say
from dipaco.errors import ConfigError
from dipaco.net.joins import kind_of
from dipaco.peer import ddp
from dipaco.peer.identity import stable_peer_id
from dipaco.peer.workers import Machine, Worker, parse_gpus
from dipaco.protocols.auth import Identity

# Options a worker gets as the machine got them (flag -> argparse dest).
PASSED = {
    "--authkey-file": "authkey_file",
    "--run": "run",
    "--coordinator-key": "coordinator_key",
    "--max-mbps": "max_mbps",
    "--memory-gb": "memory_gb",
    "--max-tasks": "max_tasks",
    "--patience": "patience",
    "--precision": "precision",
    "--compile": "compile",
    "--serve-modules": "serve_modules",  # each worker serves what it holds, on its own port
}


def worker_command(args: argparse.Namespace, name: str, state_dir: Path, n: int, machine):
    """The argv of each worker: this join, bound to the worker's device and folder (and, with
    --shard-path, to the group's rendezvous)."""

    def command(worker: Worker) -> list[str]:
        device = "cuda:0" if worker.device.startswith("cuda") else worker.device  # one visible
        argv = [sys.executable, "-m", "dipaco.cli.peer", "--log-format", "json", "join"]
        argv.append(args.address)
        for flag, dest in PASSED.items():
            value = getattr(args, dest, None)
            if value is not None:
                argv += [flag, str(value)]
        if getattr(args, "push_behind", False):
            argv.append("--push-behind")
        if getattr(args, "fetch_ahead", False):
            argv.append("--fetch-ahead")
        if args.shard_path:
            argv += ["--shard-path", "--dist-init", machine().rendezvous]
        return argv + [
            "--device", device, "--peer-id", worker.peer_id, "--state-dir", str(worker.state_dir),
            "--machine", name, "--worker", f"{worker.index}/{n}", "--machine-dir", str(state_dir),
        ]  # fmt: skip

    return command


def join_machine(args: argparse.Namespace) -> int:
    """Run a worker per device of ``--gpus`` until the run finishes or Ctrl-C."""
    if args.flower:
        raise ConfigError("--gpus works with dipaco's own transports; a Flower node is one device")
    if not args.address:
        raise ConfigError("join needs the address dipaco-coordinator start printed")
    kind_of(args.address, args.authkey_file)  # a wrong address is refused before any worker
    devices = parse_gpus(args.gpus)
    state_dir = Path(args.state_dir or Path.home() / ".cache" / "dipaco" / "peer")
    name = stable_peer_id(state_dir, args.peer_id)
    me = Identity.load_or_create(state_dir / "signing.key")  # the workers' one identity
    stop = threading.Event()
    stopping.on_stop(stop.set)
    panel = Panel(devices)
    machine = Machine(
        name,
        devices,
        state_dir,
        worker_command(args, name, state_dir, len(devices), lambda: machine),
        panel.on_event,
        stop,
        together=bool(args.shard_path),
    )
    how = "each path over all of them (DDP)" if args.shard_path else "a path each"
    say(f"peer {name}: {len(devices)} workers ({', '.join(devices)}), {how}; key {me.public_key}")
    live = None if console.lines else Live(panel.table(), console=console, refresh_per_second=2)
    panel.live = live
    with live if live is not None else contextlib.nullcontext():
        code = machine.run()
    tasks = sum(row["tasks"] for row in panel.rows)
    for w in machine.workers:
        if w.state == "failed":
            say(f"worker {w.index} ({w.device}) failed: " + " | ".join(w.last_lines[-3:]))
    finished = any(row["finished"] for row in panel.rows)
    say(
        f"{'the run has finished; ' if finished else ''}peer {name}: {tasks} tasks by "
        f"{len(devices)} workers"
    )
    return code


class Panel:
    """The workers' rows, updated from their events; each event also printed as a line."""

    def __init__(self, devices: list[str]) -> None:
        self.rows: list[dict[str, Any]] = [
            {"device": d, "state": "starting", "task": "", "step": "", "loss": "", "rate": "",
             "tasks": 0, "finished": False}
            for d in devices
        ]  # fmt: skip
        self.lock = threading.Lock()
        self.live: Live | None = None
        self.said: dict[int, float] = {}  # worker -> when its last progress line was printed

    def on_event(self, worker: Worker, event: dict[str, Any]) -> None:
        kind = event.get("event", "")
        message = event.get("message", "")
        with self.lock:
            row = self.rows[worker.index]
            if kind in (
                "worker_started", "worker_died", "worker_failed", "worker_done", "worker_stopped"
            ):  # fmt: skip
                row["state"] = kind.removeprefix("worker_")
                message = {
                    "worker_started": f"started (pid {event.get('pid')})",
                    "worker_died": f"died (signal {event.get('signal')}); only its task is lost, "
                    "starting it again",
                    "worker_failed": f"exited with code {event.get('code')}",
                    "worker_done": "done",
                    "worker_stopped": "stopped (Ctrl-C); its task is handed back",
                }[kind]
            elif kind in ("task_started", "task_progress", "task_trained"):
                row.update(state="training", task=event.get("task", ""))
                row["step"] = f"{event.get('step')}/{event.get('steps')}"
                if "loss" in event:
                    row["loss"] = f"{event['loss']:.3f}"
                if event.get("tokens_per_second"):
                    row["rate"] = f"{event['tokens_per_second']:,.0f}"
            elif kind == "task_acked":
                row.update(state="pushed", tasks=event.get("tasks_done", row["tasks"]))
            if "the run has finished" in message:
                row["finished"] = True
            if self.live is not None:
                self.live.update(self.table())
            if kind == "task_progress":  # a line at most every 30 s per worker
                if time.monotonic() - self.said.get(worker.index, 0.0) < 30:
                    return
                self.said[worker.index] = time.monotonic()
        if not message:
            return
        fields = {k: v for k, v in event.items() if k not in ("time", "event", "message")}
        console.event(
            kind or "worker_line", f"w{worker.index}: {message}", **fields, worker=worker.index
        )

    def table(self) -> Table:
        table = Table(title="workers", title_justify="left")
        for col in ("worker", "device", "state", "task", "step", "loss", "tok/s", "tasks"):
            table.add_column(col, justify="right" if col in ("tok/s", "tasks") else "left")
        for i, r in enumerate(self.rows):
            table.add_row(
                f"w{i}", r["device"], r["state"], str(r["task"]), str(r["step"]), r["loss"],
                r["rate"], str(r["tasks"]),
            )  # fmt: skip
        return table


def worker_group(args: argparse.Namespace, device: str) -> ddp.Group:
    """A --shard-path worker's place in its machine's group."""
    rank, _, world = (args.worker or "0/1").partition("/")
    return ddp.Group.join(args.dist_init, int(rank), int(world or 1), device)


def follow_path(group: ddp.Group) -> int:
    """A --shard-path worker other than rank 0: train what rank 0 leads until it quits."""
    say(f"worker {group.rank} of {group.world} ({group.device}): training rank 0's paths")
    ended = False
    try:
        steps = ddp.follow(group)
        ended = True
    finally:
        group.close(synchronise=ended)
    say(f"worker {group.rank}: {steps} steps, done")
    return leave_group_process(0)


def leave_group_process(code: int) -> NoReturn:
    """End a process that was in a --shard-path group, its group closed: without the
    interpreter's teardown, where gloo's threads can abort it ("terminate called without an
    active exception"), a signal the machine would read as a crash. Logs and output flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
