"""The process tree, read from /proc (Linux; empty elsewhere).

Used to find what a process started: the ``p2pd`` daemon a hivemind DHT process must kill when
its parent dies, and the SuperExec that Flower starts in a session of its own; and kills what is
left when a command stops (:func:`kill_descendants`). And a free port for a started process to
listen on (:func:`free_port`).
"""

from __future__ import annotations

import os
import signal
import socket

# The exit code of a command that Ctrl-C or SIGTERM stopped in order before its work was done
# (dipaco/cli/stopping.py states the rule every command follows).
STOPPED = 130


def children_map() -> dict[int, list[int]]:
    """ppid -> pids of every live process, read from /proc ({} where there is no /proc)."""
    kids: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name in (...) may hold spaces and ')': the fields after the last ')' are
        # state, ppid, ...
        try:
            ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        except (IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    return children_map().get(pid, [])


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid``: children, their children, and so on."""
    kids = children_map()
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def kill_descendants(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to every descendant of ``pid``, and to the process group of each that runs
    in a group of its own (Flower's programs start new sessions); ``pid``'s own group is left
    alone. Returns the descendants found. The tree is read before anything is signalled: a
    killed parent's children are re-parented and could no longer be found."""
    kids = descendants(pid)
    try:
        own = os.getpgid(pid)
    except OSError:
        own = -1
    groups = set()
    for kid in kids:
        try:
            group = os.getpgid(kid)
        except OSError:
            continue
        if group not in (own, 0):
            groups.add(group)
    for group in groups:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    for kid in kids:
        try:
            os.kill(kid, sig)
        except OSError:
            pass
    return kids


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
