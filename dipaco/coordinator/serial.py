"""Work that follows a round, in order, on a thread of its own.

A round closes under the coordinator's lock (rounds.after_change). What the run does with the new
versions that takes long, the per-round validation (forward passes over the validation set, and
with other owners their modules fetched over the network), runs here instead, so that no claim,
heartbeat or delta waits for it. The coordinator's ``finished_event`` is set through the same
queue (:meth:`Serial.then`), so whoever waits for the run's end sees the last round's validation
logged.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class Serial:
    """Runs the functions given to :meth:`submit` one at a time, in order, on a worker thread
    that lives while there is work. A function that fails is logged, and the next one runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[Callable[[], None]] = deque()
        self._running = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(fn)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def then(self, fn: Callable[[], None]) -> None:
        """``fn`` after everything submitted so far: at once (here) when nothing is queued."""
        with self._lock:
            if self._running:
                self._queue.append(fn)
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
                fn = self._queue.popleft()
            try:
                fn()
            except Exception:  # one round's work failing must not stop the next round's
                log.exception("%s: a round's work failed", self.name)
