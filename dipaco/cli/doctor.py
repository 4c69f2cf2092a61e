"""``dipaco-peer doctor``: check, before joining, that this machine can take part in a run.

The checks (device, memory, reachability, round trip, clock skew) are
:func:`dipaco.peer.checks.run_checks`; this command parses the arguments and prints them, as a
table or as JSON (``--json``). It exits 1 when a check that ran failed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dipaco.cli.common import choose_config, console
from dipaco.peer.checks import Check, all_passed, run_checks

_GIB = 2**30


def checks_json(checks: list[Check]) -> str:
    return json.dumps({"ok": all_passed(checks), "checks": [c.to_dict() for c in checks]})


def print_checks(checks: list[Check], console: Any) -> None:
    """A table on a terminal; to a file or a pipe one line per check (``✓ name: detail;
    advice``), which no width wraps. Then the verdict, naming skipped checks if any."""
    marks = {"skipped": ("–", "dim"), "passed": ("✓", "green"), "failed": ("✗", "red")}
    if console.lines:
        for c in checks:
            mark = marks[c.outcome][0]
            console.print(
                f"{mark} {c.name}: {c.detail}" + (f"; {c.advice}" if c.advice else ""),
                markup=False,
                highlight=False,
            )
    else:
        from rich.table import Table

        table = Table(title="dipaco-peer doctor")
        table.add_column("", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("detail")
        table.add_column("advice")
        for c in checks:
            mark, style = marks[c.outcome]
            table.add_row(f"[{style}]{mark}[/]", c.name, c.detail, c.advice)
        console.print(table)
    skipped = [c.name for c in checks if c.skipped]
    why = f" ({', '.join(skipped)} skipped: nothing to compare with)" if skipped else ""
    if all_passed(checks):
        console.print(f"[green]all checks passed[/]{why}")
    else:
        console.print(f"[red]some checks failed[/]: see the advice above{why}")


def cmd_doctor(args: argparse.Namespace) -> int:
    config = choose_config(args.config, args.preset) if (args.config or args.preset) else None
    checks = run_checks(
        args.address,
        config=config,
        device=args.device,
        memory_bytes=int(args.memory_gb * _GIB) if args.memory_gb else None,
        timeout=args.timeout,
        time_url=args.time_url,
    )
    if args.json:
        print(checks_json(checks))
    else:
        print_checks(checks, console)
    return 0 if all_passed(checks) else 1


def add_doctor_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` on the ``dipaco-peer`` command's subparsers."""
    p = sub.add_parser("doctor", help="check this machine and the coordinator before joining")
    p.add_argument(
        "address", nargs="?", help="the coordinator's address (host:port or a TCP multiaddr)"
    )
    p.add_argument("--config", help="the run's TOML config, to estimate the memory a path needs")
    p.add_argument("--preset", help="or the run's preset (demo, tiny)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda:0, ...")
    p.add_argument("--memory-gb", type=float, help="plan for this much memory instead of probing")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per network probe")
    p.add_argument(
        "--time-url", help="an HTTP URL of the coordinator (its dashboard) to compare clocks with"
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(fn=cmd_doctor)
    return p
