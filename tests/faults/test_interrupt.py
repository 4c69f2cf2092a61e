"""Every process stops within 5 s of Ctrl-C (SIGINT) or SIGTERM, in every phase, and leaves no
child process behind: real ``dipaco-coordinator`` and ``dipaco-peer`` processes on 127.0.0.1
(the harness's tiny run), with one CPU core kept busy by another process all along.

Phases: the coordinator preparing a run, serving before any peer, a peer in the middle of a
task, a peer whose push is blocked on a coordinator that stopped answering (SIGSTOP), the
coordinator finished and lingering (the signal sent to one of its other threads: the kernel may
hand a process's signal to any thread, and the main thread used to sleep through it, the
dashboard test's flake), and a hivemind coordinator with its DHT process and ``p2pd``.
"""

import ctypes
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _waiting import alive
from fault_harness import BIN, write_config

from dipaco.procs import descendants

pytestmark = [pytest.mark.slow, pytest.mark.serial]
LIMIT = 5.0  # seconds from the signal to the process's exit
TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


@pytest.fixture(scope="module", autouse=True)
def busy_core():
    """A process that keeps one core at 100 % while these tests run."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield hog
    hog.kill()
    hog.wait()


class Command:
    """One command, its output in a log file (a pipe nobody reads would block its prints)."""

    def __init__(self, workdir: Path, name: str, *args, env: dict | None = None):
        self.log_path = workdir / f"{name}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
        environ.update(PYTHONUNBUFFERED="1", DIPACO_LOG_FORMAT="plain", **(env or {}))
        with open(self.log_path, "w") as log:
            self.p = subprocess.Popen(
                [str(a) for a in args], stdout=log, stderr=subprocess.STDOUT, env=environ
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, pattern: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.log()):
            if self.p.poll() is not None:
                raise AssertionError(f"exited ({self.p.returncode}) before {pattern!r}:\n"
                                     + self.log()[-3000:])  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT, thread: bool = False) -> float:
        """Send ``sig`` (to one of its non-main threads with ``thread``); assert it exits within
        LIMIT seconds leaving none of its child processes alive; the seconds it took."""
        kids = descendants(self.p.pid)
        t0 = time.monotonic()
        if thread:
            send_to_other_thread(self.p.pid, sig)
        else:
            self.p.send_signal(sig)
        try:
            self.p.wait(LIMIT)
        except subprocess.TimeoutExpired:
            self.p.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
            time.sleep(1)
            self.p.kill()
            self.p.wait()
            raise AssertionError(
                f"running {LIMIT} s after {sig!r}:\n{self.log()[-6000:]}"
            ) from None
        took = time.monotonic() - t0
        print(f"{self.log_path.stem}: {signal.Signals(sig).name} -> exit {self.p.returncode} "
              f"in {took:.2f} s")  # fmt: skip
        time.sleep(0.3)  # a killed child's exit is asynchronous
        left = [pid for pid in kids if alive(pid)]
        assert not left, f"children left behind: {left}"
        assert "Traceback" not in self.log(), self.log()[-3000:]
        return took

    def kill(self) -> None:
        if self.p.poll() is None:
            for pid in descendants(self.p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.p.kill()
            self.p.wait()


def send_to_other_thread(pid: int, sig: int) -> None:
    """``tgkill`` ``sig`` to a thread of ``pid`` other than its main one (one that does not
    block it): what the kernel may do with a signal sent to the process."""
    mask = 1 << (sig - 1)
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(re.search(r"SigBlk:\s*([0-9a-f]+)", status).group(1), 16)
        if not blocked & mask:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.syscall(TGKILL, pid, tid, sig) == 0, ctypes.get_errno()
            return
    raise AssertionError(f"no thread of {pid} other than the main one takes signal {sig}")


def coordinator(workdir: Path, root: Path, *extra, config: Path | None = None) -> Command:
    return Command(
        workdir, f"coordinator-{len(list(workdir.glob('coordinator*.log')))}",
        BIN / "dipaco-coordinator", "start", "--config", config or write_config(workdir),
        "--run-dir", root, "--no-eval", *extra,
    )  # fmt: skip


def peer(workdir: Path, root: Path, address: str, name: str, env=None) -> Command:
    return Command(
        workdir, name,
        BIN / "dipaco-peer", "join", address, "--authkey-file", root / "coordinator" / "authkey",
        "--peer-id", name, "--state-dir", workdir / name, env=env,
    )  # fmt: skip


@pytest.fixture
def run(prepared_faults, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(prepared_faults, root)
    return root


def test_coordinator_stops_while_preparing_and_while_serving(tmp_path, run):
    # Preparing: a new run folder, stopped once its documents are being read or tokenized.
    c = coordinator(tmp_path, tmp_path / "fresh", "--transport", "loopback")
    try:
        c.wait_for(r"reading documents|training the tokenizer")
        time.sleep(0.5)
        c.stop(signal.SIGINT)
        assert c.p.returncode in (130, 128 + signal.SIGINT), c.log()[-2000:]
    finally:
        c.kill()
    # Serving, before any peer came: SIGTERM as a service manager sends it.
    c = coordinator(tmp_path, run, "--transport", "loopback")
    try:
        c.wait_for("listening on")
        assert c.stop(signal.SIGTERM) < LIMIT
        assert c.p.returncode == 130, c.log()[-2000:]  # the orderly stop, not the deadline
        assert "still stopping" not in c.log()
    finally:
        c.kill()


@pytest.mark.skipif(TGKILL is None, reason="tgkill's number is known for x86_64 and aarch64")
def test_peers_stop_mid_task_and_mid_push_and_the_lingering_coordinator_stops(tmp_path, run):
    c = coordinator(tmp_path, run, "--transport", "loopback", "--linger", "60")  # port 0
    procs = [c]
    try:
        c.wait_for("listening on")
        address = re.search(r"listening on (127\.0\.0\.1:\d+)", c.log()).group(1)
        # Three peers at once (their start-up overlaps): peer0 is stopped in the middle of a task,
        # peer1 in its push, and peer2 trains the run to its end.
        faults = tmp_path / "faults.jsonl"
        p0 = peer(tmp_path, run, address, "peer0")
        p1 = peer(tmp_path, run, address, "peer1",
                  env={"DIPACO_FAULTS": "peer.before_push=sleep:2",
                       "DIPACO_FAULTS_LOG": str(faults)})  # fmt: skip
        p2 = peer(tmp_path, run, address, "peer2")
        procs += [p0, p1, p2]
        # In the middle of a task: it stops between two steps and hands the task back.
        p0.wait_for(r"training path P\d")
        assert p0.stop(signal.SIGINT) < LIMIT
        # 130: stopped in order by Ctrl-C before the run was done (cli/stopping.py's rule)
        assert p0.p.returncode == 130 and "still stopping" not in p0.log(), p0.log()[-2000:]
        assert "left after" in p0.log()

        # A push blocked on the socket: the coordinator stops answering (SIGSTOP) while peer1
        # waits at its fault point just before sending; then its push hangs, unanswered.
        deadline = time.monotonic() + 120
        while not (faults.exists() and faults.read_text().strip()):
            assert time.monotonic() < deadline and p1.p.poll() is None, p1.log()[-2000:]
            time.sleep(0.02)
        os.kill(c.p.pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)  # the fault's 2 s are over: the push request is sent, unanswered
            assert p1.stop(signal.SIGINT) < LIMIT
            assert p1.p.returncode == 130, p1.log()[-2000:]
        finally:
            os.kill(c.p.pid, signal.SIGCONT)

        # The run goes on to its end with peer2; the coordinator then lingers.
        c.wait_for("run finished", timeout=180)
        p2.p.wait(60)  # it heard "finished"
        assert p2.p.returncode == 0, p2.log()[-2000:]
        # The signal goes to a thread other than the main one, which sleeps out its linger.
        assert c.stop(signal.SIGINT, thread=True) < LIMIT
        assert c.p.returncode == 0 and "still stopping" not in c.log(), c.log()[-2000:]
        heads = [json.loads(h.read_text()) for h in run.glob("coordinator/modules/*/head.json")]
        assert heads and all(h["version"] == 2 for h in heads)
    finally:
        for proc in procs:
            proc.kill()


def test_hivemind_coordinator_stops_with_its_dht_and_p2pd(tmp_path, run):
    c = coordinator(tmp_path, run)  # hivemind, on a port of its choosing (127.0.0.1:0)
    try:
        c.wait_for("peers join with", timeout=120)
        helpers = descendants(c.p.pid)
        assert any("p2pd" in Path(f"/proc/{pid}/cmdline").read_text() for pid in helpers)
        assert c.stop(signal.SIGINT) < LIMIT  # and the DHT process and p2pd are gone
    finally:
        c.kill()
