"""Whole runs on the local transport: real files, real training, peers in threads."""

import threading
import time

import pytest
import torch

from dipaco.prepare.pipeline import prepare
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog


def train(root, config, n_peers, *, stop_after_deltas=None, evaluate=True):
    prep = prepare(root, config)
    metrics = MetricsLog(root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=evaluate)
    stop = threading.Event()
    if stop_after_deltas is not None:
        seen = []

        def count(event):
            if event["event"] == "delta":
                seen.append(event)
                if len(seen) >= stop_after_deltas:
                    stop.set()

        metrics.listeners.append(count)
    threads = run_local_peers(coordinator, prep, n_peers, stop=stop)
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert [t.peer.error for t in threads] == [None] * n_peers
    if stop_after_deltas is None:  # the run's end: after the last round's validation
        assert all(t.peer.run_finished for t in threads), "a peer did not see the run end"
        assert coordinator.finished_event.wait(120)
    return prep, coordinator, metrics


def test_three_peers_train_four_paths_and_validation_improves(run_copy, tiny_config):
    root = run_copy()
    prep, coordinator, metrics = train(root, tiny_config, n_peers=3)
    rounds = tiny_config.train.rounds
    status = coordinator.status().state
    assert status["finished"]
    assert {m["version"] for m in status["modules"].values()} == {rounds}
    assert sum(p["tasks_done"] for p in status["peers"].values()) == 4 * rounds
    assert len(status["peers"]) == 3
    initial = evaluate_modules(
        prep, prep.config.build_topology().init_modules(prep.initial_state()).__getitem__
    )
    evals = [e for e in metrics.read() if e["event"] == "eval"]
    assert [e["round"] for e in evals] == list(range(1, rounds + 1))
    assert evals[-1]["loss"] < initial["loss"] - 0.05
    assert set(evals[-1]["per_path"]) <= {"0", "1", "2", "3"}


def test_stopped_and_resumed_run_matches_an_uninterrupted_one(run_copy, tiny_config):
    # Bit-for-bit comparisons need every round to wait for all its paths: no deadline closes.
    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})
    whole = run_copy("whole")
    _, reference, _ = train(whole, tiny_config, n_peers=2, evaluate=False)

    split = run_copy("split")
    _, first, _ = train(split, tiny_config, n_peers=2, stop_after_deltas=6, evaluate=False)
    assert not first.finished
    assert 1 <= first.round < tiny_config.train.rounds
    # A new coordinator and new peers over the same run folder: a restart.
    _, resumed, _ = train(split, tiny_config, n_peers=2, evaluate=False)
    assert resumed.finished
    assert resumed.epoch == 1
    for mid, record in reference.store.modules.items():
        assert resumed.store.version(mid) == record.version
        for name, tensor in record.params.items():
            assert torch.equal(resumed.store.params(mid)[name], tensor), (mid, name)


def test_a_peer_that_fails_fails_the_local_run_though_another_could_finish_it(
    run_copy, tiny_config, monkeypatch, thread_exceptions
):
    from dipaco.errors import DipacoError
    from dipaco.peer.peer import Peer
    from dipaco.run.local import LocalRun

    real = Peer.run_task

    def run_task(self, *args, **kwargs):
        if self.peer_id == "local-0":
            raise RuntimeError("disk on fire")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Peer, "run_task", run_task)
    prep = prepare(run_copy(), tiny_config)
    coordinator = build_coordinator(prep, MetricsLog(prep.root / "m.jsonl"), evaluate=False)
    with pytest.raises(DipacoError, match="local-0: RuntimeError: disk on fire") as failed:
        with LocalRun(coordinator, prep, 2) as local:
            local.wait()
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert not coordinator.finished  # said at once, not after local-1 trained the run alone
    # ...and the thread's own exception, which fails a test that does not expect it
    assert [(name, str(exc)) for name, exc in thread_exceptions] == [("peer-0", "disk on fire")]
    thread_exceptions.clear()


class HoldFirst:
    """``round_work.<name>`` wrapped: its first call (round 1's) notes the module tensors it is
    given (``args[modules_at]``), waits for ``release``, and checks they are still the same."""

    def __init__(self, monkeypatch, name: str, modules_at: int) -> None:
        from dipaco.protocols.wire import tensors_sha256
        from dipaco.run import round_work

        real = getattr(round_work, name)
        self.started, self.release = threading.Event(), threading.Event()
        self.held: dict[str, str] = {}

        def hashes(prep, modules) -> dict[str, str]:
            mids = prep.config.build_topology().module_ids()
            return {mid: tensors_sha256(modules(mid)) for mid in mids}

        def wrapper(*args, **kwargs):
            if not self.started.is_set():
                self.held.update(hashes(args[0], args[modules_at]))
                self.started.set()
                assert self.release.wait(300)
                assert self.held == hashes(args[0], args[modules_at])
            return real(*args, **kwargs)

        monkeypatch.setattr(round_work, name, wrapper)


def run_holding(prep, hold: HoldFirst, last: int, what: str, evaluate: bool) -> list[dict]:
    """Two local peers train the run to its ``last`` round while round 1's ``hold`` waits;
    the run is over but not ended (its end waits for the held work), then it is let go.
    Returns the run's metrics events."""
    metrics = MetricsLog(prep.root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=evaluate)
    closed = threading.Event()
    metrics.listeners.append(
        lambda e: e["event"] == "round" and e["round"] >= last and closed.set()
    )
    threads = run_local_peers(coordinator, prep, 2, stop=threading.Event())
    try:
        assert hold.started.wait(300), f"round 1 was never {what}"
        assert closed.wait(300), f"round {last} did not close while round 1 was being {what}"
        assert coordinator.finished and not coordinator.finished_event.is_set()
        assert {coordinator.store.version(mid) for mid in hold.held} == {last}
    finally:
        hold.release.set()  # round 1's work checks that its modules stayed round 1's
    for t in threads:
        t.join(300)
    assert all(t.peer.run_finished for t in threads), [t.peer.error for t in threads]
    assert coordinator.finished_event.wait(120)
    return metrics.read()


def test_a_rounds_validation_holds_up_no_peer(run_copy, tiny_config, monkeypatch):
    """Round 1's validation is held until the peers have finished a task of round 2: it runs on
    its own thread with round 1's modules, not under the coordinator's lock (where every claim,
    heartbeat and push would wait for it). It is logged, for every round, before the run's end."""
    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})  # two rounds
    hold = HoldFirst(monkeypatch, "evaluate_modules", 1)
    events = run_holding(prepare(run_copy(), tiny_config), hold, 2, "validated", evaluate=True)
    assert [e["round"] for e in events if e["event"] == "eval"] == [1, 2]


def test_a_validation_slower_than_the_rounds_skips_rounds_instead_of_holding_them(
    prepared_tiny, tiny_config, tmp_path, monkeypatch
):
    """Round 1's validation is held until round 4 has closed. Each waiting round's work holds
    that round's tensors, so at most two wait (base.ROUND_BACKLOG): round 2's is skipped,
    with a warning and a `round_work_skipped` event, and rounds 3 and 4 are validated."""
    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, train={"rounds": 4, "inner_steps": 8}
    )
    hold = HoldFirst(monkeypatch, "evaluate_modules", 1)
    prep = prepare(tmp_path / "run", tiny_config, reuse=prepared_tiny)
    events = run_holding(prep, hold, 4, "validated", evaluate=True)
    assert [e["round"] for e in events if e["event"] == "round_work_skipped"] == [2]
    assert [e["round"] for e in events if e["event"] == "eval"] == [1, 3, 4]


def test_early_stoppings_held_out_scoring_holds_up_no_peer(run_copy, tiny_config, monkeypatch):
    """Round 1's held-out scoring for early stopping is held until round 2 has closed: like the
    validation, it runs after the round on round 1's modules, not under the coordinator's
    lock. Every round is scored, and the kept snapshots are of scored rounds."""
    from dipaco.coordinator.early_stopping import EarlyStopping

    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, eval={"early_stopping": True, "every_round": False}
    )
    hold = HoldFirst(monkeypatch, "track_early_stopping", 2)
    prep = prepare(run_copy(), tiny_config)
    events = run_holding(prep, hold, 2, "scored", evaluate=False)
    assert [e["round"] for e in events if e["event"] == "heldout"] == [1, 2]
    early = EarlyStopping(prep.root / "early_stopping")
    paths = prep.config.build_topology().num_paths
    assert sorted(early.paths()) == list(range(paths))
    assert {early.best(p)["round"] for p in range(paths)} <= {1, 2}


def test_a_restart_runs_the_round_work_that_a_stop_cut_off(run_copy, tiny_config, monkeypatch):
    """The coordinator stops after a round closed and before its held-out scoring finished (that
    work runs on a thread a stop does not wait for). The restarted coordinator scores the round
    its modules are at, once: a third start finds the work done."""
    from dipaco.coordinator.early_stopping import EarlyStopping
    from dipaco.run import round_work

    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, eval={"early_stopping": True, "every_round": False}
    )
    prep = prepare(run_copy(), tiny_config)
    real, cut, stopped, cut_off = round_work.track_early_stopping, threading.Event(), set(), [True]

    def scoring(*args, **kwargs):
        """The first process's scoring never finishes: it stopped (its thread ends the test)."""
        me = threading.current_thread()
        if cut_off[0] or me in stopped:
            stopped.add(me)
            cut.wait(300)
            raise RuntimeError("the process stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(round_work, "track_early_stopping", scoring)
    log = prep.root / "metrics.jsonl"

    def heldout() -> list[int]:
        return [e["round"] for e in MetricsLog(log).read() if e["event"] == "heldout"]

    try:
        first = build_coordinator(prep, MetricsLog(log), evaluate=False)
        stop = threading.Event()
        threads = run_local_peers(first, prep, 2, stop=stop)
        deadline = time.monotonic() + 300
        while first.round < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(300)
        rnd = first.round
        assert rnd >= 1 and stopped and heldout() == []
        cut_off[0] = False
        second = build_coordinator(prep, MetricsLog(log), evaluate=False)
        assert second.after_round.drain(300)
        assert heldout() == [rnd]
        early = EarlyStopping(prep.root / "early_stopping")
        paths = prep.config.build_topology().num_paths
        assert {early.best(p)["round"] for p in range(paths)} == {rnd}
        third = build_coordinator(prep, MetricsLog(log), evaluate=False)
        assert third.after_round.drain(60)
        assert heldout() == [rnd]  # done already: not run again
    finally:
        cut.set()
