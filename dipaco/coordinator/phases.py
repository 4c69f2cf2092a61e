"""Routing phases (DiPaCo Algorithm 1, line 2): which phase's shards a task trains on, deciding a
phase during the run (written to ``decided_phases.json`` before it is used), making a phase's
shards available, and a path's outer-step weight (its shard's tokens in that phase).

``routing_phases.RoutingPhases`` is the part that owns them; ``schedule_phase`` and
``add_phase`` here are the coordinator's operations on it (bound as its methods in core.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.records import Phase
from dipaco.fileio import file_info

log = logging.getLogger(__name__)


def schedule_phase(core: CoordinatorBase) -> tuple[int, int] | None:
    """Decide a routing phase now: (its number, the first base round that trains on it).

    That round is past every module's version, so no task already issued changes shards;
    the decision is written to disk before it is returned. None when no round is left.
    """
    with core.lock:
        versions = [core.version(mid) or 0 for mid in core.topology.module_ids()]
        after = max([core.round, *versions]) + 1
        if after >= core.rounds:
            return None
        phase = core.phases.decide(after)
        if phase is None:  # one is pending already
            return None
        core.metrics({"event": "phase_decided", "phase": phase, "after_round": after})
        return phase, after


def add_phase(
    core: CoordinatorBase, phase: int, prefix: str, tokens: list[int], files: dict[str, Path]
) -> None:
    """Make a routing phase's shards available: its tasks open and its files are served."""
    with core.lock:
        infos = {name: file_info(path) for name, path in files.items()}
        core.files.update(files)
        core.phases.add(phase, Phase(prefix, tokens, infos))
        core.metrics({"event": "phase_ready", "phase": phase, "shard_tokens": tokens})
