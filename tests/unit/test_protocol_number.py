"""The protocol's number (docs/protocol.md §2): parties of different releases in one run. A
peer says its number in Hello and the coordinator answers with its own; a coordinator from
before the number says nothing (protocol 1), and the peer sends it only what its decoder takes
(unknown fields are a bad message)."""

import dataclasses

import pytest
from test_push_to_finished_owners import TASK, Links, push

from dipaco.errors import WireError
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


class Protocol1:
    """A scheduler from before the number, as its peers see it: a Welcome without it."""

    def __init__(self, transport):
        self.transport = transport

    def authenticate(self, *args):
        self.transport = self.transport.authenticate(*args)
        return self

    def request(self, msg):
        reply = self.transport.request(msg)
        if isinstance(reply, m.Welcome):
            assert reply.protocol == m.PROTOCOL  # the peer said its own
            reply = dataclasses.replace(reply, protocol=0)
            assert "protocol" not in m.to_frame(reply).fields
        return reply

    def __getattr__(self, name):
        return getattr(self.transport, name)


def test_hello_tells_its_protocol_only_to_a_peer_that_says_its_own(run_copy, tiny_config):
    """A peer from before the number gets a Welcome without the field, which its decoder
    would refuse; a peer that says its number learns the scheduler's, and what it may send."""
    root = run_copy()
    co = build_coordinator(prepare(root, tiny_config), MetricsLog(root / "m.jsonl"), evaluate=False)
    tr = LocalTransport(co.handle)
    told = tr.request(m.Hello(peer_id="new", capabilities={"protocol": 7}))
    assert told.protocol == m.PROTOCOL >= 2 and "protocol" in m.to_frame(told).fields
    old = tr.request(m.Hello(peer_id="old"))
    assert old.protocol == 0 and "protocol" not in m.to_frame(old).fields

    peer = Peer(LocalTransport(co.handle), "current", root / "p1")
    peer.setup()
    assert peer.links.scheduler_protocol == m.PROTOCOL
    peer = Peer(Protocol1(LocalTransport(co.handle)), "later", root / "p2")
    peer.setup()
    assert peer.links.scheduler_protocol == 1


def test_a_task_done_to_a_scheduler_of_protocol_1_leaves_out_what_its_decoder_lacks(monkeypatch):
    """A scheduler from before TaskDone.wait refuses a frame with the field (unknown fields are
    a bad message), so a peer of a later protocol talking to it must leave the field out of
    the frame; to a scheduler that knows it, the peer asks to wait for the owners' reports."""
    ok = m.DeltaAck(accepted=["L0.M1", "L1.M1"], closed=[], task_done=False)
    current = Links({"a": ok, "b": ok})
    push(current)
    (done,) = current.transport.sent
    assert done.wait > 0 and "wait" in m.to_frame(done).fields
    old = Links({"a": ok, "b": ok})
    old.scheduler_protocol = 1  # its Welcome told no protocol
    push(old)
    (plain,) = old.transport.sent
    assert plain.wait == 0 and "wait" not in m.to_frame(plain).fields
    # The frames as sent, read by the protocol 1 decoder: TaskDone without the field.
    frames = m.encode_message(plain), m.encode_message(done)
    fields = [(f.name, f.type, f) for f in dataclasses.fields(m.TaskDone) if f.name != "wait"]
    monkeypatch.setitem(m.REGISTRY, "TaskDone", dataclasses.make_dataclass("TaskDone", fields))
    assert m.decode_message(frames[0]).task_id == TASK.task_id
    with pytest.raises(WireError, match="unknown fields \\['wait'\\]"):
        m.decode_message(frames[1])
