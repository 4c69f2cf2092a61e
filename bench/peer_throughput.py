"""A peer's inner loop against a bare PyTorch loop: tokens per second, and model FLOPs utilisation.

dipaco: a real ``Peer`` claims path tasks from an in-process coordinator and trains each for H
steps exactly as ``dipaco-peer join`` does: the path's modules fetched and assembled, its inner
optimizer state loaded, windows drawn from the path's shard on disk, the learning-rate
schedule, gradient clipping, a checkpoint every ``--checkpoint-seconds``, and the per-step
callbacks; then the deltas pushed and the inner state saved.

bare: a minimal hand-written loop training the same path from the same weights on the same
batches (drawn before the clock starts): forward, cross-entropy, backward, AdamW step. It gets
the same hardware features dipaco uses (fused AdamW; on a GPU bf16 autocast and torch.compile),
so the ratio measures dipaco's own overhead, not a slower recipe.

Both alternate task by task (noise hits both), and the best task of each counts. Printed:
  ratio (inner loop)  dipaco's training phase (model built, state loaded, H steps, checkpoints)
  ratio (whole task)  also fetching the modules, pushing the deltas and saving the state
  MFU                 6 N + 12 L T d FLOPs per token against this device's measured matmul peak
                      (float32 on a CPU, bfloat16 on a GPU)
With ``--push-behind``, then ``--tasks`` tasks in one run twice: pushed as usual, and pushed
behind the next task (``dipaco-peer join --push-behind``), tokens per second of each. On a CPU the
send (the in-process coordinator's admission included) shares the cores with training; on a GPU
it runs beside it.

    python bench/peer_throughput.py                       # CPU: a width-256 path, H = 16
    python bench/peer_throughput.py --paper-path --device cuda   # the paper's 150M path, bf16
    python bench/peer_throughput.py --quick               # CI's short form
    python bench/peer_throughput.py --quick --push-behind # and the same peer pushing behind
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dipaco.config import preset_config
from dipaco.data.shards import TokenShard, window_batches
from dipaco.model.optim import InnerSettings, fused_adamw_available, make_optimizer
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, record  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak(device: str) -> tuple[float, str]:
    """The measured matrix-multiply peak in FLOP/s: bf16 8192^3 on a GPU, fp32 1024^3 on a CPU."""
    if device.startswith("cuda"):
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(3):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - began) / 3)
    return 2 * n**3 / best, f"{str(dtype).removeprefix('torch.')} {n}^3 matmul"


def flops_per_token(model: torch.nn.Module, cfg, seq_len: int) -> float:
    """6 N (N without the embedding lookup) + 12 L T d for attention (PaLM's appendix B)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    return 6 * n + 12 * cfg.n_layers * seq_len * cfg.dim


def bare_task(model, batches, device: str, features: dict) -> float:
    """Seconds for the hand-written loop over ``batches`` (already on the device)."""
    optimizer = make_optimizer(model, _settings())
    fwd = torch.compile(model) if features["compile"] else model
    model.train()
    sync(device)
    began = time.perf_counter()
    for batch in batches:
        with torch.autocast(device.split(":")[0], dtype=features["autocast"] or torch.float32,
                            enabled=features["autocast"] is not None):  # fmt: skip
            logits = fwd(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    sync(device)
    return time.perf_counter() - began


def _settings() -> InnerSettings:
    return InnerSettings(lr=1e-3, warmup_steps=0, total_steps=1)


def step_parts(model, device: str, repeat: int = 5) -> dict[str, float]:
    """Seconds per call of the parts of a step dipaco adds or chooses: the AdamW step (fused
    and foreach kernels) and the gradient clip, on the path's own parameters and random grads."""
    model = model.to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    out = {}
    for name, kind in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        if name == "fused" and not fused_adamw_available(device):
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **kind)
        opt.step()  # the state is made on the first step
        sync(device)
        out[f"adamw_{name}"] = best(opt.step, repeat, device)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    out["clip"] = best(clip, repeat, device)
    return out


def best(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="inner steps H per task")
    ap.add_argument("--tasks", type=int, default=6, help="tasks timed, each way")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--checkpoint-seconds",
        type=float,
        default=5.0,
        help="a checkpoint this often (peers default to 20 s: 5 s counts it four times over)",
    )
    ap.add_argument(
        "--paper-path",
        action="store_true",
        help="the paper's path: 12 blocks, width 896, 16 heads, sequence 1024 (about 150M)",
    )
    ap.add_argument(
        "--push-behind",
        action="store_true",
        help="then --tasks tasks in one run, pushed as usual and pushed behind the next task",
    )
    ap.add_argument("--work", help="a folder for the prepared run (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="CI's short form: a tiny path, 2 tasks")
    add_report_args(ap)
    args = ap.parse_args()
    if args.paper_path:
        args.dim, args.layers, args.heads, args.seq = 896, 12, 16, 1024
        args.vocab = max(args.vocab, 8192)
    if args.quick:
        args.dim, args.layers, args.heads, args.batch, args.seq = 64, 4, 2, 8, 64
        args.vocab, args.steps, args.tasks = 512, 4, 2
    with tempfile.TemporaryDirectory(prefix="dipaco-peer-bench-") as tmp:
        run(args, Path(args.work or tmp))


def path_config(args: argparse.Namespace, rounds: int) -> Any:
    """The tiny preset with the benchmarked path (``args``: vocab, dim, layers, heads, seq,
    batch, steps), no pretraining, long leases: also bench/task_costs.py's."""
    return preset_config("tiny").replace(
        validation={"heldout_check": False},  # the peer's speed, not the coordinator's scoring
        model={
            "vocab_size": args.vocab,
            "dim": args.dim,
            "n_layers": args.layers,
            "n_heads": args.heads,
            "max_seq_len": args.seq,
        },
        data={"max_docs": 600, "tokenizer_sample_chars": 600_000},
        train={
            "batch_size": args.batch,
            "seq_len": args.seq,
            "pretrain_steps": 0,
            "inner_steps": args.steps,
            "rounds": rounds,
        },
        scheduler={"lease_seconds": 3600.0, "heartbeat_seconds": 60.0},
        eval={"max_docs": 8},
    )


def run(args: argparse.Namespace, work: Path) -> None:
    # one task per path per round; more than we time (push behind times 2 x tasks more)
    config = path_config(args, 3 * args.tasks + 4 if args.push_behind else args.tasks + 2)
    print(f"preparing a run in {work} (tokenizer, router, shards)...", flush=True)
    prep = prepare(work / "run", config, device=args.device)
    coordinator = build_coordinator(
        prep, MetricsLog(work / "run" / "metrics.jsonl"), evaluate=False
    )
    peer = Peer(
        LocalTransport(coordinator.handle).authenticate(Identity.generate()),
        "bench",
        work / "peer",
        device=args.device,
        checkpoint_seconds=args.checkpoint_seconds,
    )
    peer.setup()
    device = str(peer.device)
    features = peer.features
    # The bare loop's model and batches: path 0 from the same weights, the same window sampler.
    cfg = prep.config.build_model_config()
    modules = {mid: coordinator.store.params(mid) for mid in coordinator.store.modules}
    path_model = peer.topology.build_path(
        cfg, 0, {m: {k: v.clone() for k, v in t.items()} for m, t in modules.items()}
    )
    shard = TokenShard(Path(peer.config["shards_dir"]).parent / "shards" / "P0" / "train")
    sampler = window_batches(shard, [0, 0, 0], args.batch, args.seq, device)
    batches = [next(sampler) for _ in range(args.steps)]
    tokens_per_task = args.steps * args.batch * args.seq
    n_params = sum(p.numel() for p in path_model.parameters())
    print(
        f"path: {n_params / 1e6:.1f}M parameters (width {args.dim}, {args.layers} blocks, "
        f"{args.heads} heads, vocab {args.vocab}); batch {args.batch} x {args.seq} tokens, "
        f"H = {args.steps}; device {device}; autocast {features['autocast']}, "
        f"compile {features['compile']}, fused AdamW {features['fused']}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    bare_times, inner_times, whole_times = [], [], []
    for i in range(args.tasks + 1):  # the first of each warms up (compilation, caches)
        model = peer.topology.build_path(
            cfg, 0, {m: {k: v.clone() for k, v in t.items()} for m, t in modules.items()}
        ).to(device)
        t_bare = bare_task(model, batches, device, features)
        del model
        before = dict(peer.timings)
        began = time.perf_counter()
        peer.max_tasks = peer.tasks_done + 1
        peer.run()
        t_whole = time.perf_counter() - began
        t_inner = peer.timings["train"] - before.get("train", 0.0)
        label = "warm-up" if i == 0 else f"task {i}"
        print(
            f"{label:>8}: bare {tokens_per_task / t_bare:>9,.0f} tok/s | dipaco inner loop "
            f"{tokens_per_task / t_inner:>9,.0f} tok/s, whole task {tokens_per_task / t_whole:>9,.0f}"
            f" tok/s (fetch {peer.timings['fetch'] - before.get('fetch', 0):.2f} s, push "
            f"{peer.timings['push'] - before.get('push', 0):.2f} s)",
            flush=True,
        )
        if i:
            bare_times.append(t_bare)
            inner_times.append(t_inner)
            whole_times.append(t_whole)
    parts = step_parts(path_model, device)
    step = min(bare_times) / args.steps
    print(
        f"per step of {step * 1e3:.1f} ms (bare loop): AdamW "
        + (f"fused {parts['adamw_fused'] * 1e3:.1f} ms, " if "adamw_fused" in parts else "")
        + f"foreach {parts['adamw_foreach'] * 1e3:.1f} ms; gradient clip "
        f"{parts['clip'] * 1e3:.1f} ms ({parts['clip'] / step:.1%} of the step)"
    )
    peak, how = matmul_peak(device)
    fpt = flops_per_token(path_model, cfg, args.seq)
    bare_rate = tokens_per_task / min(bare_times)
    inner_rate = tokens_per_task / min(inner_times)
    whole_rate = tokens_per_task / min(whole_times)
    print(f"matmul peak: {peak / 1e12:.2f} TFLOP/s ({how}); {fpt / 1e6:.1f} MFLOP per token")
    print(
        f"bare loop  {bare_rate:>10,.0f} tok/s  MFU {bare_rate * fpt / peak:.1%}\n"
        f"dipaco     {inner_rate:>10,.0f} tok/s  MFU {inner_rate * fpt / peak:.1%} (inner loop)\n"
        f"dipaco     {whole_rate:>10,.0f} tok/s  MFU {whole_rate * fpt / peak:.1%} (whole task)"
    )
    medians = statistics.median(bare_times) / statistics.median(inner_times)
    print(
        f"ratio dipaco / bare (inner loop): {inner_rate / bare_rate:.3f} "
        f"(median over tasks {medians:.3f}; target >= 0.97)"
    )
    print(f"ratio dipaco / bare (whole task, H = {args.steps}): {whole_rate / bare_rate:.3f}")
    behind = ""
    if args.push_behind:  # N tasks in one run, the peer pushing each one as usual, then behind
        rates = {}
        for on in (False, True):
            peer.push_behind = on
            peer.max_tasks = peer.tasks_done + args.tasks
            began = time.perf_counter()
            peer.run()
            rates[on] = tokens_per_task * args.tasks / (time.perf_counter() - began)
        print(
            f"{args.tasks} tasks in one run: {rates[False]:,.0f} tok/s, with push behind "
            f"{rates[True]:,.0f} tok/s ({rates[True] / rates[False]:.2f}x); of bare: "
            f"{rates[False] / bare_rate:.3f} and {rates[True] / bare_rate:.3f}"
        )
        behind = (
            f"; {args.tasks} tasks in one run {rates[False] / bare_rate:.3f} of bare, with push "
            f"behind {rates[True] / bare_rate:.3f} ({rates[True] / rates[False]:.2f}x)"
        )
    record(
        args,
        "peer_throughput",
        f"{n_params / 1e6:.1f}M path, H={args.steps}, {device}: inner loop "
        f"{inner_rate / bare_rate:.3f} of bare, best task each ({inner_rate:,.0f} vs "
        f"{bare_rate:,.0f} tok/s; median {medians:.3f}), "
        f"whole task {whole_rate / bare_rate:.3f}; MFU {inner_rate * fpt / peak:.1%} of "
        f"measured {how} peak {peak / 1e12:.2f} TFLOP/s{behind}",
    )


if __name__ == "__main__":
    main()
