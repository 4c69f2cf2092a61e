"""Fuzzing the wire: frames, messages and tensor files decode to a valid value or a WireError.

Promise 1 (docs/design.md, "Promises"): bad input gets a clear error, never a crash. Every
example is either a random byte string or a small mutation of a valid encoding, so the decoder's
later checks (the header's shape, tensor specs, lengths, message fields and their types) are
reached as well.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from _fuzzing import (
    FUZZ,
    assert_clean_error,
    byte_mutations,
    frame_mutations,
    json_values,
    pack_frame,
)
from hypothesis import given
from hypothesis import strategies as st

from dipaco.errors import CorruptFileError, DipacoError, WireError
from dipaco.protocols import messages as m
from dipaco.protocols import wire


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = math.prod(shape)
    return torch.arange(n, dtype=torch.float64).reshape(shape).to(dtype)


# One valid instance of each kind of message a coordinator or a peer decodes.
VALID_MESSAGES = [
    m.Hello(peer_id="p0", device="cpu", capabilities={"memory_gb": 8, "tags": ["a"]}),
    m.ClaimTask(peer_id="p0", prefer_path=3),
    m.FetchModules(peer_id="p0", task_id="P0-r0-e0-a0", have={"S.embed": 2}, ticket="abc.def"),
    m.Heartbeat(peer_id="p0", task_id="P0-r0-e0-a0", step=4),
    m.SubmitDelta(
        peer_id="p0",
        task_id="P0-r0-e0-a0",
        path=0,
        base_versions={"L0.M0": 0, "S.embed": 0},
        tokens=128,
        losses=[2.5, 2.25],
        tensors={"L0.M0/w": _t(2, 3), "S.embed/e": _t(4, dtype=torch.float16)},
        ticket="abc.def",
        codec="lossless",
    ),
    m.TaskDone("p0", "P0-r0-e0-a0", "abc.def", 128, [1.0], ["L0.M0"]),
    m.FetchFile(peer_id="p0", name="tokenizer.model", offset=0, length=4096),
    m.OwnerReport("o1", "proof", {"L0.M0": {"version": 1, "hash": "ab", "pending": [0]}}),
    m.HandOver("o1", "proof", ["L0.M0"]),
    m.ConfirmOwnership("o1", "proof", {"L0.M0": "ab"}),
    m.GetStatus(),
    m.TaskOffer("P0-r0-e0-a0", 0, 0, {"L0.M0": 0}, 5, 10, 30, 60.0, 0, ticket="t.s"),
    m.NoTask(reason="busy", retry_after=0.5, finished=False),
    m.Modules({"L0.M0": 1}, {"L0.M0": "ab"}, {"L0.M0/w": _t(3, 2, dtype=torch.bfloat16)}),
    m.DeltaAck(accepted=["L0.M0"], closed=[], task_done=True),
    m.FileChunk("x", 10, "ab", 0, {"data": _t(10, dtype=torch.uint8)}),
    m.ModuleState({"L0.M0": {"version": 1}}, {"L0.M0/params/w": _t(2, dtype=torch.int64)}),
    m.Error(reason="stale", message="too late"),
]
VALID_FRAMES = [bytes(m.encode_message(msg)) for msg in VALID_MESSAGES]


def _decodes_cleanly(data: bytes) -> m.Message | None:
    """The decoded message, or None after a clean WireError; anything else fails the test."""
    try:
        msg = m.decode_message(data)
    except DipacoError as exc:
        assert isinstance(exc, WireError), f"{type(exc).__name__} from the wire decoder"
        assert_clean_error(exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped decode_message: {exc!r}")
    # Whatever decodes must encode again (a coordinator echoes fields in replies and status),
    # except NaN and infinities in float fields, which decode (protocol.md §2) but never encode.
    try:
        m.encode_message(msg)
    except WireError as exc:
        assert "Out of range float" in str(exc), exc
    return msg


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_decoder(data):
    _decodes_cleanly(data)


@FUZZ
@given(st.sampled_from(VALID_FRAMES).flatmap(frame_mutations))
def test_mutated_frames_decode_or_raise_wire_error(data):
    _decodes_cleanly(data)


@FUZZ
@given(st.sampled_from(VALID_FRAMES).flatmap(byte_mutations))
def test_byte_mutations_anywhere_decode_or_raise_wire_error(data):
    _decodes_cleanly(data)


specs = st.tuples(
    st.text(max_size=6),
    st.sampled_from(sorted(wire.DTYPES)),
    st.lists(st.integers(0, 3), max_size=3),
)


@FUZZ
@given(
    type_=st.text(min_size=1, max_size=12),
    fields=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    spec_list=st.lists(specs, max_size=4, unique_by=lambda s: s[0]),
)
def test_valid_frames_round_trip_exactly(type_, fields, spec_list):
    tensors = {
        name: torch.randint(0, 100, shape or [], dtype=torch.int64).to(wire.DTYPES[dt])
        for name, dt, shape in spec_list
    }
    frame = wire.Frame(type_, fields, tensors)
    try:
        data = wire.encode(frame)
    except WireError:  # NaN, infinity or an int beyond 64 bits: refused when encoding too
        assert _out_of_range(fields)
        return
    back = wire.decode(data)
    assert back.type == type_ and back.fields == fields
    assert list(back.tensors) == list(tensors)
    for name, t in tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t)


def _out_of_range(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > 2**63 - 1
    if isinstance(value, dict):
        return any(_out_of_range(v) for v in value.values())
    if isinstance(value, list):
        return any(_out_of_range(v) for v in value)
    return False


def test_deeply_nested_headers_are_refused_not_a_recursion_error():
    for depth in (100, 5_000, 200_000):
        header = '{"type":"Hello","fields":{"peer_id":"p","capabilities":{"x":' + "[" * depth
        header += "]" * depth + '}},"tensors":[]}'
        data = b"DPCO\x01" + len(header).to_bytes(4, "little") + header.encode()
        msg = _decodes_cleanly(data)
        assert msg is None or depth <= wire.Limits().max_depth


# Texts with a value that breaks the rules: loads_checked checks numbers as the parser makes
# them and walks the strings only where the bytes hold a surrogate escape or a long text.
_ONLY_THE_WALK_REFUSES = [
    '"\\ud800"',
    '{"a":["x\\uDBFFy"]}',
    '"\\udc00\\ud800"',
    "[9223372036854775808]",
    "[-9223372036854775809]",
    "[1.0e400]",
    "[-2E+308]",
    '["' + "x" * (wire.MAX_TEXT + 1) + '"]',
]


@pytest.mark.parametrize("text", _ONLY_THE_WALK_REFUSES, ids=lambda t: t[:24])
def test_headers_with_a_bad_number_or_string_are_refused(text):
    with pytest.raises(WireError):
        wire.loads_checked(text.encode())


scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),  # surrogates included: json.dumps escapes them
    st.booleans(),
    st.none(),
)


@FUZZ
@given(
    value=st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
        max_leaves=12,
    ),
    exponent=st.integers(-400, 400),
)
def test_loads_checked_passes_only_what_the_walk_over_every_value_passes(value, exponent):
    """Whatever loads_checked accepts, the walk over every value accepts too."""
    for text in (json.dumps(value), json.dumps([value])[:-1] + f",1e{exponent}]"):
        try:
            back = wire.loads_checked(text.encode())
        except WireError:
            continue
        wire._check_scalars(back, "header")  # raises if a bad value got through


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_inside_free_form_fields_are_refused(bad):
    # A NaN in Hello.capabilities would be stored, then break every later Status reply (the
    # encoder refuses NaN); the decoder refuses it where the annotation is not float.
    header = {"type": "Hello", "fields": {"peer_id": "p", "capabilities": {"x": [bad]}}}
    with pytest.raises(WireError, match="finite"):
        m.decode_message(pack_frame({**header, "tensors": []}, b""))
    # Float fields refuse them too (issue 17: every float from outside is finite or refused;
    # an honest peer's encoder never writes them).
    losses = {"type": "TaskDone", "tensors": []}
    losses["fields"] = {
        "peer_id": "p",
        "task_id": "t",
        "ticket": "",
        "tokens": 1,
        "losses": [bad],
        "modules": [],
    }
    with pytest.raises(WireError, match="finite"):
        m.decode_message(pack_frame(losses, b""))


# ---- tensor files (the module store's and the peer's files on disk) ---------------------------

VALID_FILE = bytes(wire.encode(wire.Frame("Delta", {"path": 0}, {"w": _t(4, 4)})))


@FUZZ
@given(
    body=st.one_of(byte_mutations(VALID_FILE, focus=64), frame_mutations(VALID_FILE)),
    fix_checksum=st.booleans(),
)
def test_mutated_tensor_files_read_or_raise_corrupt_file_error(
    tmp_path_factory, body, fix_checksum
):
    path = tmp_path_factory.getbasetemp() / "fuzz-tensor-file.dpt"
    digest = hashlib.sha256(body).digest() if fix_checksum else hashlib.sha256(VALID_FILE).digest()
    path.write_bytes(body + digest)
    try:
        frame = wire.read_tensor_file(path)
    except DipacoError as exc:
        assert isinstance(exc, CorruptFileError), type(exc).__name__
        assert_clean_error(exc)
        assert str(path) in str(exc)  # the message names the file
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__} escaped read_tensor_file: {exc!r}")
    assert fix_checksum or body == VALID_FILE
    assert isinstance(frame, wire.Frame)


@FUZZ
@given(st.binary(max_size=300))
def test_random_tensor_files_raise_corrupt_file_error(tmp_path_factory, raw):
    path = tmp_path_factory.getbasetemp() / "fuzz-random-file.dpt"
    path.write_bytes(raw)
    with pytest.raises(CorruptFileError):
        wire.read_tensor_file(path)
