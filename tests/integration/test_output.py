"""What the commands print when a person (or a log file) reads them.

Output to a file is one timestamped line per message or event (or one JSON object per line),
never cut and without ANSI codes; every mistake a user can make at the command line ends with
exit code 2 and one line saying what to do, and leaves no file or process behind.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _waiting import alive, helper_pids, run_config, wait_for

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow
# Tests that check no daemon outlived a command scan every process and /tmp: they run alone.
serial = pytest.mark.serial
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ")
PEER_ID = "12D3KooWQ6XhUxsJ2Udqf8n2LRWpdP2Skr9boZuZAcWWxfBH4mSp"


def events(root: Path, kind: str) -> list[dict]:
    lines = (root / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def to_file(args, path: Path) -> subprocess.Popen:
    """A command with its stdout and stderr in ``path``, as under nohup or systemd."""
    out = open(path, "w")  # noqa: SIM115 - the child holds it; closed when the test ends
    return subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT)


def plain_lines(path: Path) -> list[str]:
    text = path.read_text()
    assert "\x1b" not in text, f"ANSI codes in {path.name}"
    lines = text.splitlines()
    assert lines and all(STAMP.match(line) for line in lines), text[-2000:]
    return lines


def test_each_command_writes_one_line_per_task_event_to_a_file(run_copy, tmp_path):
    root = run_copy()
    key_file = root / "coordinator" / "authkey"
    coordinator = to_file(
        [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path), "--run-dir",
         root, "--transport", "loopback", "--no-eval", "--linger", "30"],
        tmp_path / "coordinator.log",
    )  # fmt: skip
    procs = [coordinator]
    try:
        address_file = root / "coordinator" / "address"
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(), 120, "the address"
        )
        peer = to_file(
            [BIN / "dipaco-peer", "join", address, "--authkey-file", key_file, "--peer-id", "p1",
             "--state-dir", tmp_path / "p1"],
            tmp_path / "p1.log",
        )  # fmt: skip
        procs.append(peer)
        wait_for(
            lambda: "run finished" in (tmp_path / "coordinator.log").read_text(), 300, "the end"
        )
        # Joining a finished run: said, in JSON lines this time, and exit 0.
        late = to_file(
            [BIN / "dipaco-peer", "join", address, "--authkey-file", key_file, "--peer-id", "p2",
             "--state-dir", tmp_path / "p2", "--log-format", "json"],
            tmp_path / "p2.log",
        )  # fmt: skip
        procs.append(late)
        assert late.wait(120) == 0, (tmp_path / "p2.log").read_text()
        assert peer.wait(120) == 0, (tmp_path / "p1.log").read_text()
        coordinator.send_signal(signal.SIGINT)  # cuts the linger short: the run is over
        assert coordinator.wait(60) == 0, (tmp_path / "coordinator.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    # The coordinator: its join command whole (no 80-column cut), a line per task event.
    lines = plain_lines(tmp_path / "coordinator.log")
    join = next(line for line in lines if "peers join with:" in line)
    assert str(key_file) in join and re.search(r"--coordinator-key ed25519:\S{40,}$", join)
    issued, done = events(root, "task_issued"), events(root, "delta")
    steps = events(root, "outer_step")
    assert len(issued) >= len(done) == 8 and len(steps) == 12
    assert sum(" issued to p1: path P" in line for line in lines) == len(issued)
    assert sum(" done by p1: path P" in line for line in lines) == len(done)
    assert sum(re.search(r" module \S+ -> v\d ", line) is not None for line in lines) == 12
    for e in done:
        assert sum(f"task {e['task']} done by p1" in line for line in lines) == 1

    # The peer: one line when each task starts, one when it is trained, one when acknowledged.
    lines = plain_lines(tmp_path / "p1.log")
    acked = {json.loads(line)["task"] for line in (tmp_path / "p1" / "acks.jsonl").open()}
    assert len(acked) == 8
    for task in acked:
        assert sum(f"task {task}: training path P" in line for line in lines) == 1, task
        assert sum(f"task {task}: trained step 30/30" in line for line in lines) == 1, task
        assert sum(f"task {task}: delta acknowledged" in line for line in lines) == 1, task
    assert "the run has finished; peer p1 trained 8 tasks" in lines[-2] + lines[-1]

    records = [json.loads(line) for line in (tmp_path / "p2.log").read_text().splitlines()]
    assert all(STAMP.match(r["time"] + " ") for r in records)
    assert any("the run has finished; peer p2 trained 0 tasks" in r["message"] for r in records)

    # eval, to a file: lines a person reads, not a Python dict.
    ev = subprocess.run([BIN / "dipaco", "eval", "--run-dir", root], capture_output=True, text=True)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    assert "{" not in ev.stdout and "\x1b" not in ev.stdout
    assert all(STAMP.match(line) for line in ev.stdout.splitlines())
    assert re.search(r"routed validation perplexity \d+\.\d\d over [\d,]+ tokens", ev.stdout)


# ---- mistakes: wrong input, exit code 2, one line, nothing left behind ------------------------


# The variable that marks the processes a test started: p2pd inherits its parent's environment
# (hivemind copies os.environ), and keeps it when the command that started it is gone.
TAG = "DIPACO_TEST_COMMANDS"
# hivemind puts its daemons' sockets in /tmp whatever TMPDIR says: p2pd-<uid>.sock, and its
# client's p2pclient-<uid>.sock.
SOCKET = re.compile(r"/tmp/hivemind-p2p(?:d|client)-([A-Za-z0-9_-]+)\.sock")


def p2pd_processes() -> dict[int, str]:
    """pid -> command line of every p2pd on the machine."""
    out = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"p2pd" in args[0]:
            out[int(cmdline.parent.name)] = b" ".join(args).decode(errors="replace")
    return out


def tagged(pid: int, tag: str) -> bool:
    try:
        return f"{TAG}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False


class OwnDaemons:
    """The p2p daemons of the commands a test runs with ``env``, and only those: a hivemind peer
    that someone runs on the machine meanwhile is none of the test's business.

    Within the ``with`` block, every p2pd whose environment carries this block's tag is noted
    with its socket id (a thread looks every 50 ms; p2pd lives far longer than that: its
    parent waits for it to start). Leaving the block, none of them may outlive ``grace``
    seconds, nor any socket file of theirs."""

    def __init__(self, grace: float = 10.0) -> None:
        self.tag, self.grace = uuid.uuid4().hex, grace
        self.env = {**os.environ, TAG: self.tag}
        self.uids: set[str] = set()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="own-daemons", daemon=True)

    def pids(self) -> set[int]:
        """Our p2pd processes alive now (their socket ids noted)."""
        ours = set()
        for pid, cmdline in p2pd_processes().items():
            if tagged(pid, self.tag) and alive(pid):
                ours.add(pid)
                self.uids.update(SOCKET.findall(cmdline))
        return ours

    def sockets(self) -> list[Path]:
        """Our daemons' socket files still on disk."""
        return [
            f
            for uid in self.uids
            for f in (
                Path(f"/tmp/hivemind-p2pd-{uid}.sock"),
                Path(f"/tmp/hivemind-p2pclient-{uid}.sock"),
            )
            if f.exists()
        ]

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            self.pids()

    def __enter__(self) -> "OwnDaemons":
        self._watcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._watcher.join()
        if exc_info[0] is not None:
            return
        deadline = time.monotonic() + self.grace
        while (self.pids() or self.sockets()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not self.pids(), "a p2p daemon outlived a command"
        assert not self.sockets(), "a daemon socket file was left behind"


def one_error(args, *, timeout: float = 120) -> str:
    """Run a command that must fail: exit 2, exactly one error line, no traceback, and no
    daemon process or socket file of its own left behind. Its error line."""
    return errors_of(args, timeout=timeout)[0]


def errors_of(*commands, timeout: float = 120) -> list[str]:
    """``one_error`` for several commands, run side by side (each mostly imports, on one core):
    their error lines, in order; no daemon or socket file of theirs outlives any of them."""
    with OwnDaemons() as own:

        def run(args) -> subprocess.CompletedProcess:
            return subprocess.run(
                [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                env=own.env,
            )  # fmt: skip

        with ThreadPoolExecutor(len(commands)) as pool:
            done = list(pool.map(run, commands))
    lines = []
    for proc in done:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert "Traceback" not in out and "\x1b" not in out, out
        errors = [line for line in out.splitlines() if re.match(r"\S+ error \(", line)]
        assert len(errors) == 1, out
        lines.append(errors[0])
    return lines


def p2pd_binary() -> Path:
    """The p2pd that ships inside hivemind's wheel (found without importing hivemind)."""
    (package,) = importlib.util.find_spec("hivemind").submodule_search_locations
    return Path(package) / "hivemind_cli" / "p2pd"


def a_daemon(env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """A p2pd listening as hivemind starts one, once its socket is there: (process, socket)."""
    sock = Path(f"/tmp/hivemind-p2pd-{uuid.uuid4().hex[:11]}.sock")
    p = subprocess.Popen(
        [p2pd_binary(), f"-listen=/unix{sock}", "-hostAddrs=/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    wait_for(lambda: sock.exists() or p.poll() is not None, 60, "p2pd's socket")
    assert p.poll() is None, "p2pd did not start"
    return p, sock


def stop_daemon(p: subprocess.Popen, sock: Path) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    sock.unlink(missing_ok=True)


def test_a_daemon_someone_else_runs_meanwhile_is_not_taken_for_a_left_over_one(tmp_path):
    # Started while the checked commands run, as a developer's own peer may be, and left running.
    other = None
    try:
        with OwnDaemons(grace=1.0):
            other = a_daemon()
        assert other[0].poll() is None and other[1].exists()
    finally:
        if other is not None:
            stop_daemon(*other)


def test_a_daemon_a_command_leaves_behind_is_caught():
    own = OwnDaemons(grace=1.0)
    left = None
    try:
        with pytest.raises(AssertionError, match="a p2p daemon outlived a command"):
            with own:
                left = a_daemon(own.env)  # its command "exited" without stopping it
    finally:
        if left is not None:
            stop_daemon(*left)
    assert own.uids == {left[1].name.removeprefix("hivemind-p2pd-").removesuffix(".sock")}


@serial
def test_join_says_what_address_it_wanted(tmp_path):
    addresses = ["foo", "/ip4/127.0.0.1/tcp/4001", "/ip4/1.2.3/tcp/4001", "127.0.0.1:4001",
                 "http://127.0.0.1:8080/", PEER_ID]  # fmt: skip
    lines = errors_of(
        *([BIN / "dipaco-peer", "join", a, "--state-dir", tmp_path / f"state{i}"]
          for i, a in enumerate(addresses))
    )  # fmt: skip
    line = lines[0]
    assert "'foo' is not an address" in line and "/ip4/" in line and "--authkey-file" in line
    line = lines[1]
    assert "lacks the coordinator's peer id" in line and "/p2p/" in line
    assert "is not a valid multiaddr" in lines[2]
    assert "needs --authkey-file" in lines[3]
    assert "web address" in lines[4]
    assert "peer id alone" in lines[5]


@serial
def test_a_dead_address_is_retried_then_pointed_to_doctor(tmp_path):
    # A port bound and not listening: refused, and no other process can take it meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}/p2p/{PEER_ID}"
        began = time.monotonic()
        line = one_error(
            [BIN / "dipaco-peer", "join", address, "--state-dir", tmp_path / "s", "--patience", "4"]
        )
        assert time.monotonic() - began >= 4  # it retried for its patience
    assert f"error (transport): gave up reaching the run at {address} after " in line
    assert "(last error: nothing answered at that address)" in line
    assert line.endswith(f"Check the address with: dipaco-peer doctor {address}")
    assert "\n" not in line


@serial
def test_busy_ports_are_refused_before_any_work(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        options = ("--listen", "--dashboard")
        began = time.monotonic()
        lines = errors_of(
            *([BIN / "dipaco-coordinator", "start", "--preset", "tiny", "--run-dir",
               tmp_path / option.strip("-"), option, taken] for option in options)
        )  # fmt: skip
        assert time.monotonic() - began < 30
        for option, line in zip(options, lines, strict=True):
            assert f"{option} {taken}: port" in line and "is in use" in line
            run_dir = tmp_path / option.strip("-")
            assert not run_dir.exists(), "nothing is prepared for a run that cannot serve"


@serial
def test_data_that_looks_like_markup_is_printed_as_it_is(tmp_path):
    odd = tmp_path / "run[/bold] [red]x"
    owner = tmp_path / "owner"
    owner.mkdir()
    (owner / "manifest.json").write_text("{}")
    missing, owners = errors_of(
        [BIN / "dipaco", "eval", "--run-dir", odd], [BIN / "dipaco", "eval", "--run-dir", owner]
    )
    assert f"run folder {odd} does not exist" in missing
    assert "is a module owner's folder" in owners and f"--owner-dir {owner}" in owners


@serial
def test_ctrl_c_stops_a_hivemind_coordinator_quickly_and_quietly(run_copy, tmp_path):
    root = run_copy()
    log = tmp_path / "coordinator.log"
    with OwnDaemons(grace=15) as own:  # its p2pd and sockets gone with it
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--config", run_config(tmp_path), "--run-dir",
             root, "--no-eval"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=own.env,
        )  # fmt: skip
        try:
            wait_for(lambda: "peers join with" in log.read_text(), 120, "the coordinator")
            helpers = helper_pids(coordinator.pid)
            assert own.pids(), "the coordinator's p2pd is not among its own"
            began = time.monotonic()
            coordinator.send_signal(signal.SIGINT)
            code = coordinator.wait(30)
            took = time.monotonic() - began
        finally:
            if coordinator.poll() is None:
                os.killpg(coordinator.pid, signal.SIGKILL)
                coordinator.wait()
        # the DHT, p2pd and torch's shared-memory manager (which leaves once its clients have)
        wait_for(lambda: not any(alive(pid) for pid in helpers), 15, "its helpers to exit")
    text = log.read_text()
    assert code == 130, text
    assert took < 10, f"{took:.1f} s to stop"
    assert "ERROR" not in text and "hard way" not in text and "Traceback" not in text, text
    assert "run the same command to resume" in text


def test_a_flower_node_at_a_wrong_address_says_so(tmp_path):
    from dipaco.flower import deploy

    tls = deploy.make_tls(tmp_path / "tls")
    nobody = socket.socket()  # bound and not listening: refused, and no other process's port
    nobody.bind(("127.0.0.1", 0))
    wrong = f"127.0.0.1:{nobody.getsockname()[1]}"
    log = tmp_path / "node.log"
    node = subprocess.Popen(
        [BIN / "dipaco-peer", "join", "--flower", wrong, "--root-certificates", tls.ca,
         "--state-dir", tmp_path / "node", "--peer-id", "n1", "--device", "cpu",
         "--patience", "5"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: "no message from the SuperLink" in log.read_text() or node.poll() is not None,
            120,
            "the warning",
        )
        assert node.poll() is None, log.read_text()  # it warned, and is still trying
        node.send_signal(signal.SIGINT)
        assert node.wait(60) == 130  # Ctrl-C before the run was done, as every command
    finally:
        nobody.close()
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    lines = plain_lines(log)
    warning = next(line for line in lines if "no message from the SuperLink" in line)
    assert f"at {wrong} after 5 s" in warning and f"dipaco-peer doctor {wrong}" in warning
    assert lines[-1].endswith("node n1 left")
