"""Push behind in-process (peers in threads over the local transport, sharing one state folder as
local peers do): the model is the one a run without it trains, bit for bit, even when a send is
refused and its task handed back and trained again."""

import threading

import torch

from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


def refusing_once(co, reason, refused: list[str]):
    """The coordinator's handler, except that the first SubmitDelta gets ``reason`` back."""

    def handle(data: bytes) -> bytes:
        signed = auth.open_request(data)
        req = m.decode_message(signed.body)
        if isinstance(req, m.SubmitDelta) and not refused:
            refused.append(req.task_id)
            error = m.Error(reason=reason, message="refused by the test")
            return auth.seal_reply(co.identity, signed.nonce, m.encode_message(error))
        return co.handle(data)

    return handle


def train(root, config, push_behind, refused=None, setup=None, **options):
    """Two local peers (``options`` for each) until the run ends; ``setup(peer)`` before they
    start. Returns the coordinator, the peers and the run's events."""
    prep = prepare(root, config)
    metrics = MetricsLog(root / "metrics.jsonl")
    co = build_coordinator(prep, metrics, evaluate=False)
    handle = refusing_once(co, Reason.HUGE_NORM, refused) if refused is not None else co.handle
    peers = [
        Peer(
            LocalTransport(handle), f"local-{i}", root / "peers", push_behind=push_behind, **options
        )
        for i in range(2)
    ]
    for peer in peers if setup is not None else ():
        setup(peer)
    threads = [threading.Thread(target=p.run, daemon=True) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert co.finished_event.wait(60)
    return co, peers, metrics.read()


def test_push_behind_trains_the_same_model_and_survives_a_refused_send(run_copy, tiny_config):
    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})  # bit-for-bit: no deadlines
    reference, _, _ = train(run_copy("plain"), tiny_config, push_behind=False)
    refused: list[str] = []
    co, peers, events = train(run_copy("behind"), tiny_config, push_behind=True, refused=refused)

    assert co.finished and all(p.run_finished for p in peers)
    # The refused task was handed back at once and trained again (by whichever peer).
    assert len(refused) == 1
    assert any(e["event"] == "task_released" and e["task"] == refused[0] for e in events)
    rounds = tiny_config.train.rounds
    done = sorted((e["path"], e["round"]) for e in events if e["event"] == "delta")
    assert done == [(p, r) for p in range(4) for r in range(rounds)]
    assert sum(p.tasks_done for p in peers) == 4 * rounds
    # Sends ran on the push thread, and the model is the plain run's, bit for bit.
    assert all(p.behind.seconds > 0 for p in peers)
    for mid in reference.store.modules:
        assert co.store.version(mid) == rounds
        for name, tensor in reference.store.params(mid).items():
            assert torch.equal(co.store.params(mid)[name], tensor), (mid, name)
