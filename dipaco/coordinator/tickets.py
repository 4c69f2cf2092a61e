"""HMAC tickets and proofs between coordinators, so that module owners need not ask the scheduler.

The scheduler signs each task it leases (task id, peer, path, round, module versions) with
the run's coordinator secret; a module owner accepts the task's fetches and deltas when the
ticket verifies and names the caller. Owners prove themselves to the scheduler the same way
(``prove``/``check``: an HMAC over the purpose, the owner id and the payload). Issue 5 replaces
the shared secret with Ed25519 signatures; the shape of the checks stays.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from typing import Any


def _canonical(payload: Any) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def sign_ticket(secret: bytes, payload: dict[str, Any]) -> str:
    body = _canonical(payload)
    mac = hmac.new(secret, body, hashlib.sha256).hexdigest()
    return base64.urlsafe_b64encode(body).decode() + "." + mac


def read_ticket(secret: bytes, ticket: str) -> dict[str, Any] | None:
    """The ticket's payload, or None when it is malformed or was not signed with ``secret``."""
    encoded, _, mac = ticket.partition(".")
    try:
        body = base64.urlsafe_b64decode(encoded.encode())
    except (binascii.Error, ValueError):
        return None
    if not hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).hexdigest(), mac):
        return None
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return payload if isinstance(payload, dict) else None


def prove(secret: bytes, purpose: str, owner_id: str, payload: Any) -> str:
    message = purpose.encode() + b"|" + owner_id.encode() + b"|" + _canonical(payload)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def check(secret: bytes, proof: str, purpose: str, owner_id: str, payload: Any) -> bool:
    return hmac.compare_digest(prove(secret, purpose, owner_id, payload), proof)
