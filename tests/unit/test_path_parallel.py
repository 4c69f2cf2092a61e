"""Path-parallel local training: one peer trains every path of a round at once.

Step-interleaved (``batching="streams"``), no path's operations change and the outer step
averages deltas in path order, so the modules after the run equal those of one sequential peer,
bit for bit (on a CPU). Stacked (the default) they agree up to float rounding:
tests/unit/test_stacked.py.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from dipaco.coordinator.scheduler import Scheduler
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog

ROUNDS = 3


@pytest.fixture
def prepared(prepared_batch):
    return prepared_batch


def train(root, config, *, parallel, n_peers=1, batching="stacked", **scheduler):
    if scheduler:
        config = config.replace(scheduler=scheduler)
    prep = prepare(root, config)
    metrics = MetricsLog(root / "metrics.jsonl")
    co = build_coordinator(prep, metrics, evaluate=False)
    threads = run_local_peers(
        co, prep, n_peers, stop=threading.Event(), parallel=parallel, batching=batching
    )
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return co, metrics.read()


def copy(prepared, tmp_path, name):
    root, config = prepared
    dest = tmp_path / name
    shutil.copytree(root, dest)
    return dest, config


def test_an_interleaving_peer_matches_a_sequential_one_bit_for_bit(prepared, tmp_path):
    began = time.monotonic()
    seq_root, config = copy(prepared, tmp_path, "sequential")
    sequential, _ = train(seq_root, config, parallel=1)
    par_root, _ = copy(prepared, tmp_path, "parallel")
    parallel, events = train(par_root, config, parallel=4, batching="streams")
    for co in (sequential, parallel):
        assert co.finished and co.failure is None
        assert co.round == ROUNDS
    assert sequential.store.modules.keys() == parallel.store.modules.keys()
    for mid in sequential.store.modules:
        assert parallel.store.version(mid) == sequential.store.version(mid) == ROUNDS
        want, got = sequential.store.params(mid), parallel.store.params(mid)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (mid, name)
    # The peer really held all four tasks of a round at once: four issued, then four deltas.
    kinds = [e["event"] for e in events if e["event"] in ("task_issued", "delta")]
    assert kinds == (["task_issued"] * 4 + ["delta"] * 4) * ROUNDS, kinds
    assert {e["peer"] for e in events if e["event"] == "delta"} == {"local-0"}
    assert time.monotonic() - began < 60


def test_heartbeats_keep_every_lease_of_a_batch_alive(prepared, tmp_path):
    root, config = copy(prepared, tmp_path, "leases")
    prep = prepare(root, config.replace(scheduler={"lease_seconds": 0.6, "heartbeat_seconds": 0.1}))
    co = build_coordinator(prep, MetricsLog(root / "m.jsonl"), evaluate=False)
    seen = []

    def slow(info):  # a batch takes 12 x 0.1 s, twice the lease
        seen.append(info)
        time.sleep(0.1)

    key = Identity.load_or_create(root / "peer.key")
    peer = Peer(
        LocalTransport(co.handle).authenticate(key),
        "solo",
        root / "peer",
        on_progress=slow,
        parallel=4,
        max_tasks=4,
    )
    assert peer.run() == 4
    assert co.scheduler.expired == 0
    assert co.round == 1
    assert peer.tokens_trained == 4 * 3 * 4 * 64
    assert all(seconds > 0 for what, seconds in peer.timings.items()), peer.timings
    # on_progress reports every step of every path, the paths' steps interleaved.
    assert [(i["path"], i["step"]) for i in seen] == [(p, s) for s in (1, 2, 3) for p in range(4)]


def test_over_its_key_quota_a_parallel_peer_trains_what_it_holds(prepared, tmp_path):
    root, config = copy(prepared, tmp_path, "quota")
    prep = prepare(root, config.replace(security={"max_tasks_per_key": 2}))
    metrics = MetricsLog(root / "m.jsonl")
    co = build_coordinator(prep, metrics, evaluate=False)
    key = Identity.load_or_create(root / "peer.key")
    peer = Peer(LocalTransport(co.handle).authenticate(key), "solo", root / "peer", parallel=4)
    assert peer.run() == 4 * ROUNDS
    assert co.finished
    # Refused a third task, it trains its two, then claims the round's other two.
    kinds = [e["event"] for e in metrics.read() if e["event"] in ("task_issued", "delta")]
    assert kinds == ["task_issued", "task_issued", "delta", "delta"] * 2 * ROUNDS, kinds


def test_a_peer_naming_the_tasks_it_holds_gets_another_path():
    s = Scheduler(lease_seconds=30.0)
    open_paths = {0: 0, 1: 0, 2: 0}
    first = s.claim("p", open_paths, None)
    assert s.claim("p", open_paths, None) is first  # a restarted peer gets its task back
    second = s.claim("p", open_paths, None, holding=[first.task_id])
    third = s.claim("p", open_paths, None, holding=[first.task_id, second.task_id])
    assert [first.path, second.path, third.path] == [0, 1, 2]
    assert (
        s.claim("p", open_paths, None, holding=[first.task_id, second.task_id, third.task_id])
        is None
    )
    assert s.claim("p", open_paths, None, holding=[first.task_id]) is second
