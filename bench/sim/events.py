"""The discrete-event loop and the queues the simulated resources are made of.

:class:`Loop` holds a heap of ``(time, seq, callback, args)``; ``now`` is the virtual time,
which the real coordinators read as their clock. :class:`Cpu` is a single server with a FIFO
queue whose jobs run real code when they start (their cost is known only then). :class:`Pipe`
is one direction of a link as a fluid FIFO: a transfer of ``b`` bytes holds it ``b / rate``
seconds, in arrival order, so its utilization is the bytes it carried over its capacity.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.events = 0

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (never before now)."""
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float = float("inf"), stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order (ties in the order scheduled) until none is left, the next
        is past ``until``, or ``stop()`` is true after an event."""
        while self._heap and not stop():
            when = self._heap[0][0]
            if when > until:
                break
            _, _, fn, args = heapq.heappop(self._heap)
            self.now = when
            self.events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)


class Busy:
    """Busy-time accounting of a resource, in total and since a mark."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = 0.0
        self.jobs = 0

    def utilization(self, elapsed: float) -> float:
        return self.busy / elapsed if elapsed > 0 else 0.0


class Cpu(Busy):
    """``cores`` cores serving jobs in arrival order (one by default). A job is ``work() ->
    (cost, done)``: it runs when a core takes it up (at that virtual time), returns its cost in
    seconds, and ``done`` is called when the cost has elapsed. Utilization is per core."""

    def __init__(self, loop: Loop, name: str, cores: int = 1) -> None:
        super().__init__(name)
        self.loop = loop
        self.cores = cores
        self.queue: deque[Callable[[], tuple[float, Callable[[], None]]]] = deque()
        self.active = 0  # cores serving a job
        self.max_queue = 0

    def utilization(self, elapsed: float) -> float:
        return self.busy / (elapsed * self.cores) if elapsed > 0 else 0.0

    def submit(self, work: Callable[[], tuple[float, Callable[[], None]]]) -> None:
        self.queue.append(work)
        self.max_queue = max(self.max_queue, len(self.queue))
        if self.active < self.cores:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            return
        self.active += 1
        work = self.queue.popleft()
        cost, done = work()
        cost = max(0.0, cost)
        self.busy += cost
        self.jobs += 1
        self.loop.after(cost, self._finish, done)

    def _finish(self, done: Callable[[], None]) -> None:
        done()  # what it submits queues behind the jobs waiting (this core is still taken)
        self.active -= 1
        self._next()


class Pipe(Busy):
    """One direction of a link (bytes per second) as a fluid FIFO."""

    def __init__(self, loop: Loop, name: str, rate: float) -> None:
        super().__init__(name)
        self.loop, self.rate = loop, rate
        self.free_at = 0.0
        self.bytes = 0.0

    def reserve(self, nbytes: float) -> float:
        """Queue a transfer of ``nbytes``; returns when its last byte has gone through."""
        hold = nbytes / self.rate
        start = max(self.loop.now, self.free_at)
        self.free_at = start + hold
        self.busy += hold
        self.bytes += nbytes
        self.jobs += 1
        return self.free_at


def transfer(loop: Loop, nbytes: float, pipes: list[Pipe], latency: float) -> float:
    """When ``nbytes`` sent now through every pipe of ``pipes`` (the sender's uplink, the
    receiver's downlink, ...) have arrived: the slowest pipe's finish plus the latency."""
    return max(pipe.reserve(nbytes) for pipe in pipes) + latency
