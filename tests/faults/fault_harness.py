"""The fault-injection harness: a real coordinator and real peers on 127.0.0.1, faults, checks.

Shared by the short scenarios (``tests/faults/test_faults.py``, in CI) and the long randomized
form (``bench/faults.py``). A :class:`Cluster` runs ``dipaco-coordinator start --transport
loopback`` on a fixed port (so that a restarted coordinator keeps its address) and ``dipaco-peer
join`` processes, injects faults through ``DIPACO_FAULTS`` (see :mod:`dipaco.faults`),
restarts a coordinator that was killed, and waits for the run to finish. :func:`check_run`
then reads what is on disk and in the metrics log and says whether every acknowledged delta
was applied exactly once; :func:`compare_params` compares the final modules with a reference.

Peers share one state folder (as ``run_local_peers`` does): a path's inner optimizer state
then follows the path whichever peer trains it, so a run's parameters do not depend on which
peer took which task, and faults that only cost time leave them bit for bit unchanged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dipaco.protocols.wire import read_tensor_file

BIN = Path(sys.executable).parent
ROUNDS = 2
# The tiny preset, shortened: 4 paths x 2 rounds of 6 inner steps. Leases are short so that a
# killed peer's task is re-issued within seconds.
BASE_CONFIG = f"""preset = "tiny"
[train]
inner_steps = 6
rounds = {ROUNDS}
[scheduler]
lease_seconds = 4.0
heartbeat_seconds = 0.5
"""
# The paper's mean, unscored: a robust combiner gives each key one vote, so its result depends
# on which peer (key) trained which path, and the held-out check weighs a delta by its gain
# against the gains that arrived before it; the scenarios compare modules bit for bit across
# runs whose task assignment and arrival order differ. (tests/faults/test_hostile.py runs an
# open run's defaults.)
CONFIG = BASE_CONFIG + '[validation]\naggregation = "mean"\nheldout_check = false\n'


def write_config(folder: Path, text: str = CONFIG) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(text)
    return path


def prepare_run(root: Path, text: str = CONFIG) -> Path:
    """Prepare the harness's run once (tokenizer, pretraining, router, shards): ~10-20 s."""
    from dipaco.config import load_config
    from dipaco.prepare.pipeline import prepare

    prepare(root, load_config(write_config(root.parent / "config", text)))
    return root


def local_run(prepared: Path, root: Path, peers: int) -> Path:
    """A fault-free run of a copy of ``prepared`` at ``root``: ``peers`` peers, each with its own
    key, as threads of this process over the local transport (sharing one state folder, as the
    harness's peer processes do), so no peer process spends seconds starting up."""
    import shutil
    import threading

    from dipaco.config import load_config_dict
    from dipaco.prepare.pipeline import prepare
    from dipaco.run.factory import build_coordinator
    from dipaco.run.local import run_local_peers
    from dipaco.run.metrics_log import MetricsLog

    shutil.copytree(prepared, root)
    prep = prepare(root, load_config_dict(json.loads((root / "config.json").read_text())))
    core = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    for t in run_local_peers(core, prep, peers, stop=threading.Event()):
        t.join(300)
    assert core.finished, "the local run did not finish"
    return root


class Cluster:
    """One run's coordinator and peers as processes, with faults and restarts.

    ``coordinator_faults`` lists the ``DIPACO_FAULTS`` of each coordinator life in turn: a life
    that is killed (SIGKILL, by a fault or by :meth:`kill_coordinator`) is restarted with the
    next entry, or with none once the list is used up.
    """

    def __init__(
        self,
        root: Path,
        workdir: Path,
        *,
        peers: int = 2,
        coordinator_faults: list[str] | None = None,
        peer_env: dict[int, dict[str, str]] | None = None,
        restart_peers: bool = True,
        peer_restart_delay: float = 0.0,
        address: str | None = None,
        lead_peer: int | None = None,
        config: str = CONFIG,
        linger: float = 3.0,
    ) -> None:
        self.root, self.workdir = root, workdir
        # A peer that must get work: the others start once it holds its first task (a peer
        # started second may otherwise train every task before the first has even joined).
        self.lead_peer = lead_peer
        # Seconds the coordinator keeps answering after the run finished (--linger), so that
        # peers hear "finished".
        self.linger = linger
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = write_config(workdir, config)
        # The first coordinator life picks a free port (port 0) and says which; the lives after
        # it listen there again, so that a restarted coordinator keeps its address.
        self.port: int | None = None
        self._peer_address = address  # a proxy's address, if one is in between
        self.n_peers = peers
        self.coordinator_faults = list(coordinator_faults or [])
        # Each peer's extra environment applies to its first start only: a peer restarted after
        # its fault runs clean, so a scenario's fault happens once, whatever the timing.
        self.peer_env = peer_env or {}
        self.peer_started: set[int] = set()
        self.restart_peers, self.peer_restart_delay = restart_peers, peer_restart_delay
        self.fault_log = workdir / "faults.jsonl"
        self.coordinator: subprocess.Popen | None = None
        self.peers: list[subprocess.Popen | None] = [None] * peers
        self.peer_died: dict[int, float] = {}
        self.lives = self.peer_starts = 0
        self.coordinator_kills = self.peer_kills = 0
        self.finished = False

    @property
    def listen(self) -> str:
        return f"127.0.0.1:{self.port or 0}"

    @property
    def peer_address(self) -> str:
        return self._peer_address or self.listen

    @peer_address.setter
    def peer_address(self, address: str) -> None:
        self._peer_address = address

    def target(self) -> tuple[str, int]:
        """Where the coordinator listens, once it does (a proxy's upstream)."""
        assert self.port is not None, "the coordinator has not started"
        return ("127.0.0.1", self.port)

    # ---- processes ----------------------------------------------------------------------------
    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DIPACO_")}
        env.update(PYTHONUNBUFFERED="1", DIPACO_FAULTS_LOG=str(self.fault_log), **extra)
        return env

    def start_coordinator(self) -> None:
        faults = self.coordinator_faults.pop(0) if self.coordinator_faults else ""
        self.lives += 1
        log = open(self.workdir / f"coordinator-{self.lives}.log", "w")  # noqa: SIM115
        cmd = [BIN / "dipaco-coordinator", "start", "--config", self.config,
               "--run-dir", self.root, "--no-eval", "--transport", "loopback",
               "--listen", self.listen, "--linger", str(self.linger)]  # fmt: skip
        env = self._env({"DIPACO_FAULTS": faults} if faults else {})
        # Every outer step but a run's last written on a background thread, as large modules'
        # are (store.py): the kills inside the outer step hit that thread.
        env["DIPACO_BACKGROUND_STEP_BYTES"] = "0"
        self.coordinator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.coordinator_log = self.workdir / f"coordinator-{self.lives}.log"

    def wait_listening(self, timeout: float = 120.0) -> None:
        """Until this coordinator life prints its address (or dies: then the caller sees it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            said = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.coordinator_log.read_text())
            if said:
                self.port = int(said.group(1))
                return
            if self.coordinator.poll() is not None:
                return
            time.sleep(0.2)
        raise AssertionError(f"coordinator did not listen within {timeout} s:\n{self.tail()}")

    def start_peer(self, i: int) -> None:
        self.peer_starts += 1
        log = open(self.workdir / f"peer{i}.log", "a")  # noqa: SIM115
        cmd = [BIN / "dipaco-peer", "join", self.peer_address,
               "--authkey-file", self.root / "coordinator" / "authkey",
               "--peer-id", f"peer{i}", "--state-dir", self.workdir / "peers"]  # fmt: skip
        extra = self.peer_env.get(i, {}) if i not in self.peer_started else {}
        self.peer_started.add(i)
        self.peers[i] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(extra)
        )
        log.close()

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator from outside (the supervisor restarts it)."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            os.kill(self.coordinator.pid, signal.SIGKILL)
            self._log_fault("external", "coordinator")

    def kill_peer(self, i: int) -> None:
        p = self.peers[i]
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            self._log_fault("external", f"peer{i}")

    def pause_peers(self) -> None:
        """SIGSTOP every live peer: each holds its task where it is (fetching, training,
        pushing) until :meth:`resume_peers`, however long the coordinator is away."""
        for i, p in enumerate(self.peers):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGSTOP)
                self._log_fault("paused", f"peer{i}")

    def resume_peers(self) -> None:
        for p in self.peers:
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)

    def _log_fault(self, point: str, who: str) -> None:
        with open(self.fault_log, "a") as f:
            f.write(json.dumps({"time": time.time(), "point": point, "who": who}) + "\n")

    def tail(self, n: int = 3000) -> str:
        return self.coordinator_log.read_text()[-n:]

    def start(self) -> None:
        self.start_coordinator()
        self.wait_listening()
        if self.lead_peer is not None:
            self.start_peer(self.lead_peer)
            lead, deadline = f"peer{self.lead_peer}", time.monotonic() + 120
            while not any(
                e["event"] == "task_issued" and e.get("peer") == lead for e in self.events()
            ):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{lead} got no task within 120 s:\n{self.tail()}")
                time.sleep(0.1)
        for i in range(self.n_peers):
            if i != self.lead_peer:
                self.start_peer(i)

    def step(self) -> bool:
        """Restart what died; True once the coordinator has exited after finishing the run."""
        rc = self.coordinator.poll()
        if rc is not None:
            if rc == 0:
                self.finished = True
                return True
            if rc != -signal.SIGKILL:
                raise AssertionError(f"coordinator exited with {rc}:\n{self.tail()}")
            self.coordinator_kills += 1
            self.start_coordinator()
            self.wait_listening()
        now = time.monotonic()
        for i, p in enumerate(self.peers):
            # A peer that left cleanly (0) saw the run finish; one that died is started again.
            if p is None or p.poll() is None or p.returncode == 0:
                continue
            if i not in self.peer_died:
                self.peer_kills += p.returncode == -signal.SIGKILL
                self.peer_died[i] = now
            if self.restart_peers and now - self.peer_died[i] >= self.peer_restart_delay:
                del self.peer_died[i]
                self.start_peer(i)
        return False

    def wait(self, timeout: float, during=None) -> None:
        """Supervise until the run finishes; ``during()`` is called every poll (a test's hook)."""
        deadline = time.monotonic() + timeout
        while not self.step():
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not finish within {timeout} s:\n{self.tail()}")
            if during is not None:
                during(self)
            time.sleep(0.2)

    def stop(self) -> None:
        for p in [self.coordinator, *self.peers]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def run(self, timeout: float = 240.0, during=None) -> None:
        try:
            self.start()
            self.wait(timeout, during)
        finally:
            self.stop()

    # ---- what happened ------------------------------------------------------------------------
    def events(self) -> list[dict]:
        return read_events(self.root)

    def faults_injected(self) -> list[dict]:
        if not self.fault_log.exists():
            return []
        return [json.loads(line) for line in self.fault_log.read_text().splitlines() if line]

    def peers_saw(self, phrase: str) -> bool:
        """Whether a peer logged ``phrase`` (whitespace ignored: rich wraps long lines)."""
        want = "".join(phrase.split())
        return any(want in "".join(f.read_text().split()) for f in self.workdir.glob("peer*.log"))

    def rejections(self) -> dict[str, int]:
        """The coordinator's rejection counts by reason, as last saved."""
        state = self.root / "coordinator" / "coordinator.json"
        return json.loads(state.read_text()).get("rejections", {}) if state.exists() else {}

    def acked_count(self) -> int:
        return sum(1 for e in self.events() if e["event"] == "delta_acked")


def read_events(root: Path) -> list[dict]:
    path = root / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill -9 mid-write
            continue
    return out


@dataclass
class RunCheck:
    """What :func:`check_run` found. ``ok`` when nothing acknowledged was lost or doubled."""

    versions: dict[str, int]
    acked: int
    applied: int
    lost: list[tuple[str, str]] = field(default_factory=list)
    doubled: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.problems)


def check_run(root: Path, peer_state: Path | None = None, rounds: int = ROUNDS) -> RunCheck:
    """Every acknowledged delta applied exactly once, and every module at the final version.

    Acknowledged: the coordinator's ``delta_acked`` events, and what the peers recorded as
    acknowledged (``acks.jsonl`` in their state folder). Applied: the ``applied`` task list of
    each module's committed head.json (the ground truth: an ``outer_step`` event can be lost to
    a kill just after the commit), cross-checked with the ``outer_step`` events.
    """
    events = read_events(root)
    acked = {(e["module"], e["task"]) for e in events if e["event"] == "delta_acked"}
    if peer_state is not None and (peer_state / "acks.jsonl").exists():
        for line in (peer_state / "acks.jsonl").read_text().splitlines():
            if line.strip():
                info = json.loads(line)
                acked.add((info["module"], info["task"]))
    versions, applied = {}, {}
    for head_file in sorted((root / "coordinator" / "modules").glob("*/head.json")):
        head = json.loads(head_file.read_text())
        versions[head_file.parent.name] = head["version"]
        applied[head_file.parent.name] = head.get("applied", [])
    check = RunCheck(versions, len(acked), sum(len(ts) for ts in applied.values()))
    for mid, version in versions.items():
        if version != rounds:
            check.problems.append(f"{mid} ended at version {version}, not {rounds}")
    check.lost = sorted((mid, t) for mid, t in acked if t not in applied.get(mid, []))
    for mid, tasks in applied.items():
        # Task ids are P<path>-r<round>-e<epoch>-a<attempt>: one task per path and round.
        per_round = Counter(t.split("-e")[0] for t in tasks)
        check.doubled += [(mid, pr) for pr, n in per_round.items() if n > 1]
    rolled_back = {e["module"] for e in events if e["event"] == "rolled_back"}
    logged = Counter(
        (e["module"], t) for e in events if e["event"] == "outer_step" for t in e["tasks"]
    )
    for (mid, task), n in logged.items():
        if n > 1 and mid not in rolled_back:
            check.problems.append(f"{task} logged in {n} outer steps of {mid}")
        if task not in applied.get(mid, []):
            check.problems.append(f"{task} logged as applied to {mid} but not in its head")
    return check


def module_tensors(root: Path, rounds: int = ROUNDS) -> dict[str, dict[str, torch.Tensor]]:
    folder = root / "coordinator" / "modules"
    return {
        d.name: read_tensor_file(d / f"v{rounds}.dpt").tensors
        for d in sorted(folder.iterdir())
        if (d / "head.json").exists()
    }


def compare_params(root: Path, reference: Path, rounds: int = ROUNDS) -> list[str]:
    """Names of the module tensors that differ (bit for bit) from the reference run's."""
    mine, ref = module_tensors(root, rounds), module_tensors(reference, rounds)
    if set(mine) != set(ref):
        return [f"modules {sorted(mine)} vs {sorted(ref)}"]
    return [
        f"{mid}/{name}"
        for mid in ref
        for name in ref[mid]
        if name not in mine[mid] or not torch.equal(mine[mid][name], ref[mid][name])
    ]
