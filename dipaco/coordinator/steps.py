"""The module steps in flight, a part of the coordinator that owns them (``core.steps``): which
modules are being stepped (their new deltas wait), which failed to step (a full disk: the ticker
tries again), and the reservations that keep two deltas of one path from racing between their
checks and their commit. Its condition is woken on every change a waiting delta or TaskDone may
be waiting for. Changed only by these methods, under the coordinator's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

Slot = tuple[str, int, int]  # (module, base version, path)


class ModuleSteps:
    def __init__(self, lock: threading.RLock) -> None:
        self.cond = threading.Condition(lock)
        self.stepping: set[str] = set()
        self.failed: set[str] = set()  # modules whose outer step failed (disk): retried
        self.reserved: dict[Slot, str] = {}  # (module, base, path) -> the task admitting it

    def begin(self, mid: str) -> None:
        self.stepping.add(mid)

    def end(self, mid: str) -> None:
        self.stepping.discard(mid)

    def any_stepping(self, mids: Iterable[str]) -> bool:
        return any(mid in self.stepping for mid in mids)

    def fail(self, mid: str) -> bool:
        """``mid``'s step failed; True the first time (the caller logs it once)."""
        first = mid not in self.failed
        self.failed.add(mid)
        return first

    def stepped(self, mid: str) -> None:
        self.failed.discard(mid)

    def holders(self, slots: Iterable[Slot]) -> dict[Slot, str]:
        """The tasks admitting a delta into any of ``slots`` now."""
        return {s: self.reserved[s] for s in slots if s in self.reserved}

    def reserve(self, slots: Iterable[Slot], task_id: str) -> None:
        for s in slots:
            self.reserved[s] = task_id

    def release(self, slots: Iterable[Slot]) -> None:
        """The admission of those slots ended (committed or not): wake whoever waits."""
        for s in slots:
            self.reserved.pop(s, None)
        self.cond.notify_all()

    def wait(self, timeout: float) -> None:
        self.cond.wait(timeout)

    def wake(self) -> None:
        self.cond.notify_all()
