"""Who the peer is, and which coordinator it trusts: its stable peer id and pinned coordinator keys.

A peer's id is ``--peer-id``, else the one its state folder was given before (``peer_id``), else
a new one, written there. The coordinator's key is the one given (``--coordinator-key``, or a
Flower node's ``coordinator-key``), else the one this state folder pinned for the coordinator's
address before (``known_coordinators.json``), else the first key seen, trusted and pinned on first
use, like ssh's known_hosts, with a warning.

When the scheduler rotates its key (``dipaco-coordinator rotate-key``), a reply signed by the new
key is refused as ``untrusted-reply``; ``follow_rotation`` then asks for the rotation statements
and moves the peer's trust, and its pin, to the new key only if statements signed by the key it
trusted lead there (dipaco.protocols.keyrotation); else ``bad-rotation``. A joined peer's link to
the scheduler (``FollowingLink``) does that by itself on such a refusal, and asks again.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from dipaco.errors import WireError
from dipaco.fileio import write_json_atomic
from dipaco.protocols import keyrotation
from dipaco.protocols import messages as m
from dipaco.protocols.auth import check_public_key, fingerprint
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import ByteBuffer, Outgoing

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


def follow_rotation(
    transport: Transport, state_dir: Path, address: str, peer_id: str, run_id: str
) -> str:
    """Trust the scheduler's rotated key: the new key, once statements signed by the trusted
    one lead to it; the pin in ``known_coordinators.json`` follows (if ``address`` had one).

    Call it when a reply from the scheduler was refused as ``untrusted-reply``. Raises
    :class:`~dipaco.protocols.keyrotation.RotationError` (reason ``bad-rotation``) and keeps
    the old key when they do not.
    """
    identity, trusted, on_pin = transport.identity, transport.server_key, transport.on_pin
    if trusted is None:
        raise keyrotation.RotationError("no coordinator key is trusted yet: nothing to follow")
    transport.authenticate(identity, None, None)
    try:
        welcome = transport.request(m.Hello(peer_id=peer_id))
        seen = transport.server_key or ""
        if not isinstance(welcome, m.Welcome):
            raise keyrotation.RotationError("the scheduler did not answer Hello with a Welcome")
        key, _, _ = keyrotation.follow(trusted, welcome.rotations, run_id, seen)
    except Exception:
        transport.authenticate(identity, trusted, on_pin)
        raise
    transport.authenticate(identity, key, on_pin)
    if key == trusted:  # a reply refused for another reason (damaged on the way): nothing moved
        return key
    file = state_dir / KNOWN_COORDINATORS
    known = json.loads(file.read_text()) if file.exists() else {}
    if known.get(address) == trusted:
        write_json_atomic(file, {**known, address: key})
    log.warning(
        "the coordinator's key moved from %s to %s (a signed rotation)",
        fingerprint(trusted),
        fingerprint(key),
    )
    return key


class _View(Transport):
    """Another view of ``link``: its own keys, the same connection."""

    def __init__(self, link: Transport) -> None:
        self.link = link

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        return self.link._roundtrip(data)


class FollowingLink(Transport):
    """A peer's transport to the scheduler that follows a signed rotation of its key.

    A reply refused as ``untrusted-reply`` while a key is trusted makes it follow the rotation
    (``follow_rotation``, on a view of the same link, so that requests of other threads keep
    insisting on the trusted key meanwhile) and send the request once more, to the new key:
    every request a peer sends may be repeated (a claim whose reply was lost leaves a lease to
    expire; a delta or a TaskDone sent again is acknowledged again). A rotation that does not
    lead to the key that answered raises ``RotationError`` (``bad-rotation``): the peer stops.

    Args:
        link: the transport that carries the bytes (its own keys are not used).
        state_dir: the folder of ``known_coordinators.json``, whose pin for ``address`` follows.
        address: the address the peer joined, as pinned.
        peer_id: the peer's id, said in the ``Hello`` that asks for the statements.
        run_id: the run's id, which the statements must name; None to learn it from the first
            ``Welcome`` (no rotation is followed before one).
    """

    def __init__(
        self,
        link: Transport,
        state_dir: Path,
        address: str,
        peer_id: str,
        run_id: str | None = None,
    ) -> None:
        self.link, self.state_dir, self.address = link, Path(state_dir), address
        self.peer_id, self.run_id = peer_id, run_id
        self._following = threading.Lock()

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        return self.link._roundtrip(data)

    def request(self, msg: m.Message) -> m.Message:
        trusted = self.server_key
        try:
            reply = super().request(msg)
        except WireError as exc:
            if exc.reason != "untrusted-reply" or trusted is None or self.run_id is None:
                raise
            self._follow(trusted)
            reply = super().request(msg)
        if isinstance(reply, m.Welcome) and self.run_id is None:
            self.run_id = reply.run_id
        return reply

    def _follow(self, trusted: str) -> None:
        with self._following:
            if self.server_key != trusted:  # another thread's request followed it already
                return
            view = _View(self.link).authenticate(self.identity, trusted, self.on_pin)
            run_id = self.run_id or ""
            key = follow_rotation(view, self.state_dir, self.address, self.peer_id, run_id)
            self.server_key = key

    def close(self) -> None:
        self.link.close()
