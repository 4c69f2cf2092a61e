"""Saving and resuming the coordinator: ``coordinator.json`` (epoch, refusal counts, and on the
scheduler the owners, remote modules, addresses, owner keys, ended leases, the scheduler's
leases and issued tasks (``scheduler``, see ``Scheduler.snapshot``), the overdue tasks and who
trained each path's recent rounds (``trained_by``, for overlap); on
another owner the scheduler key rotations it accepted), checked before use.

Functions of the coordinator (bound as its methods in core.py); they call other parts through it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from dipaco.coordinator import rotation, rounds, verdicts
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.records import ReportedModule
from dipaco.coordinator.statetext import dumps, json_object
from dipaco.errors import CorruptFileError
from dipaco.fileio import compact_json_bytes
from dipaco.protocols import keyrotation
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)


def start(
    core: CoordinatorBase, initial_modules: dict[str, dict[str, torch.Tensor]] | None
) -> None:
    """Open the store (creating version 0 from ``initial_modules`` if new) and resume."""
    state_file = core.root / "coordinator.json"
    saved: dict[str, Any] = {}
    if state_file.exists():
        try:
            saved = json.loads(state_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptFileError(f"{state_file}: not readable coordinator state: {exc}") from None
        _check_state(state_file, saved, core.topology.module_ids())
        core.epoch = saved.get("epoch", 0) + 1
        if core.scheduler is not None:
            core.scheduler.epoch = core.epoch
        core.refusals.load_state_dict(saved)
    if core.scheduler is not None:
        core.owners = saved.get("owners") or dict.fromkeys(
            core.topology.module_ids(), core.owner_id
        )
        core.remote = _remote(saved.get("remote", {}))
        core.addresses.update(saved.get("addresses", {}))
        core.owner_keys.update(saved.get("owner_keys", {}))
        core.scheduler.ended.update(saved.get("ended", {}))
        # Leases in flight, the tasks issued and the overdue skips survive the restart: a
        # peer training a task goes on with it, and a round waiting on an overdue task does
        # not wait again from zero.
        core.scheduler.restore(saved.get("scheduler", {}))
        core.book.load(saved)
    else:
        core.owners = dict.fromkeys(core.store.owned_on_disk(), core.owner_id)
    rotation.load(core, [] if core.is_scheduler else saved.get("scheduler_rotations", []))
    mine = core.owned_modules()
    if initial_modules is not None:
        core.store.initialize({mid: initial_modules[mid] for mid in mine})
    else:
        core.store.load(mine)
    # No request may be larger than two copies of everything we own (a delta is one path's
    # share of it, in float32 or less) plus room for the header: bigger ones are refused
    # before they are decoded.
    owned_bytes = sum(
        t.numel() * t.element_size() for mid in mine for t in core.store.params(mid).values()
    )
    if core.is_scheduler:  # a ScoreDelta carries a whole path's delta (scoring.py)
        owned_bytes = max(owned_bytes, verdicts.path_bytes(core.peer_config.get("model")))
    core.gate.size_for(owned_bytes)
    for mid in mine:
        # A crash may have left a module with every delta on disk but its step not committed.
        rounds.maybe_step(core, mid)
    report_repairs(core)
    core.book.started(core.round)
    core.journal.save(required=True)  # the epoch must be on disk: task ids are never reused
    if core.finished:
        core.finished_event.set()


def save_counts(core: CoordinatorBase) -> None:
    """Write the state now, the refusal counts with it (at shutdown: refusals since the last
    change would otherwise be lost), and every outer step's files with them."""
    try:
        core.store.sync_all()
    except OSError as exc:  # the next start redoes the step from its deltas
        log.error("cannot write the last outer step: %s", exc)
    with core.lock:
        core.journal.save()


def report_repairs(core: CoordinatorBase) -> None:
    """Log and count what the store repaired on start: corrupt files, rolled-back heads."""
    for file in core.store.quarantined:
        core.refusals.by_reason[Reason.CORRUPT_FILE] += 1  # no request was refused: no peer
        core.metrics({"event": "file_quarantined", "file": file})
    for mid, (bad, used) in core.store.rolled_back.items():
        core.metrics({"event": "rolled_back", "module": mid, "bad": bad, "version": used})
    core.store.quarantined.clear()
    core.store.rolled_back.clear()


def state_bytes(core: CoordinatorBase) -> bytes:
    """coordinator.json's content now, encoded under the coordinator's lock (the file and the
    state it holds must be one moment's: leases change under that lock). Compact JSON: the
    C encoder, ten times faster than an indented file for a scheduler's thousands of tasks;
    the long sections (remembered tasks, live leases, attempts, paces, who trained each
    path's rounds) have each entry encoded once and kept while it is unchanged (statetext.py).
    The same bytes as ``compact_json_bytes(snapshot_state(core))``."""
    with core.lock:
        if core.scheduler is None:
            return compact_json_bytes(snapshot_state(core))
        texts = {k: dumps(v) for k, v in _common(core).items()}
        texts["trained_by"] = core.book.trained_by_json()
        texts["scheduler"] = core.scheduler.snapshot_text()
        return json_object(texts).encode()


def _common(core: CoordinatorBase) -> dict[str, Any]:
    """What coordinator.json holds apart from the scheduler's long sections."""
    state: dict[str, Any] = {
        "epoch": core.epoch,
        **core.refusals.state_dict(),
        "run_id": core.run_id,
        "owner_id": core.owner_id,
    }
    if core.scheduler is not None:
        state.update(
            owners=core.owners,
            remote={mid: r.to_json() for mid, r in core.remote.items()},
            addresses=core.addresses,
            owner_keys=core.owner_keys,
            ended=core.scheduler.ended,
            overdue=core.book.overdue_list(),
        )
    elif core.keys.rotations:
        state["scheduler_rotations"] = core.keys.rotations
    return state


def snapshot_state(core: CoordinatorBase) -> dict[str, Any]:
    """coordinator.json's content now, as a value (``state_bytes`` encodes the same)."""
    with core.lock:
        state = _common(core)
        if core.scheduler is not None:
            state.update(
                scheduler=core.scheduler.snapshot(),
                trained_by=core.book.trained_by_list(),
            )
        return state


# coordinator.json's shape, as the journal writes it (state_bytes): checked before any of it is
# used, so that a damaged file stops the restart with a clear error naming the section, rather
# than crash half-way or quietly hand modules to owners that never asked for them.
Count = Annotated[StrictInt, Field(ge=0)]
Seconds = FiniteFloat
Span = Annotated[FiniteFloat, Field(ge=0)]
PeerId = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class _Lax(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SavedScheduler(_Lax):
    """``Scheduler.snapshot``: the tasks issued, the live ones, attempts, durations and paces."""

    issued: list[tuple[StrictStr, Count, Count, StrictStr, Count, dict[str, Count]]] = []
    live: dict[str, tuple[Seconds, Seconds]] = {}
    clock: Seconds = 0.0  # the scheduler's clock at the save: live leases' times are on it
    attempts: list[tuple[Count, Count, Count]] = []
    durations: list[Span] = []
    paces: dict[str, list[Span]] = {}

    @field_validator("live")
    @classmethod
    def _live_were_issued(cls, v: dict, info: ValidationInfo) -> dict:
        if not set(v) <= {x[0] for x in info.data.get("issued", [])}:
            raise ValueError("a live task that was never issued")
        return v


class SavedState(_Lax):
    epoch: Count = 0
    rejections: dict[str, Count] = {}
    rejections_by_peer: dict[str, dict[str, Count]] = {}
    owners: dict[str, StrictStr] | None = None
    remote: dict[str, Any] = {}
    addresses: dict[str, list[StrictStr]] = {}
    owner_keys: dict[str, StrictStr] = {}
    ended: dict[str, Count] = {}
    overdue: list[tuple[Count, Count]] = []
    trained_by: list[tuple[Count, Count, PeerId]] = []
    scheduler_rotations: list[Any] = []
    scheduler: SavedScheduler = SavedScheduler()

    @field_validator("remote")
    @classmethod
    def _reported(cls, v: dict[str, Any]) -> dict[str, Any]:
        if any(ReportedModule.of(x) is None for x in v.values()):
            raise ValueError("not {module: {version, hash, pending paths}}")
        return v

    @field_validator("scheduler_rotations")
    @classmethod
    def _rotations(cls, v: list[Any]) -> list[Any]:
        if not all(keyrotation.well_formed(x) for x in v):
            raise ValueError("not a list of key rotation statements")
        return v


SHAPES = {  # what a section holds, for the error
    "epoch": "a count",
    "rejections": "{reason: count}",
    "rejections_by_peer": "{peer: {reason: count}}",
    "addresses": "{owner: [address]}",
    "owner_keys": "{owner: key}",
    "ended": "{task: round}",
    "overdue": "[[path, round]]",
    "trained_by": "[[path, round, peer]]",
    "scheduler.issued": "[[task, path, round, peer, steps, {module: version}]]",
    "scheduler.live": "{issued task: [deadline, issued at]}",
    "scheduler.clock": "a time in seconds",
    "scheduler.attempts": "[[path, round, attempts]]",
    "scheduler.durations": "a list of seconds",
    "scheduler.paces": "{peer: [seconds per step]}",
}


def _check_state(path: Path, saved: Any, module_ids: list[str]) -> None:
    """CorruptFileError unless coordinator.json has the shape the journal writes (SavedState),
    naming the section that does not (``'scheduler.issued'``)."""
    if not isinstance(saved, dict):
        raise CorruptFileError(f"{path}: damaged coordinator state: not a JSON object")
    if not isinstance(saved.get("scheduler", {}), dict):
        raise CorruptFileError(f"{path}: damaged coordinator state: 'scheduler' is not an object")
    try:
        state = SavedState.model_validate(saved)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        where = f"scheduler.{loc[1]}" if loc[0] == "scheduler" and len(loc) > 1 else str(loc[0])
        shape = f" is not {SHAPES[where]}" if where in SHAPES else ""
        raise CorruptFileError(
            f"{path}: damaged coordinator state: '{where}'{shape} ({err['msg'].lower()})"
        ) from None
    if state.owners and set(state.owners) != set(module_ids):
        raise CorruptFileError(
            f"{path}: damaged coordinator state: 'owners' does not map each of the run's "
            "modules to an owner"
        )


def _remote(saved: dict[str, Any]) -> dict[str, ReportedModule]:
    """The state file's other owners' modules (``remote``), which _check_state has passed."""
    return {mid: module for mid, v in saved.items() if (module := ReportedModule.of(v))}
