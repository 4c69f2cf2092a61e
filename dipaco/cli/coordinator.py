"""``dipaco-coordinator``: serve a run to peers over the internet (hivemind) or on this machine.

    dipaco-coordinator start --config run.toml --run-dir runs/r1 --listen 0.0.0.0:31337

prepares the run if needed, joins (starts) a hivemind DHT, publishes the run manifest, and prints
the address peers join with (``dipaco-peer join <address>``). Another coordinator can take over a
share of the modules and apply their outer steps itself:

    dipaco-coordinator key --run-dir runs/owner2               (on the owner: prints its key)
    dipaco-coordinator allow --owner KEY --run-dir runs/r1     (on the scheduler)
    dipaco-coordinator start --join <address> --owns L1.M0,L1.M1 --run-dir runs/owner2

Keys: every coordinator signs with ``<run-dir>/coordinator/signing.key`` (Ed25519, made on first
use). ``allow KEY`` and ``revoke KEY`` change who may join (``security.join = "allow-list"``) or
own modules, while the run goes on.

A standby scheduler on another machine (a copy of the run folder and of the scheduler's
``signing.key``) copies the scheduler's state and takes over when it stops answering:

    dipaco-coordinator start --standby --join <address> --run-dir runs/r1

``--transport loopback`` serves peers on this machine only (127.0.0.1 and a key file), without
hivemind. ``--transport flower`` runs the coordinator as a Flower ServerApp behind a SuperLink
with TLS and SuperNode authentication (docs/flower.md); admit each node's key with
``dipaco-coordinator add-peer KEY --run-dir DIR``. Every form restarts from its run folder after
a crash or Ctrl-C.
"""

from __future__ import annotations

import argparse
import secrets
import time
from pathlib import Path

from dipaco.cli import stopping
from dipaco.cli.common import choose_config, command_parser, console, dispatch, say
from dipaco.cli.events import print_events
from dipaco.cli.nodes import (
    add_join_options,
    check_relay_flags,
    check_relayed,
    joined_node,
    relayed_route,
    relays_for_owners,
)
from dipaco.config import PRESETS, RunConfig, read_run_config
from dipaco.coordinator.access import change_access
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.gather import gather_at_end, remote_fetcher, wait_gathered
from dipaco.coordinator.ticker import Ticker
from dipaco.errors import ConfigError, DipacoError, RejectedError
from dipaco.fileio import write_private
from dipaco.net import hivemind
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.addresses import check_port_free, split_hostport
from dipaco.protocols.auth import Identity
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import LoopbackServer
from dipaco.run.factory import build_coordinator, build_owner
from dipaco.run.local import LocalRun
from dipaco.run.metrics_log import MetricsLog


def secret_file(path: Path) -> tuple[bytes, Path]:
    """A 32-byte secret kept in ``path`` with owner-only access, created on first use."""
    if not path.exists():
        write_private(path, secrets.token_hex(32))
    try:
        return bytes.fromhex(path.read_text().strip()), path
    except ValueError:
        raise ConfigError(f"{path} is not a dipaco key file (64 hex digits)") from None


def authkey(run_dir: Path) -> tuple[bytes, Path]:
    """The run's shared secret for the loopback transport."""
    return secret_file(run_dir / "coordinator" / "authkey")


def wait_finished(
    coordinator: Coordinator, linger: float, publisher=None, gather_from=None
) -> None:
    while not coordinator.finished_event.wait(1.0):
        pass
    if coordinator.failure:
        raise DipacoError(coordinator.failure)
    say(f"run finished: every module at version {coordinator.round}")
    stopping.mark_done()  # a signal from now on cuts the linger short: exit 0, nothing to resume
    if publisher is not None:
        publisher.publish()  # "finished" in the DHT now: peers that cannot reach us stop
    if gather_from is not None:
        gather_from()
    # Stay a moment so that peers asking for work hear "finished" rather than a closed socket;
    # Ctrl-C cuts it short (the run is over: nothing to resume). The sleep is interrupted even
    # when the kernel hands the signal to another thread (cli/stopping.py wakes this one).
    try:
        time.sleep(linger)
    except KeyboardInterrupt:
        pass
    coordinator.save_counts()


def cmd_start(args: argparse.Namespace) -> int:
    check_relay_flags(args)
    check_port_free(args.listen, "--listen")
    if args.dashboard:
        check_port_free(args.dashboard, "--dashboard")
    if args.standby:
        return start_standby(args)
    if args.owns or args.join:
        return start_owner(args)
    run_dir = Path(args.run_dir)
    config = start_config(args, run_dir)
    prep = prepare(run_dir, config, stage=lambda s: console.log(s))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    print_events(metrics)
    if args.transport == "loopback":
        return serve_loopback(args, prep, metrics)
    if args.transport == "flower":
        from dipaco.cli.flower_serve import serve_flower

        return serve_flower(args, prep)
    from dipaco.protocols.hivemind import HivemindNode

    host, port = split_hostport(args.listen)
    node = HivemindNode(host=host, port=port, identity_path=hivemind.node_identity(run_dir))
    return serve_hivemind(args, prep, metrics, node)


def start_config(args: argparse.Namespace, run_dir: Path) -> RunConfig:
    """The run config ``start`` serves: ``--config`` or ``--preset``; without either, the one a
    run folder saved (resuming it); never a preset nobody chose."""
    if args.config or args.preset:
        return choose_config(args.config, args.preset)
    saved = run_dir / "config.json"
    if saved.exists():
        try:
            config = read_run_config(run_dir)
        except ValueError as exc:
            raise ConfigError(f"{saved}: not a readable run config: {exc}") from None
        say(f"resuming {run_dir} with the config it saved ({saved})")
        return config
    raise ConfigError(
        f"{run_dir} holds no run yet and no config was given: pass --config FILE (`dipaco init` "
        f"writes one) or --preset NAME (one of {', '.join(sorted(PRESETS))}; demo trains in "
        "about 10 minutes on 2 cores)"
    )


def serve_hivemind(args: argparse.Namespace, prep, metrics: MetricsLog, node) -> int:
    """Schedule the run (and own its modules not handed over) on ``node``, publishing it in the
    DHT, until it finishes, or until a standby's newer claim supersedes this scheduler."""
    from dipaco.net.standby import Fence
    from dipaco.protocols import discovery

    run_dir = Path(args.run_dir)
    publisher = ticker = dashboard = None
    try:
        coordinator = build_coordinator(
            prep, metrics, evaluate=not args.no_eval, owner_id=node.peer_id
        )
        addresses = node.visible_maddrs()
        coordinator.reachable_at(addresses)
        coordinator.set_remote_fetcher(remote_fetcher(coordinator, run_dir, node))
        # The node answers from 8 handler threads: at most 4 long polls at once (3 claims
        # waiting for a path, and a TaskDone waiting for an owner's report).
        coordinator.polls.limit(4)
        node.serve(
            coordinator.handle,
            workers=8,
            relay_for=relays_for_owners(coordinator) if args.relay else None,
        )
        run_id = prep.run_id
        fence = Fence(node, run_id, coordinator.epoch)

        def records() -> list[tuple]:
            if not fence.check():  # a standby took over: publish nothing, stop
                coordinator.fail(
                    f"superseded by scheduler {fence.superseded}: this one stops (start it "
                    "again with --standby to stand by)"
                )
                return []
            return hivemind.scheduler_records(coordinator, node.peer_id, addresses, run_id)

        publisher = discovery.Publisher(node, records, interval=args.publish_seconds)
        publisher.start()
        ticker = Ticker(coordinator)
        ticker.start()
        dashboard = start_dashboard(args, coordinator)
        address = addresses[0]
        (run_dir / "coordinator" / "address").write_text(address + "\n")
        console.print(
            f"coordinator for run {run_id} (hivemind, epoch {coordinator.epoch}) at "
            f"[bold]{address}[/]"
        )
        key = coordinator.identity.public_key
        console.print(
            f"peers join with: dipaco-peer join {address} --coordinator-key {key}", soft_wrap=True
        )
        console.print(
            f"another module owner: dipaco-coordinator allow --owner ITS_KEY --run-dir {run_dir}, "
            f"then on it: dipaco-coordinator start --join {address} --owns MODULES --run-dir DIR"
            + (" (add --via-relay behind NAT: this scheduler relays for it)" if args.relay else ""),
            soft_wrap=True,
        )
        console.print(
            f"a standby scheduler: copy {run_dir}, leaving out coordinator/ but for "
            f"coordinator/signing.key, to it; then on it: dipaco-coordinator start --standby "
            f"--join {address} --run-dir DIR",
            soft_wrap=True,
        )
        with LocalRun(coordinator, prep, args.local_peers):
            wait_finished(
                coordinator,
                args.linger,
                publisher,
                gather_from=lambda: gather_at_end(coordinator, run_dir, node, say),
            )
        if args.relay:
            say(f"relayed {node.stats['relayed']} requests to module owners behind NAT")
    finally:
        for worker in (publisher, ticker):
            if worker is not None:
                worker.stop.set()
        if dashboard is not None:
            stop_dashboard(dashboard, run_dir)
        node.shutdown(quick=stopping.requested())
    return 0


def start_standby(args: argparse.Namespace) -> int:
    """Stand by for a run's scheduler (``--standby --join ADDRESS``): copy its state, and
    schedule the run from that state once it stops answering."""
    from dipaco.net import standby
    from dipaco.run.manifest import peer_config

    if not args.join:
        raise ConfigError("a standby scheduler needs --join ADDRESS (any node of the run)")
    if args.owns:
        raise ConfigError("--standby and --owns: a standby schedules, it owns no modules")
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").exists():
        raise ConfigError(
            f"{run_dir} holds no prepared run: copy the active scheduler's run folder here"
        )
    key_file = run_dir / "coordinator" / "signing.key"
    if not key_file.exists():
        raise ConfigError(
            f"{key_file} is missing: a standby signs with the scheduler's key; copy it from the "
            "active scheduler's run folder"
        )
    prep = prepare(run_dir, read_run_config(run_dir))
    me = Identity.load_or_create(key_file)
    node = joined_node(args, run_dir)
    try:
        take_over = standby.follow(
            node,
            me,
            prep.run_id,
            {**peer_config(prep), "coordinator_key": me.public_key},
            run_dir / "coordinator",
            sync_seconds=args.sync_seconds,
            takeover_seconds=args.takeover_seconds,
            say=say,
            stopping=stopping.requested,
        )
    except BaseException:
        node.shutdown(quick=True)
        raise
    if not take_over:
        say("the run has finished (or this standby was stopped): the standby leaves")
        node.shutdown(quick=stopping.requested())
        return 0
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    print_events(metrics)
    return serve_hivemind(args, prep, metrics, node)


def start_owner(args: argparse.Namespace) -> int:
    """Join a run as the owner of some modules (``--join ADDRESS --owns ...``)."""
    from dipaco.coordinator.owner import Reporter, take_over
    from dipaco.protocols import discovery

    if not (args.owns and args.join):
        raise ConfigError("a module owner needs --join ADDRESS and --owns MODULES")
    run_dir = Path(args.run_dir)
    me = Identity.load_or_create(run_dir / "coordinator" / "signing.key")
    say(f"joining the DHT through {args.join}")
    node = joined_node(args, run_dir)
    reporter = ticker = publisher = None
    try:
        run_id, manifest, scheduler = hivemind.contact_scheduler(
            node, me, args.run, args.scheduler_key
        )
        say(f"found run {run_id} and its scheduler; owning {args.owns}")
        coordinator = build_owner(
            run_dir,
            manifest,
            MetricsLog(run_dir / "metrics.jsonl"),
            owner_id=node.peer_id,
            identity=me,
        )
        if args.via_relay:  # listens nowhere: reached through the scheduler it dialled
            addresses = relayed_route(coordinator, node, scheduler, args.join)
        else:
            addresses = node.visible_maddrs()
        coordinator.reachable_at(addresses)
        node.serve(coordinator.handle)
        owns = [mid.strip() for mid in args.owns.split(",") if mid.strip()]
        try:
            moved = take_over(coordinator, scheduler, owns)
        except RejectedError as exc:
            if exc.reason == Reason.NOT_AN_OWNER:
                raise ConfigError(
                    f"the scheduler does not know this owner's key; on the scheduler run: "
                    f"dipaco-coordinator allow --owner {me.public_key} --run-dir RUN_DIR"
                ) from None
            raise
        if args.via_relay:
            check_relayed(node, me, coordinator, addresses[0])
            say(f"reachable through the scheduler's relay at {addresses[0]}")
        reporter = Reporter(coordinator, scheduler, interval=args.report_seconds)
        reporter.start()
        ticker = Ticker(coordinator)
        ticker.start()

        def records() -> list[tuple]:  # the addresses as they are now (the relay may move)
            where = coordinator.addresses.get(node.peer_id, addresses)
            return hivemind.owner_records(coordinator, node.peer_id, where, run_id)

        publisher = discovery.Publisher(node, records, interval=args.publish_seconds)
        publisher.start()
        (run_dir / "coordinator" / "address").write_text(addresses[0] + "\n")
        console.print(
            f"owner {node.peer_id} of {', '.join(coordinator.owned_modules())} for run {run_id}"
            + (f" (took over {', '.join(moved)})" if moved else " (resumed from its folder)"),
            soft_wrap=True,
        )
        wait_finished(
            coordinator,
            args.linger,
            gather_from=lambda: wait_gathered(coordinator, max(args.linger, 60.0), say, reporter),
        )
    finally:
        for worker in (reporter, ticker, publisher):
            if worker is not None:
                worker.stop.set()
        node.shutdown(quick=stopping.requested())
    return 0


def start_dashboard(args, coordinator):
    """The dashboard when ``--dashboard HOST:PORT`` was given; prints its URL."""
    if not args.dashboard:
        return None
    from dipaco.watch.server import Dashboard

    host, port = split_hostport(args.dashboard)
    dashboard = Dashboard(
        coordinator, Path(args.run_dir), host=host, port=port, token=args.dashboard_token
    ).start()
    (Path(args.run_dir) / "coordinator" / "dashboard").write_text(dashboard.url + "\n")
    console.print(f"dashboard at [bold]{dashboard.url}[/]", soft_wrap=True)
    return dashboard


def stop_dashboard(dashboard, run_dir: Path) -> None:
    page = dashboard.stop()
    if page is not None:
        say(f"the dashboard's last state: {page} (or: dipaco status {run_dir})")


def serve_loopback(args, prep, metrics) -> int:
    run_dir = Path(args.run_dir)
    key, key_path = authkey(run_dir)
    coordinator = build_coordinator(prep, metrics, evaluate=not args.no_eval)
    host, port = split_hostport(args.listen)
    server = LoopbackServer(coordinator.handle, key, host=host, port=port)
    console.print(f"coordinator for run {prep.run_id} listening on [bold]{server.address}[/]")
    console.print(
        f"peers join with: dipaco-peer join {server.address} --authkey-file {key_path} "
        f"--coordinator-key {coordinator.identity.public_key}",
        soft_wrap=True,
    )
    (run_dir / "coordinator" / "address").write_text(server.address + "\n")
    dashboard = start_dashboard(args, coordinator)
    ticker = Ticker(coordinator)
    ticker.start()
    try:
        with LocalRun(coordinator, prep, args.local_peers):
            wait_finished(coordinator, args.linger)
    finally:
        ticker.stop.set()
        # Requests being handled get 10 s to finish, or 1 s after Ctrl-C (the process ends
        # within seconds: cli/stopping.py); what they made durable stays either way.
        server.close(1.0 if stopping.requested() else 10.0)
        if dashboard is not None:
            stop_dashboard(dashboard, run_dir)
    return 0


def cmd_add_peer(args: argparse.Namespace) -> int:
    """Admit a Flower SuperNode's key (now, if the run's SuperLink is up; else at its start)."""
    from dipaco.flower.launch import FlowerDeployment

    run_dir = Path(args.run_dir)
    if not ((run_dir / "config.json").exists() or (run_dir / "coordinator").is_dir()):
        raise ConfigError(f"{run_dir} is not a run folder (no config.json or coordinator/)")
    file, now = FlowerDeployment(args.run_dir).add_node(args.key)
    console.print(
        f"SuperNode key admitted ({file.name}); "
        + ("registered with the running SuperLink" if now else "registered when the run starts")
    )
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    """Print this coordinator's public key (making its key pair on first use)."""
    me = Identity.load_or_create(Path(args.run_dir) / "coordinator" / "signing.key")
    print(me.public_key)
    return 0


def cmd_access(args: argparse.Namespace) -> int:
    """Allow or revoke a key in the run's access list; a running coordinator follows at once."""
    root = Path(args.run_dir) / "coordinator"
    if not root.is_dir():
        raise ConfigError(f"{args.run_dir} is not a run folder (no coordinator/ inside)")
    what = change_access(
        root, args.key, allow=args.fn_name == "allow", owner=args.owner, note=args.note
    )
    console.print(what)
    return 0


def cmd_rotate_key(args: argparse.Namespace) -> int:
    """Give the scheduler a new key, with a statement signed by the old one naming it."""
    from dipaco.coordinator.rotation import rotate_key

    statement = rotate_key(Path(args.run_dir) / "coordinator")
    console.print(
        f"scheduler key rotated ({statement['seq']}): {statement['new']}\n"
        "restart the scheduler (the same start command) to sign with it; owners and peers "
        "that trust the old key follow the signed rotation",
        soft_wrap=True,
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco-coordinator", __doc__)
    start = sub.add_parser("start", help="prepare (if needed) and serve a run, or own modules")
    start.add_argument("--config", help="run config (TOML)")
    start.add_argument(
        "--preset",
        help=f"a preset instead of a config file ({', '.join(sorted(PRESETS))}). With neither, "
        "a run folder that holds a run resumes with the config it saved; an empty one is refused",
    )
    start.add_argument("--run-dir", required=True)
    start.add_argument(
        "--transport",
        choices=["hivemind", "loopback", "flower"],
        default="hivemind",
        help="hivemind (the internet; default), loopback (this machine only), or flower "
        "(a Flower SuperLink with TLS and node authentication)",
    )
    start.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="host:port to listen on (port 0 picks a free one; 0.0.0.0 for the internet)",
    )
    start.add_argument(
        "--tls-name",
        action="append",
        default=[],
        help="flower: a host name or address nodes dial, put in the SuperLink's certificate "
        "(repeatable; with --listen 0.0.0.0:PORT the default is this machine's name)",
    )
    add_join_options(start)
    start.add_argument(
        "--local-peers", type=int, default=0, help="also run this many peers in-process"
    )
    start.add_argument(
        "--linger",
        type=float,
        default=5.0,
        help="seconds to keep answering peers after the run finished",
    )
    start.add_argument(
        "--dashboard",
        metavar="HOST:PORT",
        help="serve the web dashboard, /api/status (dipaco status) and /metrics there "
        "(127.0.0.1:0 picks a port; beyond loopback a token is required)",
    )
    start.add_argument(
        "--dashboard-token", help="the dashboard's token (default: a random one beyond loopback)"
    )
    start.add_argument("--publish-seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    start.add_argument("--report-seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    start.add_argument(
        "--no-eval", action="store_true", help="skip the validation after each round"
    )
    start.set_defaults(fn=cmd_start)
    key = sub.add_parser("key", help="print this coordinator's public key")
    key.add_argument("--run-dir", required=True)
    key.set_defaults(fn=cmd_key)
    rotate = sub.add_parser(
        "rotate-key", help="a new scheduler key, signed over by the old one (then restart)"
    )
    rotate.add_argument("--run-dir", required=True)
    rotate.set_defaults(fn=cmd_rotate_key)
    add = sub.add_parser("add-peer", help="admit a Flower SuperNode's public key (ecdsa-...)")
    add.add_argument("key", help="the node's public key line, or a .pub file")
    add.add_argument("--run-dir", required=True)
    add.set_defaults(fn=cmd_add_peer)
    for name, text in (
        ("allow", "let a peer key join (allow-list runs), or a coordinator own modules (--owner)"),
        ("revoke", "refuse a key from now on, in every join mode"),
    ):
        access = sub.add_parser(name, help=text)
        access.add_argument("key", help="the public key, ed25519:...")
        access.add_argument("--run-dir", required=True)
        access.add_argument("--owner", action="store_true", help="a module owner's key")
        access.add_argument("--note", default="", help="who this key belongs to")
        access.set_defaults(fn=cmd_access, fn_name=name)
    dispatch(parser, argv)


if __name__ == "__main__":
    main()
