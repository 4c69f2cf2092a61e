"""Saving and resuming the coordinator: ``coordinator.json`` (epoch, refusal counts, and on the
scheduler the owners, remote modules, addresses, owner keys and ended leases), checked before use.

Functions of the coordinator (bound as its methods in core.py); they call other parts through it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.coordinator.base import CoordinatorBase
from dipaco.coordinator.records import ReportedModule
from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic
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
        core.scheduler.epoch = core.epoch
        core.rejections.update(saved.get("rejections", {}))
        for who, counts in saved.get("rejections_by_peer", {}).items():
            core.rejections_by_peer[who].update(counts)
    if core.is_scheduler:
        core.owners = saved.get("owners") or dict.fromkeys(
            core.topology.module_ids(), core.owner_id
        )
        core.remote = {mid: ReportedModule.of(v) for mid, v in saved.get("remote", {}).items()}
        core.addresses.update(saved.get("addresses", {}))
        core.owner_keys.update(saved.get("owner_keys", {}))
        core.scheduler.ended.update(saved.get("ended", {}))
    else:
        core.owners = dict.fromkeys(core.store.owned_on_disk(), core.owner_id)
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
        core._maybe_step(mid)
    report_repairs(core)
    core.last_round = core.round
    save_state(core, required=True)  # the epoch must be on disk: task ids are never reused
    if core.finished:
        core.finished_event.set()


def save_state(core: CoordinatorBase, required: bool = False) -> None:
    """Write coordinator.json. Outside ``start`` a failure (a full disk) is logged, not
    raised: the file holds counters and ownership, which the next save brings up to date,
    and raising would drop the reply to a request whose deltas are already durable."""
    try:
        write_state(core)
    except OSError as exc:
        if required:
            raise
        log.error("cannot save %s: %s", core.root / "coordinator.json", exc)


def save_counts(core: CoordinatorBase) -> None:
    """Write the state now, the refusal counts with it (at shutdown: refusals since the last
    change would otherwise be lost)."""
    with core.lock:
        save_state(core)


def report_repairs(core: CoordinatorBase) -> None:
    """Log and count what the store repaired on start: corrupt files, rolled-back heads."""
    for file in core.store.quarantined:
        core.rejections[Reason.CORRUPT_FILE] += 1
        core.metrics({"event": "file_quarantined", "file": file})
    for mid, (bad, used) in core.store.rolled_back.items():
        core.metrics({"event": "rolled_back", "module": mid, "bad": bad, "version": used})
    core.store.quarantined.clear()
    core.store.rolled_back.clear()


def write_state(core: CoordinatorBase) -> None:
    state: dict[str, Any] = {
        "epoch": core.epoch,
        "rejections": dict(core.rejections),
        "rejections_by_peer": {p: dict(c) for p, c in core.rejections_by_peer.items()},
        "run_id": core.run_id,
        "owner_id": core.owner_id,
    }
    if core.is_scheduler:
        state.update(
            owners=core.owners,
            remote={mid: r.to_json() for mid, r in core.remote.items()},
            addresses=core.addresses,
            owner_keys=core.owner_keys,
            ended=core.scheduler.ended,
        )
    write_json_atomic(core.root / "coordinator.json", state)


def _check_state(path: Path, saved: Any, module_ids: list[str]) -> None:
    """CorruptFileError unless coordinator.json has the shape ``_save_state`` writes.

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
    if problem is not None:
        raise CorruptFileError(f"{path}: damaged coordinator state: {problem}")
