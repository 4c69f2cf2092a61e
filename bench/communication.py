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
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth, codecs
from dipaco.protocols import messages as m
from dipaco.protocols.codecs import CODECS
from dipaco.protocols.hivemind import HivemindNode
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

console = Console(width=150)


def one_run(prepared: Path, work: Path, codec: str, h: int, steps: int, n_peers: int) -> dict:
    root = work / f"{codec}-H{h}"
    shutil.copytree(prepared, root, ignore=shutil.ignore_patterns("coordinator", "peers"))
    prep = prepare(root, preset_config("tiny"))
    rounds = max(1, steps // h)
    prep.config = prep.config.replace(
        train={"inner_steps": h, "rounds": rounds},
        network={"codec": codec},
        scheduler={"quorum": 1.0, "heartbeat_seconds": 1.0},
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
    client = HivemindNode(initial_peers=server.visible_maddrs(), client_mode=True)
    try:
        server.serve(timed)
        addresses = server.visible_maddrs()
        links: dict[int, list] = {i: [] for i in range(n_peers)}

        def link(i: int):
            t = client.transport(server.peer_id, addresses)
            links[i].append(t)
            return t

        stop = threading.Event()
        peers = [
            Peer(
                link(i),
                f"bench-{i}",
                root / "peers",
                stop=stop,
                connect=lambda owner, addrs, i=i: link(i),
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
    finally:
        client.shutdown()
        server.shutdown()
    tokens = sum(p["tokens"] for p in coordinator.status().state["peers"].values())
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
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--h", type=int, nargs="+", default=[8, 32], help="inner steps per round")
    ap.add_argument("--steps", type=int, default=96, help="inner steps per path in all")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--quick", action="store_true", help="H 8 only, 48 steps")
    ap.add_argument(
        "--topk-density",
        type=float,
        default=None,
        help=f"the share of each chunk topk2/topk4 send (default {codecs.SPARSE_DENSITY:.4f})",
    )
    ap.add_argument("--out", default="runs/bench/communication.json")
    args = ap.parse_args()
    if args.quick:
        args.h, args.steps = [8], 48
    if args.topk_density is not None:  # peers and coordinator share this process's codecs
        if not 0 < args.topk_density <= 1:
            ap.error("--topk-density must be in (0, 1]")
        codecs.TopK.density = args.topk_density
    work = Path(tempfile.mkdtemp(prefix="dipaco-bench-"))
    try:
        console.log("preparing the tiny preset once")
        prepared = work / "prepared"
        prepare(prepared, preset_config("tiny"))
        rows = []
        for h in args.h:
            for codec in args.codecs:
                console.log(f"codec {codec}, H={h}: training {args.steps} steps per path")
                rows.append(one_run(prepared, work, codec, h, args.steps, args.peers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"bytes per trained token, {args.peers} peers, tiny preset (2x2)")
    for col in ("codec", "H", "up B/tok", "down B/tok", "DDP B/tok", "DDP/up", "DDP/down"):
        table.add_column(col, justify="right")
    table.add_column("val ppl", justify="right")
    table.add_column("round overhead", justify="right")
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
