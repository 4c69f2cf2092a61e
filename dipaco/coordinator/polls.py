"""The scheduler's long polls, a part that owns its state: the claims that wait for a path to open
(``ClaimTask.wait``, tasks.wait_for_work) and the TaskDones that wait for an owner's report
(rounds.await_reports), how many wait now and how many may, and who polled in vain lately (a
NoTask's ``retry_after``). Every field is created here and changed only by these methods, under
the coordinator's lock (the caller holds it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

LONG_POLL_SECONDS = 2.0  # the longest a claim waits for a path to open (ClaimTask.wait)
LOOK_AGAIN_SECONDS = 1.0  # a waiting claim looks for a path this often, woken or not
# Idle polls back off under load: a NoTask says to come back after RETRY_AFTER seconds, or after
# as many as keep the claims answered NoTask near POLLS_PER_SECOND in all (the pollers seen in
# the last POLL_WINDOW seconds, each counted once), never more than MAX_RETRY_AFTER.
RETRY_AFTER = 0.5
POLLS_PER_SECOND = 100.0
MAX_RETRY_AFTER = 30.0
POLL_WINDOW = 60.0


class LongPolls:
    """Waiting requests on the coordinator's ``lock``.

    ``slots``: how many may wait at once (a transport with few handler threads lowers it,
    ``limit``); claims take all but one, the last is kept for a TaskDone waiting for an
    owner's report, so that idle peers' claims never turn a finished task's TaskDone into a
    refusal and a retry seconds later. ``generation`` counts the changes that may open a path;
    ``work`` is the condition waiting claims sleep on, woken one at a time (``changed``): a
    change that opens nothing wakes one claim, not every waiting one."""

    def __init__(
        self,
        lock: threading.RLock,
        slots: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.work = threading.Condition(lock)
        self.clock = clock  # the coordinator's (a simulation's virtual one): who polled when
        self.waiting = 0
        self.slots = slots
        self.generation = 0
        # Who claimed in vain lately (a key, or a peer id without one) -> when.
        self.pollers: OrderedDict[str, float] = OrderedDict()

    def limit(self, slots: int) -> None:
        """At most ``slots`` requests wait at once (at least 2: a claim's and a TaskDone's)."""
        if slots < 2:
            raise ValueError(f"long polls need at least 2 slots, not {slots}")
        self.slots = slots

    @contextmanager
    def slot(self, keep: int = 0) -> Iterator[bool]:
        """Hold a waiting slot while the ``with`` block waits, if one is free with ``keep``
        left over (claims keep 1 for TaskDones); yields False, holding none, if not."""
        if self.waiting >= self.slots - keep:
            yield False
            return
        self.waiting += 1
        try:
            yield True
        finally:
            self.waiting -= 1

    def changed(self, everyone: bool = False) -> None:
        """Something happened that may open a path: wake one waiting claim (the one that
        leases a path wakes the next, ``wake_next``), or every one (the run ended)."""
        self.generation += 1
        if everyone:
            self.work.notify_all()
        else:
            self.work.notify()

    def wake_next(self) -> None:
        """A claim leased a path: another may be open, the next waiting claim looks."""
        self.work.notify()

    def wait_for_change(
        self, seconds: float, over: Callable[[], bool], look: Callable[[], T | None]
    ) -> T | None:
        """Wait up to ``seconds`` (LONG_POLL_SECONDS at most) for ``look()`` to find something
        after a change; every LOOK_AGAIN_SECONDS it looks again only if something changed.
        Stops early when ``over()``. Returns what ``look`` found, or None."""
        end = time.monotonic() + min(seconds, LONG_POLL_SECONDS)
        seen = self.generation
        while not over() and (left := end - time.monotonic()) > 0:
            self.work.wait(min(left, LOOK_AGAIN_SECONDS))
            if self.generation == seen:  # nothing changed: no path opened
                continue
            seen = self.generation
            found = look()
            if found is not None:
                self.wake_next()
                return found
        return None

    def retry_after(self, who: str) -> float:
        """When ``who`` (a key; one key with many peer ids polls as one) should claim again
        after a NoTask: RETRY_AFTER, or longer when so many poll that their claims would take
        more than POLLS_PER_SECOND. Each idle claim costs the scheduler a request's envelope
        and a look at the paths; with 1,000 idle peers every 0.5 s that was most of a core
        (docs/operations.md, capacity planning), and a round's paths are picked up within
        this delay of opening."""
        now = self.clock()
        self.pollers[who] = now
        self.pollers.move_to_end(who)
        while self.pollers and next(iter(self.pollers.values())) < now - POLL_WINDOW:
            self.pollers.popitem(last=False)
        return min(MAX_RETRY_AFTER, max(RETRY_AFTER, len(self.pollers) / POLLS_PER_SECOND))

    def served(self, who: str) -> None:
        """``who`` got a task: it no longer counts as an idle poller."""
        self.pollers.pop(who, None)
