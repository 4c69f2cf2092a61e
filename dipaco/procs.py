"""The process tree, read from /proc (Linux; empty elsewhere).

Used to find what a process started: the ``p2pd`` daemon a hivemind DHT process must kill when
its parent dies, and the SuperExec that Flower starts in a session of its own.
"""

from __future__ import annotations

import os


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
