"""``dipaco-coordinator start --transport flower``: a SuperLink and the run as a Flower app, and
what the operator sees of it.

The coordinator runs inside Flower's ServerApp process, so this command follows two files: the
run's ``metrics.jsonl``, whose events it prints as the hivemind and loopback coordinators print
theirs (a task issued, a delta, an outer step, a round, the routed validation perplexity), and
``flower/run.log`` (``flwr run``'s stream), from which it prints dipaco's Flower lines (nodes,
Flower rounds) and every warning or error, each once, with this command's time stamp alone.
Flower's own progress lines (``INFO :      Starting logstream ...``) appear only under ``-v``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from dipaco.cli.common import console, say
from dipaco.cli.events import print_event
from dipaco.errors import DipacoError
from dipaco.protocols.auth import Identity

# A ServerApp log line (dipaco.flower.apps' format): time, level, logger, message.
_APP_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)? (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"([\w.-]+): (.*)$"
)
# Flower's own: "INFO :      Starting logstream ...", "WARNING :   ...".
_FLOWER_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s+(.*)$")
_SHOWN_INFO = ("dipaco.flower",)  # dipaco INFO lines the operator sees without -v


def operator_line(line: str, verbose: bool) -> str | None:
    """What the operator sees of one line of flower/run.log (None: nothing, unless -v)."""
    line = line.strip()
    if not line:
        return None
    m = _APP_LINE.match(line)
    if m:
        level, name, text = m.groups()
        if level in ("WARNING", "ERROR", "CRITICAL"):
            return f"{level} {name}: {text}"
        if level == "INFO" and name.startswith(_SHOWN_INFO):
            return text
        return f"{level} {name}: {text}" if verbose else None
    m = _FLOWER_LEVEL.match(line)
    if m:
        level, text = m.groups()
        if level in ("WARNING", "ERROR", "CRITICAL"):
            return f"{level} flower: {' '.join(text.split())}"
        return f"flower: {' '.join(text.split())}" if verbose else None
    return f"flower: {line}" if verbose else None  # "Using SuperLink ...", "Successfully ..."


class Follower:
    """Reads what the ServerApp appended to a file since the last call, whole lines only."""

    def __init__(self, path: Path, from_end: bool = False, offset: int = 0) -> None:
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else offset

    def lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        from dipaco.flower.deploy import strip_ansi

        return strip_ansi(chunk[:end].decode(errors="replace")).splitlines()


def follow(
    proc, log_file: Path, metrics_file: Path, verbose: bool, on_tick=None, log_from: int = 0
) -> int:
    """Print the run's events and the operator's lines of ``log_file`` from byte ``log_from``
    until ``proc`` exits; its exit code. Events already in ``metrics_file`` and lines before
    ``log_from`` (an earlier start's: both files are appended to) are not repeated."""
    log, events = Follower(log_file, offset=log_from), Follower(metrics_file, from_end=True)
    while True:
        code = proc.poll()
        if on_tick is not None:
            on_tick()
        for line in log.lines():
            shown = operator_line(line, verbose)
            if shown is not None:
                say(shown)
        for line in events.lines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: the dashboard counts those
            if isinstance(event, dict):
                print_event(event)
        if code is not None:
            return code
        time.sleep(0.5)


def serve_flower(args, prep) -> int:
    """A SuperLink (TLS, node authentication) and the run as a Flower app until it finishes."""
    from dipaco.flower.launch import FlowerDeployment

    run_dir = Path(args.run_dir)
    me = Identity.load_or_create(run_dir / "coordinator" / "signing.key")
    with FlowerDeployment(run_dir, listen=args.listen, names=args.tls_name) as flower:
        flower.up()
        address = flower.public_address
        console.print(
            f"coordinator for run {prep.run_id} (Flower) at [bold]{address}[/] (TLS, node auth)"
        )
        console.print(
            f"nodes join with: dipaco-peer join --flower {address} --root-certificates "
            f"{flower.tls.ca} --coordinator-key {me.public_key}",
            soft_wrap=True,
        )
        console.print(
            f"and are admitted with: dipaco-coordinator add-peer NODE_KEY --run-dir {run_dir}",
            soft_wrap=True,
        )
        (run_dir / "coordinator" / "address").write_text(address + "\n")
        if args.local_peers:
            flower.start_local_nodes(args.local_peers)
        run_log = flower.dir / "run.log"
        earlier = run_log.stat().st_size if run_log.exists() else 0  # an earlier start's lines
        runner = flower.submit(
            evaluate=not args.no_eval,
            dashboard=args.dashboard or "",
            dashboard_token=args.dashboard_token or "",
        )
        url_file = run_dir / "coordinator" / "dashboard"
        shown: list[str] = []

        def show_dashboard() -> None:  # the ServerApp starts it once the core is up
            if args.dashboard and not shown and url_file.exists():
                shown.append(url_file.read_text().strip())
                say(f"dashboard at {shown[0]}")

        code = follow(
            runner, run_log, run_dir / "metrics.jsonl", args.verbose, show_dashboard, earlier
        )
        result = flower.result()
        if not result or not result.get("finished"):
            raise DipacoError(
                f"the Flower run ended (flwr run exit {code}) before the run finished; "
                f"see {flower.dir / 'run.log'} and {flower.dir / 'superlink.log'}, then run "
                "the same command to resume"
            )
        say(f"run finished: every module at version {result['round']}")
        if args.dashboard and (run_dir / "dashboard" / "index.html").exists():
            say(
                f"the dashboard's last state: {run_dir / 'dashboard' / 'index.html'} "
                f"(or: dipaco status {run_dir})"
            )
    return 0
