"""Helpers shared by the commands: logging, config selection, errors shown without tracebacks."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.logging import RichHandler
from rich.text import Text

from dipaco.cli import stopping
from dipaco.config import RunConfig, load_config, preset_config
from dipaco.errors import DipacoError
from dipaco.protocols.linkwatch import NOTICE

FORMATS = ("auto", "rich", "plain", "json")


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


class DipacoConsole(Console):
    """What the commands print: rich on a terminal; one timestamped line per message or event
    (``plain``) or one JSON object per line (``json``) when the output is a file or a pipe.

    Plain and JSON lines are never wrapped or cut, carry no ANSI codes, and are flushed at once
    (a log under nohup or systemd shows each event when it happens). Text that is not valid
    markup (an exception holding ``[/ip4/...]``) is printed as it is instead of failing.
    """

    mode = "rich"

    def configure(self, fmt: str = "auto", stream: Any = None) -> None:
        """Choose the output form; ``stream`` (default: whatever ``sys.stdout`` is at each
        write) decides ``auto``: rich on a terminal, else plain."""
        given, stream = stream, stream or sys.stdout
        if fmt == "auto":
            fmt = os.environ.get("DIPACO_LOG_FORMAT", "auto")
        if fmt == "auto":
            fmt = "rich" if stream.isatty() else "plain"
        if fmt not in FORMATS:
            raise ValueError(f"log format {fmt!r}: expected one of {FORMATS}")
        self.mode = fmt
        if fmt == "rich":
            Console.__init__(self, file=given)
            return
        Console.__init__(
            self,
            file=given,
            force_terminal=False,
            no_color=True,
            color_system=None,
            width=100_000,
            soft_wrap=True,
            highlight=False,
            emoji=False,
        )

    @property
    def lines(self) -> bool:
        """True when output is plain or JSON lines (no live panels)."""
        return self.mode != "rich"

    def print(self, *objects: Any, **kw: Any) -> None:  # type: ignore[override]
        if self.mode == "rich":
            try:
                super().print(*objects, **kw)
            except MarkupError:
                super().print(*objects, **{**kw, "markup": False})
            return
        for key in ("soft_wrap", "highlight", "style", "justify", "overflow", "crop"):
            kw.pop(key, None)
        try:
            with self.capture() as cap:
                super().print(*objects, soft_wrap=True, highlight=False, **kw)
        except MarkupError:
            with self.capture() as cap:
                super().print(*objects, soft_wrap=True, highlight=False, **{**kw, "markup": False})
        self._write(cap.get())

    def log(self, *objects: Any, **kw: Any) -> None:  # type: ignore[override]
        if self.mode == "rich":
            super().log(*objects, **kw)
        else:
            self.print(*objects)

    def rule(self, title: Any = "", **kw: Any) -> None:  # type: ignore[override]
        if self.mode == "rich":
            super().rule(title, **kw)
        elif title:
            self.print(title)

    def event(self, kind: str, message: str, **fields: Any) -> None:
        """One line for an event: plain text with its time, or a JSON object with its fields;
        on a terminal the same text, dimmed (the live panel shows the rest)."""
        if self.mode == "rich":
            super().print(Text(message, style="dim"), soft_wrap=True)
        elif self.mode == "json":
            self._emit({"time": _stamp(), "event": kind, "message": message, **fields})
        else:
            self._emit(f"{_stamp()} {message}")

    def _write(self, text: str) -> None:
        for line in text.splitlines():
            if not line.strip():
                continue
            if self.mode == "json":
                self._emit({"time": _stamp(), "message": line.rstrip()})
            else:
                self._emit(f"{_stamp()} {line.rstrip()}")

    def _emit(self, line: Any) -> None:
        text = json.dumps(line, default=str) if isinstance(line, dict) else line
        with self._lock:
            self.file.write(text + "\n")
            self.file.flush()


console = DipacoConsole()


def say(text: str) -> None:
    """Print ``text`` as it is (never read as markup)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


class LineProgress:
    """What a rich ``Progress`` does, as lines: a line when a task completes, and at most one
    per task every ``every`` seconds while it runs (for plain and JSON output)."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.console = console
        self.tasks: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        tid = len(self.tasks)
        self.tasks[tid] = {
            "description": description,
            "total": total,
            "completed": 0,
            "fields": fields,
            "said": time.monotonic(),
            "done": False,
        }
        return tid

    def update(self, tid: int, *, advance: float = 0, completed: float | None = None,
               visible: bool = True, description: str | None = None, **fields: Any) -> None:  # fmt: skip
        t = self.tasks[tid]
        t["completed"] = completed if completed is not None else t["completed"] + advance
        t["fields"].update(fields)
        if description:
            t["description"] = description
        finished = t["total"] is not None and t["completed"] >= t["total"]
        now = time.monotonic()
        if (finished and not t["done"]) or now - t["said"] >= self.every:
            t["said"], t["done"] = now, finished
            info = " ".join(str(v) for v in t["fields"].values() if v)
            total = f"/{t['total']:g}" if t["total"] is not None else ""
            console.event(
                "progress",
                f"{t['description']}: {t['completed']:g}{total} {info}".rstrip(),
                task=t["description"],
                completed=t["completed"],
                total=t["total"],
            )


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is written (not the object
    it was when logging was set up: a caller may swap it, as test captures do)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class OneLineFormatter(logging.Formatter):
    """Every record's message on one line: a library's text with continuation lines (a
    hivemind daemon's ``  * [/ip4/...] dial backoff``) is joined onto its first."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return _BREAKS.sub(" ", super().formatMessage(record).strip())


_BREAKS = re.compile(r"\s*\n\s*")


def setup_logging(verbose: bool) -> None:
    """Log to stderr: warnings, and a link that is back (NOTICE); with ``verbose``, INFO too."""
    if console.lines:
        handler: logging.Handler = _StderrHandler()
        handler.setFormatter(
            OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
        )
    else:
        handler = RichHandler(console=Console(stderr=True), show_path=False, markup=False)
        handler.setFormatter(OneLineFormatter("%(message)s"))
    # The handler filters too: libraries (hivemind) that set their own loggers' levels would
    # otherwise print INFO lines through it.
    level = logging.INFO if verbose else NOTICE
    handler.setLevel(level)
    logging.basicConfig(level=level, handlers=[handler])


def choose_config(config: str | None, preset: str | None) -> RunConfig:
    if config:
        return load_config(Path(config))
    return preset_config(preset or "demo")


def run_command(fn: Callable[[], int | None]) -> int:
    """Run a command body; a DipacoError is a clear one-line message and exit code 2."""
    try:
        return fn() or 0
    except DipacoError as exc:
        if console.mode == "json":
            console.event("error", f"error ({exc.reason}): {one_line(exc)}", reason=exc.reason)
        else:
            console.print(Text.assemble(("error", "bold red"), f" ({exc.reason}): {one_line(exc)}"))
        return 2
    except KeyboardInterrupt:
        say("interrupted; the run folder keeps everything, run the same command to resume")
        return stopping.STOPPED


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (daemon errors come with indented continuation lines)."""
    return " ".join(str(exc).split())


def command_parser(prog: str, doc: str | None) -> tuple[argparse.ArgumentParser, Any]:
    """A command's parser with ``-v`` and required subcommands."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="auto",
        help="auto (default: rich on a terminal, plain otherwise; or $DIPACO_LOG_FORMAT), rich, "
        "plain (one timestamped line per message or event) or json (one object per line)",
    )
    return parser, parser.add_subparsers(dest="command", required=True)


def _take_option(argv: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` or ``name=VALUE`` from ``argv``; the last value given, or None."""
    value = None
    i = 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i : i + 2]
        elif argv[i].startswith(name + "="):
            value = argv[i].partition("=")[2]
            del argv[i]
        else:
            i += 1
    return value


def dump_stacks_on_usr1() -> None:
    """``kill -USR1 PID``: every thread's stack to standard error, and the process goes on.

    A Python-level handler, not ``faulthandler.register``: faulthandler's C handler walks the
    threads' frames at any instant, also while a thread is building one, and then crashes the
    process (a segfault, seen under a busy coordinator's threads). This one runs on the main
    thread between bytecodes, holding the GIL, when no thread is changing its frames; a main
    thread waiting on a lock, an event or a sleep is woken for it."""
    if not hasattr(signal, "SIGUSR1"):
        return

    def dump(signum: int, frame: object) -> None:
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # stderr is no file, or closed
            pass

    try:
        signal.signal(signal.SIGUSR1, dump)
    except ValueError:  # not the main thread (called in-process by a test)
        pass


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Parse, set up logging, run the chosen subcommand's ``fn`` and exit with its code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fmt = _take_option(argv, "--log-format")  # accepted after the subcommand too
    try:
        args = parser.parse_args(argv)  # --help prints, and may meet a closed pipe
    except BrokenPipeError:
        sys.exit(_reader_gone())
    if fmt is not None and fmt not in FORMATS:
        parser.error(f"--log-format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        console.configure(fmt or args.log_format)
    except ValueError as exc:  # DIPACO_LOG_FORMAT holds something else
        parser.error(f"DIPACO_LOG_FORMAT: {exc}")
    setup_logging(args.verbose)
    dump_stacks_on_usr1()
    stopping.install()  # SIGTERM as Ctrl-C; either one ends the process within seconds
    try:
        code = run_command(lambda: args.fn(args))
    except BrokenPipeError:
        code = _reader_gone()
    finally:
        if not stopping.requested():
            stopping.uninstall()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _reader_gone()
    stopping.finish(code)  # at once after a stop signal (leaving no child), else sys.exit


READER_GONE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose pipe closed


def _reader_gone() -> int:
    """The reader of our output went away (``| head``, ``less`` quit early): end quietly. Later
    writes, including the interpreter's last flush, go nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return READER_GONE
