"""The coordinator's outer step against memory bandwidth.

For a module of N parameters with P contributing paths, one outer step reads P deltas, the
parameters and the Nesterov momentum ((P + 2) x N float32) and writes new parameters and
momentum. The baseline is a plain tensor copy of the same (P + 2) x N x 4 bytes into buffers
already touched: what the memory system does at best. The ratio printed is copy time / outer
time, i.e. the fraction of the copy's bandwidth the outer step reaches (target: at least 0.5).

Two levels are timed:
  kernel  dipaco.coordinator.outer.apply_round: weighted average + Nesterov (foreach kernels),
          on tensors in memory, writing into the store's spare buffers (the version before
          the head's, reused from the third step on); this is the part the target is about.
          "fresh" is the same with results allocated afresh (the first two steps, or
          ModuleStore.reuse_buffers off): page faults on first touch cost more than the math.
  store   ModuleStore.outer_step as the coordinator runs it (--store): the P deltas (held in
          memory since their admission wrote their files, as a running coordinator holds them
          within DIPACO_DELTA_MEMORY_BYTES, an eighth of RAM by default), the new version and
          momentum written, the release hash (SHA-256, on a second thread), head.json
          committed with fsync. The version files are synced in the background (store.py
          persist_step): "synced ratio" also waits for that. "files ratio": the same step with
          the P delta files read back and checksummed (XXH3), as after a restart or past the
          memory budget. Printed against the same copy, and against the bare file I/O and
          checksums.

Also printed: the previous implementation (a per-tensor Python loop accumulating in float64,
as in dipaco before the foreach rewrite) at the smallest size, and how linear the kernel is in
N and in P (nanoseconds per input megabyte across rows).

    python bench/outer_step.py [--params 10 100 500] [--paths 1 2 4 8] [--store] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dipaco.coordinator.outer import OuterSettings, apply_round
from dipaco.coordinator.store import ModuleStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, best, record  # noqa: E402

WIDTH = 1024  # tensors of WIDTH x WIDTH (about a million parameters) plus a norm vector each


def module(n_params: int, fill: float) -> dict[str, torch.Tensor]:
    """A module shaped like transformer blocks: square matrices and small vectors."""
    out = {}
    for i in range(max(1, round(n_params / (WIDTH * WIDTH + WIDTH)))):
        out[f"b{i}.w"] = torch.full((WIDTH, WIDTH), fill)
        out[f"b{i}.norm"] = torch.full((WIDTH,), fill)
    return out


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def previous_outer(deltas, params, momentum, s: OuterSettings):
    """dipaco's outer step before the foreach rewrite: float64 per tensor, Python loops."""
    n = len(deltas)
    total = sum(tokens for _, tokens in deltas)
    weights = [tokens / total for _, tokens in deltas]
    grad = {
        name: math.sqrt(n)
        * sum(w * d[name].double() for w, (d, _) in zip(weights, deltas, strict=True)).float()
        for name in deltas[0][0]
    }
    new_params, new_momentum = {}, {}
    for name, theta in params.items():
        g = grad[name]
        b = s.momentum * momentum[name] + g
        new_params[name] = theta - s.lr * (g + s.momentum * b)
        new_momentum[name] = b
    return new_params, new_momentum


def available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def kernel_row(n_params: int, paths: int, repeat: int, s: OuterSettings) -> dict | None:
    # inputs (P + 2) N, the spare results 2 N, the copy's destination N (fresh results: 2 N more)
    room = 0.75 * available_bytes()
    if (paths + 5) * n_params * 4 > room:
        return None
    with_fresh = (paths + 7.5) * n_params * 4 <= room
    params, momentum = module(n_params, 0.5), module(n_params, 0.01)
    deltas = [(module(n_params, 0.001 * (i + 1)), 1000.0 * (i + 1)) for i in range(paths)]
    inputs = [params, momentum, *(d for d, _ in deltas)]
    dst = [torch.empty_like(t) for t in params.values()]
    torch._foreach_zero_(dst)  # touched once, as a warm destination

    def copy():
        for src in inputs:
            torch._foreach_copy_(dst, list(src.values()))

    out = (module(n_params, 0.0), module(n_params, 0.0))  # the store's spare buffers

    def outer():  # as the store runs it from its third step on: into the spare buffers
        return apply_round(deltas, params, momentum, s, out=out)

    def outer_fresh():  # results allocated afresh (the first steps, or reuse_buffers off)
        return apply_round(deltas, params, momentum, s)

    moved = sum(nbytes(t) for t in inputs)
    t_outer = best(outer, repeat)
    t_fresh = best(outer_fresh, repeat) if with_fresh else float("nan")
    t_copy = best(copy, repeat)
    return {
        "params": sum(t.numel() for t in params.values()),
        "paths": paths,
        "bytes": moved,
        "outer": t_outer,
        "fresh": t_fresh,
        "copy": t_copy,
        "state": (params, momentum, deltas),
    }


def store_row(n_params: int, paths: int, repeat: int, s: OuterSettings, t_copy: float) -> dict:
    """ModuleStore.outer_step on a real folder: deltas admitted (files written), a committed
    version out; with the deltas held in memory since admission (as a running coordinator
    steps), then read back from their files (after a restart, or past the memory budget)."""
    with tempfile.TemporaryDirectory(prefix="dipaco-outer-") as tmp:
        store = ModuleStore(Path(tmp))
        store.initialize({"m": module(n_params, 0.5)})
        times, synced, io_times, from_files = [], [], [], []
        for r in range(2 * repeat):
            if r == repeat:  # the same steps from files (the default budget until then)
                store.held_budget = 0
            for p in range(paths):
                store.add_delta("m", p, 1.0, f"t{r}-{p}", "peer", module(n_params, 0.001 * (p + 1)))
            store.sync_all()  # the last step's background sync is not this step's time
            began = time.perf_counter()
            store.outer_step("m", s, background=True)  # as the coordinator steps a module this size
            (times if r < repeat else from_files).append(time.perf_counter() - began)
            store.sync_all()  # the files on disk, as the next step needs them
            if r < repeat:
                synced.append(time.perf_counter() - began)
        # The floor for the same step's file work: read P delta files, write two version files.
        from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file

        folder = Path(tmp) / "io"
        tensors = module(n_params, 0.25)
        for p in range(paths):
            write_tensor_file(folder / f"d{p}.dpt", Frame("Delta", {}, tensors))
        for _ in range(repeat):
            began = time.perf_counter()
            for p in range(paths):
                read_tensor_file(folder / f"d{p}.dpt")
            write_tensor_file(folder / "v.dpt", Frame("ModuleRelease", {}, tensors))
            write_tensor_file(folder / "m.dpt", Frame("OuterMomentum", {}, tensors))
            io_times.append(time.perf_counter() - began)
    return {
        "store": min(times),
        "files": min(from_files),
        "synced": min(synced),
        "io": min(io_times),
        "copy": t_copy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=float, nargs="+", default=[10, 100, 500], help="millions")
    ap.add_argument("--paths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--store", action="store_true", help="also time ModuleStore.outer_step")
    ap.add_argument("--store-max", type=float, default=100, help="largest size for --store (M)")
    ap.add_argument("--quick", action="store_true", help="CI's short form: 2M, P = 1 and 2")
    ap.add_argument(
        "--rescale",
        default="sqrt",
        choices=["none", "sqrt", "linear", "norm"],
        help="the outer rescale (run configs default to norm: one more pass over the average)",
    )
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.params, args.paths, args.repeat, args.store_max = [2], [1, 2], 2, 2
    s = OuterSettings(rescale=args.rescale)
    print(
        f"rescale {args.rescale}; torch threads: {torch.get_num_threads()}, cores: {os.cpu_count()}"
    )
    print(
        f"{'params':>9} {'P':>2} {'in MB':>8} {'outer ms':>9} {'copy ms':>9} "
        f"{'outer GB/s':>10} {'copy GB/s':>9} {'ratio':>6} {'fresh':>6}"
        + ("  store ms  file-io ms  store ratio  synced ratio  files ratio" if args.store else "")
    )
    rows, old = [], None
    for millions in args.params:
        for paths in args.paths:
            row = kernel_row(int(millions * 1e6), paths, args.repeat, s)
            if row is None:
                print(f"{millions:>8.0f}M {paths:>2}  skipped: not enough memory on this machine")
                continue
            params, momentum, deltas = row.pop("state")
            if old is None:  # the previous implementation, once, at the smallest size
                t_old = best(
                    lambda d=deltas, p=params, b=momentum: previous_outer(d, p, b, s), args.repeat
                )
                old = (row["params"], paths, t_old, row["outer"])
            del params, momentum, deltas
            line = (
                f"{row['params'] / 1e6:>8.1f}M {paths:>2} {row['bytes'] / 1e6:>8.0f} "
                f"{row['outer'] * 1e3:>9.1f} {row['copy'] * 1e3:>9.1f} "
                f"{row['bytes'] / row['outer'] / 1e9:>10.2f} {row['bytes'] / row['copy'] / 1e9:>9.2f} "
                f"{row['copy'] / row['outer']:>6.2f} {row['copy'] / row['fresh']:>6.2f}"
            )
            if args.store and millions <= args.store_max:
                st = store_row(int(millions * 1e6), paths, args.repeat, s, row["copy"])
                row.update(store=st["store"], io=st["io"], synced=st["synced"], files=st["files"])
                line += (
                    f"  {st['store'] * 1e3:>8.0f}  {st['io'] * 1e3:>10.0f}  "
                    f"{row['copy'] / st['store']:>11.2f}  {row['copy'] / st['synced']:>12.2f}"
                    f"  {row['copy'] / st['files']:>11.2f}"
                )
            print(line, flush=True)
            rows.append(row)
    if not rows:
        raise SystemExit("no size fit in memory")
    ratios = [r["copy"] / r["outer"] for r in rows]
    big = [r for r in rows if r["params"] >= 50e6] or rows
    per_gb = [r["outer"] / (r["bytes"] / 1e9) * 1e3 for r in big]
    print(
        f"ratio outer-step / copy bandwidth: median {statistics.median(ratios):.2f}, "
        f"min {min(ratios):.2f}, max {max(ratios):.2f} (target >= 0.5)"
    )
    print(
        f"linearity: {min(per_gb):.0f} to {max(per_gb):.0f} ms per input GB over "
        f"{len(big)} rows of {min(r['params'] for r in big) / 1e6:.0f}M+ parameters "
        f"(spread {max(per_gb) / min(per_gb):.2f}x; 1.00 is perfectly linear in N and P)"
    )
    n, p, t_old, t_new = old
    print(
        f"previous implementation (float64 per-tensor loop), {n / 1e6:.1f}M x P={p}: "
        f"{t_old * 1e3:.1f} ms vs {t_new * 1e3:.1f} ms now ({t_old / t_new:.1f}x faster)"
    )
    result = (
        f"outer/copy bandwidth {statistics.median(ratios):.2f} median "
        f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(rows)} sizes "
        f"{min(r['params'] for r in rows) / 1e6:.0f}M-{max(r['params'] for r in rows) / 1e6:.0f}M, "
        f"P {min(r['paths'] for r in rows)}-{max(r['paths'] for r in rows)}; "
        f"{t_old / t_new:.1f}x the float64 loop"
    )
    stored = [r for r in rows if "store" in r]
    if stored:
        sr = [r["copy"] / r["store"] for r in stored]
        yr = [r["copy"] / r["synced"] for r in stored]
        fr = [r["io"] / r["store"] for r in stored]
        rf = [r["copy"] / r["files"] for r in stored]
        print(
            f"ratio store round / copy: median {statistics.median(sr):.2f} (target >= 0.5); "
            f"with the round's files synced: {statistics.median(yr):.2f}; the bare file I/O "
            f"and checksums are {statistics.median(fr):.2f} of the store round; with the "
            f"deltas read back from their files: {statistics.median(rf):.2f}"
        )
        result += (
            f"; whole store round/copy {statistics.median(sr):.2f}, synced "
            f"{statistics.median(yr):.2f} (file I/O {statistics.median(fr):.0%} of it), deltas "
            f"from files {statistics.median(rf):.2f}"
        )
    record(args, "outer_step", result)


if __name__ == "__main__":
    main()
