"""Whole runs on the local transport: real files, real training, peers in threads."""

import threading

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
    if stop_after_deltas is None:  # the run's end: after the last round's validation
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


def test_a_rounds_validation_holds_up_no_peer(run_copy, tiny_config, monkeypatch):
    """Round 1's validation is held until the peers have finished a task of round 2: it runs on
    its own thread with round 1's modules, not under the coordinator's lock (where every claim,
    heartbeat and push would wait for it). It is logged, for every round, before the run's end."""
    from dipaco.protocols.wire import tensors_sha256
    from dipaco.run import factory

    tiny_config = tiny_config.replace(scheduler={"quorum": 1.0})  # two rounds
    real = factory.evaluate_modules
    started, release = threading.Event(), threading.Event()
    held: dict[str, str] = {}

    def evaluate(prep, modules, **kwargs):
        if not started.is_set():  # round 1's: note what it sees, then wait
            mids = prep.config.build_topology().module_ids()
            held.update({mid: tensors_sha256(modules(mid)) for mid in mids})
            started.set()
            assert release.wait(300)
            assert held == {mid: tensors_sha256(modules(mid)) for mid in mids}
        return real(prep, modules, **kwargs)

    monkeypatch.setattr(factory, "evaluate_modules", evaluate)
    root = run_copy()
    prep = prepare(root, tiny_config)
    metrics = MetricsLog(root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=True)
    round_two = threading.Event()
    metrics.listeners.append(
        lambda e: e["event"] == "round" and e["round"] >= 2 and round_two.set()
    )
    threads = run_local_peers(coordinator, prep, 2, stop=threading.Event())
    try:
        assert started.wait(300), "round 1 was never validated"
        assert round_two.wait(120), "round 2 did not close while round 1 was being validated"
        # The run is over, but its end waits for the last round's validation.
        assert coordinator.finished and not coordinator.finished_event.is_set()
        assert {coordinator.store.version(mid) for mid in held} == {2}
    finally:
        release.set()  # round 1's validation checks that its modules stayed round 1's
    for t in threads:
        t.join(300)
    assert coordinator.finished_event.wait(120)
    evals = [e for e in metrics.read() if e["event"] == "eval"]
    assert [e["round"] for e in evals] == [1, 2]


def test_a_validation_slower_than_the_rounds_skips_rounds_instead_of_holding_them(
    prepared_tiny, tiny_config, tmp_path, monkeypatch
):
    """Round 1's validation is held until round 4 has closed. Each waiting round's work holds
    that round's tensors, so at most two wait (base.ROUND_BACKLOG): round 2's is skipped,
    with a warning and a `round_work_skipped` event, and rounds 3 and 4 are validated."""
    from dipaco.run import factory

    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, train={"rounds": 4, "inner_steps": 8}
    )
    real = factory.evaluate_modules
    started, release = threading.Event(), threading.Event()

    def evaluate(prep, modules, **kwargs):
        if not started.is_set():
            started.set()
            assert release.wait(300)
        return real(prep, modules, **kwargs)

    monkeypatch.setattr(factory, "evaluate_modules", evaluate)
    root = tmp_path / "run"
    prep = prepare(root, tiny_config, reuse=prepared_tiny)
    metrics = MetricsLog(root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=True)
    round_four = threading.Event()
    metrics.listeners.append(
        lambda e: e["event"] == "round" and e["round"] >= 4 and round_four.set()
    )
    threads = run_local_peers(coordinator, prep, 2, stop=threading.Event())
    try:
        assert started.wait(300), "round 1 was never validated"
        assert round_four.wait(300), "round 4 did not close while round 1 was being validated"
    finally:
        release.set()
    for t in threads:
        t.join(300)
    assert coordinator.finished_event.wait(120)
    events = metrics.read()
    assert [e["round"] for e in events if e["event"] == "round_work_skipped"] == [2]
    assert [e["round"] for e in events if e["event"] == "eval"] == [1, 3, 4]


def test_early_stoppings_held_out_scoring_holds_up_no_peer(run_copy, tiny_config, monkeypatch):
    """Round 1's held-out scoring for early stopping is held until round 2 has closed: like the
    validation, it runs after the round on round 1's modules, not under the coordinator's
    lock. Every round is scored, and the kept snapshots are of scored rounds."""
    from dipaco.coordinator.early_stopping import EarlyStopping
    from dipaco.protocols.wire import tensors_sha256
    from dipaco.run import factory

    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, eval={"early_stopping": True, "every_round": False}
    )
    real = factory.track_early_stopping
    started, release = threading.Event(), threading.Event()
    held: dict[str, str] = {}

    def track(prep, early, modules, rnd, device="cpu"):
        if not started.is_set():  # round 1's: note what it sees, then wait
            mids = prep.config.build_topology().module_ids()
            held.update({mid: tensors_sha256(modules(mid)) for mid in mids})
            started.set()
            assert release.wait(300)
            assert held == {mid: tensors_sha256(modules(mid)) for mid in mids}
        return real(prep, early, modules, rnd, device)

    monkeypatch.setattr(factory, "track_early_stopping", track)
    root = run_copy()
    prep = prepare(root, tiny_config)
    metrics = MetricsLog(root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=False)
    round_two = threading.Event()
    metrics.listeners.append(
        lambda e: e["event"] == "round" and e["round"] >= 2 and round_two.set()
    )
    threads = run_local_peers(coordinator, prep, 2, stop=threading.Event())
    try:
        assert started.wait(300), "round 1 was never scored"
        assert round_two.wait(120), "round 2 did not close while round 1 was being scored"
        assert coordinator.finished and not coordinator.finished_event.is_set()
        assert {coordinator.store.version(mid) for mid in held} == {2}
    finally:
        release.set()
    for t in threads:
        t.join(300)
    assert coordinator.finished_event.wait(120)
    scored = [e["round"] for e in metrics.read() if e["event"] == "heldout"]
    assert scored == [1, 2]
    early = EarlyStopping(root / "early_stopping")
    paths = prep.config.build_topology().num_paths
    assert sorted(early.paths()) == list(range(paths))
    assert {early.best(p)["round"] for p in range(paths)} <= {1, 2}
