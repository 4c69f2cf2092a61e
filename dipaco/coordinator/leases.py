"""The live leases of a scheduler, indexed so that no request scans them all.

Every request runs the ticker's bookkeeping (expiry, overdue tasks) and a claim asks who holds
what. :class:`LiveLeases` keeps the leases in the order issued (``issued_at`` ascending: the
overdue ones come first, so a walk for them stops at the first young one), indexed by peer, by
(path, round) and by path, with their deadlines in a heap: a request costs the same with ten
thousand leases as with ten. A unit test holds every answer to a scan of all the leases.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, KeysView
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lease:
    task_id: str
    path: int
    round: int
    peer_id: str
    deadline: float
    steps: int = 0
    issued_at: float = 0.0
    module_versions: dict[str, int] = field(default_factory=dict)
    hedge_of: str = ""  # the straggler's task this one copies (scheduler.hedge)
    # (when, step) of the last heartbeat that reported a step: the task's pace so far, for a
    # peer whose pace over whole tasks is not known yet (scheduler.hedge)
    progress: tuple[float, int] | None = None
    # Called with the task id when a field coordinator.json remembers the task by is set (the
    # scheduler's kept texts, statetext.MarkedTexts). ``module_versions`` is replaced, never
    # changed in place: an in-place change would not be seen.
    on_change: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _REMEMBERED and self.on_change is not None:
            self.on_change(self.task_id)


_REMEMBERED = frozenset({"path", "round", "peer_id", "steps", "module_versions"})


class LiveLeases:
    """Task id -> live lease (``by_id``, oldest first) and its indexes. Change it only
    through :meth:`add`, :meth:`drop` and :meth:`renew`."""

    def __init__(self) -> None:
        self.by_id: dict[str, Lease] = {}
        self._by_peer: dict[str, dict[str, Lease]] = {}
        self._by_task: dict[tuple[int, int], dict[str, Lease]] = {}  # (path, round) -> leases
        self._by_path: Counter[int] = Counter()  # path -> live leases of it
        # (deadline, task id): an entry per live lease whose deadline it holds or precedes; a
        # deadline moved later is found when its old entry comes up (expired), pushed again.
        self._expiry: list[tuple[float, str]] = []

    def add(self, lease: Lease) -> None:
        if lease.task_id in self.by_id:  # its indexes would hold both: a path leased for ever
            raise ValueError(f"task {lease.task_id} is live already (a task id is never reused)")
        if self.by_id and next(reversed(self.by_id.values())).issued_at > lease.issued_at:
            self._add_in_order(lease)  # older than the newest (a restore, a clock set back)
            return
        self._index(lease)
        heapq.heappush(self._expiry, (lease.deadline, lease.task_id))

    def _index(self, lease: Lease) -> None:
        self.by_id[lease.task_id] = lease
        self._by_peer.setdefault(lease.peer_id, {})[lease.task_id] = lease
        self._by_task.setdefault((lease.path, lease.round), {})[lease.task_id] = lease
        self._by_path[lease.path] += 1

    def _add_in_order(self, lease: Lease) -> None:
        """Add ``lease`` and put every lease back in issue order (rare: see add)."""
        leases = sorted([*self.by_id.values(), lease], key=lambda x: x.issued_at)
        self.by_id, self._by_peer, self._by_task, self._by_path = {}, {}, {}, Counter()
        for x in leases:
            self._index(x)
        self._expiry = [(x.deadline, x.task_id) for x in leases]
        heapq.heapify(self._expiry)

    def renew(self, lease: Lease, deadline: float) -> None:
        """Move ``lease``'s deadline. A later one is found when its heap entry comes up; an
        earlier one (the clock was set back) needs an entry of its own."""
        if deadline < lease.deadline:
            heapq.heappush(self._expiry, (deadline, lease.task_id))
        lease.deadline = deadline

    def drop(self, task_id: str) -> Lease | None:
        lease = self.by_id.pop(task_id, None)
        if lease is None:
            return None
        mine = self._by_peer[lease.peer_id]
        del mine[task_id]
        if not mine:
            del self._by_peer[lease.peer_id]
        same = self._by_task[(lease.path, lease.round)]
        del same[task_id]
        if not same:
            del self._by_task[(lease.path, lease.round)]
        self._by_path[lease.path] -= 1
        if not self._by_path[lease.path]:
            del self._by_path[lease.path]
        return lease  # its heap entry goes stale: expired() skips it

    def expired(self, now: float) -> list[Lease]:
        """Drop the leases whose deadline is before ``now``; those dropped. O(log n) per lease
        dropped or extended since, not a scan of every lease."""
        heap, gone = self._expiry, []
        while heap and heap[0][0] < now:
            _, task_id = heapq.heappop(heap)
            lease = self.by_id.get(task_id)
            if lease is None:
                continue  # finished or released since: a stale entry
            if lease.deadline >= now:  # extended since (a heartbeat): its entry moves on
                heapq.heappush(heap, (lease.deadline, task_id))
                continue
            self.drop(task_id)
            gone.append(lease)
        if len(heap) > 2 * len(self.by_id) + 64:  # many stale entries: rebuild
            self._expiry = [(x.deadline, t) for t, x in self.by_id.items()]
            heapq.heapify(self._expiry)
        return gone

    def of_peer(self, peer_id: str) -> list[Lease]:
        return list(self._by_peer.get(peer_id, {}).values())

    def of_task(self, path: int, rnd: int) -> list[Lease]:
        return list(self._by_task.get((path, rnd), {}).values())

    def held_tasks(self) -> KeysView[tuple[int, int]]:
        """The (path, round) pairs with a live lease: a view."""
        return self._by_task.keys()

    def paths(self) -> KeysView[int]:
        """The paths with a live lease: a view, not a copy (test membership against it)."""
        return self._by_path.keys()


class Reissues:
    """When each path-round's first task was issued, and which were issued again: a path's
    round is as late as its first task, not its newest. A task refused for what its delta holds
    (``huge-norm``, ``worse-heldout``) is handed back and issued again, and trains the same
    delta from the same base: judged by each new lease's age the path never became overdue, so
    its modules waited for it for ever (met by bench/schedules.py, issue 52). Kept in memory
    only: after a restart a path's round is timed from its first task since."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, int], float] = {}  # (path, round) -> its first issue
        self.again: set[tuple[int, int]] = set()  # issued more than once

    def issued(self, path: int, rnd: int, attempt: int, now: float) -> None:
        self.first.setdefault((path, rnd), now)
        if attempt > 0:
            self.again.add((path, rnd))

    def late(self, now: float, deadline: float, live: LiveLeases) -> set[tuple[int, int]]:
        """The path-rounds issued again, held now, whose first task began over ``deadline``
        seconds ago."""
        first = self.first
        return {pr for pr in self.again if now - first[pr] > deadline and live.of_task(*pr)}

    def forget_before(self, first_round: int) -> None:
        self.first = {pr: t for pr, t in self.first.items() if pr[1] >= first_round}
        self.again = {pr for pr in self.again if pr[1] >= first_round}
