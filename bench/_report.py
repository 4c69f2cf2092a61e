"""What every benchmark under bench/ shares: the machine's description and the row it records.

Each benchmark prints its ratio against a baseline measured in the same run, then appends one
row to the table in ``docs/benchmarks.md`` (benchmark, result, machine, command, date). The
destination is ``--doc PATH`` or ``$DIPACO_BENCH_DOC``; ``--no-record`` skips it (CI's short
forms write to a temporary file, never to the docs).

    from _report import add_report_args, record
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
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
