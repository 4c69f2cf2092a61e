"""Issue 17, breaks 4 and 5: extreme values in a frame or an envelope are refused by the one
checked parser, with the project's own error and reason, and counted against the sender; no NaN
or infinity gets past it to a check, a state file or the status JSON.

Each hostile request is written by hand (the encoder refuses these values), signed with a real
key and given to a real coordinator's wire handler."""

import json
import struct

import pytest
import torch

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import WireError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.wire import MAGIC, VERSION, decode, encode, loads_checked, read_tensor_file

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
TOPO = Topology.parse("2x2", 2)


def frame(header_json: str, payload: bytes = b"") -> bytes:
    head = header_json.encode("utf-8", "surrogatepass")
    return MAGIC + struct.pack("<BI", VERSION, len(head)) + head + payload


HOSTILE_HEADERS = {
    "an integer beyond the int-string limit": (
        '{"type":"Heartbeat","fields":{"peer_id":"p","step":' + "9" * 5000 + '},"tensors":[]}'
    ),
    "an integer beyond 64 bits": (
        '{"type":"Heartbeat","fields":{"peer_id":"p","step":' + "9" * 30 + '},"tensors":[]}'
    ),
    "a float that overflows": (
        '{"type":"TaskDone","fields":{"peer_id":"p","task_id":"t","ticket":"","tokens":1,'
        '"losses":[1e999],"modules":[]},"tensors":[]}'
    ),
    "NaN": (
        '{"type":"TaskDone","fields":{"peer_id":"p","task_id":"t","ticket":"","tokens":1,'
        '"losses":[NaN],"modules":[]},"tensors":[]}'
    ),
    "-Infinity": (
        '{"type":"Hello","fields":{"peer_id":"p","capabilities":{"x":-Infinity}},"tensors":[]}'
    ),
    "a lone surrogate": '{"type":"Heartbeat","fields":{"peer_id":"\\ud800"},"tensors":[]}',
    "a lone surrogate in a key": (
        '{"type":"Hello","fields":{"peer_id":"p","capabilities":{"\\udfff":1}},"tensors":[]}'
    ),
    "a zero-element tensor with overflowing sizes": (
        '{"type":"Heartbeat","fields":{"peer_id":"p"},'
        '"tensors":[["x","float32",[0,4611686018427387904,4611686018427387904]]]}'
    ),
    "token counts beyond float range": (
        '{"type":"TaskDone","fields":{"peer_id":"p","task_id":"t","ticket":"","tokens":'
        + "1"
        + "0" * 400
        + ',"losses":[],"modules":[]},"tensors":[]}'
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_the_frame_decoder_refuses_extreme_values_with_its_own_error(case):
    with pytest.raises(WireError):
        m.decode_message(frame(HOSTILE_HEADERS[case]))


def test_a_stored_file_with_extreme_values_is_reported_corrupt_not_crashed_on(tmp_path):
    import hashlib

    from dipaco.errors import CorruptFileError

    body = frame(HOSTILE_HEADERS["an integer beyond the int-string limit"])
    path = tmp_path / "head.dpt"
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(CorruptFileError):
        read_tensor_file(path)


def test_loads_checked_accepts_what_the_encoder_writes():
    msg = m.SubmitDelta(
        peer_id="p\u00e9\U0001f600", task_id="t", path=3, base_versions={"L0.M0": 2**62},
        tokens=10**12, losses=[1.5, -0.0, 1e300], tensors={"x": torch.zeros(0, 7)},
    )  # fmt: skip
    back = m.decode_message(m.encode_message(msg))
    assert (back.peer_id, back.base_versions, back.tokens, back.losses) == (
        msg.peer_id, msg.base_versions, msg.tokens, msg.losses
    )  # fmt: skip
    assert back.tensors["x"].shape == (0, 7)
    assert loads_checked(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    assert decode(encode(m.to_frame(msg))).fields["losses"] == [1.5, -0.0, 1e300]


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def coordinator(tmp_path):
    co = Coordinator(
        tmp_path, TOPO, rounds=2, inner_steps=5, step_offset=10, total_steps=20, seed=0,
        outer=OuterSettings(), lease_seconds=100.0, run_id="hostile", peer_config={},
        clock=Clock(), metrics=lambda e: None,
    )  # fmt: skip
    co.start(TOPO.init_modules(new_dense_model(CFG, 0).state_dict()))
    return co


def ask(co, identity, data: bytes, nonce: str) -> m.Message:
    reply = auth.open_reply(co.handle(data), nonce, co.identity.public_key)
    return m.decode_message(reply.body)


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_the_coordinator_answers_extreme_values_with_a_counted_refusal(coordinator, case):
    me = auth.Identity.generate()
    sealed, nonce = auth.seal_request(me, frame(HOSTILE_HEADERS[case]))
    reply = ask(coordinator, me, sealed, nonce)
    assert isinstance(reply, m.Error) and reply.reason in ("bad-message", "too-large")
    assert coordinator.rejections[reply.reason] == 1
    # Nothing of it reached what the coordinator shows or saves.
    json.dumps(coordinator.status().__dict__, allow_nan=False, default=str)


def envelope(me: auth.Identity, ts_json: str, body: bytes) -> tuple[bytes, str]:
    """A request envelope with ``ts`` written as raw JSON, signed as the real one is."""
    nonce, digest = "n" * 32, auth.body_digest(body)
    sig = me.sign(auth._request_text(me.public_key, float("nan"), nonce, digest))
    head = (
        f'{{"key":"{me.public_key}","nonce":"{nonce}","blake3":"{digest}","sig":"{sig}",'
        f'"ts":{ts_json}}}'
    ).encode()
    return auth.REQUEST_MAGIC + struct.pack("<I", len(head)) + head + body, nonce


@pytest.mark.parametrize("ts", ["NaN", "Infinity", "1e999", "9" * 400, "9" * 5000])
def test_an_envelope_timestamp_out_of_range_is_a_counted_bad_envelope(coordinator, ts):
    me = auth.Identity.generate()
    data, _ = envelope(me, ts, m.encode_message(m.Heartbeat(peer_id="p")))
    reply = ask(coordinator, me, data, "")  # an envelope that does not parse has no nonce
    assert isinstance(reply, m.Error)
    assert reply.reason in ("bad-envelope", "bad-signature", "clock-skew"), reply
    assert sum(coordinator.rejections.values()) == 1


def test_a_nan_timestamp_does_not_pass_the_clock_skew_check():
    guard = auth.ReplayGuard(skew_seconds=60)
    with pytest.raises(Exception) as info:
        guard.check(auth.Signed("k", "n", float("nan"), b""), now=1000.0)
    assert getattr(info.value, "reason", None) == "clock-skew"


def test_free_form_fields_are_bounded_so_status_stays_small(coordinator):
    """Issue 17, break 7: megabytes of Hello.capabilities per peer id made every GetStatus reply
    exceed the frame limit."""
    me = auth.Identity.generate()

    def hostile(kind, **fields):  # written by hand: our encoder refuses these too
        return frame(json.dumps({"type": kind, "fields": fields, "tensors": []}))

    for body in (
        hostile("Hello", peer_id="p", capabilities={"blob": "x" * (1 << 20)}),
        hostile("Hello", peer_id="p", capabilities={f"k{i}": "v" * 90 for i in range(60)}),
        hostile("Hello", peer_id="p", device="d" * 1000),
        hostile("Heartbeat", peer_id="p", task_id="t" * (1 << 17)),
    ):
        sealed, nonce = auth.seal_request(me, body)
        reply = ask(coordinator, me, sealed, nonce)
        assert isinstance(reply, m.Error) and reply.reason == "too-large", reply
    assert coordinator.rejections["too-large"] == 4
    sealed, nonce = auth.seal_request(
        me, m.encode_message(m.Hello(peer_id="p", capabilities={"gpu": "H100"}))
    )
    assert isinstance(ask(coordinator, me, sealed, nonce), m.Welcome)
    assert len(m.encode_message(coordinator.status())) < 64 << 10
