"""What every benchmark under bench/ shares: the machine's description and the row it records.

Each benchmark prints its ratio against a baseline measured in the same run, then appends one
row to the table in ``docs/benchmarks.md`` (benchmark, result, machine, command, date). The
destination is ``--doc PATH`` or ``$DIPACO_BENCH_DOC``; ``--no-record`` skips it (CI's short
forms write to a temporary file, never to the docs).

    from _report import add_report_args, best, path_modules, record
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
MARK = "<!-- rows: bench/_report.py appends below this line -->"
HEADER = "| benchmark | result | machine | command | date |\n|---|---|---|---|---|"


def machine() -> str:
    """A short, honest description: CPU model and cores, memory, GPU if any, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f", {mem:.0f} GiB"
    except (ValueError, OSError):
        memory = ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {cores} cores{memory}{gpu}, torch {torch.__version__}"


def add_report_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--doc", help="where the row goes (default docs/benchmarks.md)")
    ap.add_argument("--no-record", action="store_true", help="print only; record no row")


def command_line() -> str:
    """The command as typed, relative to the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(DOC.parents[1])
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def record(args: argparse.Namespace, benchmark: str, result: str) -> Path | None:
    """Append the row; returns the file written (None with --no-record)."""
    if getattr(args, "no_record", False):
        return None
    doc = Path(getattr(args, "doc", None) or os.environ.get("DIPACO_BENCH_DOC") or DOC)
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{MARK}\n{HEADER}\n"
    if MARK not in text:
        text = text.rstrip("\n") + f"\n\n{MARK}\n{HEADER}\n"
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    row = (
        f"| {cell(benchmark)} | {cell(result)} | {cell(machine())} | `{cell(command_line())}` "
        f"| {datetime.date.today().isoformat()} |"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_name(f".{doc.name}.tmp")
    tmp.write_text(text.rstrip("\n") + "\n" + row + "\n")
    os.replace(tmp, doc)
    print(f"recorded in {doc}")
    return doc


def best(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls, in seconds (noise only ever adds time)."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def path_modules(dim: int, layers: int) -> dict[str, dict[str, torch.Tensor]]:
    """A dense path of width ``dim`` split into its modules on a 2x2 topology (path 0)."""
    from dipaco.model.topology import Topology
    from dipaco.model.transformer import ModelConfig, new_dense_model

    cfg = ModelConfig(vocab_size=4096, dim=dim, n_layers=layers, n_heads=8, max_seq_len=128)
    topo = Topology.parse("2x2", cfg.n_layers)
    return topo.split_path_state(0, new_dense_model(cfg, 0).state_dict())


def submit_delta(module_ids, tensors: dict[str, torch.Tensor]):
    """The SubmitDelta a peer sends for path 0 with these wire tensors (a benchmark's payload)."""
    from dipaco.protocols import messages as m

    base = dict.fromkeys(module_ids, 0)
    return m.SubmitDelta(
        peer_id="p",
        task_id="t",
        path=0,
        base_versions=base,
        tokens=1,
        losses=[1.0],
        tensors=tensors,
    )
