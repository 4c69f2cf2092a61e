"""Fuzzing task tickets: a ticket either verifies to exactly what was signed, or reads as None.

Module owners accept a peer's fetches and deltas on the strength of the scheduler's ticket, so
``read_ticket`` must never raise on a peer's string (a crash would be a denial of service) and
must never return a payload that the scheduler did not sign.
"""

from __future__ import annotations

import base64
import inspect
import json

import pytest
from _fuzzing import FUZZ, byte_mutations
from hypothesis import given
from hypothesis import strategies as st

from dipaco.coordinator import tickets

PAYLOAD = {
    "task": "P3-r1-e0-a0",
    "peer": "peer-7",
    "path": 3,
    "round": 1,
    "versions": {"L0.M1": 1, "S.embed": 1},
    "weight": 1234.0,
}


def _keys() -> tuple[object, object]:
    """(what signs, what verifies): an Ed25519 identity and its public key, or a shared secret."""
    if next(iter(inspect.signature(tickets.sign_ticket).parameters)) == "identity":
        from dipaco.protocols.auth import Identity

        identity = Identity.generate()
        return identity, identity.public_key
    return b"fuzz-secret", b"fuzz-secret"


SIGNER, VERIFIER = _keys()
TICKET = tickets.sign_ticket(SIGNER, PAYLOAD)


def _read(ticket: object) -> dict | None:
    try:
        return tickets.read_ticket(VERIFIER, ticket)
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped read_ticket({ticket!r:.60}): {exc!r}")


def test_the_valid_ticket_reads_back():
    assert _read(TICKET) == PAYLOAD


@FUZZ
@given(st.one_of(st.text(max_size=200), st.text(alphabet="abcXYZ019-_=.", max_size=200)))
def test_random_strings_are_not_tickets(text):
    assert _read(text) is None


@FUZZ
@given(byte_mutations(TICKET.encode(), focus=len(TICKET)))
def test_mutated_tickets_read_as_the_signed_payload_or_none(raw):
    text = raw.decode("utf-8", errors="replace")
    got = _read(text)
    assert got is None or got == PAYLOAD, f"a forged ticket verified: {got}"


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(PAYLOAD)), st.integers() | st.text(max_size=5)))
def test_a_payload_edited_under_the_signature_does_not_verify(edit):
    body, _, sig = TICKET.partition(".")
    forged = {**PAYLOAD, **edit}
    canonical = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()
    encoded = base64.urlsafe_b64encode(canonical).decode()
    got = _read(encoded + "." + sig)
    assert got is None or got == PAYLOAD


@pytest.mark.parametrize("ticket", [None, 5, b"abc.def", ["a"], "", ".", "a.b.c", "é.é"])
def test_tickets_of_the_wrong_type_read_as_none(ticket):
    assert _read(ticket) is None
