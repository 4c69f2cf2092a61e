"""A late delta judged by the held-out check against modules that moved on since its base.

Such a delta is refused if it would make its path worse (applied, it would), but the refusal
says as much about its peer's speed as about its key: it counts toward neither the key's
usefulness score nor its ban budget (``security.ban_after``). A delta on time that makes its
path worse counts toward both, as before.
"""

import pytest
import torch
from _tiny import delta_message
from test_rounds import INIT, TOPO, Clock, make

from dipaco.config import ValidationSection
from dipaco.errors import RejectedError
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

KEYS = {f"p{p}": Identity.generate() for p in range(5)}


def loss(path, modules):
    """A stand-in held-out loss that every honest delta (+0.01 everywhere: params - 0.01)
    lowers: the sum of the path's parameters."""
    return sum(
        float(modules[mid][k].sum()) for mid in TOPO.path_modules(path) for k in modules[mid]
    )


def setup(tmp_path):
    clock, events = Clock(), []
    validation = ValidationSection(heldout_check=True, heldout_tolerance=0.0)
    co = make(tmp_path, clock, events=events, validation=validation, heldout_loss=loss)
    trs = {peer: LocalTransport(co.handle).authenticate(key) for peer, key in KEYS.items()}
    return co, clock, events, trs


def submit(trs, task, peer, sign=1.0):
    tensors = {
        f"{mid}/{k}": torch.full_like(v, 0.01 * sign)
        for mid in TOPO.path_modules(task.path)
        for k, v in INIT[mid].items()
    }
    msg = delta_message(task, peer, tensors, base_versions=dict(task.module_versions))
    return trs[peer].request(msg)


def claim(trs, peer, path):
    task = trs[peer].request(m.ClaimTask(peer_id=peer, prefer_path=path))
    assert task.path == path
    return task


def refused(call):
    with pytest.raises(RejectedError) as err:
        call()
    return err.value


def test_a_late_delta_that_would_hurt_is_refused_but_not_held_against_its_key(tmp_path):
    co, clock, events, trs = setup(tmp_path)
    # Round 0 in full: 4 durations of 10 s make the deadline 15 s.
    tasks = [claim(trs, f"p{p}", p) for p in range(4)]
    clock.now += 10
    for p, task in enumerate(tasks):
        submit(trs, task, f"p{p}")
    assert {co.store.version(mid) for mid in TOPO.module_ids()} == {1}
    # Round 1: paths 0-2 report; p3 straggles past the deadline and its modules step without it.
    tasks = [claim(trs, f"p{p}", p) for p in range(4)]
    clock.now += 2
    for p in range(3):
        submit(trs, tasks[p], f"p{p}")
    clock.now = 20.0  # p3 is still at it (its lease lives on) when the deadline passes
    assert trs["p3"].request(m.Heartbeat(peer_id="p3", task_id=tasks[3].task_id, step=3)).lease_ok
    clock.now = 26.0
    co.tick()
    assert {co.store.version(mid) for mid in TOPO.path_modules(3)} == {2}
    late_key = KEYS["p3"].public_key
    score_before = co.key_scores.scores.get(late_key)

    err = refused(lambda: submit(trs, tasks[3], "p3", sign=-1.0))
    assert err.reason == "worse-heldout" and "late" in str(err)
    assert co.access.offences[late_key] == 0  # not against its ban budget
    assert co.key_scores.scores.get(late_key) == score_before  # nor its usefulness score
    assert co.rejections_by_peer["p3"] == {"worse-heldout": 1}  # still counted as a refusal
    check = [e for e in events if e["event"] == "heldout_check"][-1]
    assert check["late"] is True and check["refused"] == "worse-heldout"

    # The same delta on time (round 2, base = the modules now) is held against its key.
    task = claim(trs, "p4", 0)
    assert task.round == 2 and set(task.module_versions.values()) == {2}
    err = refused(lambda: submit(trs, task, "p4", sign=-1.0))
    assert err.reason == "worse-heldout" and "late" not in str(err)
    on_time_key = KEYS["p4"].public_key
    assert co.access.offences[on_time_key] == 1
    assert co.key_scores.scores[on_time_key][0] < 0
    check = [e for e in events if e["event"] == "heldout_check"][-1]
    assert check["late"] is False and check["refused"] == "worse-heldout"
