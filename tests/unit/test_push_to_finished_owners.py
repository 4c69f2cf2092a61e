"""A peer pushes a task's deltas owner by owner: an owner whose modules have all made their last
round drops its part, and the peer goes on with the owners whose modules still wait for it."""

import pytest
import torch

from dipaco.errors import RejectedError
from dipaco.peer.push import Pusher
from dipaco.protocols import feedback
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

TASK = m.TaskOffer(
    task_id="P3-r1-e0-a0",
    path=3,
    round=1,
    module_versions={"S.embed": 2, "L0.M1": 1, "L1.M1": 1, "S.head": 2},
    inner_steps=5,
    step_offset=0,
    total_steps=10,
    lease_seconds=10.0,
    seed=0,
    ticket="t",
)
DELTA = {mid: {"w": torch.full((3,), 0.5)} for mid in TASK.module_versions}


class Transport:
    def __init__(self):
        self.sent = []

    def request(self, msg):
        self.sent.append(msg)
        return m.Ok()


class Patience:
    def call(self, call, reasons=()):
        return call()


class Links:
    """Two owners: the scheduler ("a": the shared modules) and "b" (the level modules). Each
    answers with ``answers[owner]``: a DeltaAck, or a RejectedError to raise."""

    def __init__(self, answers):
        self.answers, self.asked = answers, []
        self.transport, self.patience = Transport(), Patience()
        self.scheduler_protocol = m.PROTOCOL
        self.owners = {"S.embed": "a", "S.head": "a", "L0.M1": "b", "L1.M1": "b"}

    def by_owner(self, mids):
        groups = {}
        for mid in mids:
            groups.setdefault(self.owners[mid], []).append(mid)
        return groups

    def ask(self, owner, make, doing=""):
        msg = make()
        self.asked.append((owner, sorted(k.partition("/")[0] for k in msg.tensors)))
        answer = self.answers[owner]
        if isinstance(answer, Exception):
            raise answer
        return answer


def finished():
    return RejectedError("S.embed has made all its 2 rounds", reason=Reason.FINISHED)


def push(links):
    acks = []
    Pusher(links, feedback.ErrorFeedback(), "p3", acks.append).push(TASK, DELTA, 100, [1.0])
    return acks


def test_an_owner_that_finished_does_not_stop_the_push_to_the_others():
    ok = m.DeltaAck(accepted=["L0.M1", "L1.M1"], closed=["L0.M1", "L1.M1"], task_done=False)
    links = Links({"a": finished(), "b": ok})
    acks = push(links)
    assert links.asked == [("a", ["S.embed", "S.head"]), ("b", ["L0.M1", "L1.M1"])]
    assert sorted(a["module"] for a in acks) == ["L0.M1", "L1.M1"]  # only what will be applied
    (done,) = links.transport.sent  # the scheduler applied nothing of it: the peer says done
    assert isinstance(done, m.TaskDone) and done.task_id == TASK.task_id


def test_modules_an_ack_lists_as_finished_are_not_recorded_as_acknowledged():
    partial = m.DeltaAck(accepted=["S.head"], closed=[], task_done=False, dropped=["S.embed"])
    ok = m.DeltaAck(accepted=["L0.M1", "L1.M1"], closed=[], task_done=False)
    links = Links({"a": partial, "b": ok})
    acks = push(links)
    assert sorted(a["module"] for a in acks) == ["L0.M1", "L1.M1", "S.head"]


def test_a_task_whose_every_module_finished_is_refused():
    links = Links({"a": finished(), "b": finished()})
    with pytest.raises(RejectedError) as err:
        push(links)
    assert err.value.reason == Reason.FINISHED
    assert len(links.asked) == 2 and not links.transport.sent  # no TaskDone for nothing
