"""Fetch ahead in-process (``Peer(fetch_ahead=True)``; peers in threads over the local transport,
sharing one state folder as local peers do): the next task is claimed and its modules fetched
while the current one trains, and the model is the one a run without it trains, bit for bit,
even when a fetch ahead fails; a peer that stops hands back the task it holds ahead."""

import threading

import torch
from test_push_behind_in_process import train

from dipaco.peer.modules import TaskAborted


def same_model(reference, co, rounds):
    for mid in reference.store.modules:
        assert co.store.version(mid) == rounds
        for name, tensor in reference.store.params(mid).items():
            assert torch.equal(co.store.params(mid)[name], tensor), (mid, name)


def fails_once_ahead(peer):
    """The peer's first fetch on its fetch-ahead thread raises TaskAborted (a module that
    fails its hash check, say); every other fetch is real."""
    real, failed = peer.fetch, []

    def fetch(task):
        if threading.current_thread().name.endswith("-fetch") and not failed:
            failed.append(task.task_id)
            raise TaskAborted("the test's broken download")
        return real(task)

    peer.fetch, peer.failed_ahead = fetch, failed


def test_fetch_ahead_trains_the_same_model_and_survives_a_failed_fetch(run_copy, tiny_config):
    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})  # bit-for-bit: no deadlines
    reference, _, _ = train(run_copy("plain"), tiny_config, push_behind=False)
    co, peers, events = train(
        run_copy("ahead"), tiny_config, push_behind=False, fetch_ahead=True, setup=fails_once_ahead
    )
    assert co.finished and all(p.run_finished for p in peers)
    rounds = tiny_config.train.rounds
    done = sorted((e["path"], e["round"]) for e in events if e["event"] == "delta")
    assert done == [(p, r) for p in range(4) for r in range(rounds)]  # each once
    # Tasks were claimed and fetched while another trained: two leases at once for one peer.
    assert sum(p.ahead.tasks for p in peers) >= 2
    # Each peer's failed fetch ahead handed its task back at once; it was trained again.
    failed = [t for p in peers for t in p.failed_ahead]
    assert failed and all(
        any(e["event"] == "task_released" and e["task"] == t for e in events) for t in failed
    )
    same_model(reference, co, rounds)


def test_a_peer_that_stops_hands_back_the_task_it_fetched_ahead(run_copy, tiny_config):
    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})

    def stop_first_once_fetched(peer):
        """Stop local-0 at its first step after a task was fetched ahead; local-1 trains on."""
        if peer.peer_id == "local-0":
            peer.on_progress = lambda info: peer.ahead.tasks and peer.stop.set()

    co, peers, events = train(
        run_copy("stop"),
        tiny_config,
        push_behind=False,
        fetch_ahead=True,
        setup=stop_first_once_fetched,
    )
    stopped, other = peers
    assert stopped.ahead.tasks == 1 and stopped.stop.is_set() and other.run_finished
    # Both tasks it held, the one in training and the one fetched ahead, were handed back at
    # once (not left to expire), and trained by the other peer.
    mine = [e["task"] for e in events if e["event"] == "task_issued" and e["peer"] == "local-0"]
    released = [e["task"] for e in events if e["event"] == "task_released"]
    assert len(mine) == 2 and sorted(mine) == sorted(released)
    rounds = tiny_config.train.rounds
    done = sorted((e["path"], e["round"]) for e in events if e["event"] == "delta")
    assert done == [(p, r) for p in range(4) for r in range(rounds)]
