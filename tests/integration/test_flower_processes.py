"""Flower past one round, with real processes on 127.0.0.1: ``dipaco-coordinator start --transport
flower`` (a SuperLink and the ServerApp) and two ``dipaco-peer join --flower`` nodes, two outer
rounds.

- The coordinator is stopped with Ctrl-C after outer round 1 and started again with the same
  command; the nodes, left running, carry on, and the run finishes.
- A node's reply is damaged on the way (``DIPACO_FAULTS=flower.reply=corrupt``) and another
  node's call hangs (``flower.train=sleep``): the damaged reply is refused and counted under its
  reason, the hung call's round closes after the stragglers' grace, and the run finishes.

Each run ends with every module at the final version and every acknowledged delta applied
exactly once. ``tests/unit/test_flower_grid.py`` does the same in one process over LocalGrid.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from _waiting import wait_for
from test_flower_run import events, kill_tree, said
from test_hivemind_run import BIN, Proc, told

from dipaco.flower import deploy

pytestmark = pytest.mark.slow
ROUNDS = 2  # the session's prepared tiny run


def run_config(tmp_path: Path, straggler_seconds: float) -> Path:
    """The prepared tiny run's settings; a round waits for every path (quorum 1.0), and for a
    node that does not answer, ``straggler_seconds`` after the other one did."""
    file = tmp_path / "run.toml"
    file.write_text(
        f'preset = "tiny"\n[train]\ninner_steps = 30\nrounds = {ROUNDS}\n'
        "[scheduler]\nlease_seconds = 5.0\nheartbeat_seconds = 0.5\nquorum = 1.0\n"
        f"[flower]\nround_timeout = 180.0\nquorum = 0.5\nstraggler_seconds = {straggler_seconds}\n"
    )
    return file


def admit(root: Path, *states: Path) -> None:
    """The operator admits the nodes' keys before the run starts (made on first use)."""
    for state in states:
        public = deploy.make_node_key(state / "flower-node.key")
        done = subprocess.run(
            [BIN / "dipaco-coordinator", "add-peer", public, "--run-dir", root],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0 and "admitted" in done.stdout, done.stdout + done.stderr


def start(root: Path, config: Path, listen: str) -> tuple[Proc, tuple[str, str, str]]:
    """The operator's start command; the address, CA file and key it tells nodes to join with."""
    proc = Proc(BIN / "dipaco-coordinator", "start", "--transport", "flower", "--config", config,
                "--run-dir", root, "--no-eval", "--listen", listen, name="coordinator")  # fmt: skip
    pattern = (
        r"dipaco-peer join --flower (\S+) --root-certificates (\S+) --coordinator-key (ed25519:\S+)"
    )
    found = wait_for(
        lambda: re.search(pattern, said(proc.output)) or proc.p.poll() is not None, 180, told(proc)
    )
    assert isinstance(found, re.Match), proc.output
    return proc, found.groups()


def join(joining: tuple[str, str, str], state: Path, env: dict | None = None) -> Proc:
    address, ca, key = joining
    return Proc(BIN / "dipaco-peer", "join", "--flower", address, "--root-certificates", ca,
                "--state-dir", state, "--peer-id", state.name, "--coordinator-key", key,
                "--device", "cpu", name=state.name, env=env)  # fmt: skip


def stop(procs: list[Proc]) -> None:
    for proc in procs:
        if proc.p.poll() is None:
            kill_tree(proc.p)


def check_every_ack_applied_once(root: Path) -> None:
    """Every module at version ROUNDS, each version made once, and every delta the coordinator
    acknowledged applied by exactly one outer step of its module; every path of every round."""
    heads = {
        head.parent.name: json.loads(head.read_text())["version"]
        for head in (root / "coordinator" / "modules").glob("*/head.json")
    }
    assert heads == dict.fromkeys(["L0.M0", "L0.M1", "L1.M0", "L1.M1", "S.embed", "S.head"], ROUNDS)
    steps = events(root, "outer_step")
    made = [(e["module"], e["version"]) for e in steps]
    assert len(made) == len(set(made)) == 6 * ROUNDS, sorted(made)
    applied = Counter((e["module"], task) for e in steps for task in e["tasks"])
    assert set(applied.values()) == {1}, applied
    acked = events(root, "delta_acked")
    assert {(e["module"], e["task"]) for e in acked} == set(applied)
    assert {(e["path"], e["base_version"]) for e in acked} == {
        (p, r) for p in range(4) for r in range(ROUNDS)
    }


def test_a_flower_run_resumes_when_its_coordinator_is_stopped_and_started_again(
    run_copy, tmp_path, monkeypatch
):
    monkeypatch.setattr(Proc, "log_dir", tmp_path)  # each process's output, to read after a failure
    root, a, b = run_copy("flower"), tmp_path / "node-a", tmp_path / "node-b"
    config = run_config(tmp_path, straggler_seconds=25.0)
    admit(root, a, b)
    procs: list[Proc] = []
    try:
        # Port 0: the system picks a free one, which no other process can take meanwhile; the
        # restart listens on the port it was given (the same address the nodes dial).
        coordinator, joining = start(root, config, "127.0.0.1:0")
        procs.append(coordinator)
        listen = joining[0]
        nodes = [join(joining, a), join(joining, b)]
        procs += nodes
        wait_for(
            lambda: any(e["round"] == 1 for e in events(root, "round")),
            300,
            told(coordinator, *nodes),
        )
        acked_before = events(root, "delta_acked")
        coordinator.p.send_signal(signal.SIGINT)  # Ctrl-C: it stops in order, the run not done
        assert coordinator.finish(60) == 130, coordinator.output
        assert not (root / "flower" / "superlink.json").exists()  # its SuperLink is down
        procs.remove(coordinator)
        coordinator, again = start(root, config, listen)  # the same command
        procs.append(coordinator)
        assert again == joining  # the same address, CA and key: the nodes need nothing new
        assert coordinator.finish(400) == 0, coordinator.output
        for node in nodes:  # the run's end reaches both: each says so and exits 0 by itself
            assert node.finish(60) == 0, node.output
            assert node.saw(f"the run has finished; node {node.name} leaves"), node.output
    finally:
        stop(procs)

    assert "run finished: every module at version 2" in coordinator.output
    # What the restarted command prints is its own: not the first start's lines over again.
    assert coordinator.output.count("dipaco over Flower: run") == 1, coordinator.output
    assert json.loads((root / "coordinator" / "coordinator.json").read_text())["epoch"] == 1
    assert json.loads((root / "flower" / "result.json").read_text())["finished"]
    # Outer round 1 was done before the stop; tasks the restarted coordinator issued (epoch 1)
    # were trained after it, and nothing acknowledged before the stop was lost or applied twice.
    assert {(e["path"], e["base_version"]) for e in acked_before} >= {(p, 0) for p in range(4)}
    later = events(root, "delta_acked")[len(acked_before) :]
    assert any("-e1-" in e["task"] for e in later), later
    check_every_ack_applied_once(root)


def test_a_damaged_reply_is_refused_and_a_hung_call_closes_its_round(
    run_copy, tmp_path, monkeypatch
):
    monkeypatch.setattr(Proc, "log_dir", tmp_path)  # each process's output, to read after a failure
    root, a, b = run_copy("flower"), tmp_path / "node-a", tmp_path / "node-b"
    # A round closes 10 s after the first reply if the other node is silent: a hung call
    # (50 s) is cut short, and a live node on this loaded machine rarely is (if it is, it too
    # loses only its task, trained again later: nothing below depends on it).
    config = run_config(tmp_path, straggler_seconds=10.0)
    admit(root, a, b)
    fired = {state.name: tmp_path / f"faults-{state.name}.jsonl" for state in (a, b)}
    faults = {  # in each node's warm trainer, which answers its ClientApps
        "node-a": "flower.reply=corrupt@1",  # its first delta damaged on the way
        "node-b": "flower.train=sleep:50@2",  # its second train message hangs 50 s
    }
    procs: list[Proc] = []
    try:
        coordinator, joining = start(root, config, "127.0.0.1:0")
        procs.append(coordinator)
        nodes = [
            join(
                joining,
                s,
                {"DIPACO_FAULTS": faults[s.name], "DIPACO_FAULTS_LOG": str(fired[s.name])},
            )
            for s in (a, b)
        ]
        procs += nodes
        assert coordinator.finish(400) == 0, coordinator.output
        for node in nodes:
            assert node.finish(90) == 0, node.output
            assert node.saw(f"the run has finished; node {node.name} leaves"), node.output
    finally:
        stop(procs)

    for name, point in (("node-a", "flower.reply"), ("node-b", "flower.train")):
        (hit,) = [json.loads(line) for line in fired[name].read_text().splitlines()]
        assert hit["point"] == point, hit  # the fault fired once, in that node's process
    issued = events(root, "task_issued")
    first_a = next(e["task"] for e in issued if e["peer"] == "node-a")
    second_b = [e["task"] for e in issued if e["peer"] == "node-b"][1]
    lost = {e["task"]: e for e in events(root, "flower_task_lost")}
    # The damaged reply: refused by the core's signature check, counted under its reason, its
    # task released (and its path trained again).
    assert "bad-signature" in lost[first_a]["why"] and lost[first_a]["peer"] == "node-a", lost
    saved = json.loads((root / "coordinator" / "coordinator.json").read_text())
    assert saved["rejections"].get("bad-signature") == 1, saved["rejections"]
    # The hung call: its round closed after the stragglers' grace, without it.
    assert lost[second_b]["why"] == "no reply in time" and lost[second_b]["peer"] == "node-b", lost
    assert "round closes with 1 of 2 replies (stragglers had 10 s more)" in coordinator.output
    assert "bad-signature" not in json.dumps(events(root, "delta_acked"))
    check_every_ack_applied_once(root)
