"""Attacks on who may do what: each is refused with its reason, counted, and changes nothing.

Forged and replayed requests, deltas for tasks leased to someone else, keys the run does not
admit, floods, oversized messages, skewed clocks, impostor coordinators and forged releases. The
content attacks (NaN, huge norms, poisoned deltas...) are in test_attacks_content.py.
"""

import os
import time

import pytest
import torch
from _tiny import TOPO, constant_delta, delta_message, tiny_coordinator

from dipaco.config import SecuritySection
from dipaco.coordinator.access import change_access
from dipaco.coordinator.core import Coordinator
from dipaco.errors import ConfigError, RejectedError, WireError
from dipaco.peer.modules import TaskAborted
from dipaco.peer.peer import Peer
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


def make(root, **security) -> Coordinator:
    return tiny_coordinator(
        root,
        run_id="attack",
        peer_config={"run_id": "attack"},
        security=SecuritySection(**security),
    )


def peer(co, key=None) -> LocalTransport:
    return LocalTransport(co.handle).authenticate(key or auth.Identity.generate())


def params(co) -> dict[str, dict[str, torch.Tensor]]:
    return {mid: {k: v.clone() for k, v in r.params.items()} for mid, r in co.store.modules.items()}


def unchanged(co, before) -> bool:
    return all(
        co.store.version(mid) == 0
        and not co.store.modules[mid].pending
        and all(torch.equal(co.store.params(mid)[k], v) for k, v in ts.items())
        for mid, ts in before.items()
    )


def delta(co, task, peer_id) -> m.SubmitDelta:
    return delta_message(task, peer_id, constant_delta(co, task))


def refused(call) -> str:
    with pytest.raises(RejectedError) as info:
        call()
    return info.value.reason


def raw(co, data: bytes, nonce: str = "") -> m.Message:
    """Send bytes straight to the handler; the reply, opened."""
    return m.decode_message(auth.open_reply(co.handle(data), nonce, None).body)


def test_a_forged_signature_is_refused_and_counted(tmp_path):
    co = make(tmp_path)
    before = params(co)
    mallory, alice = auth.Identity.generate(), auth.Identity.generate()
    task = peer(co, alice).request(m.ClaimTask(peer_id="alice"))
    body = m.encode_message(delta(co, task, "alice"))
    # Mallory signs alice's delta with her own key but writes alice's key in the envelope.
    sealed, nonce = auth.seal_request(mallory, body)
    forged = sealed.replace(mallory.public_key.encode(), alice.public_key.encode())
    reply = raw(co, forged, nonce)
    assert isinstance(reply, m.Error) and reply.reason == "bad-signature"
    # A genuine envelope whose body was changed on the way fails the same way.
    sealed, nonce = auth.seal_request(alice, body)
    tampered = bytearray(sealed)
    tampered[-5] ^= 0xFF
    assert raw(co, bytes(tampered), nonce).reason == "bad-signature"
    assert co.rejections["bad-signature"] == 2
    assert unchanged(co, before)


def test_a_replayed_delta_is_refused_and_applied_once(tmp_path):
    co = make(tmp_path)
    alice = auth.Identity.generate()
    tr = peer(co, alice)
    task = tr.request(m.ClaimTask(peer_id="alice"))
    sealed, nonce = auth.seal_request(alice, m.encode_message(delta(co, task, "alice")))
    assert isinstance(raw(co, sealed, nonce), m.DeltaAck)
    pending = {mid: dict(co.store.modules[mid].pending) for mid in TOPO.path_modules(task.path)}
    reply = raw(co, sealed, nonce)  # the same bytes, captured and sent again
    assert isinstance(reply, m.Error) and reply.reason == "replay"
    assert co.rejections["replay"] == 1 and co.rejections_by_peer["key:" + alice.fingerprint]
    assert {mid: dict(co.store.modules[mid].pending) for mid in pending} == pending


def test_a_delta_for_a_task_leased_to_another_key_is_refused(tmp_path):
    co = make(tmp_path)
    before = params(co)
    alice, mallory = auth.Identity.generate(), auth.Identity.generate()
    task = peer(co, alice).request(m.ClaimTask(peer_id="alice"))
    thief = peer(co, mallory)
    # Under alice's peer id: the id belongs to alice's key.
    assert refused(lambda: thief.request(delta(co, task, "alice"))) == "identity-mismatch"
    # Under its own id, with alice's ticket: the task is not its own.
    assert refused(lambda: thief.request(delta(co, task, "mallory"))) == "not-your-task"
    # A task id that was never issued.
    task.task_id = "P0-r0-e9-a9"
    task.ticket = ""
    assert refused(lambda: thief.request(delta(co, task, "mallory"))) == "unknown-task"
    assert co.rejections_by_peer["alice"]["identity-mismatch"] == 1
    assert co.rejections_by_peer["mallory"]["not-your-task"] == 1
    assert unchanged(co, before)


def test_a_delta_against_the_wrong_base_version_is_refused(tmp_path):
    co = make(tmp_path)
    before = params(co)
    tr = peer(co)
    task = tr.request(m.ClaimTask(peer_id="alice"))
    msg = delta(co, task, "alice")
    msg.base_versions = {mid: 7 for mid in msg.base_versions}
    assert refused(lambda: tr.request(msg)) == "wrong-base"
    assert co.rejections_by_peer["alice"]["wrong-base"] == 1
    assert unchanged(co, before)


def test_an_oversized_message_is_refused_before_it_is_decoded(tmp_path):
    co = make(tmp_path)
    before = params(co)
    tr = peer(co)
    task = tr.request(m.ClaimTask(peer_id="alice"))
    msg = delta(co, task, "alice")
    msg.tensors["S.embed/padding"] = torch.zeros(co.gate.max_request_bytes // 4 + 1)
    assert refused(lambda: tr.request(msg)) == "too-large"
    assert co.rejections_by_peer["alice"]["too-large"] == 0  # not decoded: blamed on the key
    assert co.rejections["too-large"] == 1
    assert unchanged(co, before)


def test_allow_list_mode_admits_listed_keys_and_follows_revocations_live(tmp_path):
    co = make(tmp_path, join="allow-list")
    alice = auth.Identity.generate()
    tr = peer(co, alice)
    assert refused(lambda: tr.request(m.Hello(peer_id="alice"))) == "unknown-peer"
    assert co.rejections["unknown-peer"] == 1
    change_access(co.root, alice.public_key, allow=True, note="alice's lab")
    assert isinstance(tr.request(m.Hello(peer_id="alice")), m.Welcome)
    time.sleep(0.01)  # a new mtime for the next change
    change_access(co.root, alice.public_key, allow=False)
    os.utime(co.root / "access.json", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert refused(lambda: tr.request(m.ClaimTask(peer_id="alice"))) == "revoked"
    assert not co.scheduler.leases  # nothing was leased to the revoked key


def test_a_peer_over_its_rate_limit_is_refused_until_it_slows_down(tmp_path):
    co = make(tmp_path, requests_per_second=1.0, burst=3)
    tr = peer(co)
    for _ in range(3):
        tr.request(m.Hello(peer_id="alice"))
    assert refused(lambda: tr.request(m.Hello(peer_id="alice"))) == "rate-limited"
    assert co.rejections["rate-limited"] == 1
    other = peer(co)  # another key has its own budget
    assert isinstance(other.request(m.Hello(peer_id="bob")), m.Welcome)


def test_a_flood_of_new_keys_keeps_the_rate_limits_bounded(tmp_path, monkeypatch):
    co = make(tmp_path, requests_per_second=1.0, burst=3)
    buckets = co.access._buckets
    monkeypatch.setattr(buckets, "keys", 5)  # 65536 in a real run
    alice = peer(co)
    for _ in range(3):
        alice.request(m.Hello(peer_id="alice"))
    assert refused(lambda: alice.request(m.Hello(peer_id="alice"))) == "rate-limited"
    for i in range(20):  # keys made at will, one request each
        peer(co).request(m.Hello(peer_id=f"sybil{i}"))
    assert len(buckets) == 5  # not one bucket per key ever seen
    # The price: a forgotten key starts afresh, as a new key would.
    assert isinstance(alice.request(m.Hello(peer_id="alice")), m.Welcome)


def test_repeated_offenders_are_banned_and_an_allow_lifts_the_ban(tmp_path):
    co = make(tmp_path, ban_after=3)
    mallory = auth.Identity.generate()
    tr = peer(co, mallory)
    task = tr.request(m.ClaimTask(peer_id="mallory"))
    bad = delta(co, task, "mallory")
    bad.path = (task.path + 1) % 4
    for _ in range(3):
        assert refused(lambda: tr.request(bad)) == "wrong-path"
    assert refused(lambda: tr.request(m.Hello(peer_id="mallory"))) == "banned"
    # The ban survives a restart of the coordinator.
    again = make(tmp_path, ban_after=3)
    assert refused(lambda: peer(again, mallory).request(m.Hello(peer_id="mallory"))) == "banned"
    time.sleep(1.1)  # the allow must be newer than the ban (second resolution)
    change_access(again.root, mallory.public_key, allow=True, note="forgiven")
    assert isinstance(peer(again, mallory).request(m.Hello(peer_id="mallory")), m.Welcome)


def test_quotas_bound_what_one_key_may_take_in_open_mode(tmp_path):
    co = make(tmp_path, max_tasks_per_key=2, max_names_per_key=3)
    tr = peer(co)
    for name in ("a", "b"):
        assert isinstance(tr.request(m.ClaimTask(peer_id=name)), m.TaskOffer)
    assert refused(lambda: tr.request(m.ClaimTask(peer_id="c"))) == "quota"
    assert refused(lambda: tr.request(m.Hello(peer_id="d"))) == "quota"  # a 4th peer id
    assert len(co.scheduler.leases) == 2


def test_a_request_from_a_skewed_clock_is_refused_with_advice(tmp_path):
    co = make(tmp_path, clock_skew_seconds=60)
    alice = auth.Identity.generate()
    body = m.encode_message(m.Hello(peer_id="alice"))
    sealed, nonce = auth.seal_request(alice, body, now=time.time() - 3600)
    reply = raw(co, sealed, nonce)
    assert reply.reason == "clock-skew" and "NTP" in reply.message
    sealed, nonce = auth.seal_request(alice, body, now=time.time() + 30)  # inside the window
    assert isinstance(raw(co, sealed, nonce), m.Welcome)


def test_a_peer_refuses_an_impostor_coordinator(tmp_path):
    co = make(tmp_path)
    impostor = make(tmp_path / "impostor")
    pinned = LocalTransport(impostor.handle).authenticate(
        auth.Identity.generate(), server_key=co.identity.public_key
    )
    with pytest.raises(WireError, match="expected the coordinator"):
        pinned.request(m.Hello(peer_id="alice"))

    # A reply recorded for one request does not answer another.
    alice = auth.Identity.generate()
    sealed, _ = auth.seal_request(alice, m.encode_message(m.Hello(peer_id="alice")))
    recorded = co.handle(sealed)
    with pytest.raises(WireError, match="nonce"):
        auth.open_reply(recorded, "another-nonce", co.identity.public_key)


def test_a_peer_refuses_a_forged_manifest_and_a_forged_release(tmp_path):
    co = make(tmp_path)
    tr = peer(co)
    p = Peer(tr, "alice", tmp_path / "alice")
    welcome = tr.request(m.Hello(peer_id="alice"))
    p.check_manifest(welcome)  # the genuine one passes
    welcome.config["train"] = {"lr": 100.0}
    with pytest.raises(ConfigError, match="signature"):
        p.check_manifest(welcome)
    p.config = {"run_id": "attack"}
    task = tr.request(m.ClaimTask(peer_id="alice"))
    served = tr.request(m.FetchModules(peer_id="alice", task_id=task.task_id))
    p._check_releases(co.owner_id, served)  # genuine releases pass
    mid = next(iter(served.hashes))
    served.hashes[mid] = "0" * 64  # another module version under the owner's old signature
    with pytest.raises(TaskAborted, match="release signature"):
        p._check_releases(co.owner_id, served)


def test_key_files_are_private_and_checked(tmp_path):
    me = auth.Identity.load_or_create(tmp_path / "signing.key")
    assert (tmp_path / "signing.key").stat().st_mode & 0o777 == 0o600
    assert auth.Identity.load(tmp_path / "signing.key").public_key == me.public_key
    os.chmod(tmp_path / "signing.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        auth.Identity.load(tmp_path / "signing.key")
    (tmp_path / "bad.key").write_text("hello")
    os.chmod(tmp_path / "bad.key", 0o600)
    with pytest.raises(ConfigError, match="not a dipaco private key"):
        auth.Identity.load(tmp_path / "bad.key")
    with pytest.raises(ConfigError, match="not a dipaco public key"):
        change_access(tmp_path, "ed25519:short", allow=True)
