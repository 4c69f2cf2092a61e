"""``dipaco-coordinator``: serve a run to peer processes on this machine (the loopback transport).

    dipaco-coordinator start --config run.toml --run-dir runs/r1

prepares the run if needed, listens on 127.0.0.1, prints the address and key file peers need,
and exits when every module has finished its rounds. The internet transport (hivemind) and the
Flower transport come as later issues; the coordinator core they drive is the same.
"""

from __future__ import annotations

import argparse
import os
import secrets
import threading
import time
from pathlib import Path

from dipaco.cli.common import choose_config, command_parser, console, dispatch
from dipaco.coordinator.prepare import prepare
from dipaco.coordinator.run import MetricsLog, build_coordinator, run_local_peers
from dipaco.protocols.transport import LoopbackServer


def authkey(run_dir: Path) -> tuple[bytes, Path]:
    """The run's shared secret for the loopback transport, created once with owner-only access."""
    path = run_dir / "coordinator" / "authkey"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip()), path


def cmd_start(args: argparse.Namespace) -> int:
    config = choose_config(args.config, args.preset)
    run_dir = Path(args.run_dir)
    prep = prepare(run_dir, config, stage=lambda s: console.log(s))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=not args.no_eval)
    key, key_path = authkey(run_dir)
    host, _, port = args.listen.rpartition(":")
    server = LoopbackServer(coordinator.handle, key, host=host, port=int(port))
    console.print(f"coordinator for run {prep.run_id} listening on [bold]{server.address}[/]")
    console.print(
        f"peers join with: dipaco-peer join {server.address} --authkey-file {key_path}",
        soft_wrap=True,
    )
    (run_dir / "coordinator" / "address").write_text(server.address + "\n")
    stop = threading.Event()
    threads = (
        run_local_peers(coordinator, prep, args.local_peers, stop=stop) if args.local_peers else []
    )
    try:
        while not coordinator.finished_event.wait(1.0):
            pass
        console.print(f"run finished: every module at version {coordinator.round}")
        # Stay a moment so that peers asking for work hear "finished" rather than a closed socket.
        time.sleep(args.linger)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        server.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco-coordinator", __doc__)
    start = sub.add_parser("start", help="prepare (if needed) and serve a run")
    start.add_argument("--config", help="run config (TOML)")
    start.add_argument("--preset", help="a preset instead of a config file (demo, tiny)")
    start.add_argument("--run-dir", required=True)
    start.add_argument(
        "--listen", default="127.0.0.1:0", help="host:port (port 0 picks a free one)"
    )
    start.add_argument(
        "--local-peers", type=int, default=0, help="also run this many peers in-process"
    )
    start.add_argument(
        "--linger",
        type=float,
        default=3.0,
        help="seconds to keep answering peers after the run finished",
    )
    start.add_argument(
        "--no-eval", action="store_true", help="skip the validation after each round"
    )
    start.set_defaults(fn=cmd_start)
    dispatch(parser, argv)


if __name__ == "__main__":
    main()
