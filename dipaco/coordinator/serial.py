"""Work that follows a round, in order, on a thread of its own.

A round closes under the coordinator's lock (rounds.after_change). What the run does with the new
versions that takes long, the per-round validation (forward passes over the validation set, and
with other owners their modules fetched over the network), runs here instead, so that no claim,
heartbeat or delta waits for it. The coordinator's ``finished_event`` is set through the same
queue (:meth:`Serial.then`), so whoever waits for the run's end sees the last round's validation
logged.

Each round's work holds that round's tensors. When it falls behind (the validation takes longer
than a round), at most ``max_waiting`` rounds wait: the oldest waiting one is skipped, and said,
so that a slow validation costs skipped rounds, never memory without end.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class Serial:
    """Runs the functions given to :meth:`submit` one at a time, in order, on a worker thread
    that lives while there is work. A function that fails is logged, and the next one runs.

    Work submitted with ``on_skip`` may be skipped: when more than ``max_waiting`` such pieces
    wait (not counting the one running), the oldest waiting one is dropped and its ``on_skip``
    called, on the submitter's thread."""

    def __init__(self, name: str, max_waiting: int | None = None) -> None:
        self.name = name
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # (work, what to call if it is skipped; None: never skipped)
        self._queue: deque[tuple[Callable[[], None], Callable[[], None] | None]] = deque()
        self._running = False

    def submit(self, fn: Callable[[], None], on_skip: Callable[[], None] | None = None) -> None:
        skipped: list[Callable[[], None]] = []
        with self._lock:
            self._queue.append((fn, on_skip))
            if on_skip is not None and self.max_waiting is not None:
                waiting = [(item, skip) for item in self._queue if (skip := item[1]) is not None]
                for item, skip in waiting[: max(0, len(waiting) - self.max_waiting)]:
                    self._queue.remove(item)
                    skipped.append(skip)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
        for skip in skipped:
            skip()

    def then(self, fn: Callable[[], None]) -> None:
        """``fn`` after everything submitted so far: at once (here) when nothing is queued."""
        with self._lock:
            if self._running:
                self._queue.append((fn, None))
                return
        fn()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and nothing runs; False if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._running, timeout)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    self._idle.notify_all()
                    return
                fn, _ = self._queue.popleft()
            try:
                fn()
            except Exception:  # one round's work failing must not stop the next round's
                log.exception("%s: a round's work failed", self.name)
