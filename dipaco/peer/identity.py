"""Who the peer is, and which coordinator it trusts: its stable peer id and pinned coordinator keys.

A peer's id is ``--peer-id``, else the one its state folder was given before (``peer_id``), else
a new one, written there. The coordinator's key is the one given (``--coordinator-key``, or a
Flower node's ``coordinator-key``), else the one this state folder pinned for the coordinator's
address before (``known_coordinators.json``), else the first key seen, trusted and pinned on first
use, like ssh's known_hosts, with a warning.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from dipaco.fileio import write_json_atomic
from dipaco.protocols.auth import check_public_key

log = logging.getLogger(__name__)

KNOWN_COORDINATORS = "known_coordinators.json"


def stable_peer_id(state_dir: Path, given: str | None) -> str:
    """The peer's id: ``given``, else the one this state folder was given before, else new."""
    file = state_dir / "peer_id"
    if given:
        return given
    if file.exists():
        return file.read_text().strip()
    peer_id = f"{socket.gethostname()}-{secrets.token_hex(3)}"
    state_dir.mkdir(parents=True, exist_ok=True)
    file.write_text(peer_id + "\n")
    return peer_id


def coordinator_trust(
    state_dir: Path,
    address: str,
    given: str | None,
    on_first_use: Callable[[str], None] | None = None,
) -> tuple[str | None, Callable[[str], None]]:
    """The coordinator key to insist on, and what to do when one is first seen (``pin``).

    ``given`` wins; else the key this state folder pinned for ``address`` before; else None,
    and ``pin(key)`` trusts the first key seen: it tells ``on_first_use`` (by default a logged
    warning) and keeps the key for ``address`` in the state folder.
    """
    file = state_dir / KNOWN_COORDINATORS
    known = json.loads(file.read_text()) if file.exists() else {}
    key = check_public_key(given) if given else known.get(address)

    def pin(seen: str) -> None:
        if on_first_use is None:
            log.warning("trusting coordinator key %s on first use (%s)", seen, address)
        else:
            on_first_use(seen)
        write_json_atomic(file, {**known, address: seen})

    return key, pin
