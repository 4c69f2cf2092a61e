"""``dipaco-peer``: join a run and train its paths until the run finishes.

    dipaco-peer join 127.0.0.1:PORT --authkey-file runs/r1/coordinator/authkey

Ctrl-C stops after releasing the current task, so the coordinator re-issues it at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dipaco.cli.common import command_parser, console, dispatch
from dipaco.peer.peer import Peer
from dipaco.protocols.transport import LoopbackTransport


def cmd_join(args: argparse.Namespace) -> int:
    key = bytes.fromhex(Path(args.authkey_file).read_text().strip())
    peer_id = args.peer_id or f"{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    transport = LoopbackTransport(args.address, key)
    state_dir = Path(args.state_dir or Path.home() / ".cache" / "dipaco" / peer_id)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    current: dict[str, TaskID] = {}

    def on_progress(info: dict) -> None:
        if info["task"] not in current:
            for old in current.values():
                progress.update(old, visible=False)
            current.clear()
            current[info["task"]] = progress.add_task(
                f"task {info['task']} (path P{info['path']})", total=info["steps"], loss=""
            )
        progress.update(
            current[info["task"]], completed=info["step"], loss=f"loss {info['loss']:.3f}"
        )

    peer = Peer(
        transport,
        peer_id,
        state_dir,
        max_tasks=args.max_tasks,
        device=args.device,
        stop=stop,
        on_progress=on_progress,
    )
    console.print(f"peer {peer_id} ({peer.device}) joined {args.address}")
    try:
        with progress:
            done = peer.run()
    finally:
        transport.close()
    console.print(f"peer {peer_id} left after {done} tasks")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco-peer", __doc__)
    join = sub.add_parser("join", help="join a run at ADDRESS")
    join.add_argument("address", help="host:port printed by dipaco-coordinator start")
    join.add_argument("--authkey-file", required=True, help="the run's key file")
    join.add_argument("--peer-id")
    join.add_argument(
        "--state-dir", help="where inner optimizer state is kept (default ~/.cache/dipaco/<id>)"
    )
    join.add_argument("--max-tasks", type=int)
    join.add_argument(
        "--device", default="auto", help="auto (a CUDA GPU if there is one), cpu, cuda:0, ..."
    )
    join.set_defaults(fn=cmd_join)
    dispatch(parser, argv)


if __name__ == "__main__":
    main()
