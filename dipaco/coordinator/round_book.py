"""The round book, a part of the coordinator that owns its state (``core.book``): which path-rounds
are done and who trained them, which ran past their deadline, the last round announced, and (on
an owner) the scheduler's void tickets as its last report acknowledgement said. Every field is
created here and changed only by these methods, under the coordinator's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dipaco.coordinator.statetext import MarkedTexts, dumps
from dipaco.protocols.reasons import SKIP_AFTER_JUDGED

PathRound = tuple[int, int]


class RoundBook:
    def __init__(self) -> None:
        self.done: set[PathRound] = set()  # (path, round) whose task every owner acked
        # (path, round) -> the peer whose task it was, since that peer's last Hello: overlap
        # offers a path's next round only to the peer that holds where it ended (in memory).
        self.trained_by: dict[PathRound, str] = {}
        # its entries' JSON, kept in its order and encoded again only when marked (statetext.py)
        self.trained_by_texts = MarkedTexts(lambda k, peer: dumps([*k, peer]))
        # (path, round) whose task ran past the deadline: rounds may close without them.
        self.overdue: set[PathRound] = set()
        # (path, round) -> its tasks whose delta this coordinator refused for what it held
        # (reasons.JUDGED), and those refused for SKIP_AFTER_JUDGED tasks: skipped (in memory).
        self.refused: dict[PathRound, set[str]] = {}
        self.judged_out: set[PathRound] = set()
        self.void: dict[str, int] = {}  # an owner's copy of the scheduler's ended leases
        self.last_round = 0  # the last round announced (a "round" event)
        # rounds.path_rounds' answer, with what it was made of (it is asked by every claim)
        self._path_rounds: tuple[tuple, list[tuple[int, int, bool]]] | None = None

    def finish(self, path: int, rnd: int, peer_id: str) -> None:
        """The task of ``path`` for round ``rnd`` is done, trained by ``peer_id``."""
        self.done.add((path, rnd))
        self.trained_by[(path, rnd)] = peer_id
        self.trained_by_texts.mark((path, rnd))

    def path_rounds(
        self, key: tuple, compute: Callable[[], list[tuple[int, int, bool]]]
    ) -> list[tuple[int, int, bool]]:
        """``compute()``, kept until ``key`` (what it is made of) changes."""
        if self._path_rounds is None or self._path_rounds[0] != key:
            self._path_rounds = (key, compute())
        return self._path_rounds[1]

    def trainer(self, path: int, rnd: int) -> str | None:
        return self.trained_by.get((path, rnd))

    def forget_trainer(self, peer_id: str) -> bool:
        """``peer_id`` said Hello again (it lost its inner state): it trained nothing any
        more. True if it had."""
        kept = {k: p for k, p in self.trained_by.items() if p != peer_id}
        forgot = len(kept) < len(self.trained_by)
        if forgot:
            self.trained_by = kept
            self.trained_by_texts.rebuilt()
        return forgot

    def add_overdue(self, late: set[PathRound], current: int) -> bool:
        """Mark ``late`` overdue, forgetting those of rounds before ``current``: once overdue,
        a (path, round) stays skipped until the round is over everywhere, so that a module that
        closed without it does not leave the path's other modules waiting. True if any of
        ``late`` is new and kept (the caller saves: the skip survives a restart)."""
        new = late - self.overdue
        self.overdue = {(p, r) for p, r in self.overdue | new if r >= current}
        return bool(new & self.overdue)

    def judged(self, path: int, rnd: int, task_id: str) -> bool:
        """A delta of ``path``'s round ``rnd`` (task ``task_id``) was refused for what it held.
        Another peer's task of it trains the same delta from the same base: once
        SKIP_AFTER_JUDGED tasks of it were refused, the path's round is skipped, as an overdue
        one, and counts out of the quorum (rounds.due). True when that happens now."""
        tasks = self.refused.setdefault((path, rnd), set())
        tasks.add(task_id)
        if len(tasks) < SKIP_AFTER_JUDGED or (path, rnd) in self.judged_out:
            return False
        self.judged_out.add((path, rnd))
        return True

    def skipped(self) -> set[PathRound]:
        """The path-rounds a module may close without: overdue, or judged out."""
        return self.overdue | self.judged_out if self.judged_out else self.overdue

    def follow(self, overdue: Iterable[Iterable[int]], ended: dict[str, int]) -> None:
        """An owner takes the scheduler's overdue path-rounds and void tickets (a ReportAck)."""
        self.overdue = {(int(p), int(r)) for p, r in overdue}
        self.void = dict(ended)

    def advance(self, current: int, horizon: int) -> range:
        """The rounds closed since the last call (up to ``current``), to announce; the tasks of
        rounds before ``horizon``, which no delta can join any more, are forgotten, so that a
        long run does not keep a record of every task it ever leased."""
        closed = range(self.last_round + 1, current + 1)
        if closed:
            self.last_round = current
            self.done = {(p, r) for p, r in self.done if r >= horizon}
            self.refused = {k: v for k, v in self.refused.items() if k[1] >= horizon}
            self.judged_out = {k for k in self.judged_out if k[1] >= horizon}
            self.trained_by = {k: v for k, v in self.trained_by.items() if k[1] >= horizon}
            self.trained_by_texts.rebuilt()
        return closed

    # ---- coordinator.json's entries ---------------------------------------------------------
    def load(self, saved: dict[str, Any]) -> None:
        """The scheduler's overdue skips and trainers from coordinator.json: a round waiting on
        an overdue task does not wait again from zero, and the peer that trained a path's last
        rounds still goes ahead on it (overlap) rather than wait for the round to close."""
        self.overdue = {(p, r) for p, r in saved.get("overdue", [])}
        self.trained_by = {(p, r): peer for p, r, peer in saved.get("trained_by", [])}
        self.trained_by_texts.rebuilt()

    def started(self, current: int) -> None:
        """The coordinator (re)started at round ``current``: rounds before it are not announced."""
        self.last_round = current

    def trained_by_json(self) -> str:
        """``trained_by_list`` as JSON text, its entries kept while unchanged."""
        return "[" + self.trained_by_texts.joined(self.trained_by) + "]"

    def overdue_list(self) -> list[list[int]]:
        return sorted([p, r] for p, r in self.overdue)

    def trained_by_list(self) -> list[list]:
        """``[[path, round, peer]]`` in the order trained (the file keeps it: a restart too)."""
        return [[p, r, peer] for (p, r), peer in self.trained_by.items()]
