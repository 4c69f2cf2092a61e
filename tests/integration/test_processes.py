"""Real processes on 127.0.0.1: a coordinator and peers, with peers and the coordinator killed."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import run_config, wait_for

from dipaco.errors import TransportError
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LoopbackTransport

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow
DELTA = '"event": "delta"'


def start_peer(address, root, tmp_path, i) -> subprocess.Popen:
    return subprocess.Popen(
        [BIN / "dipaco-peer", "join", address, "--authkey-file", root / "coordinator" / "authkey",
         "--peer-id", f"peer{i}", "--state-dir", tmp_path / f"peer{i}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def module_versions(root) -> list[int]:
    heads = (root / "coordinator" / "modules").glob("*/head.json")
    return sorted(json.loads(h.read_text())["version"] for h in heads)


def events(root) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def test_a_peer_killed_mid_task_costs_only_its_task(run_copy, tmp_path):
    root = run_copy()
    start = [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path),
             "--run-dir", root, "--no-eval", "--transport", "loopback"]  # fmt: skip
    procs = []
    try:
        coordinator = subprocess.Popen(
            start, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        procs.append(coordinator)
        address_file = root / "coordinator" / "address"
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "the address"
        )
        key = bytes.fromhex((root / "coordinator" / "authkey").read_text())
        with pytest.raises(TransportError, match="refused our key"):
            LoopbackTransport(address, b"wrong key")
        procs += [start_peer(address, root, tmp_path, i) for i in range(3)]
        status = LoopbackTransport(address, key)

        def victim_task():
            leases = status.request(m.GetStatus()).state["leases"]
            return next((t for t, lease in leases.items() if lease["peer"] == "peer0"), None)

        task = wait_for(victim_task, 120, "peer0 to hold a task")
        os.kill(procs[1].pid, signal.SIGKILL)
        assert task in status.request(m.GetStatus()).state["leases"], (
            "peer0 finished before the kill"
        )
        out, _ = coordinator.communicate(timeout=300)
        assert coordinator.returncode == 0, out
        assert "run finished" in out
    finally:
        kill_all(procs)
    assert module_versions(root) == [2] * 6
    log = events(root)
    assert task in [e["task"] for e in log if e["event"] == "lease_expired"]
    deltas = [(e["path"], e["round"]) for e in log if e["event"] == "delta"]
    assert sorted(deltas) == [(p, r) for p in range(4) for r in range(2)]  # each task applied once
    same_task = task.split("-e")[0] + "-"  # "P<path>-r<round>-": the task, whatever its attempt
    redone = [e for e in log if e["event"] == "delta" and e["task"].startswith(same_task)]
    assert len(redone) == 1 and redone[0]["peer"] != "peer0"


def test_a_coordinator_killed_mid_run_restarts_and_the_peers_carry_on(run_copy, tmp_path):
    root = run_copy()
    start = [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path),
             "--run-dir", root, "--no-eval", "--transport", "loopback"]  # fmt: skip
    metrics = root / "metrics.jsonl"
    address = root / "coordinator" / "address"
    procs = []
    try:
        # The first life picks its port; the second listens there again, where the peers are.
        first = subprocess.Popen(start, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(first)
        listen = wait_for(
            lambda: address.exists() and address.read_text().strip(), 120, "the coordinator"
        )
        start += ["--listen", listen]
        procs += [start_peer(listen, root, tmp_path, i) for i in range(2)]
        wait_for(
            lambda: metrics.exists() and metrics.read_text().count(DELTA) >= 3, 120, "3 deltas"
        )
        first.kill()
        first.wait()
        acked_before = metrics.read_text().count(DELTA)
        second = subprocess.Popen(
            start, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        procs.append(second)
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 0, out
        for peer in procs[1:3]:
            assert peer.wait(timeout=60) == 0  # the peers outlived the crash and left cleanly
    finally:
        kill_all(procs)
    assert module_versions(root) == [2] * 6
    assert json.loads((root / "coordinator" / "coordinator.json").read_text())["epoch"] == 1
    deltas = [(e["path"], e["round"]) for e in events(root) if e["event"] == "delta"]
    assert len(deltas) == len(set(deltas))  # no acknowledged delta was trained or applied twice
    assert acked_before >= 3
