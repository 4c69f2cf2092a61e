"""The machine's supervisor (``dipaco.peer.workers.Machine``) over real child processes: a worker
killed by a signal is started again and the others run on; one that fails by itself is not; a
group (``--shard-path``) restarts as a whole; a stop ends every worker."""

import os
import signal
import sys
import threading
import time

import pytest

from dipaco.peer.workers import Machine, parse_gpus

# A stand-in worker: says it started, then waits (a real worker trains; here the supervision
# is what is tested). Exits with $EXIT_CODE after $EXIT_AFTER seconds if set.
WORKER = """
import json, os, sys, time
print(json.dumps({"event": "task_started", "message": "training", "task": "t", "step": 0,
                  "steps": 1}), flush=True)
after = float(os.environ.get("EXIT_AFTER", "60"))
time.sleep(after)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def make(tmp_path, n=2, together=False, env=None):
    events: list[tuple[int, dict]] = []
    stop = threading.Event()
    machine = Machine(
        "box",
        ["cpu"] * n,
        tmp_path,
        lambda w: [sys.executable, "-c", WORKER],
        lambda w, e: events.append((w.index, e)),
        stop,
        restart_seconds=0.1,
        together=together,
    )
    for key, value in (env or {}).items():
        os.environ[key] = value
    return machine, events, stop


def started(events, index):
    return sum(1 for i, e in events if i == index and e.get("event") == "worker_started")


def wait(pred, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture(autouse=True)
def _clean_env():
    yield
    for key in ("EXIT_AFTER", "EXIT_CODE"):
        os.environ.pop(key, None)


def run_in_thread(machine):
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("code", machine.run()), daemon=True)
    t.start()
    return t, result


def test_a_killed_worker_is_started_again_and_the_other_runs_on(tmp_path):
    machine, events, stop = make(tmp_path)
    t, result = run_in_thread(machine)
    wait(lambda: all(w.proc is not None for w in machine.workers) and started(events, 1) == 1)
    survivor = machine.workers[0].proc.pid
    os.kill(machine.workers[1].proc.pid, signal.SIGKILL)
    wait(lambda: started(events, 1) == 2)
    assert (1, {"event": "worker_died", "signal": signal.SIGKILL}) in events
    assert machine.workers[0].proc.pid == survivor and machine.workers[0].proc.poll() is None
    pids = [w.proc.pid for w in machine.workers]
    began = time.monotonic()
    stop.set()
    t.join(10)
    assert time.monotonic() - began < 5 and result["code"] == 0
    for pid in pids:  # stopped and reaped: no worker left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_fails_by_itself_is_not_restarted(tmp_path):
    machine, events, _ = make(tmp_path, n=1, env={"EXIT_AFTER": "0.2", "EXIT_CODE": "3"})
    assert machine.run() == 1
    assert (0, {"event": "worker_failed", "code": 3}) in events
    assert started(events, 0) == 1
    assert machine.workers[0].last_lines  # what it said, for the machine to show


def test_a_worker_stopped_by_ctrl_c_is_neither_failed_nor_restarted(tmp_path):
    # Ctrl-C on a terminal reaches the workers too (one process group): each exits 130, the
    # code of a command stopped in order (cli/stopping.py), which is not a failure of its own.
    machine, events, _ = make(tmp_path, n=1, env={"EXIT_AFTER": "0.2", "EXIT_CODE": "130"})
    t, result = run_in_thread(machine)
    wait(lambda: any(e.get("event") == "worker_stopped" for _, e in events))
    machine.stop.set()
    t.join(10)
    assert result["code"] == 0 and started(events, 0) == 1
    assert not any(e.get("event") in ("worker_failed", "worker_died") for _, e in events)


def test_workers_that_finish_end_the_machine(tmp_path):
    machine, events, _ = make(tmp_path, env={"EXIT_AFTER": "0.2"})
    assert machine.run() == 0
    assert [w.state for w in machine.workers] == ["done", "done"]
    assert any(e.get("event") == "task_started" for _, e in events)  # their lines came through


def test_a_group_restarts_as_a_whole_at_a_new_rendezvous(tmp_path):
    machine, events, stop = make(tmp_path, together=True)
    t, _ = run_in_thread(machine)
    wait(lambda: started(events, 0) == 1 and started(events, 1) == 1)
    first = machine.rendezvous
    other = machine.workers[0].proc.pid
    os.kill(machine.workers[1].proc.pid, signal.SIGKILL)
    wait(lambda: started(events, 0) == 2 and started(events, 1) == 2)
    assert machine.rendezvous != first and machine.rendezvous.startswith("tcp://127.0.0.1:")
    with pytest.raises(ProcessLookupError):  # the survivor was stopped with the group
        os.kill(other, 0)
    stop.set()
    t.join(10)


# Rank 0 ends the run normally; rank 1 then aborts while its process exits (what gloo's threads
# did to a --shard-path follower at interpreter exit, once the run was over).
ENDING_GROUP = """
import os, sys, time
if sys.argv[1] == "0":
    time.sleep(0.2)
    sys.exit(0)
time.sleep(0.8)
os.abort()
"""


def test_a_group_that_ended_is_not_restarted_for_a_rank_dying_on_its_way_out(tmp_path):
    events: list[tuple[int, dict]] = []
    machine = Machine(
        "box",
        ["cpu", "cpu"],
        tmp_path,
        lambda w: [sys.executable, "-c", ENDING_GROUP, str(w.index)],
        lambda w, e: events.append((w.index, e)),
        threading.Event(),
        restart_seconds=0.1,
        together=True,
    )
    assert machine.run() == 0
    assert [w.state for w in machine.workers] == ["done", "done"]
    assert started(events, 0) == started(events, 1) == 1  # no restart after the end


def test_gpu_specs():
    assert parse_gpus("cpu:3", 0) == ["cpu"] * 3
    assert parse_gpus("all", 2) == ["cuda:0", "cuda:1"]
    assert parse_gpus("1,0", 2) == ["cuda:1", "cuda:0"]
    for bad, count in (("all", 0), ("2", 2), ("0,0", 2), ("cpu:x", 0), ("cpu:0", 0), ("a", 1)):
        with pytest.raises(Exception, match="--gpus"):
            parse_gpus(bad, count)


# A worker (grandchild) whose machine (child) is killed outright: its watch sets its stop.
ORPHAN = """
import sys, threading, time
from pathlib import Path
from dipaco.peer.workers import watch_parent
stop = threading.Event()
watch_parent(stop)
Path(sys.argv[1]).write_text("watching")
if stop.wait(30):
    Path(sys.argv[1]).write_text("stopped")
"""
MACHINE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)
"""


def test_a_worker_stops_when_its_machine_is_killed(tmp_path):
    import subprocess

    mark = tmp_path / "mark"
    machine = subprocess.Popen([sys.executable, "-c", MACHINE, ORPHAN, str(mark)])
    try:
        wait(lambda: mark.exists() and mark.read_text() == "watching")
        machine.kill()  # SIGKILL: no goodbye to its worker
        machine.wait()
        wait(lambda: mark.read_text() == "stopped", timeout=10)
    finally:
        if machine.poll() is None:
            machine.kill()


def test_a_workers_log_lines_carry_one_time_stamp_the_machines(tmp_path):
    # A worker's logging writes "TIME LEVEL name: text" to the stream the machine reads; the
    # machine prints every worker line with its own time, so the worker's is dropped.
    logs = 'import sys\nprint("2026-11-28T23:43:02 WARNING dipaco.peer: lost it", flush=True)\n'
    events: list[tuple[int, dict]] = []
    machine = Machine(
        "box", ["cpu"], tmp_path, lambda w: [sys.executable, "-c", logs],
        lambda w, e: events.append((w.index, e)), threading.Event(),
    )  # fmt: skip
    machine.run()
    said = [e["message"] for _, e in events if "message" in e]
    assert said == ["WARNING dipaco.peer: lost it"], events
