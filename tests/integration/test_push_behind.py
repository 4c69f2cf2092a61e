"""Push behind and fetch ahead (``dipaco-peer join --push-behind --fetch-ahead``), real processes
on 127.0.0.1: a peer whose uploads and downloads are slow trains its next task while the last
one's deltas go out, claims and downloads the task after it meanwhile, and the run ends with
every task's deltas applied once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import run_config, wait_for

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def test_a_peer_trains_its_next_task_while_the_last_ones_deltas_upload(run_copy, tmp_path):
    root = run_copy()
    procs: list[subprocess.Popen] = []
    try:
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path),
             "--run-dir", root, "--no-eval", "--transport", "loopback"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs.append(coordinator)
        address_file = root / "coordinator" / "address"
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "the address"
        )
        # Each send waits 1 s before its first byte (a slow uplink), twice a task's
        # training here: without push behind the peer would idle through it.
        peer = subprocess.Popen(
            [BIN / "dipaco-peer", "join", address, "--authkey-file", root / "coordinator" /
             "authkey", "--peer-id", "peer0", "--state-dir", tmp_path / "peer0", "--push-behind",
             "--fetch-ahead"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "DIPACO_FAULTS": "peer.send=sleep:1.0;peer.fetch=sleep:0.3"},
        )  # fmt: skip
        procs.append(peer)
        out, _ = coordinator.communicate(timeout=300)
        assert coordinator.returncode == 0, out
        peer_out, _ = peer.communicate(timeout=60)
        assert peer.returncode == 0, peer_out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    events = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    # Tasks were issued to the peer while it still held one whose deltas were unacknowledged.
    issued, acked, overlapped = set(), set(), 0
    for e in events:
        if e["event"] == "task_issued":
            overlapped += bool(issued - acked)
            issued.add(e["task"])
        elif e["event"] == "delta":
            acked.add(e["task"])
    assert overlapped >= 3, "the peer never trained a task while its last one was pushed"
    # Tasks were claimed and downloaded ahead, and the peer says so when it leaves.
    timings = json.loads((tmp_path / "peer0" / "timings.json").read_text())
    assert timings["fetched_ahead_tasks"] >= 2, timings
    assert "fetched ahead of training" in peer_out
    # Every path's every round: one task done, each of its modules' deltas in one outer step.
    done = [(e["path"], e["round"]) for e in events if e["event"] == "delta"]
    assert sorted(done) == [(p, r) for p in range(4) for r in range(2)]
    applied = [t for e in events if e["event"] == "outer_step" for t in e["tasks"]]
    steps = [(e["module"], e["version"]) for e in events if e["event"] == "outer_step"]
    assert len(steps) == len(set(steps)) == 6 * 2
    per_module: dict[str, list[str]] = {}
    for e in events:
        if e["event"] == "outer_step":
            per_module.setdefault(e["module"], []).extend(e["tasks"])
    assert all(len(ts) == len(set(ts)) for ts in per_module.values())
    assert set(applied) == {e["task"] for e in events if e["event"] == "delta"}
