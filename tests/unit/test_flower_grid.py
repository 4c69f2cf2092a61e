"""The Flower transport's ServerApp strategy and ClientApp, in one process (no SuperLink).

The real apps (``dipaco.flower.apps``) over ``LocalGrid`` (``_flower_grid.py``, next to this
file): real training, the real coordinator core and run folder, real node state folders.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from _flower_grid import LocalGrid
from flwr.app import Message
from flwr.clientapp import ClientApp

from dipaco.config import load_config_dict
from dipaco.fileio import write_json_atomic
from dipaco.flower import records as rec
from dipaco.flower.apps import client_app, serve
from dipaco.flower.client import NodeTrainer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import messages as m
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog


def configure(root: Path, **sections: dict) -> None:
    """Change operational settings of a prepared run folder (as an operator edits them)."""
    file = root / "config.json"
    config = load_config_dict(json.loads(file.read_text())).replace(**sections)
    write_json_atomic(file, config.to_dict())


def nodes(tmp_path: Path, *ids: int) -> dict[int, dict]:
    return {nid: {"state-dir": str(tmp_path / f"node{nid}")} for nid in ids}


def params(core) -> dict[str, dict[str, torch.Tensor]]:
    return {mid: dict(core.store.params(mid)) for mid in core.store.modules}


def local_reference(root: Path, n_peers: int):
    """The same run on the local transport (peers in threads)."""
    config = load_config_dict(json.loads((root / "config.json").read_text()))
    prep = prepare(root, config)
    core = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    for t in run_local_peers(core, prep, n_peers, stop=threading.Event()):
        t.join(300)
    assert core.finished
    return core


def events(root: Path, kind: str) -> list[dict]:
    lines = (root / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


@pytest.fixture
def strict(run_copy):
    """A run folder whose rounds wait for every path, with the paper's mean, unscored
    (bit-for-bit comparisons: a robust combiner gives each key one vote, so its result depends
    on which node or peer trained which path; the held-out check's weights, on the order in
    which deltas arrive)."""

    def make(name: str) -> Path:
        root = run_copy(name)
        validation = {"aggregation": "mean", "heldout_check": False}
        configure(root, scheduler={"quorum": 1.0}, validation=validation)
        return root

    return make


def test_two_nodes_train_every_module_to_the_end(strict, tmp_path, tiny_config):
    root = strict("flower")
    grid = LocalGrid(client_app, nodes(tmp_path, 11, 12))
    core = serve(grid, root, evaluate=False)
    grid.close()
    rounds = tiny_config.train.rounds
    assert core.finished
    assert {core.store.version(mid) for mid in core.store.modules} == {rounds}
    assert sum(core.rejections.values()) == 0
    # Every path trained every round, by one of the two nodes.
    acked = events(root, "delta_acked")
    assert {(e["path"], e["base_version"]) for e in acked} == {
        (p, r) for p in range(4) for r in range(rounds)
    }
    assert len({e["peer"] for e in acked}) == 2
    # What the nodes keep between messages lives on their disks, keyed by path.
    saved = json.loads((root / "coordinator" / "flower_nodes.json").read_text())
    assert {n["key"].split(":")[0] for n in saved.values()} == {"ed25519"}
    for nid in (11, 12):
        state = tmp_path / f"node{nid}"
        assert list((state / "inner").glob("P*.dpt")), "inner optimizer state per path"
        assert list((state / "flower" / "modules").glob("*.dpt")), "cached modules"
        assert list((state / "runs").rglob("train.tokens")), "the shards it was sent"
    rounds_run = events(root, "flower_round")
    assert rounds_run[0]["messages"] == 2 and rounds_run[0].get("accepted", 0) == 0  # hellos


@pytest.mark.parametrize("n_nodes,n_peers,warm", [(2, 2, True), (1, 3, False)])
def test_same_parameters_as_the_local_transport(strict, tmp_path, n_nodes, n_peers, warm):
    """Lossless codec, fixed seeds: the Flower run ends with exactly the local run's modules.
    Each path's inner optimizer state follows the path on both (local peers share one folder;
    the ServerApp keeps each path on the node that holds its state), so the node count does
    not matter. ``warm``: the ClientApps hand their tasks to a warm trainer per node."""
    flower_root, local_root = strict("flower"), strict("local")
    configs = nodes(tmp_path, *range(1, n_nodes + 1))
    trainers = [NodeTrainer(cfg) for cfg in configs.values()] if warm else []
    for cfg, trainer in zip(configs.values(), trainers, strict=False):
        cfg.update(trainer.node_config)
    grid = LocalGrid(client_app, configs)
    core = serve(grid, flower_root, evaluate=False)
    grid.close()
    for trainer in trainers:
        trainer.close()
        assert trainer.served >= 3  # its hello and its tasks went through the warm trainer
    reference = local_reference(local_root, n_peers)
    got, want = params(core), params(reference)
    assert got.keys() == want.keys()
    for mid in want:
        assert core.store.version(mid) == reference.store.version(mid)
        for name, tensor in want[mid].items():
            assert torch.equal(got[mid][name], tensor), (mid, name)


def test_a_node_that_goes_silent_loses_only_its_task(run_copy, tmp_path, tiny_config):
    root = run_copy("silent")
    configure(root, flower={"round_timeout": 20.0, "quorum": 0.5, "straggler_seconds": 1.0})
    grid = LocalGrid(client_app, nodes(tmp_path, 1, 2))
    trained = []

    def on_round(info: dict) -> None:
        trained.append(info)
        if len(trained) == 2:  # after the hellos and one training round: node 2 dies
            grid.silence(2)
        if info["outer_round"] == tiny_config.train.rounds:
            # By the run's end the dead node is off the node list, as a SuperLink drops a node
            # that stopped sending heartbeats: the ServerApp's "finished" goes to the live node
            # only, instead of waiting 15 s for a reply that never comes.
            grid.remove(2)

    try:
        core = serve(grid, root, evaluate=False, on_round=on_round)
    finally:
        grid.close()
    assert core.finished
    assert {core.store.version(mid) for mid in core.store.modules} == {tiny_config.train.rounds}
    lost = events(root, "flower_task_lost")
    assert lost and all("no reply" in e["why"] for e in lost)
    lost_paths = {e["path"] for e in lost}
    # The lost path was trained later, by the node that stayed.
    late = [e for e in events(root, "delta_acked") if e["path"] in lost_paths]
    survivor = {e["peer"] for e in events(root, "delta_acked")} - {e["peer"] for e in lost}
    assert late and {e["peer"] for e in late} <= survivor


class Tamper(ClientApp):
    """A node whose replies are altered on the way: ``how`` picks the damage."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def __call__(self, message: Message, context) -> Message:
        reply = client_app(message, context)
        if message.metadata.message_type != "train":
            return reply
        meta = rec.meta_of(reply.content)
        if self.how == "no-record":
            return Message(rec.pack({"op": "train", "state": "[1, 2"}), reply_to=message)
        envelope = bytearray(rec.blob(reply.content, "envelope"))
        envelope[-1] ^= 0xFF  # the body no longer matches its signed hash
        return Message(rec.pack(meta, {"envelope": envelope}), reply_to=message)


@pytest.mark.parametrize("how,reason", [("flip", "bad-signature"), ("no-record", "bad-message")])
def test_a_damaged_reply_is_refused_counted_and_its_path_trained_again(
    run_copy, tmp_path, how, reason
):
    root = run_copy(how)
    bad = tmp_path / "bad"
    good = tmp_path / "good"
    grid = LocalGrid(Tamper(how), {1: {"state-dir": str(bad)}})
    # The damaged node alone for three rounds: nothing it sends is applied.
    core = serve(grid, root, evaluate=False, num_rounds=3)
    grid.close()
    assert core.rejections[reason] >= 1, core.rejections
    assert {core.store.version(mid) for mid in core.store.modules} == {0}
    assert events(root, "flower_task_lost")
    # An honest node then trains the run to the end from the same folder.
    grid = LocalGrid(client_app, {2: {"state-dir": str(good)}})
    core = serve(grid, root, evaluate=False)
    grid.close()
    assert core.finished


def test_a_restarted_serverapp_resumes_and_matches_an_uninterrupted_run(strict, tmp_path):
    whole, split = strict("whole"), strict("split")
    grid = LocalGrid(client_app, nodes(tmp_path / "a", 1, 2))
    reference = serve(grid, whole, evaluate=False)
    grid.close()
    grid = LocalGrid(client_app, nodes(tmp_path / "b", 1, 2))
    first = serve(grid, split, evaluate=False, num_rounds=3)  # hellos and two task rounds
    assert not first.finished and first.round >= 1
    resumed = serve(grid, split, evaluate=False)  # a new ServerApp over the same folder
    grid.close()
    assert resumed.finished and resumed.epoch == 1
    want, got = params(reference), params(resumed)
    for mid in want:
        for name, tensor in want[mid].items():
            assert torch.equal(got[mid][name], tensor), (mid, name)


class FailsOnPath(ClientApp):
    """A node that cannot train one path (say its shard is unreadable there): it reports an
    error for that path's tasks and trains the others."""

    def __call__(self, message: Message, context) -> Message:
        bad = context.node_config.get("fail-path")
        if message.metadata.message_type == "train" and bad is not None:
            offer = m.decode_message(rec.raw(rec.meta_of(message.content), "offer"))
            if offer.path == bad:
                error = {"op": "train", "error": "cannot read the shard", "reason": "bad-data"}
                return Message(rec.pack(error), reply_to=message)
        return client_app(message, context)


def test_a_node_that_keeps_failing_a_path_does_not_hold_it(run_copy, tmp_path, tiny_config):
    root = run_copy("failing")
    configs = nodes(tmp_path, 1, 2)
    configs[1]["fail-path"] = 0  # the first path it is offered
    grid = LocalGrid(FailsOnPath(), configs)
    core = serve(grid, root, evaluate=False, num_rounds=20)  # 6 task rounds suffice
    grid.close()
    assert core.finished
    lost = events(root, "flower_task_lost")
    assert lost and {e["path"] for e in lost} == {0}
    assert all("bad-data" in e["why"] for e in lost)
    # Node 1 failed path 0 at most once per outer round: it then left it to node 2.
    assert len(lost) <= tiny_config.train.rounds
    trained_p1 = {e["peer"] for e in events(root, "delta_acked") if e["path"] == 0}
    assert trained_p1 and lost[0]["peer"] not in trained_p1


def test_a_grid_call_that_hangs_at_the_end_does_not_hold_the_serverapp(
    strict, tmp_path, tiny_config, monkeypatch
):
    """Telling the nodes the run has finished is bounded: a Flower grid call that blocks then
    (once seen for 3 minutes in a fresh-clone run) delays the ServerApp by the limit at most."""
    import time

    from dipaco.flower import server

    monkeypatch.setattr(server, "ANNOUNCE_LIMIT_SECONDS", 1.0)
    grid = LocalGrid(client_app, nodes(tmp_path, 21))
    last_round, release = [], threading.Event()
    real = grid.get_node_ids

    def get_node_ids():
        if last_round:  # the run has finished: the announcement's call blocks
            release.wait(60)
        return real()

    def on_round(info):
        if info["outer_round"] >= tiny_config.train.rounds:
            last_round.append(time.monotonic())

    grid.get_node_ids = get_node_ids
    core = serve(grid, strict("hang"), evaluate=False, on_round=on_round)
    returned = time.monotonic()
    release.set()  # the announcement goes on, and ends, before the grid closes
    for thread in threading.enumerate():
        if thread.name == "announce-finished":
            thread.join(30)
    grid.close()
    assert core.finished and last_round
    assert returned - last_round[0] < 10  # the 1 s limit, not the blocked call's 60 s
