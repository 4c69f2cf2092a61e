"""Fuzzing a live coordinator: a mutated request gets an Error reply and changes nothing.

Requests are signed envelopes (dipaco.protocols.auth). Most examples mutate the *message* inside
and then seal it properly, so the mutation reaches the decoder and the operation behind a valid
signature (what a peer with a real key could send); the rest mutate the sealed envelope itself.
After every example: ``handle`` returned a signed reply (it never raised), the reply decodes, an
``Error`` carries a reason and a message, and the modules (parameters, versions, pending deltas)
are exactly as before, unless the request was a well-formed delta for the task, which may be
acknowledged once. Status still encodes (nothing stored from a request can break a later reply).
"""

from __future__ import annotations

import json
import math
import random
import struct

import pytest
import torch
from _fuzzing import FUZZ, byte_mutations, frame_mutations
from _tiny import TOPO, tiny_coordinator
from hypothesis import event, given
from hypothesis import strategies as st

from dipaco.config import SecuritySection
from dipaco.protocols import auth, codecs
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from dipaco.protocols.wire import tensors_sha256

PEER = "p0"


class Rig:
    """One coordinator, one peer key holding one task, and a valid request of every kind."""

    def __init__(self, root) -> None:
        self.co = tiny_coordinator(
            root,
            rounds=3,
            lease_seconds=1e6,
            run_id="fuzz",
            # The fuzzer is one key sending hundreds of hostile requests: no bans, no rate cap,
            # so that every example reaches the code under test rather than the ban list.
            security=SecuritySection(
                ban_after=0, requests_per_second=1e9, burst=10**9, max_names_per_key=10**9
            ),
        )
        self.identity = auth.Identity.generate()
        self.tr = LocalTransport(self.co.handle).authenticate(
            self.identity, self.co.identity.public_key
        )
        self.tr.request(m.Hello(peer_id=PEER))
        task = self.tr.request(m.ClaimTask(peer_id=PEER))
        assert isinstance(task, m.TaskOffer)
        self.task = task
        mids = TOPO.path_modules(task.path)
        delta = {
            mid: {k: torch.full_like(v, 1e-3) for k, v in self.co.store.params(mid).items()}
            for mid in mids
        }

        def submit(codec: str) -> m.SubmitDelta:
            tensors = {
                f"{mid}/{k}": t for mid in mids for k, t in codecs.encode(codec, delta[mid]).items()
            }
            return m.SubmitDelta(
                PEER,
                task.task_id,
                task.path,
                task.module_versions,
                100,
                [2.0],
                tensors,
                ticket=task.ticket,
                codec=codec,
            )

        other = self.tr.request(m.ClaimTask(peer_id="p1"))
        assert isinstance(other, m.TaskOffer) and other.path != task.path
        self.other = other
        self.submit = submit("lossless")
        requests = [
            self.submit,
            submit("int8"),
            submit("bf16"),
            m.Hello(peer_id=PEER, capabilities={"memory_gb": 4}),
            m.ClaimTask(peer_id=PEER, prefer_path=1),
            m.FetchModules(PEER, task.task_id, {}, task.ticket),
            m.Heartbeat(PEER, task.task_id, 2),
            m.TaskDone(PEER, task.task_id, task.ticket, 100, [1.0], mids),
            m.FetchFile(PEER, "tokenizer.model", 0, 10),
            m.OwnerReport("o1", "proof", {"L0.M0": {"version": 1, "hash": "x", "pending": []}}),
            m.HandOver("o1", "proof", ["L0.M0"]),
            m.ConfirmOwnership("o1", "proof", {"L0.M0": "x"}),
            m.GetOwners(),
            m.GetStatus(),
        ]
        self.valid = [bytes(m.encode_message(r)) for r in requests]

    def snapshot(self) -> dict:
        out = {}
        for mid, r in self.co.store.modules.items():
            assert tensors_sha256(r.params) == r.hash
            momentum = tensors_sha256(r.momentum) if r.momentum is not None else None
            pending = {p: d.task_id for p, d in r.pending.items()}
            late = {p: d.task_id for p, d in r.late.items()}
            out[mid] = (r.version, r.hash, momentum, pending, late)
        return out

    def call(self, raw: bytes) -> m.Message:
        """Send a sealed frame; return the reply message after checking its signature."""
        reply = self.co.handle(raw)
        assert isinstance(reply, bytes | bytearray | memoryview)
        assert bytes(reply[:4]) == auth.REPLY_MAGIC
        (size,) = struct.unpack_from("<I", reply, 4)
        nonce = json.loads(bytes(reply[8 : 8 + size]))["nonce"]
        opened = auth.open_reply(reply, nonce, self.co.identity.public_key)
        return m.decode_message(opened.body)


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Rig:
    return Rig(tmp_path_factory.mktemp("fuzz-coordinator") / "co")


@st.composite
def requests(draw: st.DrawFn, rig: Rig) -> tuple[str, bytes, int, bool]:
    """(where to mutate, the inner message bytes, a seed for the envelope's mutation, whether
    the request must be refused).

    A sealed envelope differs from run to run (nonce, timestamp), so its mutation is drawn as
    a seed and applied afterwards: hypothesis needs the same draws to replay an example. A
    mutated message or envelope may well still be (or become) a valid request, so only the
    well-formed wrong submissions are known to be invalid.
    """
    inner = draw(st.sampled_from(rig.valid))
    where = draw(st.sampled_from(["message", "message", "fields", "fields", "envelope"]))
    invalid = False
    if where == "message":
        inner = draw(st.one_of(frame_mutations(inner), byte_mutations(inner, focus=512)))
    elif where == "fields":
        inner, invalid = draw(wrong_submissions(rig))
    return where, inner, draw(st.integers(0, 2**32)), invalid


def _mutate_envelope(sealed: bytes, seed: int) -> bytes:
    """Flip bits in, cut, extend or splice the sealed request (header first, mostly)."""
    rng = random.Random(seed)
    data = bytearray(sealed)
    kind = rng.choice(["flip", "flip", "truncate", "extend", "length", "body"])
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(min(len(data), 300))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data)) :]
    elif kind == "extend":
        data += rng.randbytes(rng.randint(1, 32))
    elif kind == "length":
        data[4:8] = struct.pack("<I", rng.choice([0, 7, 4097, 2**32 - 1, len(data)]))
    else:  # the message swapped for another one under the same signature
        data[rng.randrange(300, len(data)) :] = bytes(m.encode_message(m.GetOwners()))
    return bytes(data)


@st.composite
def wrong_submissions(draw: st.DrawFn, rig: Rig) -> tuple[bytes, bool]:
    """A well-formed SubmitDelta with one field changed, or its tensors changed in one way: these
    pass the decoder and test the coordinator's own checks. Also says whether the change makes
    it invalid (a few are fine: no ticket at the scheduler, odd losses, big finite values)."""
    msg = rig.submit
    fields = {f: getattr(msg, f) for f in msg.__dataclass_fields__}
    tensors = dict(msg.tensors)
    key = draw(st.sampled_from(sorted(tensors)))
    kind = draw(
        st.sampled_from(
            [
                "path",
                "base",
                "tokens",
                "ticket",
                "task",
                "peer",
                "codec",
                "losses",
                "drop",
                "add",
                "rename",
                "shape",
                "dtype",
                "value",
            ]
        )
    )
    if kind == "path":
        fields["path"] = draw(st.sampled_from([-1, 1, 2, 3, 4, 2**40]))
    elif kind == "base":
        mid = draw(st.sampled_from(sorted(msg.base_versions)))
        fields["base_versions"] = draw(
            st.sampled_from(
                [
                    {},
                    {**msg.base_versions, mid: 1},
                    {**msg.base_versions, mid: -1},
                    {**msg.base_versions, "L7.M7": 0},
                ]
            )
        )
    elif kind == "tokens":
        fields["tokens"] = draw(st.sampled_from([0, -5, 2**62]))
    elif kind == "ticket":
        fields["ticket"] = draw(
            st.sampled_from(["", rig.other.ticket, msg.ticket[:-3], "x." + msg.ticket[2:], "."])
        )
    elif kind == "task":
        fields["task_id"] = draw(st.sampled_from([rig.other.task_id, "", "P0-r9-e0-a0"]))
    elif kind == "peer":
        fields["peer_id"] = draw(st.sampled_from(["p1", "", "stranger"]))
    elif kind == "codec":
        fields["codec"] = draw(st.sampled_from(["int8", "fp16", "zstd", ""]))
    elif kind == "losses":
        fields["losses"] = draw(st.sampled_from([[], [1e300], [-1.0] * 1000]))
    elif kind == "drop":
        del tensors[key]
    elif kind == "add":
        tensors[draw(st.sampled_from(["L1.M1/w", "nomodule", key + "x", "S.embed/zz"]))] = tensors[
            key
        ]
    elif kind == "rename":
        tensors[draw(st.sampled_from([key.upper(), key + "/", "/" + key]))] = tensors.pop(key)
    elif kind == "shape":
        t = tensors[key]
        tensors[key] = draw(
            st.sampled_from([t.reshape(-1), t.reshape(-1)[:-1], torch.zeros(0), t[None]])
        )
    elif kind == "dtype":
        tensors[key] = tensors[key].to(
            draw(st.sampled_from([torch.float64, torch.float16, torch.int64, torch.bfloat16]))
        )
    else:
        t = tensors[key].clone().reshape(-1)
        t[draw(st.integers(0, t.numel() - 1))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -3e38])
        )
        tensors[key] = t.reshape(tensors[key].shape)
    fields["tensors"] = tensors
    valid = (
        (kind == "tokens" and fields["tokens"] > 0)
        or (kind == "ticket" and fields["ticket"] == "")
        or kind == "losses"
        or (kind == "shape" and tensors[key].shape == msg.tensors[key].shape)  # 1-D reshaped
        # An extra module in base_versions is ignored: only the path's modules are checked.
        or (kind == "base" and msg.base_versions.items() <= fields["base_versions"].items())
        or (kind == "value" and bool(torch.isfinite(tensors[key]).all()))
    )
    return bytes(m.encode_message(m.SubmitDelta(**fields))), not valid


def _is_submit(inner: bytes) -> bool:
    try:
        return isinstance(m.decode_message(inner), m.SubmitDelta)
    except Exception:  # noqa: BLE001 - an undecodable message is not a submission
        return False


@FUZZ
@given(data=st.data())
def test_mutated_requests_get_an_error_and_change_no_module(rig, data):
    where, inner, seed, invalid = data.draw(requests(rig))
    sealed, _ = auth.seal_request(rig.identity, inner)
    if where == "envelope":
        sealed = _mutate_envelope(sealed, seed)
    before = rig.snapshot()
    refused = sum(rig.co.rejections.values())
    reply = rig.call(sealed)  # never raises: every failure is an Error reply
    event(f"{where}: {reply.reason if isinstance(reply, m.Error) else type(reply).__name__}")
    after = rig.snapshot()
    if invalid:
        assert isinstance(reply, m.Error), f"an invalid submission was answered {reply}"
    if isinstance(reply, m.Error):
        assert reply.reason and reply.message.strip()
        assert sum(rig.co.rejections.values()) == refused + 1  # every refusal is counted once
        assert after == before, f"rejected ({reply.reason}) but the modules changed"
    elif after != before:
        # Only a well-formed delta for the task may change anything: acknowledged once, the
        # task's path joins its modules' pending deltas, and nothing else moves.
        assert isinstance(reply, m.DeltaAck) and _is_submit(inner) and where != "envelope"
        for mid, (version, digest, momentum, pending, late) in after.items():
            b_version, b_digest, b_momentum, b_pending, b_late = before[mid]
            assert (version, digest, momentum, late) == (b_version, b_digest, b_momentum, b_late)
            assert {p: t for p, t in pending.items() if p not in b_pending} in (
                {},
                {rig.task.path: rig.task.task_id},
            )
    status = rig.call(auth.seal_request(rig.identity, bytes(m.encode_message(m.GetStatus())))[0])
    assert isinstance(status, m.Status), status


def test_the_valid_requests_are_valid(tmp_path):
    rig = Rig(tmp_path / "co")
    for raw in rig.valid[:1]:
        reply = rig.call(auth.seal_request(rig.identity, raw)[0])
        assert isinstance(reply, m.DeltaAck) and reply.accepted
    pending = {mid: set(r.pending) for mid, r in rig.co.store.modules.items()}
    assert all(rig.task.path in pending[mid] for mid in TOPO.path_modules(rig.task.path))
