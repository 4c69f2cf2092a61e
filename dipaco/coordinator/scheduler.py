"""The task scheduler: one task per path per round, leased to one peer at a time.

A path is open for round r when every module of the path is at version r, r is below the run's
round count, and the path has not yet reported for r. A lease has a deadline; heartbeats extend
it, and an expired lease re-opens the path so that another peer can take the task (DiPaCo
section 3: the queue returns a failed worker's task). Peers keep affinity to the paths they
trained the round before, because their inner optimizer state for a path is local: a path
leased to another peer trains with that peer's older state of it, or none (``pick_path``).

Deadlines come from what the run has observed, not from a guessed constant: ``robust_deadline``
is the median of the observed durations plus max(k * MAD, slack * median). Task durations
(lease to done) give the task deadline; a peer whose measured speed cannot finish H steps in it
is offered the steps it trains in the median task's time (never below ``min_step_fraction`` of
H), so a slow peer's task ends with the others', and its delta weighs the tokens it trained. A
peer that stops heartbeating for ``lease_seconds`` has vanished.

Every request runs the ticker's bookkeeping (expiry, overdue tasks) and a claim asks who holds
what, so none of these scans the live leases: ``leases.LiveLeases`` keeps them indexed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, KeysView, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dipaco.coordinator.leases import Lease, LiveLeases, Reissues
from dipaco.coordinator.statetext import SchedulerTexts


def robust_deadline(
    samples: Sequence[float], mads: float, slack: float, min_observations: int
) -> float | None:
    """median + max(mads * MAD, slack * median) of ``samples``; None with too few of them."""
    if len(samples) < min_observations:
        return None
    median = statistics.median(samples)
    mad = statistics.median(abs(x - median) for x in samples)
    return median + max(mads * mad, slack * median)


@dataclass(frozen=True)
class DeadlinePolicy:
    """When a task is overdue and how few steps a slow peer may be offered (config ``scheduler``)."""

    mads: float = 4.0  # deadline: median + max(mads * MAD, slack * median) of task durations
    slack: float = 0.5
    floor: float = 10.0  # never a deadline shorter than this (seconds)
    min_observations: int = 4  # task durations needed before deadlines apply
    min_step_fraction: float = 0.25  # a slow peer gets at least this fraction of H steps


def copy_ends_first(
    lease: Lease,
    theirs: Collection[float] | None,
    mine: Collection[float] | None,
    durations: Collection[float],
    now: float,
) -> bool:
    """Whether a copy of ``lease`` (hedging) is expected to end before the lease does: a slow
    peer that was offered fewer steps ends on time, and copying it would only waste its work.
    The lease's end: by its peer's pace over its last whole tasks (``theirs``, seconds per
    step), else by its progress so far (the steps its heartbeats report), else unknown (it ran
    longer than the typical task: copy). The copy's length: by the copying peer's pace
    (``mine``), else the typical task's (the median of ``durations``)."""
    steps = max(1, lease.steps)
    if theirs:
        ends = lease.issued_at + steps * statistics.median(theirs)
    elif lease.progress is not None:
        when, step = lease.progress
        ends = when + (steps - step) * (when - lease.issued_at) / step
    else:
        return True
    takes = steps * statistics.median(mine) if mine else statistics.median(durations)
    return now + takes < ends


def pick_path(peer_id: str, free: list[int], prefer: int | None, last: Mapping[int, str]) -> int:
    """Of the ``free`` paths (sorted), the one to lease: one that ``peer_id`` trained the
    round before (``last``: path -> its trainer then), its ``prefer``red one first; else
    ``prefer``; else one that nobody trained the round before; else the lowest. A path
    another peer trained last stays for that peer while anything else is free, so that
    every path trains with its newest inner optimizer state wherever the schedule allows."""
    mine = [p for p in free if last.get(p) == peer_id]
    if mine:
        return prefer if prefer in mine else mine[0]
    if prefer in free:
        return prefer
    nobody = [p for p in free if p not in last]
    return (nobody or free)[0]


class Scheduler:
    def __init__(
        self,
        lease_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        policy: DeadlinePolicy | None = None,
    ) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.policy = policy or DeadlinePolicy()
        self.live = LiveLeases()  # the live leases, indexed (leases.py)
        self._deadline: tuple[int, float | None] | None = None  # (durations seen, task_deadline)
        self._finished = 0  # tasks finished (durations appended), for the cache above
        self.issued: dict[str, Lease] = {}  # every task id handed out, for late submissions
        self.texts = SchedulerTexts()  # snapshot_text's kept entries (statetext.py)
        self.attempts: dict[tuple[int, int], int] = {}
        self.reissues = Reissues()  # when each path-round was first issued (overdue)
        self.expired = 0
        # Leases released or expired, task id -> round: their tickets are void, so a ticket
        # cannot outlive its lease (and beat the path's next holder to its delta).
        self.ended: dict[str, int] = {}
        self.epoch = 0  # bumped on every coordinator restart, so task ids are never reused
        self.durations: deque[float] = deque(maxlen=64)  # seconds from lease to done
        self.paces: dict[str, deque[float]] = {}  # per peer: seconds per step of its last tasks

    @property
    def leases(self) -> dict[str, Lease]:
        """Task id -> live lease, oldest first; changed only through ``self.live``."""
        return self.live.by_id

    def expire(self) -> list[Lease]:
        """End the leases past their deadline; those ended (no scan: LiveLeases.expired)."""
        gone = self.live.expired(self.clock())
        for lease in gone:
            self.ended[lease.task_id] = lease.round
            self.expired += 1
        return gone

    def leased_paths(self) -> KeysView[int]:
        return self.live.paths()

    def holders(self, path: int, rnd: int) -> list[Lease]:
        """The live leases of ``path``'s round ``rnd`` (a task and its hedged copy)."""
        return self.live.of_task(path, rnd)

    def claim(
        self,
        peer_id: str,
        open_paths: dict[int, int],
        prefer: int | None,
        steps: int = 0,
        holding: Collection[str] = (),
        last_trainer: Callable[[int], str | None] | None = None,
    ) -> Lease | None:
        """Lease one open path (path -> round) to ``peer_id``; None if all are taken. Which
        one: :meth:`pick` (``last_trainer(path)``: who trained the path's round before, if
        known; asked only of the free paths).

        A peer that already holds a live lease (it restarted) gets the same task back, unless
        the peer names it in ``holding``: a path-parallel peer asking for one task more.
        """
        held = [lease for lease in self.leases_of(peer_id) if lease.task_id not in holding]
        if held:
            self.live.renew(held[0], self.clock() + self.lease_seconds)
            return held[0]
        leased = self.leased_paths()
        free = sorted(p for p in open_paths if p not in leased)
        if not free:
            return None
        last = {}
        if last_trainer is not None:
            last = {p: who for p in free if (who := last_trainer(p)) is not None}
        path = pick_path(peer_id, free, prefer, last)
        return self._issue(path, open_paths[path], peer_id, self.steps_for(peer_id, steps))

    def _issue(self, path: int, rnd: int, peer_id: str, steps: int, **extra: Any) -> Lease:
        """A new lease of ``path``'s round ``rnd`` for ``peer_id``, its attempt numbered,
        live and remembered (``extra``: a hedged copy's base versions and original)."""
        attempt = self.attempts.get((path, rnd), 0)
        self.attempts[(path, rnd)] = attempt + 1
        now = self.clock()
        self.reissues.issued(path, rnd, attempt, now)
        lease = Lease(
            f"P{path}-r{rnd}-e{self.epoch}-a{attempt}",
            path,
            rnd,
            peer_id,
            now + self.lease_seconds,
            steps=steps,
            issued_at=now,
            **extra,
        )
        self.live.add(lease)
        self.issued[lease.task_id] = lease
        lease.on_change = self.texts.issued.mark
        self.texts.issued.mark(lease.task_id)
        self.texts.attempts.mark((path, rnd))
        return lease

    def hedge(
        self,
        peer_id: str,
        done: Collection[tuple[int, int]],
        moved: Callable[[Lease], bool] = lambda _lease: False,
    ) -> Lease | None:
        """A copy of a straggler's task for ``peer_id``, which has nothing else to train: the
        oldest live task of another peer that has run longer than the typical (median) task,
        trains its path's current round (not a round ahead, whose start only its peer holds),
        is not done, has no copy yet and whose modules have not ``moved`` past its base (a
        copy's peer would find them moved and give it up: a fetch for nothing). The copy has its
        base versions and steps; None if no task is late, or too few have finished to say what
        typical is."""
        if len(self.durations) < self.policy.min_observations or self.leases_of(peer_id):
            return None
        typical, now = statistics.median(self.durations), self.clock()
        slow = None
        for x in self.leases.values():  # oldest first: the first that qualifies
            if now - x.issued_at <= typical:
                break  # the rest are younger still
            if (
                x.peer_id != peer_id
                and len(self.live.of_task(x.path, x.round)) == 1
                and (x.path, x.round) not in done
                and x.module_versions
                and all(v >= x.round for v in x.module_versions.values())
                and not moved(x)
                and copy_ends_first(
                    x, self.paces.get(x.peer_id), self.paces.get(peer_id), self.durations, now
                )
            ):
                slow = x
                break
        if slow is None:
            return None
        versions = dict(slow.module_versions)
        return self._issue(
            slow.path,
            slow.round,
            peer_id,
            slow.steps,
            module_versions=versions,
            hedge_of=slow.task_id,
        )

    def task_deadline(self) -> float | None:
        """The task deadline (seconds): computed again only when a task has finished since."""
        if self._deadline is None or self._deadline[0] != self._finished:
            deadline = robust_deadline(
                self.durations, self.policy.mads, self.policy.slack, self.policy.min_observations
            )
            value = None if deadline is None else max(deadline, self.policy.floor)
            self._deadline = (self._finished, value)
        return self._deadline[1]

    def overdue(self) -> set[tuple[int, int]]:
        """(path, round) of live leases past the task deadline (oldest first: the walk stops at
        the first that is not), or of path-rounds issued again whose first task is (Reissues)."""
        deadline = self.task_deadline()
        if deadline is None:
            return set()
        now, late = self.clock(), set()
        for lease in self.leases.values():
            if now - lease.issued_at <= deadline:
                break
            late.add((lease.path, lease.round))
        return late | self.reissues.late(now, deadline, self.live)

    def steps_for(self, peer_id: str, steps: int) -> int:
        """H, or fewer for a peer too slow to finish H steps within the task deadline: as many
        as it trains in the typical (median) task's time, so that its task ends with the
        round's others rather than at the deadline (a mixed fleet's rounds do not wait for the
        slowest card's full H). Never below ``min_step_fraction`` of H."""
        deadline, paces = self.task_deadline(), self.paces.get(peer_id, ())
        if deadline is None or len(paces) < 2:  # judge a peer on more than one task
            return steps
        per_step = statistics.median(paces)
        if per_step * steps <= deadline:
            return steps
        typical = statistics.median(self.durations)
        floor = max(1, math.ceil(self.policy.min_step_fraction * steps))
        return max(floor, min(steps, int(typical / per_step)))

    def heartbeat(self, task_id: str, peer_id: str, step: int = 0) -> Lease | None:
        lease = self.leases.get(task_id)
        if lease is None or lease.peer_id != peer_id:
            return None
        now = self.clock()
        self.live.renew(lease, now + self.lease_seconds)
        if step > 0:
            lease.progress = (now, step)
        return lease

    def finish(self, task_id: str) -> None:
        lease = self.live.drop(task_id)
        if lease is not None:
            took = self.clock() - lease.issued_at
            self.durations.append(took)
            self._finished += 1
            # The peer's pace over whole tasks (fetch and push included), for its next offers.
            pace = self.paces.setdefault(lease.peer_id, deque(maxlen=3))
            pace.append(took / max(1, lease.steps))

    def release(self, task_id: str, peer_id: str) -> bool:
        lease = self.leases.get(task_id)
        if lease is None or lease.peer_id != peer_id:
            return False
        self.live.drop(task_id)
        self.ended[task_id] = lease.round
        return True

    def forget_before(self, first_round: int) -> None:
        """Drop the record of tasks of rounds before ``first_round`` (those no delta can join).

        ``issued`` answers late submissions that come without a ticket, and ``attempts`` numbers
        re-issued tasks so that ids are never reused; both only matter for rounds that can still
        take a delta, so a coordinator calls this as rounds complete (with the run's round minus
        its max staleness), and a long run does not keep every task it ever leased. A live lease
        is kept whatever its round, and so is its path-round's attempt count: its peer may still
        be heartbeating it, and a copy of it (hedge) must not be numbered from 0 again, which
        gave the copy the live task's own id.
        """
        self.issued = {
            t: lease
            for t, lease in self.issued.items()
            if lease.round >= first_round or t in self.leases
        }
        held = self.live.held_tasks()
        self.attempts = {
            pr: n for pr, n in self.attempts.items() if pr[1] >= first_round or pr in held
        }
        self.ended = {t: r for t, r in self.ended.items() if r >= first_round}
        self.reissues.forget_before(first_round)
        self.texts.issued.rebuilt()
        self.texts.attempts.rebuilt()

    def leases_of(self, peer_id: str) -> list[Lease]:
        return self.live.of_peer(peer_id)

    def snapshot(self) -> dict[str, Any]:
        """What a restart must find again (coordinator.json ``scheduler``), in few bytes.

        ``issued``: every task remembered (live leases included) as ``[task, path, round, peer,
        steps, {module: version}]``; ``live``: each live lease's ``[deadline, issued at]`` on
        this scheduler's clock, and ``clock`` that clock at the save: the clock is monotonic and
        does not survive a restart, so :meth:`restore` rebases them; ``attempts``: ``[path,
        round, n]``; ``durations`` and ``paces``: what deadlines and step offers are judged by.
        """
        return {
            "issued": [
                [t, x.path, x.round, x.peer_id, x.steps, x.module_versions]
                for t, x in self.issued.items()
            ],
            "clock": round(self.clock(), 3),
            "live": {
                t: [round(x.deadline, 3), round(x.issued_at, 3)] for t, x in self.leases.items()
            },
            "attempts": [[p, r, n] for (p, r), n in self.attempts.items()],
            "durations": [round(d, 3) for d in self.durations],
            "paces": {peer: [round(x, 4) for x in pace] for peer, pace in self.paces.items()},
        }

    def snapshot_text(self) -> str:
        """:meth:`snapshot` as compact JSON, keys sorted, each remembered task, live lease,
        attempt count and pace encoded once and kept while it stays the same (statetext.py):
        coordinator.json is written for most requests."""
        return self.texts.text(
            self.issued, self.leases, self.attempts, self.paces, self.durations, self.clock()
        )

    def restore(self, saved: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot` (already checked) after a restart.

        A live lease keeps its remaining time, and at least half a lease: its peer could not
        heartbeat while the coordinator was down, and the last save may predate its last
        heartbeat. Its age (for the task deadline) does not count the time down either.
        """
        now = self.clock()
        live = saved.get("live", {})
        back, saved_at = [], saved.get("clock", 0.0)
        for task, path, rnd, peer, steps, versions in saved.get("issued", []):
            lease = Lease(task, path, rnd, peer, now, steps, now, dict(versions))
            lease.on_change = self.texts.issued.mark
            self.issued[task] = lease
            if task in live:
                deadline, issued_at = live[task]
                left, age = deadline - saved_at, max(0.0, saved_at - issued_at)
                lease.deadline = now + max(left, self.lease_seconds / 2)
                lease.issued_at = now - age
                back.append(lease)
        for lease in sorted(back, key=lambda x: x.issued_at):  # leases stay in issue order
            self.live.add(lease)
        self.attempts.update({(p, r): n for p, r, n in saved.get("attempts", [])})
        self.texts.issued.rebuilt()
        self.texts.attempts.rebuilt()
        self.durations.extend(saved.get("durations", []))
        self._finished += 1  # the task deadline is judged afresh
        for peer, pace in saved.get("paces", {}).items():
            self.paces[peer] = deque(pace, maxlen=3)
