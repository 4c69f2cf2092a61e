"""Helpers shared by the commands: logging, config selection, errors shown without tracebacks."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from dipaco.config import RunConfig, load_config, preset_config
from dipaco.errors import DipacoError

console = Console()


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )


def choose_config(config: str | None, preset: str | None) -> RunConfig:
    if config:
        return load_config(Path(config))
    return preset_config(preset or "demo")


def run_command(fn: Callable[[], int | None]) -> int:
    """Run a command body; a DipacoError is a clear one-line message and exit code 2."""
    try:
        return fn() or 0
    except DipacoError as exc:
        console.print(f"[bold red]error[/] ({exc.reason}): {exc}")
        return 2
    except KeyboardInterrupt:
        console.print(
            "[yellow]interrupted; the run folder keeps everything, run the same command to resume[/]"
        )
        return 130


def command_parser(prog: str, doc: str | None) -> tuple[argparse.ArgumentParser, Any]:
    """A command's parser with ``-v`` and required subcommands."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    return parser, parser.add_subparsers(dest="command", required=True)


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Parse, set up logging, run the chosen subcommand's ``fn`` and exit with its code."""
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack to stderr, run goes on
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (OSError, ValueError):  # stderr is no file (called in-process, output captured)
            pass
    sys.exit(run_command(lambda: args.fn(args)))
