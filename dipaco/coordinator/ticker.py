"""The coordinator's clock: a thread that calls ``Coordinator.tick()`` every second, so that
leases expire and overdue rounds close on time even when no request arrives."""

from __future__ import annotations

import threading

from dipaco.coordinator.core import Coordinator


class Ticker(threading.Thread):
    """Calls ``coordinator.tick()`` every ``interval`` seconds until ``stop`` is set."""

    def __init__(self, coordinator: Coordinator, interval: float = 1.0) -> None:
        super().__init__(name="dipaco-tick", daemon=True)
        self.coordinator, self.interval, self.stop = coordinator, interval, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.coordinator.tick()
