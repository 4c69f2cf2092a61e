"""One peer for a machine's devices (``dipaco-peer join --gpus cpu:2``): two worker processes,
one key, one row with two workers in ``dipaco status``; a killed worker costs only its task."""

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _waiting import run_config, wait_for
from rich.console import Console

from dipaco.cli.watch import render
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.procs import child_pids
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport, LoopbackTransport
from dipaco.protocols.wire import read_tensor_file
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def worker_pid(machine: int, peer_id: str) -> int | None:
    """The pid of the machine's worker process with ``peer_id``."""
    for pid in child_pids(machine):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if peer_id.encode() in argv:
            return pid
    return None


def run_to_the_end(coordinator, machine, machine_log: Path) -> list[dict]:
    """Wait for the run to finish and the machine to leave by itself; the machine's events."""
    out, _ = coordinator.communicate(timeout=300)
    assert coordinator.returncode == 0 and "run finished" in out, out
    machine.wait(60)
    text = machine_log.read_text()
    assert machine.returncode == 0, text
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def worker_1_died_and_came_back(lines: list[dict], starts: int) -> None:
    """The machine said worker 1 died, started ``starts`` worker processes in all and saw the
    run finish."""
    said = " | ".join(e.get("message", "") for e in lines)
    assert any(e.get("event") == "worker_died" and e.get("worker") == 1 for e in lines), said
    assert sum(e.get("event") == "worker_started" for e in lines) == starts, said
    assert "the run has finished" in said, said


def test_a_two_worker_machine_trains_a_run_and_survives_a_killed_worker(run_copy, tmp_path):
    root = run_copy()
    start = [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path),
             "--run-dir", root, "--no-eval", "--transport", "loopback",
             "--dashboard", "127.0.0.1:0"]  # fmt: skip
    procs = []
    try:
        coordinator = subprocess.Popen(
            start, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        procs.append(coordinator)
        address_file, url_file = (
            root / "coordinator" / "address",
            root / "coordinator" / "dashboard",
        )
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "the address"
        )
        machine_log = tmp_path / "machine.jsonl"
        slow = tmp_path / "slow"  # while it exists, a step sleeps (a task is caught mid-way)
        slow.touch()
        machine = subprocess.Popen(
            [BIN / "dipaco-peer", "--log-format", "json", "join", address, "--authkey-file",
             root / "coordinator" / "authkey", "--gpus", "cpu:2", "--peer-id", "lab",
             "--state-dir", tmp_path / "lab"],
            stdout=machine_log.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "DIPACO_FAULTS": f"peer.inner_step=sleep:0.1@if:{slow}"},
        )  # fmt: skip
        procs.append(machine)
        status = LoopbackTransport(
            address, bytes.fromhex((root / "coordinator" / "authkey").read_text())
        )

        def leases_by_peer():
            leases = status.request(m.GetStatus()).state["leases"]
            return {lease["peer"]: t for t, lease in leases.items()}

        both = wait_for(
            lambda: (held := leases_by_peer()) and {"lab-w0", "lab-w1"} <= set(held) and held,
            120,
            "both workers to hold a task",
        )
        # Kill worker 1 (SIGKILL: no goodbye, its lease is left to expire).
        victim = wait_for(lambda: worker_pid(machine.pid, "lab-w1"), 30, "worker 1's process")
        lost_task = both["lab-w1"]
        os.kill(victim, signal.SIGKILL)
        assert lost_task in status.request(m.GetStatus()).state["leases"], "w1 finished first"
        slow.unlink()  # the rest of the run at full speed
        # `dipaco status`: one peer, two workers, each on its own path.
        url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 30, "dashboard")
        shown = subprocess.run(
            [BIN / "dipaco", "status", url, "--json"], capture_output=True, text=True, timeout=60
        )
        snapshot = json.loads(shown.stdout)
        assert snapshot["machines"]["lab"]["workers"] == ["lab-w0", "lab-w1"]
        assert snapshot["machines"]["lab"]["devices"] == ["cpu", "cpu"]
        assert snapshot["peers"]["lab-w1"]["capabilities"] == {
            "machine": "lab", "worker": 1, "workers": 2, "protocol": m.PROTOCOL,
        }  # fmt: skip
        # ...and its table, as `dipaco status URL` prints that snapshot
        out_text = Console(width=200, record=True, file=io.StringIO())
        out_text.print(render(snapshot))
        table = out_text.export_text()
        assert "lab (2 workers)" in table and "└ w1 (lab-w1)" in table, table
        lines = run_to_the_end(coordinator, machine, machine_log)
    finally:
        kill_all(procs)
    worker_1_died_and_came_back(lines, starts=3)  # w0 once, w1 twice
    log = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    deltas = [(e["path"], e["round"]) for e in log if e["event"] == "delta"]
    assert sorted(deltas) == [(p, r) for p in range(4) for r in range(2)]  # each task once
    by = {e["task"]: e["peer"] for e in log if e["event"] == "delta"}
    assert set(by.values()) <= {"lab-w0", "lab-w1"}
    # The killed worker's task was trained to the end once, by the restarted w1 (resumed while
    # its lease lived) or by anyone after the lease expired; nothing else was redone.
    same = lost_task.split("-e")[0] + "-"
    assert sum(t.startswith(same) for t in by) == 1
    issued = [e for e in log if e["event"] == "task_issued"]
    assert len(issued) <= 8 + 1  # at most the lost task issued again


def test_a_machine_training_each_path_over_two_gloo_ranks_matches_one_device(
    short_copy, short_config, tmp_path
):
    """--shard-path: rank 0 claims and pushes, rank 1 trains half of every batch; the status
    shows one peer whose paths train over two devices. Rank 1 is killed mid-task: the group
    starts again, and the run still ends with the parameters a one-device peer reaches (DDP
    averages the same gradient; the task is trained again from its base)."""
    root = short_copy("sharded")
    config = tmp_path / "run.toml"
    config.write_text(
        'preset = "tiny"\n[train]\ninner_steps = 8\nrounds = 2\n'
        "[scheduler]\nlease_seconds = 5.0\nheartbeat_seconds = 0.5\nquorum = 1.0\n"
    )
    coordinator = subprocess.Popen(
        [BIN / "dipaco-coordinator", "start", "--config", config, "--run-dir", root, "--no-eval",
         "--transport", "loopback"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    machine_log = tmp_path / "machine.jsonl"
    slow = tmp_path / "slow"  # while it exists, a step sleeps (a task is caught mid-way)
    slow.touch()
    procs = [coordinator]
    try:
        address_file = root / "coordinator" / "address"
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "the address"
        )
        machine = subprocess.Popen(
            [BIN / "dipaco-peer", "--log-format", "json", "join", address, "--authkey-file",
             root / "coordinator" / "authkey", "--gpus", "cpu:2", "--shard-path",
             "--peer-id", "lab", "--state-dir", tmp_path / "lab"],
            stdout=machine_log.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "DIPACO_FAULTS": f"peer.inner_step=sleep:0.2@if:{slow}"},
        )  # fmt: skip
        procs.append(machine)
        key = bytes.fromhex((root / "coordinator" / "authkey").read_text())
        status = LoopbackTransport(address, key)
        held = wait_for(
            lambda: [
                t for t, lease in status.request(m.GetStatus()).state["leases"].items()
                if lease["peer"] == "lab-w0"
            ],
            120,
            "rank 0 to hold a task",
        )  # fmt: skip
        shown = status.request(m.GetStatus()).state["machines"]
        assert shown == {
            "lab": {"workers": ["lab-w0"], "devices": ["cpu"], "tasks_done": shown["lab"][
                "tasks_done"], "state": "training", "shard_path": True, "devices_per_path": 2},
        }  # fmt: skip
        victim = wait_for(lambda: worker_pid(machine.pid, "lab-w1"), 30, "rank 1's process")
        os.kill(victim, signal.SIGKILL)
        assert held[0] in status.request(m.GetStatus()).state["leases"], "rank 0 finished first"
        slow.unlink()  # the rest of the run at full speed
        lines = run_to_the_end(coordinator, machine, machine_log)
    finally:
        kill_all(procs)
    worker_1_died_and_came_back(lines, starts=4)  # the whole group, twice

    ref_root = short_copy("one-device")
    reference = build_coordinator(
        prepare(ref_root, short_config.replace(scheduler={"quorum": 1.0})),
        MetricsLog(ref_root / "m.jsonl"),
        evaluate=False,
    )
    Peer(LocalTransport(reference.handle), "solo", tmp_path / "solo", device="cpu").run()
    assert reference.finished
    worst = 0.0
    for mid in reference.store.modules:
        head = json.loads((root / "coordinator" / "modules" / mid / "head.json").read_text())
        assert head["version"] == 2
        trained = read_tensor_file(root / "coordinator" / "modules" / mid / "v2.dpt").tensors
        for name, tensor in reference.store.params(mid).items():
            worst = max(worst, (trained[name] - tensor).abs().max().item())
    assert worst < 1e-5, worst
