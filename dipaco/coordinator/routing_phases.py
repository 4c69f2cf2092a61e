"""A run's routing phases, a part of the coordinator that owns them (``core.phases``): the base
rounds at which each phase starts, the decided ones on disk, and the phases whose shards are
ready. phases.py holds the coordinator's operations on it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dipaco.coordinator.records import Phase
from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic


class RoutingPhases:
    """A run's routing phases: ``rounds``, the base rounds from which phase 1, 2... train
    (given in the config, or decided during the run and kept in ``decided_phases.json`` so
    that they survive a restart), and ``ready``, the phases whose shards are available (the
    scheduler's phase 0 from the start). Tasks of a phase wait until it is ready."""

    def __init__(self, root: Path, rounds: Sequence[int], first: Phase | None = None) -> None:
        self.file = root / "decided_phases.json"
        self.rounds = sorted(rounds)
        if self.file.exists():
            try:
                decided = [int(r) for r in json.loads(self.file.read_text())["after"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptFileError(f"{self.file}: unreadable ({exc})") from exc
            self.rounds = sorted(set(self.rounds) | set(decided))
        self.ready: dict[int, Phase] = {} if first is None else {0: first}

    def of(self, base_round: int) -> int:
        """The routing phase whose shards a task of this base round trains on."""
        return sum(1 for r in self.rounds if r <= base_round)

    def ready_for(self, base_round: int) -> bool:
        """Whether the shards a task of this base round trains on are available."""
        return self.of(base_round) in self.ready

    def tokens(self, base_round: int) -> list[int] | None:
        """Each path's shard tokens in the phase of this base round, if known."""
        phase = self.ready.get(self.of(base_round))
        return phase.tokens if phase else None

    def decide(self, after: int) -> int | None:
        """Start a new phase at base round ``after``, on disk before it counts; its number, or
        None if a phase is pending already (one starts at or after ``after``)."""
        if any(r >= after for r in self.rounds):
            return None
        previous = json.loads(self.file.read_text())["after"] if self.file.exists() else []
        self.file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.file, {"after": sorted({*previous, after})})
        self.rounds = sorted({*self.rounds, after})
        return len(self.rounds)

    def add(self, phase: int, shards: Phase) -> None:
        """Phase ``phase``'s shards are available."""
        self.ready[phase] = shards
