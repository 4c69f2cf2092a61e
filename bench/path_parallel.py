"""All paths at once on one device: a path-parallel local peer against a sequential one.

One prepared run is copied three times and trained to the end by one local peer each:

  sequential  ``Peer(parallel=1)``: one task (path) at a time, as ``run_local_peers`` does
  streams     ``Peer(parallel=P, batching="streams")``: every task of a round claimed at once
              and trained together, step i of every path before step i + 1 of any, each path on
              its own CUDA stream on a GPU (plain turns on a CPU)
  stacked     ``Peer(parallel=P, batching="stacked")``: the same tasks as one stacked model, one
              batched step for all of them (dipaco/model/stacked.py)

All do the same work (P paths x rounds x H steps, the same pushes and outer steps), so the
ratios printed are wall times against the sequential peer's (below 1: faster). Streams on a CPU
are about 1 (the paths' steps do not overlap); stacking pays the per-operation cost once for all
paths. Also printed: tokens per second of each, where each peer's time went, and how far the
modules after each run are from the sequential run's (streams: identical, bit for bit, on a
CPU; stacked: float rounding, tests/unit/test_stacked.py).

    python bench/path_parallel.py                        # CPU, 4x4 topology, a tiny model
    python bench/path_parallel.py --device cuda --dim 256 --layers 8 --steps 20 --rounds 3
    python bench/path_parallel.py --dim 16 --layers 4 --heads 1 --vocab 256 --no-byte-fallback \
        --batch 8 --steps 50 --rounds 3 --compile on      # the regime ladder's paths
    python bench/path_parallel.py --quick                # CI's short form
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dipaco.config import preset_config
from dipaco.peer.device import resolve_device
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, record  # noqa: E402


def train(
    root: Path, config, parallel: int, device: str, batching: str, compile: str = "auto"
) -> tuple[dict, dict]:
    """Train the prepared run in ``root`` to the end with one local peer: its figures, and the
    modules' parameters at the end."""
    # The parallel peer holds a whole round's leases on its one key (run_local_peers does the
    # same): the quota per key is operational, so the prepared run accepts the change.
    config = config.replace(
        security={"max_tasks_per_key": max(parallel, config.security.max_tasks_per_key)}
    )
    prep = prepare(root, config, device=device)
    coordinator = build_coordinator(
        prep, MetricsLog(root / "metrics.jsonl"), evaluate=False, device=device
    )
    peer = Peer(
        LocalTransport(coordinator.handle).authenticate(Identity.generate()),
        "bench",
        root / "peer",
        device=device,
        parallel=parallel,
        batching=batching,
        compile=compile,
    )
    began = time.perf_counter()
    done = peer.run()
    wall = time.perf_counter() - began
    if not coordinator.finished:
        raise SystemExit(f"the run with parallel={parallel} did not finish")
    params = {mid: dict(coordinator.store.params(mid)) for mid in coordinator.store.modules}
    figures = {"wall": wall, "tasks": done, "tokens": peer.tokens_trained, "timings": peer.timings}
    return figures, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    ap.add_argument("--topology", default="4x4", help="module levels, e.g. 4x4 (16 paths)")
    ap.add_argument("--steps", type=int, default=3, help="inner steps H per task")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--heads", type=int, help="attention heads (default 2, or width / 64)")
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="the stacked peer's torch.compile (auto: on a GPU; on speeds it on a CPU too); the "
        "sequential and interleaving peers keep a local run's default",
    )
    ap.add_argument(
        "--byte-fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the tokenizer's byte fallback (off for a vocabulary of a few hundred pieces)",
    )
    ap.add_argument("--work", help="a folder for the runs (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="CI's short form: 2x2, 1 round of 2 steps")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.topology, args.steps, args.rounds = "2x2", 2, 1
    with tempfile.TemporaryDirectory(prefix="dipaco-path-parallel-") as tmp:
        run(args, Path(args.work or tmp))


def run(args: argparse.Namespace, work: Path) -> None:
    device = resolve_device(args.device)
    heads = args.heads or (2 if args.dim < 128 else args.dim // 64)
    config = preset_config("tiny").replace(
        validation={"heldout_check": False},  # the peer's speed, not the coordinator's scoring
        model={
            "vocab_size": args.vocab,
            "dim": args.dim,
            "n_layers": args.layers,
            "n_heads": heads,
            "max_seq_len": args.seq,
        },
        data={
            "max_docs": 400,
            "tokenizer_sample_chars": 200_000,
            "byte_fallback": args.byte_fallback,
        },
        topology={"levels": args.topology},
        train={
            "batch_size": args.batch,
            "seq_len": args.seq,
            "pretrain_steps": 4,
            "warmup_steps": 2,
            "inner_steps": args.steps,
            "rounds": args.rounds,
        },
        scheduler={"lease_seconds": 600.0, "heartbeat_seconds": 5.0},
        eval={"max_docs": 8},
    )
    paths = config.build_topology().num_paths
    print(f"preparing a run in {work} (tokenizer, pretraining, router, shards)...", flush=True)
    prepare(work / "prepared", config, device=device)
    print(
        f"{paths} paths ({args.topology}), width {args.dim}, {args.layers} blocks, batch "
        f"{args.batch} x {args.seq}, H = {args.steps}, {args.rounds} rounds; device {device}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results, params = {}, {}
    # The sequential and interleaving peers as a local run trains by default (torch.compile on a
    # GPU only); the stacked one with --compile.
    runs = (
        ("sequential", 1, "streams", "auto"),
        ("streams", paths, "streams", "auto"),
        ("stacked", paths, "stacked", args.compile),
    )
    for name, parallel, batching, compile in runs:
        root = work / name
        shutil.copytree(work / "prepared", root)
        results[name], params[name] = train(root, config, parallel, device, batching, compile)
        r = results[name]
        t = r["timings"]
        print(
            f"{name:>10} (parallel={parallel:>2}): {r['wall']:7.2f} s wall, {r['tasks']} tasks, "
            f"{r['tokens'] / r['wall']:>9,.0f} tok/s | train {t['train']:.2f} s, fetch "
            f"{t['fetch']:.2f} s, push {t['push']:.2f} s, save {t['save']:.2f} s, claim/wait "
            f"{t['claim']:.2f} s",
            flush=True,
        )
    seq = results["sequential"]
    parts = []
    for name in ("streams", "stacked"):
        par = results[name]
        diff = max(
            float((params[name][mid][n] - t).abs().max())
            for mid, tensors in params["sequential"].items()
            for n, t in tensors.items()
        )
        ratio = par["wall"] / seq["wall"]
        train_ratio = par["timings"]["train"] / seq["timings"]["train"]
        print(
            f"ratio {name}/sequential wall: {ratio:.3f} (training phase alone {train_ratio:.3f}); "
            f"tokens/s {par['tokens'] / par['wall']:,.0f} against {seq['tokens'] / seq['wall']:,.0f}"
            f"; largest module difference from the sequential run {diff:.2e}"
        )
        parts.append(
            f"{name}/sequential wall {ratio:.3f} (training {train_ratio:.3f}, "
            f"{par['tokens'] / par['wall']:,.0f} tok/s, max diff {diff:.1e})"
        )
    record(
        args,
        "path_parallel",
        f"{paths} paths ({args.topology}), width {args.dim}, {args.layers} blocks, "
        f"H={args.steps} x {args.rounds} rounds, {device}: sequential "
        f"{seq['tokens'] / seq['wall']:,.0f} tok/s; " + "; ".join(parts),
    )


if __name__ == "__main__":
    main()
