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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.coordinator import rotation, rounds
from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.records import ReportedModule
from dipaco.coordinator.statetext import dumps, json_object
from dipaco.errors import CorruptFileError
from dipaco.fileio import compact_json_bytes, finite_number
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
        core.remote = _remote(state_file, saved.get("remote", {}))
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
    core.max_request_bytes = 2 * owned_bytes + (16 << 20)
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


def _check_state(path: Path, saved: Any, module_ids: list[str]) -> None:
    """CorruptFileError unless coordinator.json has the shape the journal writes (state_bytes).

    Checked before any of it is used: a damaged file must stop the restart with a clear error,
    not crash half-way or quietly hand modules to owners that never asked for them.
    """

    def mapping(value: Any, check: Callable[[Any], bool]) -> bool:
        return isinstance(value, dict) and all(
            isinstance(k, str) and check(v) for k, v in value.items()
        )

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    problem = None
    if not isinstance(saved, dict):
        problem = "not a JSON object"
    elif not count(saved.get("epoch", 0)):
        problem = "'epoch' is not a count"
    elif not mapping(saved.get("rejections", {}), count) or not mapping(
        saved.get("rejections_by_peer", {}), lambda c: mapping(c, count)
    ):
        problem = "'rejections' is not {reason: count}"
    elif not mapping(saved.get("owners") or {}, lambda v: isinstance(v, str)) or (
        saved.get("owners") and set(saved["owners"]) != set(module_ids)
    ):
        problem = "'owners' does not map each of the run's modules to an owner"
    elif not mapping(saved.get("remote", {}), lambda v: ReportedModule.of(v) is not None):
        problem = "'remote' is not {module: {version, hash, pending paths}}"
    elif not mapping(
        saved.get("addresses", {}),
        lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
    ):
        problem = "'addresses' is not {owner: [address]}"
    elif not mapping(saved.get("owner_keys", {}), lambda v: isinstance(v, str)):
        problem = "'owner_keys' is not {owner: key}"
    elif not mapping(saved.get("ended", {}), count):
        problem = "'ended' is not {task: round}"
    elif not _pairs(saved.get("overdue", []), 2):
        problem = "'overdue' is not [[path, round]]"
    elif not _trained_by(saved.get("trained_by", [])):
        problem = "'trained_by' is not [[path, round, peer]]"
    elif not isinstance(saved.get("scheduler_rotations", []), list) or not all(
        keyrotation.well_formed(x) for x in saved.get("scheduler_rotations", [])
    ):
        problem = "'scheduler_rotations' is not a list of key rotation statements"
    else:
        problem = _scheduler_problem(saved.get("scheduler", {}))
    if problem is not None:
        raise CorruptFileError(f"{path}: damaged coordinator state: {problem}")


def _remote(path: Path, saved: dict[str, Any]) -> dict[str, ReportedModule]:
    """The state file's other owners' modules (``remote``), which _check_state has passed."""
    remote = {}
    for mid, v in saved.items():
        module = ReportedModule.of(v)
        if module is None:  # _check_state refuses such a file first
            raise CorruptFileError(
                f"{path}: damaged coordinator state: 'remote' {mid} is not "
                "{version, hash, pending paths}"
            )
        remote[mid] = module
    return remote


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _seconds(v: Any) -> bool:
    return finite_number(v)


def _pairs(value: Any, n: int) -> bool:
    """A list of lists of ``n`` counts."""
    return isinstance(value, list) and all(
        isinstance(x, list) and len(x) == n and all(_count(c) for c in x) for x in value
    )


def _trained_by(value: Any) -> bool:
    """A list of [path, round, peer id] (``core.book.trained_by``)."""
    return isinstance(value, list) and all(
        isinstance(x, list)
        and len(x) == 3
        and _count(x[0])
        and _count(x[1])
        and isinstance(x[2], str)
        and 0 < len(x[2]) <= 256
        for x in value
    )


def _scheduler_problem(saved: Any) -> str | None:
    """What is wrong with ``coordinator.json`` ``scheduler`` (``Scheduler.snapshot``), if any."""

    def issued(x: Any) -> bool:
        return (
            isinstance(x, list)
            and len(x) == 6
            and isinstance(x[0], str)
            and _count(x[1])
            and _count(x[2])
            and isinstance(x[3], str)
            and _count(x[4])
            and isinstance(x[5], dict)
            and all(isinstance(k, str) and _count(v) for k, v in x[5].items())
        )

    if not isinstance(saved, dict):
        return "'scheduler' is not an object"
    tasks = saved.get("issued", [])
    if not isinstance(tasks, list) or not all(issued(x) for x in tasks):
        return "'scheduler.issued' is not [[task, path, round, peer, steps, {module: version}]]"
    live = saved.get("live", {})
    known = {x[0] for x in tasks}
    if not isinstance(live, dict) or not all(
        k in known and isinstance(v, list) and len(v) == 2 and all(_seconds(t) for t in v)
        for k, v in live.items()
    ):
        return "'scheduler.live' is not {issued task: [deadline, issued at]}"
    if "clock" in saved and not _seconds(saved["clock"]):
        return "'scheduler.clock' is not a time in seconds"
    if not _pairs(saved.get("attempts", []), 3):
        return "'scheduler.attempts' is not [[path, round, attempts]]"
    durations = saved.get("durations", [])
    if not isinstance(durations, list) or not all(_seconds(d) and d >= 0 for d in durations):
        return "'scheduler.durations' is not a list of seconds"
    paces = saved.get("paces", {})
    if not isinstance(paces, dict) or not all(
        isinstance(v, list) and all(_seconds(x) and x >= 0 for x in v) for v in paces.values()
    ):
        return "'scheduler.paces' is not {peer: [seconds per step]}"
    return None
