"""Fuzzing signed envelopes: a mutated envelope opens to what was signed, or is refused.

``open_request`` runs on every request before anything else, on bytes from anyone: it must
refuse every malformed, truncated or tampered envelope with a RejectedError (reasons unsigned,
bad-envelope, bad-signature), and ``open_reply`` every bad reply with a WireError; never another
exception, and never a body other than the one that was signed.
"""

from __future__ import annotations

import pytest
from _fuzzing import FUZZ, assert_clean_error, byte_mutations
from hypothesis import given
from hypothesis import strategies as st

from dipaco.errors import DipacoError, RejectedError, WireError
from dipaco.protocols import auth

IDENTITY = auth.Identity.generate()
BODY = b"DPCO\x01" + b"x" * 40
# Fixed time and nonce would need private hooks; one sealed request and reply serve as seeds.
REQUEST, NONCE = auth.seal_request(IDENTITY, BODY, now=1_700_000_000.0)
REPLY = auth.seal_reply(IDENTITY, NONCE, BODY)


@FUZZ
@given(st.one_of(byte_mutations(REQUEST, focus=250), st.binary(max_size=300)))
def test_mutated_requests_open_to_the_signed_body_or_are_refused(raw):
    try:
        signed = auth.open_request(raw)
    except DipacoError as exc:
        assert isinstance(exc, RejectedError), type(exc).__name__
        assert_clean_error(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped open_request: {exc!r}")
    assert signed.body == BODY and signed.key == IDENTITY.public_key


@FUZZ
@given(st.one_of(byte_mutations(REPLY, focus=250), st.binary(max_size=300)))
def test_mutated_replies_open_to_the_signed_body_or_raise_wire_error(raw):
    try:
        signed = auth.open_reply(raw, NONCE, IDENTITY.public_key)
    except DipacoError as exc:
        assert isinstance(exc, WireError), type(exc).__name__
        assert_clean_error(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped open_reply: {exc!r}")
    assert signed.body == BODY
