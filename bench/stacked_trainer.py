"""Many small paths at once: the stacked trainer against the sequential one, in the same run.

P paths of one shape (by default 16 paths of the regime ladder's size: vocabulary 256, width 16,
4 blocks, one head, windows of 64 tokens, batch 8; 24.7 k parameters each), each with its own
batches and AdamW, trained for the same steps by:

  sequential            each path in turn, ``optim.train_step`` on its ``PathModel`` with
                        ``optim.make_optimizer`` (what a peer does for one task; the baseline)
  sequential, compiled  the same with ``torch.compile`` on each path's model
  stacked               ``dipaco.model.stacked``: one forward, backward and AdamW step for all
  stacked, compiled     the same through ``torch.compile`` (what bench/regime.py uses on a CPU)

Each prints tokens per second, the ratio to the sequential trainer, and (the stacked ones) the
largest difference of any parameter from the sequential run's after the same steps (float
rounding: tests/unit/test_stacked.py states the tolerance) and the page faults a step. Compiling is
timed apart from the steps (its first steps are warm-up, not measured). The measured steps run in
turns (``--turns``: blocks of steps, every trainer in each block, each turn begun by the next
trainer; by default one step a turn) and each ratio is the median of the per-turn ratios, printed
with its range: these machines' speed drifts within seconds, and a ratio of two rates measured
seconds apart carries the drift (blocks of five steps gave medians of 4.2x to 5.7x in one hour on
one machine; one step a turn, 5.1x to 5.4x). Every trainer runs with the heap
held as a stacked peer's is (``dipaco.peer.device.hold_heap``).

    python bench/stacked_trainer.py                       # 16 ladder-sized paths (~2 min)
    python bench/stacked_trainer.py --dim 64 --vocab 1024 --seq 128 --heads 4   # capacity size
    python bench/stacked_trainer.py --device cuda --dim 256 --layers 8 --vocab 8192 --seq 256
    python bench/stacked_trainer.py --quick               # CI's short form
    python bench/stacked_trainer.py --profile             # and where a stacked step's time goes

``--profile`` adds the machine's rate on one large matrix product (the ceiling for the batched
products) and a ``torch.profiler`` breakdown of 10 stacked steps (compiled unless --no-compile):
batched products, attention, the compiled elementwise kernels, the rest.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from dipaco.model.optim import InnerSettings, make_optimizer, train_step
from dipaco.model.stacked import StackedAdamW, StackedPaths, stacked_step
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.peer.device import hold_heap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="measured steps per path")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (compiles)")
    ap.add_argument(
        "--turns",
        type=int,
        default=0,
        help="the measured steps in this many blocks, in turns (default: one step a turn)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-compile", action="store_true", help="leave out the two compiled trainers")
    ap.add_argument("--quick", action="store_true", help="CI's short form: 4 paths, 3 steps")
    ap.add_argument("--profile", action="store_true", help="where a stacked step's time goes")
    ap.add_argument(
        "--no-hold-heap",
        action="store_true",
        help="leave glibc's heap settings as they are (what a stack paid before hold_heap)",
    )
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.paths, args.steps, args.warmup, args.no_compile, args.turns = 4, 3, 1, True, 3
    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq,
    )
    settings = InnerSettings(lr=3e-3, warmup_steps=2, total_steps=10_000)
    g = torch.Generator().manual_seed(0)
    total = args.warmup + args.steps
    batches = torch.randint(
        0, args.vocab, (total, args.paths, args.batch, args.seq + 1), generator=g
    ).to(args.device)
    tokens = args.steps * args.paths * args.batch * args.seq
    per_path = sum(p.numel() for p in new_dense_model(cfg, 0).parameters())
    print(
        f"{args.paths} paths of {per_path:,} parameters (vocab {args.vocab}, width {args.dim}, "
        f"{args.layers} blocks, {args.heads} heads), batch {args.batch} x {args.seq}; "
        f"{args.warmup} warm-up + {args.steps} measured steps per path on {args.device}, "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    if not args.no_hold_heap:
        hold_heap()  # what a stacked peer does (peer/device.py); the same for every trainer here
    trainers = [("sequential", False), ("sequential, compiled", True)]
    trainers += [("stacked", False), ("stacked, compiled", True)]
    runs = {
        name: (_Sequential if name.startswith("sequential") else _Stacked)(
            cfg, settings, batches, args, compiled
        )
        for name, compiled in trainers
        if not (compiled and args.no_compile)
    }
    for run in runs.values():
        began = time.perf_counter()
        for k in range(args.warmup):
            run.step(k)
        _sync(args.device)
        run.warm = time.perf_counter() - began
    # Measured in turns, a block of steps each (the machine's speed drifts; a ratio is taken
    # within each turn, where every trainer met the same machine).
    turns = args.turns or args.steps
    blocks = [list(r) for r in _blocks(args.warmup, args.warmup + args.steps, turns)]
    seconds = {name: [] for name in runs}
    faults = dict.fromkeys(runs, 0)
    cpu = {name: [0.0, 0.0] for name in runs}  # user, kernel seconds (every thread)
    for turn, block in enumerate(blocks):
        # Each turn starts with another trainer: none always runs first (or after the slowest).
        names = list(runs)
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            run = runs[name]
            before = resource.getrusage(resource.RUSAGE_SELF)
            began = time.perf_counter()
            for k in block:
                run.step(k)
            _sync(args.device)
            seconds[name].append(time.perf_counter() - began)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[name] += after.ru_minflt - before.ru_minflt
            cpu[name][0] += after.ru_utime - before.ru_utime
            cpu[name][1] += after.ru_stime - before.ru_stime
    results: dict[str, tuple[float, float | None]] = {}
    ratios: dict[str, list[float]] = {}
    reference = runs["sequential"].states()
    for name, run in runs.items():
        states = run.states()
        diff = None
        if name != "sequential":
            diff = max(
                float((s[k] - r[k]).abs().max())
                for s, r in zip(states, reference, strict=True)
                for k in r
            )
        results[name] = (tokens / sum(seconds[name]), diff)
        ratios[name] = sorted(
            a / b for a, b in zip(seconds["sequential"], seconds[name], strict=True)
        )
        print(
            f"{name:>21}: {results[name][0]:>10,.0f} tok/s  ({_median(ratios[name]):5.2f}x the "
            f"sequential trainer: median of {len(blocks)} turns, {ratios[name][0]:.2f}-"
            f"{ratios[name][-1]:.2f})"
            + (f"; warm-up and compile {run.warm:.1f} s" if compiled_name(name) else "")
            + ("" if diff is None else f"; largest parameter difference {diff:.2e}")
            + f"; {faults[name] / args.steps:,.0f} page faults, CPU "
            f"{sum(cpu[name]) / args.steps * 1e3:.1f} ms ({cpu[name][1] / args.steps * 1e3:.1f} "
            "in the kernel) a step",
            flush=True,
        )
    base = results["sequential"][0]
    best = max((r for r in results if r.startswith("stacked")), key=lambda r: _median(ratios[r]))
    print(
        f"ratio {best}/sequential tokens per second: {_median(ratios[best]):.2f} (median of "
        f"{len(blocks)} turns, {ratios[best][0]:.2f}-{ratios[best][-1]:.2f}; sequential "
        f"{base:,.0f}, {best} {results[best][0]:,.0f} tok/s)"
    )
    summary = ", ".join(f"{n} {_median(ratios[n]):.2f}x" for n in results if n != "sequential")
    if args.profile:
        _profile(cfg, settings, batches, args)
    record(
        args,
        "stacked_trainer",
        f"{args.paths} paths of {per_path / 1000:.1f} k params (width {args.dim}, {args.layers} "
        f"blocks, vocab {args.vocab}, batch {args.batch} x {args.seq}), {args.device}: sequential "
        f"{base:,.0f} tok/s; {summary}; best {best} {_median(ratios[best]):.2f}x "
        f"({ratios[best][0]:.2f}-{ratios[best][-1]:.2f} over {len(blocks)} turns)",
    )


def compiled_name(name: str) -> bool:
    return name.endswith("compiled")


def _blocks(first: int, end: int, turns: int) -> list[range]:
    """Steps ``first``..``end`` - 1 in ``turns`` consecutive blocks of (nearly) equal size."""
    turns = max(1, min(turns, end - first))
    cuts = [first + (end - first) * i // turns for i in range(turns + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def _median(values: list[float]) -> float:
    return statistics.median(values)


class _Sequential:
    """Each path in turn: ``optim.train_step`` on its model (what a peer does for one task)."""

    def __init__(self, cfg, settings, batches, args, compiled) -> None:
        self.settings, self.batches, self.warm = settings, batches, 0.0
        self.models = [new_dense_model(cfg, seed).to(args.device) for seed in range(args.paths)]
        self.optimizers = [make_optimizer(m, settings) for m in self.models]
        self.forwards = [torch.compile(m) if compiled else None for m in self.models]
        for m in self.models:
            m.train()

    def step(self, k: int) -> None:
        for i, m in enumerate(self.models):
            train_step(
                m,
                self.optimizers[i],
                self.batches[k, i],
                self.settings,
                step=k,
                forward=self.forwards[i],
            )

    def states(self) -> list[dict[str, torch.Tensor]]:
        return [m.state_dict() for m in self.models]


class _Stacked:
    """All paths as one stacked model (``dipaco.model.stacked``)."""

    def __init__(self, cfg, settings, batches, args, compiled) -> None:
        self.settings, self.batches, self.warm = settings, batches, 0.0
        models = [new_dense_model(cfg, seed) for seed in range(args.paths)]
        self.paths = StackedPaths(
            cfg, [m.state_dict() for m in models], args.device, compile=compiled
        )
        self.optimizer = StackedAdamW(self.paths, settings)
        self.n = args.paths

    def step(self, k: int) -> None:
        stacked_step(self.paths, self.optimizer, self.batches[k], [self.settings.lr_at(k)] * self.n)

    def states(self) -> list[dict[str, torch.Tensor]]:
        return [self.paths.state(i) for i in range(self.n)]


def _profile(cfg, settings, batches, args) -> None:
    """The large-product ceiling, then the share of a stacked step's time by kind of operation."""
    from torch.profiler import ProfilerActivity, profile

    n = 2048
    a, b = (torch.randn(n, n, device=args.device) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(args.device)
    began, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    _sync(args.device)
    print(
        f"one {n} x {n} product: {2 * n**3 * reps / (time.perf_counter() - began) / 1e9:.0f} GFLOP/s"
    )
    models = [new_dense_model(cfg, seed) for seed in range(args.paths)]
    compiled = not args.no_compile
    paths = StackedPaths(cfg, [m.state_dict() for m in models], args.device, compile=compiled)
    optimizer = StackedAdamW(paths, settings)
    lrs = [settings.lr] * args.paths
    for k in range(args.warmup):
        stacked_step(paths, optimizer, batches[k], lrs)
    activities = [ProfilerActivity.CPU]
    if str(args.device).startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    steps = min(10, batches.shape[0])
    with profile(activities=activities) as prof:
        for k in range(steps):
            stacked_step(paths, optimizer, batches[k], lrs)
        _sync(args.device)
    kinds = {"batched products": 0.0, "attention": 0.0, "compiled kernels": 0.0, "other": 0.0}
    for e in prof.key_averages():
        if e.key == "aten::bmm":
            kind = "batched products"
        elif "scaled_dot_product" in e.key:
            kind = "attention"
        elif "CompiledFxGraph" in e.key:
            kind = "compiled kernels"
        else:
            kind = "other"
        kinds[kind] += e.self_cpu_time_total
    total = sum(kinds.values())
    print(
        f"stacked{', compiled' if compiled else ''} step, {total / steps / 1e3:.1f} ms of CPU time: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.items())
    )


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
