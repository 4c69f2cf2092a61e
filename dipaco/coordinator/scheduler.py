"""The task scheduler: one task per path per round, leased to one peer at a time.

A path is open for round r when every module of the path is at version r, r is below the run's
round count, and the path has not yet reported for r. A lease has a deadline; heartbeats extend
it, and an expired lease re-opens the path so that another peer can take the task (DiPaCo
section 3: the queue returns a failed worker's task). Peers keep affinity to the path they
trained last, because their inner optimizer state for it is local.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    task_id: str
    path: int
    round: int
    peer_id: str
    deadline: float


class Scheduler:
    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.leases: dict[str, Lease] = {}  # task id -> live lease
        self.issued: dict[str, Lease] = {}  # every task id handed out, for late submissions
        self.attempts: dict[tuple[int, int], int] = {}
        self.expired = 0
        self.epoch = 0  # bumped on every coordinator restart, so task ids are never reused

    def expire(self) -> list[Lease]:
        now = self.clock()
        gone = [lease for lease in self.leases.values() if lease.deadline < now]
        for lease in gone:
            del self.leases[lease.task_id]
            self.expired += 1
        return gone

    def leased_paths(self) -> set[int]:
        return {lease.path for lease in self.leases.values()}

    def claim(self, peer_id: str, open_paths: dict[int, int], prefer: int | None) -> Lease | None:
        """Lease one open path (path -> round) to ``peer_id``; None if all are taken."""
        free = sorted(set(open_paths) - self.leased_paths())
        if not free:
            return None
        path = prefer if prefer in free else free[0]
        rnd = open_paths[path]
        attempt = self.attempts.get((path, rnd), 0)
        self.attempts[(path, rnd)] = attempt + 1
        lease = Lease(
            f"P{path}-r{rnd}-e{self.epoch}-a{attempt}",
            path,
            rnd,
            peer_id,
            self.clock() + self.lease_seconds,
        )
        self.leases[lease.task_id] = lease
        self.issued[lease.task_id] = lease
        return lease

    def heartbeat(self, task_id: str, peer_id: str) -> Lease | None:
        lease = self.leases.get(task_id)
        if lease is None or lease.peer_id != peer_id:
            return None
        lease.deadline = self.clock() + self.lease_seconds
        return lease

    def finish(self, task_id: str) -> None:
        self.leases.pop(task_id, None)

    def release(self, task_id: str, peer_id: str) -> bool:
        lease = self.leases.get(task_id)
        if lease is None or lease.peer_id != peer_id:
            return False
        del self.leases[task_id]
        return True

    def leases_of(self, peer_id: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.peer_id == peer_id]
