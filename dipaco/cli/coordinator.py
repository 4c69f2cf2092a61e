"""``dipaco-coordinator``: serve a run to peers over the internet (hivemind) or on this machine.

    dipaco-coordinator start --config run.toml --run-dir runs/r1 --listen 0.0.0.0:31337

prepares the run if needed, joins (starts) a hivemind DHT, publishes the run manifest, and prints
the address peers join with (``dipaco-peer join <address>``). Another coordinator can take over a
share of the modules and apply their outer steps itself:

    dipaco-coordinator start --join <address> --owns L1.M0,L1.M1 \\
        --owner-key runs/r1/coordinator/owner.key --run-dir runs/owner2

``--transport loopback`` serves peers on this machine only (127.0.0.1 and a key file), without
hivemind. Every form restarts from its run folder after a crash or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import secrets
import threading
import time
from pathlib import Path

from dipaco.cli.common import choose_config, command_parser, console, dispatch
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.prepare import prepare
from dipaco.coordinator.run import MetricsLog, build_coordinator, build_owner, run_local_peers
from dipaco.errors import ConfigError, DipacoError
from dipaco.protocols.transport import LoopbackServer


def secret_file(path: Path) -> tuple[bytes, Path]:
    """A 32-byte secret kept in ``path`` with owner-only access, created on first use."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    try:
        return bytes.fromhex(path.read_text().strip()), path
    except ValueError:
        raise ConfigError(f"{path} is not a dipaco key file (64 hex digits)") from None


def authkey(run_dir: Path) -> tuple[bytes, Path]:
    """The run's shared secret for the loopback transport."""
    return secret_file(run_dir / "coordinator" / "authkey")


def identity(run_dir: Path) -> Path:
    """The node's libp2p key, so that its address (PeerID) survives restarts."""
    from hivemind.p2p import P2P

    path = run_dir / "coordinator" / "identity.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return path


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ConfigError(f"--listen wants host:port, got {listen!r}") from None


class Ticker(threading.Thread):
    """Calls ``coordinator.tick()`` every second: leases expire and overdue rounds close on time."""

    def __init__(self, coordinator: Coordinator) -> None:
        super().__init__(name="dipaco-tick", daemon=True)
        self.coordinator, self.stop = coordinator, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.coordinator.tick()


def wait_finished(coordinator: Coordinator, linger: float, publisher=None) -> None:
    while not coordinator.finished_event.wait(1.0):
        pass
    if coordinator.failure:
        raise DipacoError(coordinator.failure)
    console.print(f"run finished: every module at version {coordinator.round}")
    if publisher is not None:
        publisher.publish()  # "finished" in the DHT now: peers that cannot reach us stop
    # Stay a moment so that peers asking for work hear "finished" rather than a closed socket.
    time.sleep(linger)


def cmd_start(args: argparse.Namespace) -> int:
    if args.owns or args.join:
        return start_owner(args)
    config = choose_config(args.config, args.preset)
    run_dir = Path(args.run_dir)
    prep = prepare(run_dir, config, stage=lambda s: console.log(s))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if args.transport == "loopback":
        return serve_loopback(args, prep, metrics)
    from dipaco.protocols import discovery
    from dipaco.protocols.hivemind_transport import HivemindNode

    host, port = _split(args.listen)
    key, key_path = secret_file(run_dir / "coordinator" / "owner.key")
    node = HivemindNode(host=host, port=port, identity_path=identity(run_dir))
    publisher = ticker = None
    threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        coordinator = build_coordinator(
            prep, metrics, evaluate=not args.no_eval, owner_id=node.peer_id, secret=key
        )
        addresses = node.visible_maddrs()
        coordinator.addresses[node.peer_id] = addresses
        node.serve(coordinator.handle)
        manifest = coordinator.peer_config
        run_id = prep.run_id

        def records() -> list[tuple]:
            with coordinator.lock:
                owners: dict[str, list[str]] = {}
                for mid, owner in coordinator.owners.items():
                    owners.setdefault(owner, []).append(mid)
                versions = {mid: coordinator.version(mid) for mid in coordinator.owners}
                out = [
                    (
                        discovery.RUNS,
                        {
                            "scheduler": node.peer_id,
                            "addresses": addresses,
                            "manifest": discovery.manifest_sha256(manifest),
                        },
                        run_id,
                    ),
                    (discovery.key(run_id, "manifest"), manifest),
                    (
                        discovery.key(run_id, "progress"),
                        {
                            "round": coordinator.round,
                            "rounds": coordinator.rounds,
                            "modules": versions,
                            "finished": coordinator.finished,
                        },
                    ),
                ]
                for owner, mids in owners.items():
                    info = {
                        "modules": sorted(mids),
                        "addresses": coordinator.addresses.get(owner, []),
                        "scheduler": owner == node.peer_id,
                    }
                    out.append((discovery.key(run_id, "owners"), info, owner))
            return out

        publisher = discovery.Publisher(node, records, interval=args.publish_seconds)
        publisher.start()
        ticker = Ticker(coordinator)
        ticker.start()
        address = addresses[0]
        (run_dir / "coordinator" / "address").write_text(address + "\n")
        console.print(f"coordinator for run {run_id} (hivemind) at [bold]{address}[/]")
        console.print(f"peers join with: dipaco-peer join {address}", soft_wrap=True)
        console.print(
            f"another module owner: dipaco-coordinator start --join {address} --owns MODULES "
            f"--owner-key {key_path} --run-dir DIR",
            soft_wrap=True,
        )
        if args.local_peers:
            threads = run_local_peers(coordinator, prep, args.local_peers, stop=stop)
        wait_finished(coordinator, args.linger, publisher)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for worker in (publisher, ticker):
            if worker is not None:
                worker.stop.set()
        node.shutdown()
    return 0


def start_owner(args: argparse.Namespace) -> int:
    """Join a run as the owner of some modules (``--join ADDRESS --owns ...``)."""
    from dipaco.coordinator.owner import Reporter, take_over
    from dipaco.protocols import discovery
    from dipaco.protocols import messages as m
    from dipaco.protocols.hivemind_transport import HivemindNode

    if not (args.owns and args.join and args.owner_key):
        raise ConfigError("a module owner needs --join ADDRESS, --owns MODULES and --owner-key")
    run_dir = Path(args.run_dir)
    key, _ = secret_file(Path(args.owner_key))
    host, port = _split(args.listen)
    node = HivemindNode(
        initial_peers=[args.join], host=host, port=port, identity_path=identity(run_dir)
    )
    reporter = ticker = publisher = None
    try:
        run_id, entry, manifest = discovery.find_run(node, args.run)
        scheduler = node.transport(entry["scheduler"], entry.get("addresses", []))
        welcome = scheduler.request(m.Hello(peer_id=node.peer_id, device="coordinator"))
        if discovery.manifest_sha256(welcome.config) != entry["manifest"]:
            raise ConfigError("the scheduler's manifest differs from the one in the DHT")
        coordinator = build_owner(
            run_dir,
            manifest,
            MetricsLog(run_dir / "metrics.jsonl"),
            owner_id=node.peer_id,
            secret=key,
        )
        addresses = node.visible_maddrs()
        coordinator.addresses[node.peer_id] = addresses
        node.serve(coordinator.handle)
        owns = [mid.strip() for mid in args.owns.split(",") if mid.strip()]
        moved = take_over(coordinator, scheduler, owns)
        reporter = Reporter(coordinator, scheduler, interval=args.report_seconds)
        reporter.start()
        ticker = Ticker(coordinator)
        ticker.start()

        def records() -> list[tuple]:
            info = {
                "modules": coordinator.owned_modules(),
                "addresses": addresses,
                "scheduler": False,
            }
            return [(discovery.key(run_id, "owners"), info, node.peer_id)]

        publisher = discovery.Publisher(node, records, interval=args.publish_seconds)
        publisher.start()
        (run_dir / "coordinator" / "address").write_text(addresses[0] + "\n")
        console.print(
            f"owner {node.peer_id} of {', '.join(coordinator.owned_modules())} for run {run_id}"
            + (f" (took over {', '.join(moved)})" if moved else " (resumed from its folder)"),
            soft_wrap=True,
        )
        wait_finished(coordinator, args.linger)
    finally:
        for worker in (reporter, ticker, publisher):
            if worker is not None:
                worker.stop.set()
        node.shutdown()
    return 0


def serve_loopback(args, prep, metrics) -> int:
    run_dir = Path(args.run_dir)
    key, key_path = authkey(run_dir)
    # The key file is also the secret that signs task tickets.
    coordinator = build_coordinator(prep, metrics, evaluate=not args.no_eval, secret=key)
    host, port = _split(args.listen)
    server = LoopbackServer(coordinator.handle, key, host=host, port=port)
    console.print(f"coordinator for run {prep.run_id} listening on [bold]{server.address}[/]")
    console.print(
        f"peers join with: dipaco-peer join {server.address} --authkey-file {key_path}",
        soft_wrap=True,
    )
    (run_dir / "coordinator" / "address").write_text(server.address + "\n")
    stop = threading.Event()
    ticker = Ticker(coordinator)
    ticker.start()
    threads = (
        run_local_peers(coordinator, prep, args.local_peers, stop=stop) if args.local_peers else []
    )
    try:
        wait_finished(coordinator, args.linger)
    finally:
        stop.set()
        ticker.stop.set()
        for t in threads:
            t.join(30)
        server.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco-coordinator", __doc__)
    start = sub.add_parser("start", help="prepare (if needed) and serve a run, or own modules")
    start.add_argument("--config", help="run config (TOML)")
    start.add_argument("--preset", help="a preset instead of a config file (demo, tiny)")
    start.add_argument("--run-dir", required=True)
    start.add_argument(
        "--transport",
        choices=["hivemind", "loopback"],
        default="hivemind",
        help="hivemind (the internet; default) or loopback (this machine only)",
    )
    start.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="host:port to listen on (port 0 picks a free one; 0.0.0.0 for the internet)",
    )
    start.add_argument("--join", help="another owner: the address the run's coordinator printed")
    start.add_argument("--owns", help="another owner: comma-separated module ids to take over")
    start.add_argument("--owner-key", help="another owner: the run's coordinator/owner.key")
    start.add_argument("--run", help="the run id, when the DHT announces several")
    start.add_argument(
        "--local-peers", type=int, default=0, help="also run this many peers in-process"
    )
    start.add_argument(
        "--linger",
        type=float,
        default=5.0,
        help="seconds to keep answering peers after the run finished",
    )
    start.add_argument("--publish-seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    start.add_argument("--report-seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    start.add_argument(
        "--no-eval", action="store_true", help="skip the validation after each round"
    )
    start.set_defaults(fn=cmd_start)
    dispatch(parser, argv)


if __name__ == "__main__":
    main()
