"""Shared by the process tests: wait for something a child process does, with a clear failure;
the run config the session's prepared tiny run was made with; a process's helpers."""

import time
from pathlib import Path


def wait_for(predicate, timeout, what):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else an AssertionError
    naming ``what``: a text, or a callable that makes it then (a process's output by the time
    the wait ended, not when it began)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


def run_config(tmp_path: Path) -> Path:
    """The session's prepared tiny run's settings (two rounds of tasks long enough to be caught
    mid-way, short leases), as a config file a command can start from."""
    config = tmp_path / "run.toml"
    config.write_text(
        'preset = "tiny"\n[train]\ninner_steps = 30\nrounds = 2\n'
        "[scheduler]\nlease_seconds = 5.0\nheartbeat_seconds = 0.5\n"
    )
    return config


def helper_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the DHT process, p2pd, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child in Path("/proc").glob(f"{parent}/task/*/children"):
            try:
                kids = [int(k) for k in child.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is not: in a container nothing may reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
