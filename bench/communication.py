"""Bytes on the wire per trained token: dipaco over hivemind vs DDP's all-reduce, per codec and H.

For the tiny preset, a real run per (codec, H) over the hivemind transport: one coordinator node
serving the run, four peers (threads) reaching it through their own hivemind client links. Bytes
come from the transports' own counters (payload bytes up and down, every request and reply).
The baseline is what a ring all-reduce would move for a dense model of one path's size training
the same tokens on the same number of workers: 2 (N-1)/N x 4 bytes x parameters each way, every
step of B x T tokens. Also printed: the validation perplexity each codec reaches (at the default
H), and the round overhead: the time from the last delta of a round arriving at the coordinator
to the new module versions being committed and fetchable.

    python bench/communication.py [--h 8 32] [--steps 96] [--peers 4] [--quick]
    python bench/communication.py --h 8 --codecs int8 --peers 8 --serve-modules  # peer to peer

With ``--serve-modules`` every peer has its own hivemind node and serves the module versions
it holds (``dipaco-peer join --serve-modules``); the table's last column is the module owner's
share of the bytes served to the peers (the rest came from other peers).

The overlap of communication and training: ``--overlap`` turns on ``scheduler.overlap`` (a peer
that has pushed trains its path's next round rather than wait for the round to close), and
``--pipeline`` the peer's own (``push-behind``: uploads while the next task trains;
``fetch-ahead``: the next task's download while this one trains; ``both``). The bytes per token
do not change with them; where the peers' time goes does, and each row prints it: the share
spent on transfers the training waited for (fetch, push, save) and waiting for work.

    python bench/communication.py --h 8 --codecs int8 --overlap --pipeline both
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dipaco.config import preset_config
from dipaco.peer.peer import Peer
from dipaco.peer.seeds import SeedFetcher, SeedServer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth, codecs
from dipaco.protocols import messages as m
from dipaco.protocols.codecs import CODECS
from dipaco.protocols.hivemind import HivemindNode
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

console = Console(width=150)


def tiny(source: str, topology: str = "2x2"):
    """The tiny preset on a corpus (builtin, builtin:mixed, a file...) and topology."""
    return preset_config("tiny").replace(
        data={"source": source},
        topology={"levels": topology},
        validation={"heldout_check": False},  # the wire, not an open run's scoring
    )


def one_run(
    prepared: Path,
    work: Path,
    codec: str,
    h: int,
    steps: int,
    n_peers: int,
    outer: dict | None = None,
    source: str = "builtin",
    network: dict | None = None,
    serve: bool = False,
    topology: str = "2x2",
    overlap: bool = False,
    pipeline: str = "none",
) -> dict:
    root = work / f"{codec}-H{h}{'-p2p' if serve else ''}"
    shutil.copytree(prepared, root, ignore=shutil.ignore_patterns("coordinator", "peers"))
    prep = prepare(root, tiny(source, topology))
    rounds = max(1, steps // h)
    prep.config = prep.config.replace(
        train={"inner_steps": h, "rounds": rounds},
        network={"codec": codec, **(network or {})},
        scheduler={"quorum": 1.0, "heartbeat_seconds": 1.0, "overlap": overlap},
        **({"outer": outer} if outer else {}),
    )
    coordinator = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    overheads: list[float] = []

    def timed(data: bytes) -> bytes:
        began = time.perf_counter()
        reply = coordinator.handle(data)
        # Replies are signed envelopes (docs/protocol.md): open it to read the message.
        ack = m.decode_message(bytes(auth.open_reply(reply, auth.peek_nonce(data), None).body))
        if isinstance(ack, m.DeltaAck) and ack.closed:  # the round closed: versions committed
            overheads.append(time.perf_counter() - began)
        return reply

    server = HivemindNode()
    # One client node for all the peers; with --serve-modules each peer has its own node that
    # others can dial, and serves the module versions it holds (peer/seeds.py).
    nodes = [HivemindNode(initial_peers=server.visible_maddrs(), client_mode=not serve)]
    seeders: list[tuple[SeedFetcher, SeedServer]] = []
    try:
        server.serve(timed)
        addresses = server.visible_maddrs()
        links: dict[int, list] = {i: [] for i in range(n_peers)}
        identities = [auth.Identity.generate() for _ in range(n_peers)]
        if serve:
            nodes += [HivemindNode(initial_peers=addresses) for _ in range(n_peers - 1)]
            for i, node in enumerate(nodes):
                fetcher = SeedFetcher(
                    node, coordinator.run_id, identities[i], f"bench-{i}", serving=True
                )
                seeders.append((fetcher, SeedServer(identities[i], fetcher.held)))
                node.serve(seeders[-1][1].handle, workers=2)

        def link(i: int):
            t = nodes[i % len(nodes)].transport(server.peer_id, addresses)
            links[i].append(t)
            return t

        stop = threading.Event()
        peers = [
            Peer(
                link(i).authenticate(identities[i], coordinator.identity.public_key),
                f"bench-{i}",
                root / "peers",
                stop=stop,
                connect=lambda owner, addrs, i=i: link(i),
                identity=identities[i],
                seeds=seeders[i][0] if serve else None,
                push_behind=pipeline in ("push-behind", "both"),
                fetch_ahead=pipeline in ("fetch-ahead", "both"),
            )
            for i in range(n_peers)
        ]
        threads = [threading.Thread(target=p.run, daemon=True) for p in peers]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
        wall = time.monotonic() - began
        assert coordinator.finished, "the run did not finish"
        sent = sum(t.bytes_sent for ts in links.values() for t in ts)
        received = sum(t.bytes_received for ts in links.values() for t in ts)
        owner_out = server.stats["bytes_out"]
        seed_out = sum(srv.bytes_out for _, srv in seeders)
        received += sum(f.seed_bytes for f, _ in seeders)
        fetched = {
            k: sum(f.counts()[k] for f, _ in seeders)
            for k in ("from_seeds", "from_owner", "refused")
        }
    finally:
        for f, _ in seeders:
            f.close()
        for node in nodes:
            node.shutdown()
        server.shutdown()
    tokens = sum(p["tokens"] for p in coordinator.status().state["peers"].values())
    seconds = {k: sum(p.timings[k] for p in peers) for k in peers[0].timings}
    busy = sum(seconds.values()) or 1.0
    c = prep.config
    path_params = sum(p.numel() for p in prep.initial_model().parameters())
    per_step_tokens = c.train.batch_size * c.train.seq_len
    ddp_each_way = 2 * (n_peers - 1) / n_peers * 4 * path_params / per_step_tokens
    result = evaluate_modules(prep, coordinator.store.params)
    return {
        "codec": codec,
        "H": h,
        "rounds": rounds,
        "tokens": tokens,
        "up_per_token": sent / tokens,
        "down_per_token": received / tokens,
        "ddp_per_token": ddp_each_way,
        "ratio_up": ddp_each_way / (sent / tokens),
        "ratio_down": ddp_each_way / (received / tokens),
        "ppl": result["ppl"],
        "round_overhead_ms": 1000 * statistics.median(overheads) if overheads else None,
        "p2p": serve,
        "module_fetches": fetched if serve else None,
        # of the bytes served to the peers, the module owner's share (the rest: other peers)
        "owner_share": owner_out / (owner_out + seed_out) if owner_out + seed_out else 1.0,
        "wall_s": wall,
        "overlap": overlap,
        "pipeline": pipeline,
        # the peers' time: transfers training waited for, and waiting for work (claims)
        "transfer": sum(seconds.get(k, 0.0) for k in ("fetch", "push", "save")) / busy,
        "waiting": seconds.get("claim", 0.0) / busy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--h", type=int, nargs="+", default=[8, 32], help="inner steps per round")
    ap.add_argument("--steps", type=int, default=96, help="inner steps per path in all")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--topology", default="2x2", help="the tiny preset's levels (default 2x2)")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--quick", action="store_true", help="H 8 only, 48 steps")
    ap.add_argument(
        "--serve-modules",
        action="store_true",
        help="every peer serves the module versions it holds to the others (peer to peer)",
    )
    ap.add_argument(
        "--topk-density",
        type=float,
        default=None,
        help=f"network.topk_density: the share of each chunk topk2/topk4 send (default "
        f"{codecs.SPARSE_DENSITY:g})",
    )
    ap.add_argument("--source", default="builtin", help="corpus (builtin, builtin:mixed, a file)")
    ap.add_argument(
        "--ef-decay", type=float, help="network.error_feedback_decay: the residual's weight"
    )
    ap.add_argument("--outer-lr", type=float, help="outer.lr (default: the codec's)")
    ap.add_argument("--outer-momentum", type=float, help="outer.momentum (default: the codec's)")
    ap.add_argument("--outer-rescale", help="outer.rescale")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="scheduler.overlap: peers train their path's next round rather than wait",
    )
    ap.add_argument(
        "--pipeline",
        choices=("none", "push-behind", "fetch-ahead", "both"),
        default="none",
        help="the peers' uploads (push-behind) and downloads (fetch-ahead) while they train",
    )
    ap.add_argument("--out", default="runs/bench/communication.json")
    args = ap.parse_args()
    outer = {
        k: v
        for k, v in (
            ("lr", args.outer_lr),
            ("momentum", args.outer_momentum),
            ("rescale", args.outer_rescale),
        )
        if v is not None
    }

    if args.quick:
        args.h, args.steps = [8], 48
    network = {
        k: v
        for k, v in (("topk_density", args.topk_density), ("error_feedback_decay", args.ef_decay))
        if v is not None
    }
    work = Path(tempfile.mkdtemp(prefix="dipaco-bench-"))
    try:
        console.log("preparing the tiny preset once")
        prepared = work / "prepared"
        prepare(prepared, tiny(args.source, args.topology))
        rows = []
        for h in args.h:
            for codec in args.codecs:
                console.log(f"codec {codec}, H={h}: training {args.steps} steps per path")
                rows.append(
                    one_run(
                        prepared,
                        work,
                        codec,
                        h,
                        args.steps,
                        args.peers,
                        outer,
                        args.source,
                        network,
                        args.serve_modules,
                        args.topology,
                        args.overlap,
                        args.pipeline,
                    )
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    how = ", overlap" * args.overlap + (f", {args.pipeline}" if args.pipeline != "none" else "")
    table = Table(
        title=f"bytes per trained token, {args.peers} peers, tiny preset ({args.topology}){how}"
    )
    for col in ("codec", "H", "up B/tok", "down B/tok", "DDP B/tok", "DDP/up", "DDP/down"):
        table.add_column(col, justify="right")
    table.add_column("val ppl", justify="right")
    table.add_column("round overhead", justify="right")
    table.add_column("owner's share down", justify="right")
    table.add_column("transfers", justify="right")
    table.add_column("waiting", justify="right")
    for r in rows:
        table.add_row(
            r["codec"],
            str(r["H"]),
            f"{r['up_per_token']:.1f}",
            f"{r['down_per_token']:.1f}",
            f"{r['ddp_per_token']:.1f}",
            f"{r['ratio_up']:.1f}x",
            f"{r['ratio_down']:.1f}x",
            f"{r['ppl']:.2f}",
            f"{r['round_overhead_ms']:.0f} ms" if r["round_overhead_ms"] is not None else "-",
            f"{100 * r['owner_share']:.0f}%",
            f"{100 * r['transfer']:.1f}%",
            f"{100 * r['waiting']:.1f}%",
        )
    console.print(table)
    for h in args.h:
        base = next((r for r in rows if r["H"] == h and r["codec"] == "lossless"), None)
        if base is None:
            continue
        for r in rows:
            if r["H"] == h and r["codec"] != "lossless":
                cost = 100 * (r["ppl"] / base["ppl"] - 1)
                console.print(f"H={h} {r['codec']}: perplexity {cost:+.2f}% against lossless")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
