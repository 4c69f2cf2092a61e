"""Rotating the scheduler's key while owners and peers run: they follow a rotation signed by the
key they trust, keep the old key for the tickets it already signed, and refuse a forged one."""

import json
import os
import time

import pytest
import torch
from _tiny import TOPO, delta_message, initial_modules, tiny_coordinator

from dipaco.cli.coordinator import main as coordinator_cli
from dipaco.coordinator import rotation, tickets
from dipaco.coordinator.access import change_access
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.owner import Reporter, take_over
from dipaco.errors import ConfigError, RejectedError, WireError
from dipaco.peer.identity import KNOWN_COORDINATORS, FollowingLink, follow_rotation
from dipaco.protocols import keyrotation
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity, sign_payload
from dipaco.protocols.transport import LocalTransport

RUN = "rot"
OWNER_KEY = Identity.generate()
ALICE, BOB, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()


class Switch:
    """A handler that is whichever coordinator answers at the address now (a restart swaps it)."""

    def __init__(self, co):
        self.co = co

    def __call__(self, data):
        return self.co.handle(data)


def scheduler(run_dir, first=True):
    co = tiny_coordinator(run_dir / "coordinator", start=False, run_id=RUN, peer_config={})
    co.start(initial_modules() if first else None)
    return co


def owner(root, scheduler_key):
    co = Coordinator(
        root, TOPO, rounds=2, inner_steps=5, step_offset=0, total_steps=100, seed=0,
        outer=OuterSettings(), lease_seconds=30.0, run_id=RUN, peer_config={}, owner_id="b",
        identity=OWNER_KEY, scheduler_key=scheduler_key, is_scheduler=False,
    )  # fmt: skip
    co.start(None)
    return co


def l1m0_delta(co, task, name, **override):
    """The share of ``task``'s delta that owner ``co`` holds (L1.M0)."""
    tensors = {f"L1.M0/{k}": torch.full_like(v, 0.01) for k, v in co.store.params("L1.M0").items()}
    return delta_message(task, name, tensors, **override)


@pytest.fixture
def run(tmp_path):
    """A scheduler and an owner of L1.M0 that reports to it through a switchable address."""
    sched = scheduler(tmp_path / "run")
    change_access(sched.root, OWNER_KEY.public_key, allow=True, owner=True)
    switch = Switch(sched)
    link = LocalTransport(switch)
    own = owner(tmp_path / "owner", sched.identity.public_key)
    take_over(own, link, ["L1.M0"])
    return sched, own, switch, link


def restart_rotated(sched, switch, times=1):
    """``dipaco-coordinator rotate-key`` (``times`` over), then the scheduler's restart."""
    run_dir = sched.root.parent
    for _ in range(times):
        with pytest.raises(SystemExit) as done:
            coordinator_cli(["rotate-key", "--run-dir", str(run_dir)])
        assert done.value.code in (0, None)
    again = scheduler(run_dir, first=False)
    switch.co = again
    return again


def wait_for(condition, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_running_owner_follows_the_rotation_and_accepts_both_keys_tickets(run, tmp_path):
    sched, own, switch, link = run
    old_key, old_identity = sched.identity.public_key, sched.identity
    alice = LocalTransport(switch).authenticate(ALICE)
    before = alice.request(m.ClaimTask(peer_id="alice", prefer_path=0))  # signed by the old key

    sched = restart_rotated(sched, switch, times=2)  # two rotations, followed in one go
    new_key = sched.identity.public_key
    assert new_key != old_key and sched.epoch == 1
    assert [s["seq"] for s in sched.keys.rotations] == [1, 2]

    reporter = Reporter(own, link, interval=0.05)
    reporter.start()
    try:
        wait_for(lambda: own.scheduler_key == new_key and reporter.sent > 0)
    finally:
        reporter.close()
    assert link.server_key == new_key and own.rejections["bad-rotation"] == 0

    to_owner = LocalTransport(own.handle)
    # A ticket the old key signed before the rotation is still good, at the owner...
    ack = to_owner.authenticate(ALICE).request(l1m0_delta(own, before, "alice"))
    assert ack.accepted == ["L1.M0"]
    rest_mids = [mid for mid in TOPO.path_modules(0) if mid != "L1.M0"]
    rest = {  # ...and at the restarted scheduler, for the path's other modules
        f"{mid}/{k}": torch.full_like(v, 0.01)
        for mid in TOPO.path_modules(0)
        if mid != "L1.M0"
        for k, v in sched.store.params(mid).items()
    }
    alice = LocalTransport(switch).authenticate(ALICE, new_key)
    assert sorted(alice.request(delta_message(before, "alice", rest)).accepted) == sorted(rest_mids)
    # ...and new tickets, signed by the new key only, are accepted too.
    bob = LocalTransport(switch).authenticate(BOB)
    after = bob.request(m.ClaimTask(peer_id="bob", prefer_path=2))
    assert tickets.read_ticket(old_key, after.ticket) is None
    assert tickets.read_ticket(new_key, after.ticket) is not None
    assert LocalTransport(own.handle).authenticate(BOB).request(
        l1m0_delta(own, after, "bob")
    ).accepted == ["L1.M0"]
    # The old key signs nothing new: a ticket for a task of the new epoch is refused.
    forged = {
        "task": "P2-r0-e1-a7", "peer": "mallory", "path": 2, "round": 0,
        "versions": after.module_versions, "weight": None, "key": MALLORY.public_key,
    }  # fmt: skip
    task = m.TaskOffer(**{**after.__dict__, "task_id": "P2-r0-e1-a7"})
    task.ticket = tickets.sign_ticket(old_identity, forged)
    with pytest.raises(RejectedError) as err:
        LocalTransport(own.handle).authenticate(MALLORY).request(l1m0_delta(own, task, "mallory"))
    assert err.value.reason == "bad-ticket"

    # The owner keeps the rotated key across its own restart.
    own_again = owner(tmp_path / "owner", old_key)
    assert own_again.scheduler_key == new_key


def forged_scheduler(tmp_path, trusted_key):
    """Mallory's coordinator, for the same run, with a rotation "from" the trusted key that
    Mallory signed herself."""
    fake = tiny_coordinator(tmp_path / "fake", run_id=RUN, peer_config={}, identity=MALLORY)
    body = {"run": RUN, "seq": 1, "old": trusted_key, "new": MALLORY.public_key, "epoch": 0}
    fake.keys.rotations = [{**body, "sig": sign_payload(MALLORY, keyrotation.PURPOSE, body)}]
    return fake


def test_a_forged_rotation_is_refused_counted_and_changes_nothing(run, tmp_path):
    sched, own, switch, link = run
    trusted = sched.identity.public_key
    fake = forged_scheduler(tmp_path, trusted)
    switch.co = fake
    with pytest.raises(WireError) as err:
        link.request(own.report())
    assert err.value.reason == "untrusted-reply"
    assert rotation.follow(own, link) is False
    assert own.scheduler_key == trusted and link.server_key == trusted
    assert own.status().state["rejections"] == {"bad-rotation": 1}
    # Mallory's tickets are worth nothing at the owner.
    task = (
        LocalTransport(fake.handle)
        .authenticate(MALLORY)
        .request(m.ClaimTask(peer_id="mallory", prefer_path=0))
    )
    with pytest.raises(RejectedError) as err:
        LocalTransport(own.handle).authenticate(MALLORY).request(l1m0_delta(own, task, "mallory"))
    assert err.value.reason == "bad-ticket"
    # The Reporter refuses it the same way, and goes on trusting the old key.
    reporter = Reporter(own, link, interval=0.05)
    reporter.start()
    try:
        wait_for(lambda: own.rejections["bad-rotation"] >= 2)
    finally:
        reporter.close()
    assert own.scheduler_key == trusted and reporter.sent == 0


def test_a_pinned_peer_follows_a_signed_rotation_and_refuses_a_forged_one(run, tmp_path):
    sched, _, switch, _ = run
    state_dir = tmp_path / "peer"
    state_dir.mkdir()
    old_key = sched.identity.public_key
    (state_dir / KNOWN_COORDINATORS).write_text(json.dumps({"addr": old_key}))
    peer = LocalTransport(switch).authenticate(ALICE, old_key)

    real = restart_rotated(sched, switch)
    fake = forged_scheduler(tmp_path, old_key)
    switch.co = fake
    with pytest.raises(keyrotation.RotationError) as err:
        follow_rotation(peer, state_dir, "addr", "alice", RUN)
    assert err.value.reason == "bad-rotation"
    assert peer.server_key == old_key
    assert json.loads((state_dir / KNOWN_COORDINATORS).read_text()) == {"addr": old_key}

    switch.co = real
    with pytest.raises(WireError):
        peer.request(m.Hello(peer_id="alice"))  # the new key's reply, refused until followed
    assert follow_rotation(peer, state_dir, "addr", "alice", RUN) == real.identity.public_key
    welcome = peer.request(m.Hello(peer_id="alice"))
    assert welcome.config["coordinator_key"] == real.identity.public_key
    pinned = json.loads((state_dir / KNOWN_COORDINATORS).read_text())
    assert pinned == {"addr": real.identity.public_key}


def test_a_joined_peers_link_follows_the_rotation_by_itself_and_not_a_forged_one(run, tmp_path):
    sched, _, switch, _ = run
    state_dir = tmp_path / "peer"
    state_dir.mkdir()
    old_key = sched.identity.public_key
    (state_dir / KNOWN_COORDINATORS).write_text(json.dumps({"addr": old_key}))
    link = FollowingLink(LocalTransport(switch), state_dir, "addr", "alice")
    link.authenticate(ALICE, old_key)
    assert link.request(m.Hello(peer_id="alice")).run_id == RUN  # the run id, from its Welcome

    real = restart_rotated(sched, switch)
    new_key = real.identity.public_key
    switch.co = forged_scheduler(tmp_path, old_key)
    with pytest.raises(keyrotation.RotationError) as err:  # Mallory's "rotation": the peer stops
        link.request(m.ClaimTask(peer_id="alice", prefer_path=0))
    assert err.value.reason == "bad-rotation" and link.server_key == old_key

    switch.co = real  # the request the new key answered is sent again, under the new key
    offer = link.request(m.ClaimTask(peer_id="alice", prefer_path=0))
    assert isinstance(offer, m.TaskOffer) and link.server_key == new_key
    assert json.loads((state_dir / KNOWN_COORDINATORS).read_text()) == {"addr": new_key}
    beat = link.request(m.Heartbeat(peer_id="alice", task_id=offer.task_id, step=1))
    assert beat.lease_ok  # and everything after it, without asking again


def test_rotate_key_needs_a_started_scheduler_and_finishes_a_cut_rotation(tmp_path):
    with pytest.raises(ConfigError, match="start the run once"):
        rotation.rotate_key(tmp_path / "nothing")
    sched = scheduler(tmp_path / "run")
    folder, old = sched.root, sched.identity.public_key
    old_file = (folder / "signing.key").read_bytes()
    statement = rotation.rotate_key(folder)
    assert (statement["old"], statement["seq"], statement["epoch"]) == (old, 1, 0)
    # A crash after the statement, before the new key took the old one's place:
    os.replace(folder / "signing.key", folder / "signing.key.next")
    (folder / "signing.key").write_bytes(old_file)
    os.chmod(folder / "signing.key", 0o600)
    again = scheduler(tmp_path / "run", first=False)
    assert again.identity.public_key == statement["new"]
    assert again.peer_config["coordinator_key"] == statement["new"]
    assert not (folder / "signing.key.next").exists()
    welcome = LocalTransport(again.handle).request(m.Hello(peer_id="x"))
    assert welcome.rotations == [statement]


def test_a_rotation_chain_is_checked_link_by_link():
    k0, k1, k2 = Identity.generate(), Identity.generate(), Identity.generate()
    s1 = keyrotation.make_statement(k0, k1.public_key, RUN, 1, 0)
    s2 = keyrotation.make_statement(k1, k2.public_key, RUN, 2, 3)
    key, retired, used = keyrotation.follow(k0.public_key, [s1, s2], RUN, k2.public_key)
    assert key == k2.public_key and retired == {k0.public_key: 0, k1.public_key: 3}
    assert keyrotation.follow(k1.public_key, [s1, s2], RUN)[0] == k2.public_key
    for bad, why in [
        ([s1, {**s2, "seq": 5}], "in sequence"),
        ([{**s1, "run": "other"}], "for run"),
        ([{**s1, "new": MALLORY.public_key}], "not signed"),
        ([{**s1, "extra": 1}], "malformed"),
        ([s1], "no rotation signed"),
    ]:
        with pytest.raises(keyrotation.RotationError, match=why):
            keyrotation.follow(k0.public_key, bad, RUN, k2.public_key)


def test_welcome_carries_the_rotations_on_the_wire():
    s = keyrotation.make_statement(ALICE, BOB.public_key, RUN, 1, 0)
    msg = m.decode_message(m.encode_message(m.Welcome(run_id=RUN, config={}, rotations=[s])))
    assert msg.rotations == [s]
    assert m.decode_message(m.encode_message(m.Welcome(run_id=RUN, config={}))).rotations == []
