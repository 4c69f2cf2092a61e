"""Hostile values in every field of every message and envelope, not only mutated bytes.

For each registered message type a valid example is written as a frame by hand, with one field
(or one value inside a field) replaced by a value drawn from the classes an attacker reaches
for: integers past 64 bits or past Python's int-string limit, NaN and infinity tokens, numbers
too large for a float, lone surrogates, strings past the text bound, path-like names, deep
nesting, long lists, wrong types. The properties:

- the message decoder returns a message of the type, whose every value is a finite 64-bit
  number or a bounded string, or raises the project's own error with a reason (never another
  exception);
- a live coordinator answers every such request, signed by a real key, with a signed reply:
  an Error with its reason, counted once, the modules untouched, or a valid reply;
- the envelope's own fields (key, timestamp, nonce, digest, signature) get the same values and
  are refused as ``bad-envelope`` / ``bad-signature`` / ``unsigned``.

``DIPACO_FUZZ_EXAMPLES`` sets the examples per test (``bench/fuzz.py`` runs 20,000).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import torch
from _fuzzing import FUZZ, assert_clean_error, json_values
from hypothesis import event, given
from hypothesis import strategies as st
from test_fuzz_coordinator import Rig

from dipaco.errors import DipacoError
from dipaco.peer.seeds import Held, Release, SeedServer
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.wire import INT_LIMIT, MAX_TEXT, tensors_sha256

# Raw JSON tokens a Python value cannot stand for: json.dumps writes the marker, then it is
# replaced by the token in the frame's text.
RAW = {
    "@nan@": "NaN",
    "@inf@": "Infinity",
    "@-inf@": "-Infinity",
    "@bigfloat@": "1e400",
    "@endless@": "9" * 5000,  # past Python's int-string limit
    "@surrogate@": '"\\ud800x"',
    "@deep@": "[" * 5000 + "]" * 5000,
}
HOSTILE_SCALARS = [
    None,
    True,
    False,
    0,
    -1,
    INT_LIMIT,
    INT_LIMIT + 1,
    -(2**63) - 1,
    2**200,
    1e308,
    -1e308,
    5e-324,
    "",
    "x" * (MAX_TEXT + 1),
    "../../../../etc/passwd",
    "/abs/path",
    "a\x00b",
    "C:\\windows",
    "é" * 1000,
    [],
    {},
    [0] * 5000,
    {"k" * 300: "v"},
    *RAW,
]
hostile = st.one_of(st.sampled_from(HOSTILE_SCALARS), json_values)


def _sample_tensors() -> dict[str, torch.Tensor]:
    return {"L0.M0/w": torch.zeros(2, 3)}


SAMPLES: dict[str, Any] = {
    "Hello": m.Hello(peer_id="p0", capabilities={"memory_gb": 4}),
    "ClaimTask": m.ClaimTask(peer_id="p0", prefer_path=1, holding=["t"], wait=2.0),
    "FetchModules": m.FetchModules("p0", "P0-r0-e0-a0", {"L0.M0": 0}, "tk"),
    "Heartbeat": m.Heartbeat("p0", "P0-r0-e0-a0", 2),
    "SubmitDelta": m.SubmitDelta("p0", "P0-r0-e0-a0", 0, {"L0.M0": 0}, 100, [2.0], {}, "tk"),
    "TaskDone": m.TaskDone("p0", "P0-r0-e0-a0", "tk", 100, [1.0], ["L0.M0"]),
    "ScoreDelta": m.ScoreDelta("p0", "P0-r0-e0-a0", 0, {"L0.M0": 0}, 100, {}, "tk"),
    "Scored": m.Scored("verdict"),
    "GetOwners": m.GetOwners(),
    "FetchReleases": m.FetchReleases("p0", ["L0.M0"]),
    "FetchSeed": m.FetchSeed("p0", "L0.M0", 3),
    "FetchFile": m.FetchFile("p0", "tokenizer.model", 0, 10),
    "OwnerReport": m.OwnerReport("o1", "proof", {"L0.M0": {"version": 1}}, ["/ip4/1"]),
    "HandOver": m.HandOver("o1", "proof", ["L0.M0"]),
    "ConfirmOwnership": m.ConfirmOwnership("o1", "proof", {"L0.M0": "x"}),
    "ReleaseTask": m.ReleaseTask("p0", "P0-r0-e0-a0"),
    "StandbySync": m.StandbySync(standby_id="s0"),
    "StandbyState": m.StandbyState(epoch=1, tensors={}),
    "GetStatus": m.GetStatus(),
    "Welcome": m.Welcome("run", {"coordinator_key": "k"}, "sig"),
    "TaskOffer": m.TaskOffer(
        "P0-r0-e0-a0", 0, 0, {"L0.M0": 0}, 10, 0, 100, 30.0, 7, "tk", {"L0.M0": "o"}
    ),
    "NoTask": m.NoTask("busy", 0.5, False),
    "Modules": m.Modules({"L0.M0": 0}, {"L0.M0": "h"}, _sample_tensors(), {"L0.M0": "s"}),
    "HeartbeatAck": m.HeartbeatAck(True, 3.0),
    "DeltaAck": m.DeltaAck(["L0.M0"], [], True),
    "ReportAck": m.ReportAck([[0, 1]], {"t": 1}, ["L0.M0"]),
    "Owners": m.Owners({"L0.M0": "o"}, {"o": ["/ip4/1"]}, {"o": "k"}),
    "FileChunk": m.FileChunk("f", 3, "h", 0, {"data": torch.zeros(3, dtype=torch.uint8)}),
    "ModuleState": m.ModuleState({"L0.M0": {"version": 0}}, {}),
    "Ok": m.Ok(),
    "Status": m.Status({"round": 1}),
    "Error": m.Error("why", "because"),
}
REQUESTS = [
    "Hello",
    "ClaimTask",
    "FetchModules",
    "Heartbeat",
    "SubmitDelta",
    "ScoreDelta",
    "TaskDone",
    "GetOwners",
    "FetchReleases",
    "FetchFile",
    "OwnerReport",
    "HandOver",
    "ConfirmOwnership",
    "ReleaseTask",
    "GetStatus",
]


def test_every_registered_message_has_a_sample():
    assert set(SAMPLES) == set(m.REGISTRY), set(m.REGISTRY) ^ set(SAMPLES)
    for name, msg in SAMPLES.items():
        assert type(m.decode_message(m.encode_message(msg))) is m.REGISTRY[name]


def _spots(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside a field's value where a hostile value can go (the value itself,
    a list item, a dict value, and a new dict key)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _spots(v, prefix + (k,))
        out.append(prefix + ("@newkey@",))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _spots(v, prefix + (i,))
    return out


def _put(obj: Any, spot: tuple, value: Any) -> Any:
    if not spot:
        return value
    head, rest = spot[0], spot[1:]
    if head == "@newkey@":  # the hostile value becomes a key (as a string) of this dict
        key = value if isinstance(value, str) else json.dumps(value)[:100]
        return {**obj, key: 1}
    copy = list(obj) if isinstance(obj, list) else dict(obj)
    copy[head] = _put(obj[head], rest, value)
    return copy


def _frame_text(header: dict) -> bytes:
    text = json.dumps(header, separators=(",", ":"), allow_nan=True)
    for marker, token in RAW.items():
        text = text.replace(json.dumps(marker), token)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def hostile_frames(draw: st.DrawFn, names: list[str]) -> tuple[str, str, bytes]:
    """(type, field, frame bytes): a sample with one spot in one field made hostile (or one
    unknown field added, or a field dropped)."""
    name = draw(st.sampled_from(names))
    frame = m.to_frame(SAMPLES[name])
    fields = json.loads(json.dumps(frame.fields))
    choices = sorted(fields) + ["@extra@", "@drop@"]
    target = draw(st.sampled_from(choices))
    value = draw(hostile)
    if target == "@extra@":
        fields[draw(st.sampled_from(["tensors", "x", "peer_id2", ""]))] = value
    elif target == "@drop@":
        if fields:
            fields.pop(draw(st.sampled_from(sorted(fields))))
    else:
        spot = draw(st.sampled_from(_spots(fields[target])))
        fields[target] = _put(fields[target], spot, value)
    specs, payload = [], b""
    for key, t in frame.tensors.items():
        specs.append(
            [key, {torch.float32: "float32", torch.uint8: "uint8"}[t.dtype], list(t.shape)]
        )
        payload += t.numpy().tobytes()
    text = _frame_text({"type": name, "fields": fields, "tensors": specs})
    raw = b"DPCO" + struct.pack("<BI", 1, len(text)) + text + payload
    return name, target, raw


def _all_values(value: Any):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _all_values(v)
    elif isinstance(value, list):
        for v in value:
            yield from _all_values(v)
    else:
        yield value


def _assert_sane(msg: Any) -> None:
    """A decoded message holds only finite 64-bit numbers and bounded, encodable strings."""
    for f in msg.__dataclass_fields__:
        if f == "tensors":
            continue
        for v in _all_values(getattr(msg, f)):
            if isinstance(v, float):
                assert math.isfinite(v), (f, v)
            elif isinstance(v, int) and not isinstance(v, bool):
                assert -(2**63) <= v <= INT_LIMIT, (f, v)
            elif isinstance(v, str):
                assert len(v) <= MAX_TEXT, f
                v.encode("utf-8")  # no lone surrogate
    m.encode_message(msg)  # what was read can be written again


@FUZZ
@given(hostile_frames(sorted(SAMPLES)))
def test_hostile_field_values_decode_sanely_or_raise_the_projects_error(case):
    name, target, raw = case
    try:
        msg = m.decode_message(raw)
    except DipacoError as exc:
        assert_clean_error(exc)
        event(f"{name}: refused ({exc.reason})")
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped decoding {name}.{target}: {exc!r}")
    assert type(msg) is m.REGISTRY[name]
    _assert_sane(msg)
    event(f"{name}: decoded")


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Rig:
    return Rig(tmp_path_factory.mktemp("fuzz-fields") / "co")


@FUZZ
@given(case=hostile_frames(REQUESTS))
def test_a_live_coordinator_answers_hostile_fields_with_a_counted_error(rig, case):
    name, target, raw = case
    before = rig.snapshot()
    refused = sum(rig.co.rejections.values())
    sealed, _ = auth.seal_request(rig.identity, raw)
    reply = rig.call(sealed)  # never raises: every failure is an Error reply
    event(f"{name}: {reply.reason if isinstance(reply, m.Error) else type(reply).__name__}")
    if isinstance(reply, m.Error):
        assert reply.reason and reply.message.strip()
        assert sum(rig.co.rejections.values()) == refused + 1
    # No sample request carries a delta the rig's task would take: nothing moves, ever.
    assert rig.snapshot() == before, f"{name}.{target} changed the modules"
    status = rig.call(auth.seal_request(rig.identity, bytes(m.encode_message(m.GetStatus())))[0])
    assert isinstance(status, m.Status)
    json.dumps(status.state, allow_nan=False)  # the status page stays valid JSON


ENVELOPE_FIELDS = ["key", "ts", "nonce", "blake3", "sig"]


@FUZZ
@given(
    field=st.sampled_from(ENVELOPE_FIELDS + ["@extra@", "@drop@"]),
    value=hostile,
    body=st.sampled_from([bytes(m.encode_message(SAMPLES[n])) for n in ("GetStatus", "Hello")]),
)
def test_hostile_envelope_fields_are_refused_cleanly(rig, field, value, body):
    sealed, _ = auth.seal_request(rig.identity, body)
    (size,) = struct.unpack_from("<I", sealed, 4)
    header = json.loads(sealed[8 : 8 + size])
    if field == "@extra@":
        header["x"] = value
    elif field == "@drop@":
        header.pop("ts")
    else:
        header[field] = value
    text = _frame_text(header)
    raw = sealed[:4] + struct.pack("<I", len(text)) + text + sealed[8 + size :]
    try:
        signed = auth.open_request(raw)
    except DipacoError as exc:
        assert_clean_error(exc)
        assert exc.reason in ("bad-envelope", "bad-signature", "unsigned"), exc.reason
        event(f"{field}: {exc.reason}")
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped open_request ({field}): {exc!r}")
    else:
        # Only a change the signature does not cover can pass: an extra header field, or a
        # timestamp written differently but equal in value.
        assert signed.body == body and field in ("@extra@", "ts")
        event(f"{field}: opened")
    # The coordinator answers the same bytes with a signed reply, whatever they hold.
    reply = rig.call(raw)
    assert isinstance(reply, m.Error | m.Status | m.Welcome), reply


@pytest.fixture(scope="module")
def seed_server() -> SeedServer:
    held = Held()
    tensors = {"w": torch.ones(2, 3)}
    held.put("L0.M0", Release(3, tensors_sha256(tensors), "sig", tensors))
    return SeedServer(auth.Identity.generate(), held)


@FUZZ
@given(case=hostile_frames(sorted(SAMPLES)))
def test_a_peer_serving_modules_answers_hostile_requests_with_a_counted_error(seed_server, case):
    """What a peer that serves modules (--serve-modules) gets from anyone on the DHT: every
    message type, with one hostile field. Only a well-formed FetchSeed of a held version gets
    modules; everything else an Error reply, counted, and never an exception."""
    name, target, raw = case
    refused, served = sum(seed_server.refused.values()), seed_server.served
    sealed, nonce = auth.seal_request(auth.Identity.generate(), raw)
    reply = m.decode_message(auth.open_reply(seed_server.handle(sealed), nonce, None).body)
    if isinstance(reply, m.Modules):
        assert name == "FetchSeed" and seed_server.served == served + 1
        assert set(reply.versions) == {"L0.M0"}
    else:
        assert isinstance(reply, m.Error) and reply.reason and reply.message.strip()
        assert sum(seed_server.refused.values()) == refused + 1
    event(f"{name}: {reply.reason if isinstance(reply, m.Error) else 'served'}")
