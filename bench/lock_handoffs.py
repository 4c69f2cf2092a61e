"""What a delta's checks cost while other threads run Python: NumPy views against torch operations.

Every torch operation lets the interpreter's lock go and takes it back; in a process whose other
threads run Python (a coordinator's request threads under load), taking it back waits for one of
them to let it go, up to the switch interval (5 ms). This times, per module delta, what
admission does with the tensors (the finiteness check, the norm, the staged file's encoding):
the coordinator's way (``validation.delta_norm``, also its finiteness check, ``wire.encode_parts``
through NumPy views, ``wire.host_array``) and, as the baseline in the same run, the same work as
torch operations per tensor (what admission did before), first alone, then with ``--busy``
threads running Python beside it. It prints milliseconds per delta for both and their ratio
with the busy threads, with the process's context switches per delta.

    python bench/lock_handoffs.py [--dim 256] [--layers 2] [--deltas 10] [--busy 2] [--quick]
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from dipaco.coordinator.validation import delta_norm, nonfinite
from dipaco.protocols.wire import Frame, encode_parts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, path_modules, record  # noqa: E402


def torch_way(delta: dict[str, torch.Tensor]) -> float:
    """The baseline: per tensor, torch operations (as admission made them before)."""
    for t in delta.values():
        if not torch.isfinite(t).all():
            raise ValueError("non-finite")
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in delta.values()))
    for t in delta.values():
        memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return norm


def numpy_way(delta: dict[str, torch.Tensor]) -> float:
    """The coordinator's way: a few NumPy calls per module, one view per tensor; the norm is
    the finiteness check (``nonfinite`` only names the tensor of a refused delta)."""
    norm = delta_norm(delta)
    if not math.isfinite(norm):
        raise ValueError(f"{nonfinite(delta)} is not finite")
    encode_parts(Frame("Delta", {}, delta))
    return norm


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def per_delta(way, deltas: list[dict[str, torch.Tensor]], busy: int) -> tuple[float, float]:
    """Seconds and context switches per delta, with ``busy`` threads running Python."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    try:
        s0, t0 = _switches(), time.perf_counter()
        for d in deltas:
            way(d)
        dt, ds = time.perf_counter() - t0, _switches() - s0
    finally:
        stop.set()
        for t in threads:
            t.join()
    return dt / len(deltas), ds / len(deltas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--deltas", type=int, default=10, help="module deltas timed per case")
    ap.add_argument("--busy", type=int, default=2, help="threads running Python beside it")
    ap.add_argument("--quick", action="store_true", help="CI's short form: width 64, 3 deltas")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.dim, args.deltas = 64, 3
    torch.set_num_threads(1)
    modules = path_modules(args.dim, args.layers)
    mid = max(modules, key=lambda k: len(modules[k]))  # the module with the most tensors
    g = torch.Generator().manual_seed(0)
    deltas = [
        {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in modules[mid].items()}
        for _ in range(args.deltas)
    ]
    assert math.isclose(numpy_way(deltas[0]), torch_way(deltas[0]), rel_tol=1e-9)
    print(
        f"module {mid}: {len(deltas[0])} tensors, {sum(t.numel() for t in deltas[0].values())} values"
    )
    got = {}
    for busy in (0, args.busy):
        for name, way in (("torch", torch_way), ("numpy", numpy_way)):
            got[name, busy] = per_delta(way, deltas, busy)
            sec, sw = got[name, busy]
            print(
                f"{name:5s} way, {busy} busy threads: {sec * 1e3:9.2f} ms per delta, "
                f"{sw:7.1f} context switches per delta"
            )
    ratio = got["torch", args.busy][0] / got["numpy", args.busy][0]
    print(f"ratio torch way / numpy way with {args.busy} busy threads: {ratio:.1f}")
    record(
        args,
        "lock_handoffs",
        f"{len(deltas[0])} tensors, {args.busy} busy threads: torch way "
        f"{got['torch', args.busy][0] * 1e3:.1f} ms vs numpy way "
        f"{got['numpy', args.busy][0] * 1e3:.2f} ms per delta ({ratio:.0f}x); alone "
        f"{got['torch', 0][0] * 1e3:.2f} vs {got['numpy', 0][0] * 1e3:.2f} ms",
    )


if __name__ == "__main__":
    main()
