"""Rotating the scheduler's key: a statement, signed by the old key, that names the new one.

``dipaco-coordinator rotate-key`` makes a new scheduler key and a *rotation statement*::

    {"run": run id, "seq": 1, 2, ..., "old": old public key, "new": new public key,
     "epoch": the last restart epoch whose tickets the old key signed, "sig": ...}

``sig`` is the old key's payload signature (purpose ``scheduler-key-rotation``) of the other
fields. A party that trusts key K (an owner, from the manifest it joined with; a peer, from
``--coordinator-key`` or its pinned key) follows the statements from K, each verified by the key
it retires, to the scheduler's current key; any other key is refused (:class:`RotationError`,
reason ``bad-rotation``). The retired keys stay good for the tickets they signed before the
rotation: the task id carries the epoch it was issued in (``P<p>-r<r>-e<epoch>-a<n>``), and a
rotation takes effect at a scheduler start, which begins a new epoch.
"""

from __future__ import annotations

from typing import Any

from dipaco.errors import DipacoError
from dipaco.protocols.auth import Identity, check_payload, fingerprint, sign_payload
from dipaco.protocols.reasons import Reason

PURPOSE = "scheduler-key-rotation"
FIELDS = ("run", "seq", "old", "new", "epoch")


class RotationError(DipacoError):
    """A key the party trusts was not handed over to the key that answered."""

    reason = Reason.BAD_ROTATION


def make_statement(old: Identity, new_key: str, run_id: str, seq: int, epoch: int) -> dict:
    """The statement by which ``old`` hands the scheduler's role over to ``new_key``."""
    body = {"run": run_id, "seq": seq, "old": old.public_key, "new": new_key, "epoch": epoch}
    return {**body, "sig": sign_payload(old, PURPOSE, body)}


def well_formed(statement: Any) -> bool:
    """The statement has its fields with their types (not whether its signature verifies)."""

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    return (
        isinstance(statement, dict)
        and set(statement) == {*FIELDS, "sig"}
        and all(isinstance(statement[k], str) for k in ("run", "old", "new", "sig"))
        and count(statement["seq"])
        and count(statement["epoch"])
    )


def follow(
    trusted: str, statements: Any, run_id: str, target: str | None = None
) -> tuple[str, dict[str, int], list[dict]]:
    """Follow ``statements`` from the ``trusted`` key: the key they lead to, the keys retired on
    the way (each with the last epoch whose tickets it signed), and the statements followed.

    Each followed statement must be well formed, for this run, the next in sequence, and signed
    by the key it retires. With ``target`` (the key that answered), the chain must end there.
    Raises :class:`RotationError` saying what is wrong.
    """
    if not isinstance(statements, list) or not all(well_formed(s) for s in statements):
        raise RotationError("the key rotation statements are malformed")
    key = trusted
    retired: dict[str, int] = {}
    used: list[dict[str, Any]] = []
    start = next((i for i, s in enumerate(statements) if s["old"] == trusted), None)
    for s in statements[start:] if start is not None else []:
        body = {k: s[k] for k in FIELDS}
        if s["old"] != key or (used and s["seq"] != used[-1]["seq"] + 1):
            raise RotationError(
                f"rotation {s['seq']} does not follow from key {fingerprint(key)} in sequence"
            )
        if s["run"] != run_id:
            raise RotationError(f"rotation {s['seq']} is for run {s['run']!r}, not {run_id!r}")
        if not check_payload(s["old"], s["sig"], PURPOSE, body):
            raise RotationError(
                f"rotation {s['seq']} to key {fingerprint(s['new'])} is not signed by the key it "
                f"retires ({fingerprint(s['old'])})"
            )
        retired[key] = s["epoch"]
        key = s["new"]
        used.append(s)
    if target is not None and key != target:
        raise RotationError(
            f"the scheduler answered with key {fingerprint(target)}, and no rotation signed by "
            f"the trusted key {fingerprint(trusted)} leads to it"
        )
    return key, retired, used
