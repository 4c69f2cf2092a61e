import json
import pickle
import struct

import pytest
import torch

from dipaco.errors import CorruptFileError, RejectedError, WireError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.wire import (
    DTYPES,
    MAGIC,
    Frame,
    Limits,
    decode,
    encode,
    read_tensor_file,
    write_tensor_file,
)


def frame_bytes(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<4sBI", MAGIC, 1, len(raw)) + raw + body


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_allowed_dtype_round_trips_bit_exactly(dtype):
    x = (torch.randn(3, 5) * 10).to(DTYPES[dtype])
    out = decode(encode(Frame("T", {"k": [1, "a"]}, {"x": x, "scalar": x[0, 0].clone()})))
    assert out.type == "T" and out.fields == {"k": [1, "a"]}
    assert out.tensors["x"].dtype == x.dtype and torch.equal(out.tensors["x"], x)
    assert out.tensors["scalar"].shape == () and torch.equal(out.tensors["scalar"], x[0, 0])


def test_decoded_tensors_are_writable_copies():
    data = encode(Frame("T", {}, {"x": torch.zeros(4)}))
    out = decode(data)
    out.tensors["x"] += 1  # must not raise and must not touch the buffer
    assert torch.equal(decode(data).tensors["x"], torch.zeros(4))


def test_truncated_messages_are_rejected_with_a_clear_error():
    data = encode(Frame("T", {}, {"x": torch.randn(10)}))
    for cut in (0, 3, 8, 20, len(data) - 1):
        with pytest.raises(WireError, match="truncated"):
            decode(data[:cut])


def test_malformed_messages_are_rejected():
    with pytest.raises(WireError, match="not a dipaco message"):
        decode(b"XXXX" + bytes(20))
    with pytest.raises(WireError, match="not valid JSON"):
        decode(struct.pack("<4sBI", MAGIC, 1, 5) + b"{oops")
    with pytest.raises(WireError, match="wire version"):
        decode(struct.pack("<4sBI", MAGIC, 9, 2) + b"{}")
    with pytest.raises(WireError, match="invalid shape"):
        decode(frame_bytes({"type": "T", "tensors": [["x", "float32", [-1]]]}))
    with pytest.raises(WireError, match="appears twice"):
        decode(
            frame_bytes({"type": "T", "tensors": [["x", "uint8", [1]], ["x", "uint8", [1]]]}, b"ab")
        )
    with pytest.raises(WireError, match="trailing"):
        decode(encode(Frame("T")) + b"\x00")


def test_unknown_and_forbidden_dtypes_are_rejected():
    for dtype in ("complex64", "object", "pickle", "float128"):
        with pytest.raises(WireError, match="unknown or forbidden dtype"):
            decode(frame_bytes({"type": "T", "tensors": [["x", dtype, [1]]]}, bytes(16)))
    with pytest.raises(WireError, match="not one of"):
        encode(Frame("T", {}, {"x": torch.zeros(2, dtype=torch.complex64)}))


def test_oversized_messages_are_rejected_before_reading():
    small = Limits(max_header_bytes=64, max_total_bytes=1000)
    with pytest.raises(WireError, match="exceeds the limit"):
        decode(encode(Frame("T", {}, {"x": torch.zeros(1000)})), small)
    with pytest.raises(WireError, match="exceeds the limit"):
        encode(Frame("T", {"pad": "x" * 100}), small)
    huge = frame_bytes({"type": "T", "tensors": [["x", "float32", [1 << 40]]]})
    with pytest.raises(WireError, match="exceeds the size limit"):
        decode(huge)


def test_a_pickle_is_never_unpickled():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    with pytest.raises(WireError):
        m.decode_message(pickle.dumps(Boom()))


def test_messages_round_trip_with_tensors():
    msg = m.SubmitDelta(
        peer_id="p",
        task_id="t",
        path=2,
        base_versions={"L0.M1": 3},
        tokens=100,
        losses=[2.5, 2.25],
        tensors={"L0.M1/w": torch.ones(2, 2)},
    )
    out = m.decode_message(m.encode_message(msg))
    assert isinstance(out, m.SubmitDelta)
    assert out.base_versions == {"L0.M1": 3} and out.losses == [2.5, 2.25]
    assert torch.equal(out.tensors["L0.M1/w"], torch.ones(2, 2))


def test_message_fields_are_type_checked():
    good = json.loads(json.dumps({"peer_id": "p", "task_id": "t"}))
    assert isinstance(m.decode_message(encode(Frame("FetchModules", good))), m.FetchModules)
    with pytest.raises(WireError, match="unknown message type"):
        m.decode_message(encode(Frame("Shutdown", {})))
    with pytest.raises(WireError, match="missing field 'task_id'"):
        m.decode_message(encode(Frame("FetchModules", {"peer_id": "p"})))
    with pytest.raises(WireError, match="FetchModules.have"):
        m.decode_message(encode(Frame("FetchModules", {**good, "have": {"L0.M0": "3"}})))
    with pytest.raises(WireError, match="unknown fields"):
        m.decode_message(encode(Frame("FetchModules", {**good, "admin": True})))
    with pytest.raises(WireError, match="carries no tensors"):
        m.decode_message(encode(Frame("FetchModules", good, {"x": torch.zeros(1)})))
    with pytest.raises(WireError, match="ClaimTask.peer_id"):
        m.decode_message(encode(Frame("ClaimTask", {"peer_id": 5})))


def test_tensor_files_detect_corruption_and_truncation(tmp_path):
    path = tmp_path / "m.dpt"
    write_tensor_file(path, Frame("ModuleRelease", {"version": 1}, {"w": torch.randn(8, 8)}))
    assert read_tensor_file(path).fields == {"version": 1}
    raw = bytearray(path.read_bytes())
    raw[60] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="m.dpt.*checksum"):
        read_tensor_file(path)
    path.write_bytes(bytes(raw[:100]))
    with pytest.raises(CorruptFileError, match="m.dpt"):
        read_tensor_file(path)
    with pytest.raises(CorruptFileError, match="missing"):
        read_tensor_file(tmp_path / "absent.dpt")


def test_tensor_files_are_read_into_aligned_writable_tensors_and_old_files_still_read(tmp_path):
    tensors = {
        "odd": torch.arange(7, dtype=torch.int8),  # puts the next tensor off a 4-byte boundary
        "w": torch.randn(5, 3),
        "d": torch.randn(4, dtype=torch.float64),
    }
    write_tensor_file(tmp_path / "new.dpt", Frame("Delta", {"a": 1}, tensors))
    assert (tmp_path / "new.dpt").read_bytes().endswith(b"DPXXH3\x00\x01")  # XXH3 trailer
    got = read_tensor_file(tmp_path / "new.dpt").tensors
    for name, t in tensors.items():
        assert torch.equal(got[name], t)
        assert got[name].data_ptr() % got[name].element_size() == 0
    got["w"].add_(1.0)  # writable: a view of the caller's own buffer
    # A flipped bit, and a frame with no trailer at all, are refused.
    damaged = bytearray((tmp_path / "new.dpt").read_bytes())
    damaged[-40] ^= 1
    (tmp_path / "bad.dpt").write_bytes(bytes(damaged))
    (tmp_path / "bare.dpt").write_bytes(bytes(encode(Frame("Delta", {"a": 1}, tensors))))
    for name in ("bad.dpt", "bare.dpt"):
        with pytest.raises(CorruptFileError, match="checksum"):
            read_tensor_file(tmp_path / name)


def test_an_envelope_sealed_in_place_is_the_same_bytes_and_never_copies_the_body():
    """The transports seal a message in the room left in front of its frame: the envelope is a
    view of the frame's own buffer, byte for byte what sealing a copy makes, and it verifies."""
    me = auth.Identity.generate()
    msg = m.SubmitDelta("p", "t1", 0, {"L0.M0": 0}, 8, [1.0], {"L0.M0/w": torch.randn(64, 64)})
    room = auth.ENVELOPE_ROOM
    body = m.encode_message(msg, room=room)
    assert bytes(body[room:]) == bytes(m.encode_message(msg))
    sealed, nonce = auth.seal_request(me, body, now=1_700_000_000.0, room=room)
    assert isinstance(sealed, memoryview) and sealed.obj is body  # no new buffer
    opened = auth.open_request(sealed)
    assert opened.key == me.public_key
    assert torch.equal(m.decode_message(opened.body).tensors["L0.M0/w"], msg.tensors["L0.M0/w"])
    # The same envelope as sealing the plain frame (nonces differ: compare the layout).
    plain, _ = auth.seal_request(me, bytes(m.encode_message(msg)), now=1_700_000_000.0)
    assert len(plain) == len(sealed) and bytes(plain[:4]) == bytes(sealed[:4])
    # A body changed after sealing fails the envelope's hash.
    body[-1] ^= 0xFF
    with pytest.raises(RejectedError) as info:
        auth.open_request(sealed)
    assert info.value.reason == Reason.BAD_SIGNATURE
    # A reply sealed in place, and a room too small for the header (sealed by copying).
    reply = m.encode_message(m.Ok(), room=room)
    opened = auth.open_reply(auth.seal_reply(me, nonce, reply, room=room), nonce, me.public_key)
    assert isinstance(m.decode_message(opened.body), m.Ok)
    small = m.encode_message(m.Ok(), room=16)
    sealed_small = auth.seal_reply(me, nonce, small, room=16)
    assert isinstance(sealed_small, bytearray)
    assert isinstance(m.decode_message(auth.open_reply(sealed_small, nonce, None).body), m.Ok)
