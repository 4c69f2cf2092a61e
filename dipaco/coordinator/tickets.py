"""Signed tickets and proofs between coordinators, so that module owners need not ask the scheduler.

The scheduler signs each task it leases (task id, peer, path, round, module versions, weight)
with its Ed25519 key; a module owner accepts the task's fetches and deltas when the ticket
verifies against the scheduler's public key (from the run manifest) and names the caller. Owners
prove themselves to the scheduler the same way (``prove``/``check``: a signature by the owner's
key over the purpose, the owner id and the payload); the scheduler accepts only owner keys that
its operator allowed (``dipaco-coordinator allow --owner KEY``).

After a rotation of the scheduler's key (dipaco.protocols.keyrotation) a ticket verifies against
the current key, or against a retired one if its task was issued in an epoch that key signed
for (``read_ticket_from``): tickets already issued stay good, new ones need the new key.
:class:`SchedulerKeys` is the coordinator's part that holds those keys (rotation.py changes
them).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from typing import Any

from dipaco.protocols.auth import Identity, canonical, check_payload, sign_payload, verify

# What a signature is for, signed with the payload: a ticket is never read as a verdict.
TICKET, VERDICT = b"ticket\n", b"verdict\n"


def sign_ticket(identity: Identity, payload: dict[str, Any], domain: bytes = TICKET) -> str:
    body = canonical(payload)
    return base64.urlsafe_b64encode(body).decode() + "." + identity.sign(domain + body)


def read_ticket(public_key: str, ticket: str, domain: bytes = TICKET) -> dict[str, Any] | None:
    """The ticket's payload, or None when it is malformed or was not signed by ``public_key``
    (for ``domain``: a ticket, or a scorer's verdict)."""
    if not isinstance(ticket, str):
        return None
    encoded, _, sig = ticket.partition(".")
    try:
        body = base64.urlsafe_b64decode(encoded.encode())
    except (binascii.Error, ValueError):
        return None
    if not verify(public_key, sig, domain + body):
        return None
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


_EPOCH = re.compile(r"-e(\d+)-a\d+$")


def epoch_of(task_id: Any) -> int | None:
    """The restart epoch a scheduler task id was issued in (``P<p>-r<r>-e<epoch>-a<n>``)."""
    match = _EPOCH.search(task_id) if isinstance(task_id, str) else None
    return int(match.group(1)) if match else None


def read_ticket_from(
    keys: Iterable[tuple[str, int | None]], ticket: str, domain: bytes = TICKET
) -> dict[str, Any] | None:
    """The payload of a ticket signed by one of ``keys``: (key, None) for the current scheduler
    key, (key, epoch) for a retired one, good only for tasks of that epoch or earlier."""
    for key, last_epoch in keys:
        payload = read_ticket(key, ticket, domain)
        if payload is None:
            continue
        epoch = epoch_of(payload.get("task"))
        if last_epoch is None or (epoch is not None and epoch <= last_epoch):
            return payload
        return None
    return None


def prove(identity: Identity, purpose: str, owner_id: str, payload: Any) -> str:
    return sign_payload(identity, f"owner/{purpose}/{owner_id}", payload)


def check(public_key: str, proof: str, purpose: str, owner_id: str, payload: Any) -> bool:
    return check_payload(public_key, proof, f"owner/{purpose}/{owner_id}", payload)


class SchedulerKeys:
    """The scheduler's keys as a coordinator knows them, a part of the coordinator that owns
    this state and nothing else:

    - ``current``: the scheduler's key now, whose tickets and replies are accepted;
    - ``retired``: each earlier key with the last epoch it signed for (its tickets stay good
      for tasks of those epochs);
    - ``rotations``: the rotation statements that lead from the manifest's key to ``current``
      (the scheduler serves them in ``Welcome.rotations``; an owner saves them in its
      coordinator.json and follows them again on start).
    """

    def __init__(self, current: str) -> None:
        self.current = current
        self.retired: dict[str, int] = {}
        self.rotations: list[dict[str, Any]] = []

    def trusted(self) -> list[tuple[str, int | None]]:
        """(key, None) for the current key, (key, last epoch) for each retired one: what
        ``read_ticket_from`` takes."""
        return [(self.current, None), *self.retired.items()]

    def accept(self, key: str, retired: dict[str, int], rotations: list[dict[str, Any]]) -> None:
        """``key`` is the scheduler's from now on, reached by ``rotations``; ``retired`` keys
        keep the tickets of their epochs."""
        self.retired.update(retired)
        self.retired.pop(key, None)
        self.rotations = rotations
        self.current = key

    def use(self, key: str) -> None:
        """The scheduler signs with ``key`` from now on (its own rotation, finished on start:
        the statements that retire the old key are read next, with ``accept``)."""
        self.current = key

    def read(self, ticket: str, domain: bytes = TICKET) -> dict[str, Any] | None:
        """The payload of ``ticket`` (or of a verdict, ``domain``) if one of these keys signed
        it for its task's epoch."""
        return read_ticket_from(self.trusted(), ticket, domain)
