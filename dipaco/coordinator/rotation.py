"""The scheduler's key rotation, on the coordinators' side (the statement itself is
:mod:`dipaco.protocols.keyrotation`).

- ``rotate_key(folder)``: what ``dipaco-coordinator rotate-key`` does, on disk, the scheduler
  running or not: a new ``signing.key``, and a statement signed by the old key appended to
  ``key_rotations.json``. The scheduler signs with the new key from its next start on (a new
  epoch: the old key's tickets, all of earlier epochs, stay good at every owner).
- ``load(core, saved)`` (from ``state.start``): the scheduler reads its statements, which it
  serves in ``Welcome.rotations``; an owner re-follows those it accepted (saved in its
  coordinator.json) from the manifest's key. Either way the keys land in ``core.keys``
  (``tickets.SchedulerKeys``), the part that owns them.
- ``follow(core, transport)``: an owner whose scheduler answered with a key it does not trust
  asks for the statements (a ``Hello``; the reply's content proves itself), follows them from
  the key it trusts, and from then on accepts the new key, or refuses and counts
  ``bad-rotation`` and keeps the key it had.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dipaco.coordinator.base import CoordinatorBase
from dipaco.errors import ConfigError, CorruptFileError, DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.protocols import auth, keyrotation
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)

ROTATIONS = "key_rotations.json"
SIGNING_KEY = "signing.key"
NEXT_KEY = "signing.key.next"


def read_statements(folder: Path) -> list[dict[str, Any]]:
    """The statements in ``folder/key_rotations.json`` (none if it is absent); a damaged file
    is a CorruptFileError naming it."""
    file = folder / ROTATIONS
    if not file.exists():
        return []
    try:
        statements = json.loads(file.read_text())["rotations"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{file}: not a list of key rotations ({exc})") from None
    if not isinstance(statements, list) or not all(keyrotation.well_formed(s) for s in statements):
        raise CorruptFileError(f"{file}: a key rotation is malformed")
    return statements


def rotate_key(folder: str | Path) -> dict[str, Any]:
    """Make a new scheduler key in ``folder`` (``<run-dir>/coordinator``) and the statement,
    signed by the current key, that names it; returns the statement.

    Order, for a crash at any point: the new key goes to ``signing.key.next``, the statement is
    appended, then the new key replaces ``signing.key``. A rotation cut before the last step is
    finished by the next ``rotate_key`` or scheduler start.
    """
    folder = Path(folder)
    state_file = folder / "coordinator.json"
    try:
        saved = json.loads(state_file.read_text())
        run_id, epoch = saved["run_id"], saved["epoch"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(
            f"{folder} holds no started scheduler (no readable coordinator.json): start the run "
            "once before rotating its key"
        ) from None
    if not saved.get("owners"):
        raise ConfigError(f"{folder} is a module owner's folder; only the scheduler's key rotates")
    finish_pending(folder)
    old = auth.Identity.load(folder / SIGNING_KEY)
    statements = read_statements(folder)
    new = auth.Identity.generate()
    new.save(folder / NEXT_KEY)
    seq = statements[-1]["seq"] + 1 if statements else 1
    statement = keyrotation.make_statement(old, new.public_key, run_id, seq, epoch)
    write_json_atomic(folder / ROTATIONS, {"rotations": [*statements, statement]})
    os.replace(folder / NEXT_KEY, folder / SIGNING_KEY)
    return statement


def finish_pending(folder: Path) -> bool:
    """Put a rotation's new key in place if a crash cut it after its statement was written;
    drop a new key whose statement never was. True if a key was put in place."""
    pending = folder / NEXT_KEY
    if not pending.exists():
        return False
    statements = read_statements(folder)
    if statements and statements[-1]["new"] == auth.Identity.load(pending).public_key:
        os.replace(pending, folder / SIGNING_KEY)
        return True
    pending.unlink()
    return False


def load(core: CoordinatorBase, saved: list[dict[str, Any]]) -> None:
    """On start, ``core.keys`` from disk: the scheduler's statements (``key_rotations.json``),
    or an owner's ``saved`` ones (its coordinator.json), followed from the manifest's key."""
    if core.is_scheduler:
        if finish_pending(core.root):
            use_identity(core, auth.Identity.load(core.root / SIGNING_KEY))
        statements = read_statements(core.root)
        if not statements:
            return
        # From the first key the statements name to ours: a key replaced by hand (not rotated)
        # ends the chain, and owners then cannot follow; say so.
        try:
            key, retired, used = keyrotation.follow(
                statements[0]["old"], statements, core.run_id, core.identity.public_key
            )
        except keyrotation.RotationError as exc:
            log.warning("%s: %s; owners and peers cannot follow it", core.root / ROTATIONS, exc)
            return
        core.keys.accept(key, retired, used)
        return
    if saved:
        try:
            key, retired, used = keyrotation.follow(core.keys.current, saved, core.run_id)
        except keyrotation.RotationError as exc:
            raise CorruptFileError(
                f"{core.root / 'coordinator.json'}: its scheduler key rotations do not follow "
                f"from the manifest's key: {exc}"
            ) from None
        accept(core, key, retired, used)


def use_identity(core: CoordinatorBase, identity: auth.Identity) -> None:
    """The scheduler signs with ``identity`` from now on (a rotation finished on start)."""
    core.identity = identity
    core.keys.use(identity.public_key)
    core.owner_keys[core.owner_id] = identity.public_key
    core.peer_config["coordinator_key"] = identity.public_key
    core.access.self_keys.add(identity.public_key)


def accept(core: CoordinatorBase, key: str, retired: dict[str, int], used: list[dict]) -> None:
    """An owner trusts ``key`` as the scheduler's from now on, and the retired keys for the
    tickets of their epochs."""
    core.keys.accept(key, retired, used)
    core.access.self_keys.add(key)


def follow(core: CoordinatorBase, scheduler: Transport) -> bool:
    """Learn the scheduler's rotated key after it answered with one this owner does not trust.

    Asks for the statements with a ``Hello`` whose reply is taken from any key: what it says is
    used only if the statements, signed by the key this owner trusts, lead to the key that
    signed the reply. True when the owner now trusts that key; False (counted ``bad-rotation``,
    the old key kept) otherwise.
    """
    identity, trusted, on_pin = scheduler.identity, scheduler.server_key, scheduler.on_pin
    scheduler.authenticate(identity, None, None)
    seen: str | None = None
    try:
        welcome = scheduler.request(m.Hello(peer_id=core.owner_id, device="coordinator"))
        seen = scheduler.server_key
        if not isinstance(welcome, m.Welcome) or seen is None:
            raise keyrotation.RotationError("the scheduler did not answer Hello with a Welcome")
        with core.lock:
            start_key = core.keys.current
        key, retired, used = keyrotation.follow(start_key, welcome.rotations, core.run_id, seen)
    except keyrotation.RotationError as exc:
        scheduler.authenticate(identity, trusted, on_pin)
        who = f"key:{auth.fingerprint(seen)}" if seen else "scheduler"
        with core.lock:
            core.refusals.count(who, Reason.BAD_ROTATION)
            core.journal.save()
        log.error("refused the scheduler's new key: %s (%s)", exc, Reason.BAD_ROTATION)
        core.metrics({"event": "key_rotation_refused", "reason": str(exc)})
        return False
    except DipacoError:
        scheduler.authenticate(identity, trusted, on_pin)
        raise
    scheduler.authenticate(identity, key, on_pin)
    if key == start_key:  # a reply refused for another reason (a stale nonce): nothing moved
        return True
    with core.lock:
        accept(core, key, retired, [*core.keys.rotations, *used])
        core.journal.save()
    log.warning("the scheduler's key is now %s (rotated from %s)", key, start_key)
    core.metrics({"event": "scheduler_key_rotated", "key": key, "from": start_key})
    return True
