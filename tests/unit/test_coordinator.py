"""The coordinator core driven through its wire handler, as every transport drives it."""

import time

import pytest
import torch
from _tiny import TOPO, constant_delta, delta_message, initial_modules, tiny_coordinator

from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import RejectedError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(root, clock=None, rounds=2, shard_tokens=None):
    return tiny_coordinator(
        root,
        outer=OuterSettings(rescale="sqrt"),  # the steps below are figured with sqrt(paths)
        rounds=rounds,
        step_offset=10,
        total_steps=30,
        lease_seconds=10.0,
        shard_tokens=shard_tokens,
        clock=clock or Clock(),
    )


def claim(tr, peer, prefer=None):
    return tr.request(m.ClaimTask(peer_id=peer, prefer_path=prefer))


def delta_for(co, task, scale=0.01, peer="a", **override):
    # Without the ticket unless asked: the scheduler then checks its lease table.
    return delta_message(task, peer, constant_delta(co, task, scale), **{"ticket": "", **override})


def test_a_round_steps_every_module_once_all_paths_report(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"peer{i}") for i in range(4)]
    assert sorted(t.path for t in tasks) == [0, 1, 2, 3]
    assert isinstance(claim(tr, "peer9"), m.NoTask)  # every open path is leased
    closed = []
    for i, task in enumerate(tasks):
        ack = tr.request(delta_for(co, task, peer=f"peer{i}"))
        closed += ack.closed
    assert sorted(closed) == sorted(TOPO.module_ids())
    assert {co.store.version(mid) for mid in TOPO.module_ids()} == {1}
    # Level modules had 2 paths through them, shared parts 4: the step differs by sqrt(2).
    init = initial_modules()
    moved = (
        init["L0.M0"]["layers.0.mlp.up_proj.weight"]
        - co.store.params("L0.M0")["layers.0.mlp.up_proj.weight"]
    )
    assert torch.allclose(moved, torch.full_like(moved, 0.01 * 2**0.5 * 0.7 * 1.9))
    moved = (
        init["S.embed"]["embed_tokens.weight"] - co.store.params("S.embed")["embed_tokens.weight"]
    )
    assert torch.allclose(moved, torch.full_like(moved, 0.01 * 2 * 0.7 * 1.9))


def test_bad_deltas_are_rejected_with_reasons_and_counted(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    task = claim(tr, "a")
    good = delta_for(co, task)
    first = next(iter(good.tensors))
    cases = {
        "wrong-base": {"base_versions": {mid: 7 for mid in task.module_versions}},
        "wrong-shape": {"tensors": {**good.tensors, first: torch.zeros(3)}},
        "non-finite": {"tensors": {**good.tensors, first: good.tensors[first] * float("nan")}},
        "wrong-tensors": {"tensors": dict(list(good.tensors.items())[1:])},
        "unknown-module": {"tensors": {**good.tensors, "L9.M9/w": torch.zeros(1)}},
        "wrong-path": {"path": (task.path + 1) % 4},
        "unknown-task": {"task_id": "P0-r0-forged"},
        "bad-tokens": {"tokens": 0},
    }
    for reason, override in cases.items():
        with pytest.raises(RejectedError) as err:
            tr.request(delta_for(co, task, **override))
        assert err.value.reason == reason, reason
    with pytest.raises(RejectedError) as err:
        tr.request(delta_for(co, task, peer="mallory"))
    assert err.value.reason == "not-your-task"
    status = tr.request(m.GetStatus()).state
    assert status["rejections"] == {reason: 1 for reason in [*cases, "not-your-task"]}
    assert status["rejections_by_peer"]["mallory"] == {"not-your-task": 1}
    assert all(not r["pending"] for r in status["modules"].values())  # nothing bad was stored
    first_ack = tr.request(good)
    # A retried submission (the ack was lost) is acknowledged again, not applied twice.
    assert tr.request(good).accepted == first_ack.accepted
    assert sorted(co.store.modules["S.embed"].pending) == [task.path]


def test_garbage_bytes_get_an_error_reply_not_a_crash(tmp_path):
    co = make(tmp_path)

    def send(data: bytes, nonce: str = "") -> m.Message:
        return m.decode_message(auth.open_reply(co.handle(data), nonce, None).body)

    reply = send(b"\x80\x04garbage")  # a pickle's opening bytes
    assert isinstance(reply, m.Error) and reply.reason == "unsigned"
    me = auth.Identity.generate()
    sealed, nonce = auth.seal_request(me, b"\x80\x04garbage")
    reply = send(sealed, nonce)
    assert isinstance(reply, m.Error) and reply.reason == "bad-message"
    sealed, nonce = auth.seal_request(me, m.encode_message(m.Welcome(run_id="x", config={})))
    reply = send(sealed, nonce)
    assert isinstance(reply, m.Error) and "not a request" in reply.message
    assert co.status().state["rejections"]["bad-message"] == 2
    assert co.status().state["rejections"]["unsigned"] == 1


def test_expired_lease_is_reissued_and_heartbeats_keep_it(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock)
    tr = LocalTransport(co.handle)
    tasks = {claim(tr, f"p{i}").path: f"p{i}" for i in range(4)}
    assert len(tasks) == 4
    t0 = co.status().state["leases"]
    held = next(t for t, lease in t0.items() if lease["peer"] == "p0")
    clock.now = 8.0
    for i in range(1, 4):  # every peer but p0 keeps heartbeating
        task_id = next(t for t, lease in t0.items() if lease["peer"] == f"p{i}")
        assert tr.request(m.Heartbeat(peer_id=f"p{i}", task_id=task_id, step=3)).lease_ok
    clock.now = 12.0
    again = claim(tr, "p4")
    assert (
        isinstance(again, m.TaskOffer) and again.path == t0[held]["path"] and again.task_id != held
    )
    assert co.status().state["expired_leases"] == 1
    assert not tr.request(m.Heartbeat(peer_id="p0", task_id=held)).lease_ok


def test_affinity_gives_a_peer_its_previous_path(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    assert claim(tr, "a", prefer=3).path == 3
    assert claim(tr, "b", prefer=3).path == 0  # taken: the lowest free path instead


def test_release_reopens_the_path_at_once(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    task = claim(tr, "a", prefer=2)
    tr.request(m.ReleaseTask(peer_id="a", task_id=task.task_id))
    assert claim(tr, "b", prefer=2).path == 2


def test_restart_keeps_acknowledged_deltas_and_rolls_back_a_half_step(tmp_path):
    def run_round(co, paths):
        tr = LocalTransport(co.handle)
        for p in paths:
            task = claim(tr, f"p{p}", prefer=p)
            assert task.path == p
            tr.request(delta_for(co, task, peer=f"p{p}", scale=0.01 * (p + 1)))

    co = make(tmp_path / "crashed")
    run_round(co, [0, 1, 2])
    assert co.store.version("L0.M0") == 1  # paths 0 and 1 are all of L0.M0's paths
    # A crash inside L0.M1's outer step: its new version file written, its head not yet moved.
    half = tmp_path / "crashed" / "modules" / "L0.M1" / "v1.dpt"
    half.write_bytes(b"half-written")
    again = make(tmp_path / "crashed")
    assert not half.exists()
    assert again.epoch == 1
    assert again.store.version("L0.M0") == 1 and again.store.version("L0.M1") == 0
    assert sorted(again.store.modules["S.embed"].pending) == [0, 1, 2]  # acked deltas survived
    assert again.open_paths() == {3: 0}  # only the path that never reported is trained again
    run_round(again, [3])
    assert {again.store.version(mid) for mid in TOPO.module_ids()} == {1}

    reference = make(tmp_path / "reference")
    run_round(reference, [0, 1, 2, 3])
    for mid in TOPO.module_ids():
        for k, v in reference.store.params(mid).items():
            assert torch.equal(v, again.store.params(mid)[k]), (mid, k)


def test_corrupt_store_files_are_named_in_the_error(tmp_path):
    from dipaco.errors import CorruptFileError

    make(tmp_path)
    head = tmp_path / "modules" / "L1.M0" / "head.json"
    good = head.read_text()
    head.write_text("{not json")
    with pytest.raises(CorruptFileError, match="L1.M0/head.json"):
        make(tmp_path)
    head.write_text(good)
    params = tmp_path / "modules" / "L1.M0" / "v0.dpt"
    raw = bytearray(params.read_bytes())
    raw[-40] ^= 1
    params.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="L1.M0/v0.dpt"):
        make(tmp_path)


def test_outer_step_weights_paths_by_their_shard_tokens(tmp_path):
    co = make(tmp_path, shard_tokens=[1000, 3000, 1000, 1000])
    tr = LocalTransport(co.handle)
    before = {k: v.clone() for k, v in co.store.params("L0.M0").items()}
    for p, scale in [(0, 0.01), (1, 0.05), (2, 0.0), (3, 0.0)]:
        task = claim(tr, f"p{p}", prefer=p)
        tr.request(delta_for(co, task, scale=scale, peer=f"p{p}"))
    # L0.M0 is on paths 0 and 1: (1000 * 0.01 + 3000 * 0.05) / 4000 = 0.04, times sqrt(2),
    # then the first Nesterov step moves by lr * (1 + momentum) = 0.7 * 1.9.
    name = "layers.0.self_attn.q_proj.weight"
    moved = before[name] - co.store.params("L0.M0")[name]
    assert torch.allclose(moved, torch.full_like(moved, 0.04 * 2**0.5 * 0.7 * 1.9), atol=1e-6)


def claimed_with_delta(tmp_path):
    """A coordinator, a transport, a task claimed by peer "a", and its plain delta."""
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    task = claim(tr, "a")
    return co, tr, task, delta_for(co, task)


def encoded(co, task, plain, codec):
    """``plain``'s tensors sent through ``codec`` (for a test to send, or to spoil first)."""
    from dipaco.protocols import codecs

    delta = delta_for(co, task, codec=codec)
    delta.tensors = codecs.encode(codec, plain.tensors)
    return delta


def test_encoded_deltas_are_decoded_checked_and_applied(tmp_path):
    co, tr, task, plain = claimed_with_delta(tmp_path)
    bad = encoded(co, task, plain, "int8")
    del bad.tensors[next(k for k in bad.tensors if k.endswith("#scale"))]
    with pytest.raises(RejectedError) as err:
        tr.request(bad)
    assert err.value.reason == "bad-encoding"
    with pytest.raises(RejectedError) as err:
        tr.request(delta_for(co, task, codec="zip"))
    assert err.value.reason == "bad-codec"
    good = encoded(co, task, plain, "int8")
    assert tr.request(good).accepted
    stored = co.store.delta_tensors(co.store.modules["S.embed"].pending[task.path])
    assert torch.allclose(stored["embed_tokens.weight"], torch.full((64, 16), 0.01), atol=1e-4)


def test_a_retry_after_its_round_closed_is_acknowledged_not_applied_again(tmp_path):
    co = make(tmp_path, rounds=3)
    tr = LocalTransport(co.handle)
    tasks = [claim(tr, f"p{i}") for i in range(4)]
    deltas = [delta_for(co, t, peer=f"p{i}") for i, t in enumerate(tasks)]
    for d in deltas:
        tr.request(d)
    after = {mid: co.store.version(mid) for mid in TOPO.module_ids()}
    assert set(after.values()) == {1}
    ack = tr.request(deltas[0])  # the first ack was lost; the round has closed since
    assert sorted(ack.accepted) == sorted(TOPO.path_modules(tasks[0].path))
    assert all(not r.pending and not r.late for r in co.store.modules.values())
    restarted = make(tmp_path, rounds=3)  # the applied task ids survive a restart
    ack = LocalTransport(restarted.handle).request(
        delta_for(restarted, tasks[0], peer="p0", ticket=tasks[0].ticket)
    )
    assert ack.accepted and not any(r.late for r in restarted.store.modules.values())


def test_an_expired_lease_takes_its_ticket_with_it_and_the_reissued_task_counts(tmp_path):
    clock = Clock()
    co = make(tmp_path, clock)
    tr = LocalTransport(co.handle)
    tasks = {t.path: (t, f"p{i}") for i, t in enumerate(claim(tr, f"p{i}") for i in range(4))}
    clock.now = 20.0  # every lease expires: the paths are offered again
    again = claim(tr, "late-comer", prefer=3)
    assert again.path == 3 and again.task_id != tasks[3][0].task_id
    for task, peer in tasks.values():  # the original peers come back too late
        with pytest.raises(RejectedError) as err:
            tr.request(delta_for(co, task, peer=peer))
        assert err.value.reason == "lease-ended"
    tr.request(delta_for(co, again, peer="late-comer"))  # the path's current holder counts
    assert all(3 in co.store.modules[mid].pending for mid in TOPO.path_modules(3))
    assert not any(r.late for r in co.store.modules.values())


def test_hello_tells_its_clock_only_to_a_peer_that_asks(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    asked = tr.request(m.Hello(peer_id="new", capabilities={"clock": 1}))
    assert abs(asked.clock["now"] - time.time()) < 5
    assert asked.clock["window"] == co.security.clock_skew_seconds
    assert tr.request(m.Hello(peer_id="old")).clock == {}
    # A peer from before the field refuses unknown fields: a Welcome without a clock leaves
    # the field out of the frame, and one with it decodes to the same clock.
    assert "clock" not in m.to_frame(m.Welcome(run_id="r", config={})).fields
    back = m.decode_message(m.encode_message(asked))
    assert back.clock == asked.clock and "clock" in m.to_frame(asked).fields


def test_a_sign1_delta_with_a_bad_scale_is_refused_counted_and_the_good_one_applied(tmp_path):
    co, tr, task, plain = claimed_with_delta(tmp_path)
    bad = encoded(co, task, plain, "sign1")
    scale = next(k for k in bad.tensors if k.endswith("#scale"))
    bad.tensors[scale] = -bad.tensors[scale] - 1.0  # a negative block magnitude
    with pytest.raises(RejectedError) as err:
        tr.request(bad)
    assert err.value.reason == "bad-encoding" and "negative scales" in str(err.value)
    assert co.rejections["bad-encoding"] == 1 and co.rejections_by_peer["a"]["bad-encoding"] == 1
    good = encoded(co, task, plain, "sign1")
    assert tr.request(good).accepted
    stored = co.store.delta_tensors(co.store.modules["S.embed"].pending[task.path])
    # every element of the constant delta is +0.01: sign bits 0, each block's mean 0.01
    assert torch.allclose(stored["embed_tokens.weight"], torch.full((64, 16), 0.01), atol=1e-6)
