"""``dipaco status ADDRESS``: a run's state in the terminal, live with ``--watch``, or JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dipaco.cli.common import console
from dipaco.errors import TransportError


def status_url(address: str, token: str | None) -> str:
    """``host:port``, ``http://host:port/`` or the dashboard URL the coordinator printed."""
    if "://" not in address:
        address = "http://" + address
    parts = urlsplit(address)
    if not parts.hostname:
        raise TransportError(f"{address!r} is not a dashboard address (host:port)")
    query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
    if token:
        query["token"] = token
    suffix = ("?" + urlencode(query)) if query else ""
    return f"{parts.scheme}://{parts.netloc}/api/status{suffix}"


def saved_status(run_dir: Path) -> dict:
    """The last state a run's dashboard saved when its coordinator stopped."""
    file = run_dir / "dashboard" / "status.json"
    if not file.exists():
        raise TransportError(
            f"{run_dir} has no saved dashboard state ({file}): it is written when a coordinator "
            "started with --dashboard stops; for a live run give the dashboard's address"
        )
    try:
        state = json.loads(file.read_text())
    except ValueError as exc:
        raise TransportError(f"{file}: not readable: {exc}") from None
    state["saved_at"] = file.stat().st_mtime  # not live: render() says so
    return state


def fetch_status(address: str, token: str | None = None, timeout: float = 10.0) -> dict:
    if Path(address).is_dir():
        return saved_status(Path(address))
    url = status_url(address, token)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise TransportError(
                "the dashboard wants its token: --token, or the URL the coordinator printed "
                "(the token is also in RUN_DIR/coordinator/dashboard.token)"
            ) from None
        raise TransportError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TransportError(
            f"cannot reach the dashboard at {address}: {reason}. Start the coordinator with "
            "--dashboard HOST:PORT and give that address"
        ) from None


def render(s: dict) -> Group:
    state = "[green]finished[/]" if s["finished"] else "training"
    head = Table.grid(padding=(0, 3))
    head.add_row(
        f"run [bold]{s['run_id']}[/]",
        f"round [bold]{s['round']}/{s['rounds']}[/]",
        state,
        peer_count(s),
        f"tasks out {len(s['leases'])}",
    )
    if s.get("saved_at") is not None and not s["finished"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["saved_at"]))
        head.add_row(Text(f"saved when its coordinator stopped, {when}; not running now", "dim"))
    if s.get("stale_seconds"):
        head.add_row(
            Text(
                f"the coordinator is busy: its state as of {s['stale_seconds']:.0f} s ago",
                style="dim",
            )
        )
    routed = s["series"]["routed_ppl"]
    if routed:
        head.add_row(f"routed validation ppl {routed[-1]['ppl']:.2f} (round {routed[-1]['round']})")
    elif s.get("evaluation"):
        head.add_row(Text(s["evaluation"], style="dim"))
    grid = Table(
        title="modules (version; -N: N versions behind the newest module; deltas pending/paths)",
        title_justify="left",
    )
    width = max((len(r["modules"]) for r in s["grid"]), default=0)
    grid.add_column("row")
    for i in range(width):
        grid.add_column(f"M{i}")
    for row in s["grid"]:
        cells = [
            f"{m['id']} v{m['version']}"
            + (f" [yellow]-{m['behind']}[/]" if m["behind"] else "")
            + (f" ({m['pending']}/{m['paths']})" if m["pending"] else "")
            for m in row["modules"]
        ]
        grid.add_row(row["name"], *cells)
    peers = Table(title="peers", title_justify="left")
    columns = (
        "peer",
        "state",
        "device",
        "task",
        "path",
        "tok/s",
        "tasks",
        "MB in",
        "MB out",
        "seen",
    )
    for col in columns:
        right = col in ("tok/s", "tasks", "MB in", "MB out", "seen")
        peers.add_column(col, justify="right" if right else "left", no_wrap=True)
    machines = s.get("machines", {})
    for pid, name, p in peer_lines(s["peers"], machines):
        if p is None:  # a multi-device peer: one line for the machine, then its workers
            mach = machines[name]
            rate = sum(s["peers"][w].get("tokens_per_s", 0) for w in mach["workers"])
            n = mach.get("devices_per_path") or len(mach["workers"])
            how = ", one path over DDP" if mach.get("shard_path") else ""
            peers.add_row(
                f"{name} ({n} worker{'s' * (n != 1)}{how})", mach["state"],
                ", ".join(mach["devices"]), "", "", f"{rate:.0f}", str(mach["tasks_done"]),
                "", "", "",
            )  # fmt: skip
            continue
        peers.add_row(
            f"  └ w{p['worker']} ({pid})" if "machine" in p else pid,
            str(p.get("state", "")),
            str(p.get("device", "")),
            str(p.get("task") or ""),
            "" if p.get("current_path") is None else f"P{p['current_path']}",
            f"{p.get('tokens_per_s', 0):.0f}",
            str(p.get("tasks_done", 0)),
            f"{p.get('bytes_in', 0) / 1e6:.2f}",
            f"{p.get('bytes_out', 0) / 1e6:.2f}",
            f"{p.get('seen_ago', 0):.1f} s",
        )
    owners = Table(title="module owners", title_justify="left")
    for col in ("owner", "role", "modules", "address", "seen"):
        owners.add_column(col, no_wrap=col != "modules")
    for oid, o in sorted(s.get("owners", {}).items()):
        seen = o.get("seen_ago")
        owners.add_row(
            oid,
            "scheduler" if o.get("scheduler") else "owner",
            ", ".join(o.get("modules", [])),
            (o.get("addresses") or [""])[0],
            "" if seen is None else f"{seen:.1f} s",
        )
    parts = [head, grid, peers, owners]
    if s["rejections"]:
        rej = Table(title="rejections", title_justify="left")
        rej.add_column("reason")
        rej.add_column("count", justify="right")
        for reason, n in sorted(s["rejections"].items()):
            rej.add_row(reason, str(n))
        parts.append(rej)
    return Group(*parts)


def peer_count(s: dict) -> str:
    """The header's peers: a machine of several workers (``--gpus``) counts once. Live only
    while the coordinator runs; a finished or saved run says how many took part."""
    machines = s.get("machines", {})
    order = {"training": 0, "idle": 1, "gone": 2}
    units: dict[str, str] = {}
    workers = 0
    for pid, p in s["peers"].items():
        unit = p.get("machine") if p.get("machine") in machines else pid
        workers += unit != pid
        state = p.get("state", "gone")
        if unit not in units or order.get(state, 2) < order.get(units[unit], 2):
            units[unit] = state
    n_machines = len({u for u in units if u in machines})
    on = f" ({workers} workers on {n_machines} machine{'s' * (n_machines != 1)})" if workers else ""
    if s["finished"] or s.get("saved_at") is not None:
        return f"peers {len(units)} took part{on}"
    live = sum(state != "gone" for state in units.values())
    gone = len(units) - live
    return f"peers {live} live" + (f", {gone} gone" if gone else "") + on


def peer_lines(peers: dict[str, dict], machines: dict[str, dict]):
    """(peer id, machine, row) in the order the peers table shows them: single peers by id; a
    machine (row None) where its first worker would sort, followed by its workers by index."""
    out, shown = [], set()
    for pid, p in sorted(peers.items()):
        name = p.get("machine")
        if name not in machines:
            out.append((pid, None, p))
        elif name not in shown:
            shown.add(name)
            out.append((name, name, None))
            out += [(w, name, peers[w]) for w in machines[name]["workers"] if w in peers]
    return out


def cmd_status(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(fetch_status(args.address, args.token), indent=2, sort_keys=True))
        return 0
    if not args.watch:
        console.print(render(fetch_status(args.address, args.token)))
        return 0
    # On a terminal one live picture; to a file the whole state every interval, as lines.
    live = None if console.lines else Live(console=console, refresh_per_second=4)
    with live if live is not None else contextlib.nullcontext():
        while True:
            s = fetch_status(args.address, args.token)
            if live is not None:
                live.update(render(s))
            else:
                console.print(render(s))
            if s["finished"]:
                return 0
            time.sleep(args.interval)


def add_status_command(sub) -> None:
    st = sub.add_parser(
        "status", help="a run's state from its coordinator's dashboard address (host:port)"
    )
    st.add_argument(
        "address",
        help="the dashboard address the coordinator printed, or a run folder (its last saved "
        "state)",
    )
    st.add_argument("--token", help="the dashboard token (when it listens beyond loopback)")
    st.add_argument("--json", action="store_true", help="print the whole snapshot as JSON")
    st.add_argument("--watch", action="store_true", help="refresh until the run finishes")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    st.set_defaults(fn=cmd_status)
