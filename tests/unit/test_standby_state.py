"""A standby scheduler's parts: the state it copies (StandbySync, only for the scheduler's own
key), the files it writes, the order of two schedulers' claims on a run, and the scheduler link
that follows a takeover. The whole takeover, with real processes, is
tests/integration/test_standby.py."""

from __future__ import annotations

import shutil

import pytest
import torch
from _tiny import TOPO, initial_modules

from dipaco.config import SchedulerSection
from dipaco.coordinator import standby
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import RejectedError, TransportError, WireError
from dipaco.net.hivemind import SchedulerLink, supersedes
from dipaco.net.standby import Fence
from dipaco.protocols import discovery
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport, Transport

LEASE = 10.0


def make(root, owner_id, initial=None):
    co = Coordinator(
        root, TOPO, rounds=4, inner_steps=5, step_offset=0, total_steps=100, seed=0,
        outer=OuterSettings(), lease_seconds=LEASE, run_id="test", peer_config={},
        shard_tokens=[1000, 2000, 3000, 4000], policy=SchedulerSection(lease_seconds=LEASE),
        owner_id=owner_id,
    )  # fmt: skip
    co.start(initial)
    return co


def sync(co, identity, standby_id="standby"):
    link = LocalTransport(co.handle).authenticate(identity, co.identity.public_key)
    return link.request(m.StandbySync(standby_id=standby_id))


def test_a_standby_copies_the_leases_and_resumes_them_in_a_new_epoch(tmp_path):
    active = make(tmp_path / "active", "active", initial_modules())
    alice = LocalTransport(active.handle).authenticate(Identity.generate())
    task = alice.request(m.ClaimTask(peer_id="alice", prefer_path=2))
    # The standby holds a copy of the scheduler's key, and nothing else of its folder.
    folder = tmp_path / "standby"
    folder.mkdir()
    shutil.copy(tmp_path / "active" / "signing.key", folder / "signing.key")
    # A key the scheduler learnt to distrust (its delta made path 2 worse).
    active.key_scores.judge("ed25519:mallory", 5.0, 5.5, 0, 2)
    active.key_scores.save()
    reply = sync(active, Identity.load_or_create(folder / "signing.key"))
    assert standby.keep(folder, reply) == active.epoch
    assert {p.name for p in folder.iterdir()} >= {"coordinator.json", "signing.key"}
    assert active.standbys.keys() == {"standby"}

    taken = make(folder, "standby")  # the takeover: a restart from the copied state
    assert taken.epoch == active.epoch + 1
    # ...is still distrusted after the takeover (key_scores.json copied).
    assert taken.key_scores.score("ed25519:mallory") == active.key_scores.score("ed25519:mallory")
    assert taken.key_scores.score("ed25519:mallory") < 0
    assert taken.identity.public_key == active.identity.public_key
    assert taken.owned_modules() == []  # the modules stay with their owner
    beat = LocalTransport(taken.handle).authenticate(alice.identity)
    ack = beat.request(m.Heartbeat(peer_id="alice", task_id=task.task_id, step=1))
    assert ack.lease_ok  # the lease in flight goes on with the new scheduler
    assert taken.scheduler.leases[task.task_id].peer_id == "alice"
    assert taken.scheduler.issued.keys() == active.scheduler.issued.keys()


def test_only_the_schedulers_own_key_gets_its_state(tmp_path):
    active = make(tmp_path / "active", "active", initial_modules())
    with pytest.raises(RejectedError) as err:
        sync(active, Identity.generate(), standby_id="mallory")
    assert err.value.reason == "not-standby"
    assert active.rejections["not-standby"] == 1
    assert active.rejections_by_peer["mallory"]["not-standby"] == 1
    assert active.standbys == {}


def test_a_state_naming_another_file_is_refused_and_nothing_is_written(tmp_path):
    state = torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8)
    for name in ("file/../evil.json", "file/signing.key", "coordinator.json"):
        reply = m.StandbyState(epoch=1, tensors={"file/coordinator.json": state, name: state})
        with pytest.raises(WireError):
            standby.keep(tmp_path / "out", reply)
        assert not (tmp_path / "out").exists()
    with pytest.raises(WireError):
        standby.keep(tmp_path / "out", m.StandbyState(epoch=1, tensors={}))


def test_claims_on_a_run_are_ordered_by_epoch_then_by_node_id():
    assert supersedes({"scheduler": "b", "epoch": 3}, "a", 2)
    assert not supersedes({"scheduler": "b", "epoch": 1}, "a", 2)
    assert supersedes({"scheduler": "b", "epoch": 2}, "a", 2)
    assert not supersedes({"scheduler": "a", "epoch": 2}, "b", 2)  # exactly one gives way
    assert not supersedes({"scheduler": "a", "epoch": 9}, "a", 2)  # itself
    for junk in (None, [], {"scheduler": 5, "epoch": 3}, {"scheduler": "b", "epoch": "3"}):
        assert not supersedes(junk, "a", 2)


class FakeDHT:
    """A node whose DHT holds one run entry, and which dials fake schedulers by id."""

    def __init__(self, entry):
        self.entry, self.peer_id, self.dialled = entry, "me", []

    def get(self, key):
        assert key == discovery.RUNS
        return {"r": self.entry}


class Scheduler(Transport):
    def __init__(self, name, up=True):
        self.name, self.up, self.seen = name, up, []

    def _roundtrip(self, data):
        if not self.up:
            raise TransportError(f"{self.name} does not answer")
        self.seen.append(data)
        return self.name.encode()


def test_the_scheduler_link_follows_a_newer_scheduler_and_only_a_newer_one():
    node = FakeDHT({"scheduler": "old", "epoch": 1, "addresses": []})
    schedulers = {"old": Scheduler("old"), "new": Scheduler("new"), "stale": Scheduler("stale")}

    def connect(peer, addresses):
        node.dialled.append(peer)
        return schedulers[peer]

    link = SchedulerLink(node, "r", node.entry, connect)
    assert link._roundtrip(b"1") == b"old"
    schedulers["old"].up = False
    with pytest.raises(TransportError):  # the DHT names no one newer: the failure stands
        link._roundtrip(b"2")
    node.entry = {"scheduler": "stale", "epoch": 0, "addresses": []}
    with pytest.raises(TransportError):  # an older claim is never followed
        link._roundtrip(b"3")
    node.entry = {"scheduler": "new", "epoch": 2, "addresses": []}
    assert link._roundtrip(b"4") == b"new"  # the same request, sent to the new scheduler
    assert link._roundtrip(b"5") == b"new" and schedulers["new"].seen == [b"4", b"5"]
    assert node.dialled == ["old", "new"]


def test_a_superseded_scheduler_fences_itself():
    node = FakeDHT({"scheduler": "me", "epoch": 1})
    fence = Fence(node, "r", 1)
    assert fence.check() and fence.superseded is None
    node.entry = {"scheduler": "standby", "epoch": 2}
    assert not fence.check() and fence.superseded == "standby (epoch 2)"
    node.entry = {"scheduler": "me", "epoch": 1}
    assert not fence.check()  # once superseded, for good
