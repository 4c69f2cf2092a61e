"""``dipaco-peer``: join a run and train its paths until the run finishes.

    dipaco-peer join /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...      (over the internet)
    dipaco-peer join 127.0.0.1:PORT --authkey-file runs/r1/coordinator/authkey   (this machine)
    dipaco-peer join --flower 10.0.0.5:9092 --root-certificates ca.pem        (a Flower SuperLink)

Over the internet the peer joins the run's DHT in client mode (it only dials out, so it works
behind NAT), reads and checks the run manifest, downloads the tokenizer and the shards of the
paths it trains, picks a micro-batch that fits its device, trains, and pushes each module's delta
to the module's owner. Ctrl-C releases the current task at once, so it is re-issued without
waiting for its lease to expire; run the same command again (same --state-dir) to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dipaco.cli import stopping
from dipaco.cli.common import command_parser, console, dispatch, one_line, say
from dipaco.cli.doctor import add_doctor_command
from dipaco.cli.machine import follow_path, join_machine, leave_group_process, worker_group
from dipaco.cli.peer_report import link_line, on_loopback, seed_summary, time_summary
from dipaco.errors import ConfigError, TransportError
from dipaco.fileio import write_json_atomic
from dipaco.net import joins
from dipaco.net.joins import JoinRequest, kind_of
from dipaco.peer.checks import check_device, clock_check
from dipaco.peer.ddp import quit_followers
from dipaco.peer.device import resolve_device
from dipaco.peer.identity import coordinator_trust, stable_peer_id
from dipaco.peer.metrics import PeerMetrics
from dipaco.peer.peer import Peer
from dipaco.peer.workers import watch_parent
from dipaco.protocols.auth import Identity, check_public_key


def cmd_join(args: argparse.Namespace) -> int:
    if args.flower:
        return join_flower(args)
    if args.gpus and not args.machine:
        return join_machine(args)
    group = None
    if args.shard_path and args.machine:  # a worker of a machine that trains paths over DDP
        group = worker_group(args, resolve_device(args.device))
        if group.rank != 0:
            return follow_path(group)
    if not args.address:
        raise ConfigError("join needs the address dipaco-coordinator start printed (or --flower)")
    kind_of(args.address, args.authkey_file)  # a wrong address is refused before any work
    state_dir = Path(args.state_dir or Path.home() / ".cache" / "dipaco" / "peer")
    peer_id = stable_peer_id(state_dir, args.peer_id)
    # A machine's worker (--machine, from join --gpus) holds the machine's key and pins.
    machine_dir = Path(args.machine_dir) if args.machine_dir else state_dir
    me = Identity.load_or_create(machine_dir / "signing.key")
    trust = coordinator_trust(machine_dir, args.address, args.coordinator_key, _trusted_first)
    stop = threading.Event()
    join = joins.join(
        JoinRequest(
            args.address,
            peer_id,
            state_dir,
            me,
            trust,
            run=args.run,
            authkey_file=args.authkey_file,
            device=args.device,
            memory_gb=args.memory_gb,
            max_mbps=args.max_mbps,
            patience=args.patience,
            on_wait=say,
            serve_modules=args.serve_modules,
            trust_dir=machine_dir,
        )
    )
    transport = join.scheduler
    if join.note:
        console.print(join.note)
    # Once the node runs, Ctrl-C (or SIGTERM) stops the peer, which releases its task; before,
    # it interrupts the join. Either way the process ends within seconds (cli/stopping.py).
    stopping.on_stop(stop.set)
    if args.machine:
        watch_parent(stop)
    state_dir.mkdir(parents=True, exist_ok=True)
    acks = state_dir / "acks.jsonl"

    def on_ack(info: dict) -> None:
        if info["task"] not in acked_tasks:
            if meter is not None:
                meter.tasks.inc()
        acked_tasks.add(info["task"])
        # once, when every owner of the task's modules has it
        if not info.get("unacked") and info["task"] not in announced:
            announced.add(info["task"])
            n = len(acked_tasks)
            console.event(
                "task_acked",
                f"task {info['task']}: delta acknowledged ({n} task{'s' * (n != 1)} done)",
                task=info["task"],
                tasks_done=n,
            )
        with open(acks, "a") as f:
            f.write(json.dumps(info) + "\n")

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[totals]}"),
        console=console,
    )
    current: dict[str, TaskID] = {}
    first: dict[str, tuple[int, float]] = {}  # task -> (step, time) when this process saw it
    acked_tasks: set[str] = set()  # on_ack comes once per module of a task
    announced: set[str] = set()  # tasks whose acknowledgement was printed
    said: dict[str, float] = {}  # task -> when its last progress line was printed (plain output)
    said_link: list[bool] = []  # the link line (after the first task) was printed

    def traffic() -> tuple[int, int]:
        return join.traffic() if join.traffic is not None else (0, 0)

    def totals() -> str:
        """Tasks done, and the traffic where the transport counts it (hivemind links)."""
        out = f"{len(acked_tasks)} tasks done"
        if join.traffic is not None:
            up, down = join.traffic()
            out += f", {up / 1e6:.1f} MB up, {down / 1e6:.1f} MB down"
        return out

    def on_progress(info: dict) -> None:
        if join.announce is not None:  # what the network shows of this peer: task, progress
            join.announce.update(
                task=info["task"], step=info["step"], steps=info["steps"], loss=info["loss"]
            )
        if info["task"] not in current:
            if len(acked_tasks) == 1 and not said_link:  # the first task is done: the link
                said_link.append(True)
                console.print(
                    link_line(
                        peer.timings,
                        traffic() if join.traffic else None,
                        peer.behind.seconds if peer.push_behind else None,
                        tasks=len(acked_tasks),
                        local=on_loopback(args.address),
                        outage=peer.patience.watch.down_seconds,
                    )
                )
            for old in current.values():
                progress.update(old, visible=False)
            current.clear()
            console.event(
                "task_started",
                f"task {info['task']}: training path P{info['path']} "
                f"(step {info['step']} of {info['steps']})",
                task=info["task"],
                path=info["path"],
                step=info["step"],
                steps=info["steps"],
            )
            said[info["task"]] = time.monotonic()
            current[info["task"]] = progress.add_task(
                f"task {info['task']} (path P{info['path']})",
                total=info["steps"],
                loss="",
                rate="",
                totals=totals(),
            )
            first[info["task"]] = (info["step"], time.monotonic())
        step0, t0 = first[info["task"]]
        seconds = time.monotonic() - t0
        rate = (info["step"] - step0) * info.get("tokens_per_step", 0) / seconds if seconds else 0
        if meter is not None:
            meter.progress(info, rate)
        done = info["step"] >= info["steps"]
        every = 1.0 if args.machine else 30.0  # a machine's panel shows its workers' steps
        if console.lines and (done or time.monotonic() - said.get(info["task"], 0) >= every):
            said[info["task"]] = time.monotonic()
            console.event(
                "task_trained" if done else "task_progress",
                f"task {info['task']}: "
                + ("trained " if done else "")
                + f"step {info['step']}/{info['steps']}, loss {info['loss']:.3f}"
                + (f", {rate:,.0f} tok/s" if rate else ""),
                task=info["task"],
                step=info["step"],
                steps=info["steps"],
                loss=info["loss"],
                tokens_per_second=round(rate, 1),
            )
        progress.update(
            current[info["task"]],
            completed=info["step"],
            loss=f"loss {info['loss']:.3f}",
            rate=f"{rate:,.0f} tok/s" if rate else "",
            totals=totals(),
        )

    meter: PeerMetrics | None = None
    peer = Peer(
        transport,
        peer_id,
        state_dir,
        max_tasks=args.max_tasks,
        device=args.device,
        stop=stop,
        on_progress=on_progress,
        on_ack=on_ack,
        memory_bytes=int(args.memory_gb * 2**30) if args.memory_gb else None,
        identity=me,
        precision=args.precision,
        compile=args.compile,
        capabilities=worker_capabilities(args),
        inner_dir=machine_dir / "inner" if args.machine else None,
        shard_group=group,
        push_behind=args.push_behind,
        fetch_ahead=args.fetch_ahead,
        address=args.address,
        **join.peer_options,
    )
    console.print(f"peer {peer_id} ({peer.device}) joined {args.address}")
    if args.metrics_port is not None:
        meter = PeerMetrics(peer_id, str(peer.device), traffic)
        port = meter.serve(args.metrics_port)
        (state_dir / "metrics_address").write_text(f"127.0.0.1:{port}\n")
        console.print(f"this peer's metrics: http://127.0.0.1:{port}/metrics")
    device_check, _ = check_device(args.device)
    console.print(
        f"device: {device_check.detail}"
        + (f" [yellow]({device_check.advice})[/]" if device_check.advice else "")
    )
    said_clock: list[bool] = []

    def on_setup(peer: Peer) -> None:  # after Hello: the clock, once, in one line
        if peer.clock_offset is not None and not said_clock:
            said_clock.append(True)
            check = clock_check(*peer.clock_offset, "measured at Hello")
            console.print(
                f"clock: {check.detail}" + ("" if check.ok else f" [yellow]({check.advice})[/]")
            )

    peer.on_setup = on_setup
    ended = False
    sent: int | None = None  # hivemind links' bytes, where counted
    received: int | None = None
    try:
        with progress if not console.lines else contextlib.nullcontext():
            done = peer.run()
        ended = True
    finally:
        if group is not None:  # the other ranks stop with this one
            quit_followers(group)
            group.close(synchronise=ended)
        join.close()
        if meter is not None:
            meter.close()
        if join.traffic is not None:
            sent, received = join.traffic()
            console.print(f"traffic: {sent / 1e6:.1f} MB up, {received / 1e6:.1f} MB down")
        if peer.seeds is not None:
            console.print(seed_summary(peer.seeds, join.seed_server))
    if peer.run_finished:
        say(f"the run has finished; peer {peer_id} trained {done} tasks in this session")
    else:
        say(f"peer {peer_id} left after {done} tasks")
    console.print(
        time_summary(peer.timings)
        + (f"; sending behind training {peer.behind.seconds:.1f} s" if args.push_behind else "")
        + (
            f"; {peer.ahead.tasks} tasks fetched ahead of training in {peer.ahead.seconds:.1f} s"
            if args.fetch_ahead
            else ""
        )
    )
    write_json_atomic(
        state_dir / "timings.json",
        {
            "peer": peer_id,
            "tasks": done,
            "tokens": peer.tokens_trained,
            "seconds": {k: round(v, 4) for k, v in peer.timings.items()},
            "sent_behind_s": round(peer.behind.seconds, 4),  # on the push thread (--push-behind)
            # claims and downloads on the fetch thread (--fetch-ahead), and the tasks they got
            "fetched_ahead_s": round(peer.ahead.seconds, 4),
            "fetched_ahead_tasks": peer.ahead.tasks,
            # the messages' bytes over hivemind links (the wire adds framing and headers)
            "bytes_sent": sent,
            "bytes_received": received,
        },
    )
    if group is not None:  # rank 0 leaves as its followers do (its group closed above)
        return leave_group_process(0)
    return 0


def worker_capabilities(args: argparse.Namespace) -> dict[str, Any]:
    """What a machine's worker says in Hello: its machine, its index and how many there are."""
    if not args.machine:
        return {}
    index, _, count = (args.worker or "0/1").partition("/")
    caps = {"machine": args.machine, "worker": int(index), "workers": int(count or 1)}
    return caps | ({"shard_path": True} if args.shard_path else {})


def join_flower(args: argparse.Namespace) -> int:
    """Run a Flower SuperNode whose ClientApp is dipaco's peer, until Ctrl-C.

    Its node key (ECDSA P-384, ``<state-dir>/flower-node.key``) is made on first use; the run's
    operator admits it with ``dipaco-coordinator add-peer``. Everything the node keeps between
    rounds lives in the state folder.
    """
    from dipaco.flower import deploy

    state_dir = Path(args.state_dir or Path.home() / ".cache" / "dipaco" / "peer").resolve()
    peer_id = stable_peer_id(state_dir, args.peer_id)
    Identity.load_or_create(state_dir / "signing.key")
    if not args.root_certificates:
        raise ConfigError(
            "--flower needs --root-certificates: the run's CA (its operator's "
            "<run-dir>/flower/tls/ca.pem); the SuperLink only admits nodes over TLS"
        )
    key_file = state_dir / "flower-node.key"
    public = deploy.make_node_key(key_file)
    console.print(f"this node's key: {public}", soft_wrap=True)
    console.print(
        "the run's operator admits it with: dipaco-coordinator add-peer "
        f"'{public}' --run-dir RUN_DIR",
        soft_wrap=True,
    )
    config: dict[str, Any] = {
        "state-dir": str(state_dir),
        "peer-id": peer_id,
        "device": args.device,
        "superlink": args.flower,
    }
    if args.coordinator_key:
        config["coordinator-key"] = check_public_key(args.coordinator_key)
    if args.memory_gb:
        config["memory-gb"] = float(args.memory_gb)
    trainer = None
    if not args.cold:
        from dipaco.flower.client import NodeTrainer

        def on_task(info: dict) -> None:
            if info.get("error"):
                console.event("task_failed", f"{info['op']} failed: {one_line(info['error'])}")
            elif info.get("task"):
                console.event(
                    "task_trained",
                    f"task {info['task']}: trained in {info['seconds']:.1f} s",
                    task=info["task"],
                    seconds=round(info["seconds"], 2),
                )

        trainer = NodeTrainer(config, on_task=on_task)
        config.update(trainer.node_config)
    node = deploy.SuperNode(
        state_dir / "flower-home",
        args.flower,
        ca=Path(args.root_certificates).resolve(),
        node_key=key_file,
        node_config=config,
        log_file=state_dir / "supernode.log",
    )
    stop = threading.Event()
    stopping.on_stop(stop.set)
    finished = state_dir / "flower" / "finished.json"
    finished.unlink(missing_ok=True)  # a marker from an earlier run
    node.start()
    say(f"SuperNode {peer_id} started for {args.flower} (log: {node.log_file})")
    began, warned = time.monotonic(), False
    try:
        while not stop.wait(1.0):
            if finished.exists():
                say(f"the run has finished; node {peer_id} leaves")
                break
            code = node.returncode
            if code is None:
                if (
                    not warned
                    and trainer is not None
                    and trainer.served == 0
                    and time.monotonic() - began > args.patience
                ):
                    warned = True
                    tail = one_line(deploy.strip_ansi(node.log_tail(3)))
                    say(
                        f"no message from the SuperLink at {args.flower} after "
                        f"{args.patience:.0f} s: check the address and that the operator ran "
                        f"add-peer for this node's key (dipaco-peer doctor {args.flower}); "
                        f"the SuperNode's log ends: {tail}"
                    )
                continue
            if deploy.REFUSED_LOG_LINE in deploy.strip_ansi(node.log_tail(200)):
                raise ConfigError(
                    "the SuperLink refused this node: its key is not registered. Ask the run's "
                    f"operator to run: dipaco-coordinator add-peer '{public}' --run-dir RUN_DIR "
                    f"(the SuperNode's log: {node.log_file})"
                )
            raise TransportError(
                f"the SuperNode exited with code {code}: {last_error(deploy.strip_ansi(node.log_tail(40)))} "
                f"(its log: {node.log_file})"
            )
    finally:
        quick = stopping.requested()  # Ctrl-C: everything below within the stop's deadline
        node.stop(grace=1.5 if quick else 10.0)
        if trainer is not None:
            trainer.close(timeout=0.5 if quick else 10.0)
    if not finished.exists():
        say(f"node {peer_id} left")
    return 0


def last_error(tail: str) -> str:
    """The line of a SuperNode's log tail that says what went wrong: its last error line, not
    the web server's shutdown lines printed after it."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line or "Error" in line or "error" in line]
    return (errors or lines or ["(empty log)"])[-1]


def _trusted_first(seen: str) -> None:
    """Say that a coordinator key is trusted on first use (``coordinator_trust`` pins it)."""
    console.print(
        f"[yellow]trusting coordinator key {seen} on first use[/] (pass --coordinator-key "
        "to check it against what the run's operator published)",
        soft_wrap=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco-peer", __doc__)
    join = sub.add_parser("join", help="join a run at ADDRESS")
    join.add_argument(
        "address",
        nargs="?",
        help="the address dipaco-coordinator start printed (a multiaddr or host:port)",
    )
    join.add_argument(
        "--flower", metavar="SUPERLINK", help="join a Flower run: the SuperLink's host:port"
    )
    join.add_argument(
        "--root-certificates", help="--flower: the run's CA certificate (PEM), for TLS"
    )
    join.add_argument(
        "--cold",
        action="store_true",
        help="--flower: train inside each ClientApp process instead of this process's warm "
        "trainer (slower: every round imports torch again)",
    )
    join.add_argument("--authkey-file", help="loopback only: the run's key file")
    join.add_argument("--run", help="the run id, when the DHT announces several")
    join.add_argument(
        "--coordinator-key",
        help="the coordinator's public key (ed25519:...), as its operator published it; "
        "without it the first key seen is trusted and remembered",
    )
    join.add_argument(
        "--max-mbps", type=float, help="cap this peer's upload and download rate (megabits/s)"
    )
    join.add_argument(
        "--memory-gb", type=float, help="memory to plan micro-batches for (default: probe device)"
    )
    join.add_argument("--peer-id")
    join.add_argument(
        "--state-dir",
        help="where the peer keeps its key, task checkpoints and downloads "
        "(default ~/.cache/dipaco/peer)",
    )
    join.add_argument("--max-tasks", type=int)
    join.add_argument(
        "--serve-modules",
        nargs="?",
        const="0.0.0.0",
        metavar="HOST",
        help="hivemind: listen on HOST (default 0.0.0.0) and serve the module versions this peer "
        "holds to other peers; needs a reachable address (without it: client mode, fetch only)",
    )
    join.add_argument(
        "--patience",
        type=float,
        default=60.0,
        help="seconds to keep retrying an address that does not answer yet (default 60)",
    )
    join.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="the forward pass's precision (auto: bf16 autocast on a GPU that has it, else fp32)",
    )
    join.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the path (auto: on a GPU)",
    )
    join.add_argument(
        "--push-behind",
        action="store_true",
        help="send a task's deltas while the next task trains (a thin uplink, a fast device)",
    )
    join.add_argument(
        "--fetch-ahead",
        action="store_true",
        help="claim the next task and download its modules while this one trains its last steps",
    )
    join.add_argument(
        "--metrics-port",
        type=int,
        help="serve this peer's Prometheus /metrics on 127.0.0.1:PORT (0 picks one)",
    )
    join.add_argument(
        "--device", default="auto", help="auto (a CUDA GPU if there is one), cpu, cuda:0, ..."
    )
    join.add_argument(
        "--gpus",
        help="one peer for several devices, a worker process each training its own path: all "
        "(every GPU), 0,1,... (those GPUs), or cpu:N (N workers sharing the CPU)",
    )
    # A worker of a --gpus machine (set by the machine, not by hand).
    join.add_argument("--machine", help=argparse.SUPPRESS)
    join.add_argument("--worker", help=argparse.SUPPRESS)
    join.add_argument("--machine-dir", help=argparse.SUPPRESS)
    join.add_argument(
        "--shard-path",
        action="store_true",
        help="with --gpus: train one path at a time over all the devices (data parallel), for "
        "a path one device cannot hold or to finish each task sooner",
    )
    join.add_argument("--dist-init", help=argparse.SUPPRESS)
    join.set_defaults(fn=cmd_join)
    key = sub.add_parser("key", help="print this peer's public key (for an allow-list)")
    key.add_argument("--state-dir", help="the peer's state folder (default ~/.cache/dipaco/peer)")
    key.set_defaults(fn=cmd_key)
    add_doctor_command(sub)
    dispatch(parser, argv)


def cmd_key(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir or Path.home() / ".cache" / "dipaco" / "peer")
    print(Identity.load_or_create(state_dir / "signing.key").public_key)
    return 0


if __name__ == "__main__":
    main()
