"""A run with a discriminative routing phase, overlapping shards and early stopping.

Peers here fetch their shards over the protocol (``FetchFile``), as remote peers do, so the
phase's new shards must reach them through the task offers.
"""

import json
import threading

import numpy as np
import pytest

from dipaco.cli.main import main
from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.data.shards import TokenShard
from dipaco.errors import ConfigError
from dipaco.peer.download import RunFiles
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.routing.discriminative import LogisticRouter
from dipaco.routing.routers import load_router
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.manifest import peer_config
from dipaco.run.metrics_log import MetricsLog


def test_discriminative_phase_reshards_mid_run_and_peers_download_the_new_shards(
    prepared_tiny, tiny_config, tmp_path, capsys
):
    config = tiny_config.replace(
        train={"inner_steps": 4, "rounds": 3},
        routing={"discriminative_after": [1], "overlap": 2, "candidates": 2},
        eval={"early_stopping": True, "every_round": False, "reroute_windows": [16]},
    )
    root = tmp_path / "run"
    prep = prepare(root, config, reuse=prepared_tiny)
    assert (root / "tokenizer.model").samefile(prepared_tiny / "tokenizer.model")
    metrics = MetricsLog(root / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=False)
    handle = coordinator.handle
    stop = threading.Event()
    peers, threads = [], []
    for i in range(2):
        link = LocalTransport(handle).authenticate(Identity.generate())  # as dipaco-peer does
        files = RunFiles(link, f"remote-{i}", peer_config(prep)["files"], tmp_path / f"p{i}")
        peer = Peer(
            link,
            f"remote-{i}",
            tmp_path / f"state{i}",
            stop=stop,
            shard_source=files.shard,
        )
        peers.append(peer)
        threads.append(threading.Thread(target=peer.run, daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert all(p.run_finished for p in peers), [p.error for p in peers]
    # The run's end comes after the last round's held-out scoring (it runs after each round,
    # off the coordinator's lock), as the CLI waits for it.
    assert coordinator.finished_event.wait(60)
    assert coordinator.finished and coordinator.failure is None

    # The phase ran once, after round 1, and round 2 onward trained on its shards.
    events = metrics.read()
    phases = [e for e in events if e["event"] == "routing_phase"]
    assert [e["phase"] for e in phases] == [1]
    issued = [e for e in events if e["event"] == "task_issued"]
    assert {e["phase"] for e in issued if e["round"] == 0} == {0}
    assert {e["phase"] for e in issued if e["round"] >= 1} == {1}
    # ... which each peer that trained in the new phase downloaded by name from the offers.
    later = {e["peer"] for e in issued if e["round"] >= 1}
    assert later
    for i in range(2):
        if f"remote-{i}" in later:
            assert any((tmp_path / f"p{i}" / "shards" / "phase1").rglob("train.tokens")), i

    prep.refresh()
    assert [r.phase for r in prep.routings] == [0, 1]
    router = load_router(root / "router-phase1.json")
    assert isinstance(router, LogisticRouter)
    stats = json.loads((root / "routing-phase1.json").read_text())
    assert sum(stats["label_counts"]) == stats["router_docs"] > 0
    assert stats["candidates"] == 2  # only each document's top 2 k-means paths were scored
    # Every path has data in the new phase (the bias correction), and with overlap 2 every
    # training document sits in exactly two shards.
    train = TokenShard(root / "data" / "train")
    for phase in (0, 1):
        prefix = root / prep.routings[phase].prefix
        trained = [d for p in range(4) for d in TokenShard(prefix / f"P{p}" / "train").doc_ids]
        heldout = [d for p in range(4) for d in TokenShard(prefix / f"P{p}" / "heldout").doc_ids]
        assert all(TokenShard(prefix / f"P{p}" / "train").n_tokens > 0 for p in range(4))
        counts = {d: trained.count(d) for d in set(trained)}
        assert set(counts.values()) == {2}
        assert len(heldout) == len(set(heldout))
        assert set(counts) | set(heldout) == set(train.doc_ids)
    # Evaluation routes with the latest router; the router documents were never trained on.
    router_ids = set(TokenShard(root / "data" / "router").doc_ids)
    assert router_ids and not router_ids & set(train.doc_ids)
    assert np.array_equal(prep.val_paths, router.assign(prep.features("val")))

    # Early stopping kept one snapshot per path, from some round, and evaluation can use them.
    early = EarlyStopping(root / "early_stopping")
    assert sorted(early.paths()) == [0, 1, 2, 3]
    assert {early.best(p)["round"] for p in range(4)} <= {1, 2, 3}
    final = evaluate_modules(prep, coordinator.store.params)
    stopped = evaluate_modules(prep, coordinator.store.params, early=early)
    rerouted = evaluate_modules(prep, coordinator.store.params, early=early, window=16)
    learned = evaluate_modules(prep, coordinator.store.params, early=early, window=16, learned=True)
    assert final["tokens"] == stopped["tokens"] == rerouted["tokens"] == learned["tokens"] > 0
    assert np.isfinite([final["ppl"], stopped["ppl"], rerouted["ppl"], learned["ppl"]]).all()
    # The phase also fitted a chunk router, on windows of the router documents.
    assert isinstance(prep.routing.chunk_router, LogisticRouter)
    assert (root / "chunk-router-phase1.json").exists()

    # `dipaco eval` reports all three from the run folder alone.
    capsys.readouterr()
    try:
        main(["eval", "--run-dir", str(root), "--json"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["early_stopping_ppl"] == pytest.approx(stopped["ppl"])
    assert report["rerouted_every_16_ppl"] == pytest.approx(rerouted["ppl"])
    assert report["rerouted_every_16_learned_ppl"] == pytest.approx(learned["ppl"])
    # and as lines a person reads, one per figure
    try:
        main(["eval", "--run-dir", str(root)])
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = capsys.readouterr().out
    assert f"rerouted every 16: perplexity {rerouted['ppl']:.2f}" in out
    assert "{" not in out, out


def test_overlap_changes_training_shards_but_never_evaluation(prepared_tiny, tiny_config, tmp_path):
    one = prepare(
        tmp_path / "one", tiny_config.replace(routing={"overlap": 1}), reuse=prepared_tiny
    )
    two = prepare(
        tmp_path / "two", tiny_config.replace(routing={"overlap": 2}), reuse=prepared_tiny
    )
    assert np.array_equal(one.val_paths, two.val_paths)
    for p in range(4):
        assert one.heldout_docs(p) and len(one.heldout_docs(p)) == len(two.heldout_docs(p))
        assert all(
            np.array_equal(a, b)
            for a, b in zip(one.heldout_docs(p), two.heldout_docs(p), strict=True)
        )
    tokens = [r.stats["shards"]["train"]["tokens"] for r in (one.routing, two.routing)]
    assert sum(tokens[1]) == 2 * sum(tokens[0])


def test_a_phase_with_modules_on_other_owners_stops_the_run_with_a_reason(
    prepared_tiny, tiny_config, tmp_path
):
    config = tiny_config.replace(
        train={"inner_steps": 4, "rounds": 3},
        routing={"discriminative_after": [1]},
        eval={"every_round": False},
    )
    prep = prepare(tmp_path / "run", config, reuse=prepared_tiny)
    coordinator = build_coordinator(prep, MetricsLog(tmp_path / "m.jsonl"), evaluate=False)
    coordinator.owners["L1.M0"] = "another-owner"
    coordinator.on_round(1)
    assert coordinator.finished_event.wait(60)
    assert "other owners" in coordinator.failure and "L1.M0" in coordinator.failure
    assert not (tmp_path / "run" / "routing-phase1.json").exists()


def test_two_phases_alternate_like_em(prepared_tiny, tiny_config, tmp_path):
    config = tiny_config.replace(
        train={"inner_steps": 3, "rounds": 3},
        routing={"discriminative_after": [1, 2]},
        eval={"every_round": False},
    )
    prep = prepare(tmp_path / "run", config, reuse=prepared_tiny)
    metrics = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=False)
    stop = threading.Event()
    threads = run_local_peers(coordinator, prep, 2, stop=stop)
    for t in threads:
        t.join(300)
    assert all(t.peer.run_finished for t in threads), [t.peer.error for t in threads]
    assert coordinator.finished and coordinator.failure is None
    events = metrics.read()
    assert [e["phase"] for e in events if e["event"] == "routing_phase"] == [1, 2]
    issued = {(e["round"], e["phase"]) for e in events if e["event"] == "task_issued"}
    assert issued == {(0, 0), (1, 1), (2, 2)}
    prep.refresh()
    assert [r.phase for r in prep.routings] == [0, 1, 2]
    # Phase 2's labels came from paths trained on phase 1's shards: a router of its own.
    assert prep.routings[2].router.sha256 != prep.routings[1].router.sha256


def test_a_phase_decided_from_held_out_losses_starts_when_they_stop_falling(
    prepared_tiny, tiny_config, tmp_path
):
    # 0.99: any round that improves the held-out loss by less than 99% is a plateau, so the
    # second measured round (round 2) decides a phase. The scoring runs after the round, off
    # the coordinator's lock, while the peers train on: the phase's first round is the first
    # one no task had been issued for at the decision (3, or later if round 3 was issued).
    config = tiny_config.replace(
        train={"inner_steps": 3, "rounds": 6},
        routing={"discriminative_plateau": 0.99, "discriminative_phases": 1},
        eval={"every_round": False},
    )
    prep = prepare(tmp_path / "run", config, reuse=prepared_tiny)
    metrics = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    coordinator = build_coordinator(prep, metrics, evaluate=False)
    stop = threading.Event()
    threads = run_local_peers(coordinator, prep, 2, stop=stop)
    for t in threads:
        t.join(300)
    assert all(t.peer.run_finished for t in threads), [t.peer.error for t in threads]
    assert coordinator.finished_event.wait(60)
    assert coordinator.finished and coordinator.failure is None
    events = metrics.read()
    heldout = [e["round"] for e in events if e["event"] == "heldout"]
    assert heldout[:2] == [1, 2]
    (plateau,) = [e for e in events if e["event"] == "plateau"]
    after = plateau["after_round"]
    assert plateau["round"] == 2 and 3 <= after <= 5 and plateau["phase"] == 1
    assert plateau["heldout_loss"] > plateau["previous"] * 0.01
    assert [e["phase"] for e in events if e["event"] == "routing_phase"] == [1]
    issued = {(e["round"], e["phase"]) for e in events if e["event"] == "task_issued"}
    assert issued == {(r, int(r >= after)) for r in range(6)}
    # The decision survives a restart: a coordinator built again on the run knows the phase.
    again = build_coordinator(prep, MetricsLog(tmp_path / "m2.jsonl"), evaluate=False)
    assert again.phases.rounds == [after] and again.phases.of(5) == 1 and 1 in again.phases.ready


def test_a_plateau_phase_and_fixed_phase_rounds_are_not_both_allowed(tiny_config):
    with pytest.raises(ConfigError, match="set one"):
        tiny_config.replace(routing={"discriminative_plateau": 0.01, "discriminative_after": [1]})
    with pytest.raises(ConfigError, match="iid"):
        tiny_config.replace(routing={"discriminative_plateau": 0.01, "method": "iid"})
