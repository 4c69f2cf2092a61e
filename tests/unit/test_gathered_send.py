"""A large delta goes out from its own memory and comes in as one buffer: the peer's encoded,
sealed request is Pieces whose tensor parts are the delta's tensors (not a copy of them), its
envelope verifies as the joined bytes would, and the loopback and hivemind framings carry it
byte for byte; the receiver's buffer is its own, and a delta decoded from it is views of it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.hivemind.framing import CHUNK, Assembly, pieces
from dipaco.protocols.transport import LoopbackServer, LoopbackTransport
from dipaco.protocols.wire import GATHER_BYTES, Pieces, is_received, joined

KEY = b"k" * 32


def _delta(n: int = 700_000) -> m.SubmitDelta:
    g = torch.Generator().manual_seed(0)
    return m.SubmitDelta(
        peer_id="p",
        task_id="t",
        path=0,
        base_versions={"S.embed": 0, "L0.0": 0},
        tokens=1,
        losses=[1.0],
        tensors={
            "S.embed/weight": torch.randn(n, generator=g),
            "L0.0/w": torch.randn(n // 2 + 3, generator=g),
            "L0.0/b": torch.randn(5, generator=g),
        },
        ticket="x",
        codec="lossless",
    )


def _address(t: torch.Tensor) -> int:
    return t.data_ptr()


def test_a_large_request_is_sent_from_its_tensors_memory_and_verifies_as_one_buffer():
    msg = _delta()
    room = auth.ENVELOPE_ROOM
    body = m.encode_message_gathered(msg, room=room)
    assert isinstance(body, Pieces)
    # The tensor parts are the tensors' own memory: no copy was made of them.
    starts = {np.frombuffer(p, dtype=np.uint8).ctypes.data for p in body.parts[1:]}
    assert {_address(t) for t in msg.tensors.values()} <= starts
    identity = auth.Identity.generate()
    sealed, nonce = auth.seal_request(identity, body, room=room)
    assert isinstance(sealed, Pieces)
    whole = sealed.join()
    opened = auth.open_request(whole)
    assert opened.nonce == nonce
    # The same bytes as the one-buffer encoding (both padded to MESSAGE_ALIGN).
    assert bytes(opened.body) == bytes(m.encode_message(msg))
    again = m.decode_message(opened.body)
    for name, t in msg.tensors.items():
        assert torch.equal(again.tensors[name], t)
    # A bit changed in a tensor after sealing is caught by the envelope's digest.
    msg.tensors["L0.0/w"][0] += 1.0
    with pytest.raises(Exception, match="hash"):
        auth.open_request(sealed.join())


def test_a_small_request_is_one_buffer():
    small = _delta(1000)
    assert sum(t.numel() * 4 for t in small.tensors.values()) < GATHER_BYTES
    assert isinstance(m.encode_message_gathered(small), bytearray)


@pytest.mark.parametrize(
    "sizes",
    [[5], [CHUNK], [CHUNK + 1, 3], [10, 2 * CHUNK + 7, CHUNK - 10, 10], [CHUNK - 1, 1, CHUNK]],
)
def test_hivemind_pieces_of_pieces_are_the_bytes_in_chunks(sizes):
    parts = [os.urandom(n) for n in sizes]
    out = list(pieces(Pieces([bytearray(p) for p in parts])))
    assert b"".join(out) == b"".join(parts)
    assert all(len(piece) == CHUNK for piece in out[:-1]) and 0 < len(out[-1]) <= CHUNK
    got = Assembly(sum(sizes))
    for piece in out:
        got.add(piece)
    assert got.got == got.size and bytes(got.buffer) == b"".join(parts)
    with pytest.raises(ValueError):
        got.add(b"x")  # beyond the announced size


def test_loopback_carries_pieces_and_the_server_owns_what_it_received():
    seen: list[tuple[bool, int]] = []

    def handler(data):
        seen.append((is_received(data), len(data)))
        return bytes(data)  # echo

    server = LoopbackServer(handler, KEY)
    transport = LoopbackTransport(server.address, KEY, timeout=30)
    try:
        body = m.encode_message_gathered(_delta(), room=auth.ENVELOPE_ROOM)
        assert isinstance(body, Pieces)
        sealed, _ = auth.seal_request(auth.Identity.generate(), body, room=auth.ENVELOPE_ROOM)
        reply = transport._roundtrip(sealed)
        assert bytes(reply) == bytes(sealed.join())
        assert is_received(reply)  # the client's own buffer too
        assert seen == [(True, len(sealed))]
        # The same bytes as one buffer take the same way.
        assert bytes(transport._roundtrip(joined(sealed))) == bytes(sealed.join())
        assert bytes(transport._roundtrip(b"ping")) == b"ping"
    finally:
        transport.close()
        server.close()


def test_a_message_received_into_its_own_buffer_decodes_to_views_of_it():
    msg = _delta()
    room = auth.ENVELOPE_ROOM
    sealed, _ = auth.seal_request(
        auth.Identity.generate(), m.encode_message_gathered(msg, room=room), room=room
    )
    received = bytearray(sealed.join())  # as a transport received it
    body = auth.open_request(received).body
    base = np.frombuffer(received, dtype=np.uint8).ctypes.data
    views = m.decode_message(body, copy=False)
    for name, t in views.tensors.items():
        assert base <= t.data_ptr() < base + len(received), name  # aligned: a view, no copy
        assert torch.equal(t, msg.tensors[name])
    copies = m.decode_message(body)
    assert all(not base <= t.data_ptr() < base + len(received) for t in copies.tensors.values())
