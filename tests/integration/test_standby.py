"""A standby scheduler takes over a hivemind run whose scheduler is killed mid-round.

Real processes on 127.0.0.1: the scheduler, two module owners that hold every module between
them, a standby started from a copy of the run folder (and the scheduler's signing key), and
one peer. The first owner is behind NAT: it listens nowhere, and is reached through the
scheduler's relay. The scheduler is SIGKILLed (with its p2pd) right after the first delta is
acknowledged. The standby, which copied the scheduler's state every second, takes over with a
new epoch, and relays for that owner from then on; the owners and the peer follow it without
restarting; the run finishes with every acknowledged delta applied exactly once and exactly
the parameters of a fault-free run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from _waiting import wait_for
from test_hivemind_run import (
    BIN,
    UNSCORED_ALL_PATHS,
    Proc,
    config_file,
    final_modules,
    read_events,
    start_peer,
    told,
)

from dipaco.config import load_config
from dipaco.prepare.pipeline import prepare
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog

pytestmark = pytest.mark.slow
# The owners hold every module, the shared ones too: the scheduler holds none.
SHARES = ("S.embed,L0.M0,L0.M1", "S.head,L1.M0,L1.M1")


def start_owner(
    address: str, root: Path, owner_dir: Path, modules: str, name: str, *extra: str
) -> Proc:
    key = subprocess.run([BIN / "dipaco-coordinator", "key", "--run-dir", owner_dir],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run([BIN / "dipaco-coordinator", "allow", "--owner", key, "--run-dir", root],
                   check=True, capture_output=True)  # fmt: skip
    return Proc(BIN / "dipaco-coordinator", "-v", "start", "--join", address, "--owns", modules,
                "--run-dir", owner_dir, "--report-seconds", "0.5", "--publish-seconds", "2",
                *extra, name=name)  # fmt: skip


def standby_copy(root: Path, dest: Path) -> Path:
    """What the operator copies to the standby's machine: the prepared run, and of the
    coordinator's folder the signing key only."""
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns("coordinator", "metrics.jsonl"))
    (dest / "coordinator").mkdir()
    shutil.copy2(root / "coordinator" / "signing.key", dest / "coordinator" / "signing.key")
    return dest


def test_the_standby_takes_over_a_scheduler_killed_mid_round(run_copy, tmp_path, monkeypatch):
    monkeypatch.setattr(Proc, "log_dir", tmp_path)  # each process's output, to read after a failure
    config = config_file(tmp_path, extra=UNSCORED_ALL_PATHS)  # bit for bit: test_hivemind_run
    local = run_copy("local")
    prep = prepare(local, load_config(config))
    reference = build_coordinator(prep, MetricsLog(local / "metrics.jsonl"), evaluate=False)
    for t in run_local_peers(reference, prep, 1, stop=threading.Event()):
        t.join(300)
    assert reference.finished

    root = run_copy("active")
    owner_dirs = (tmp_path / "owner-a", tmp_path / "owner-b")
    procs: list[Proc] = []
    try:
        scheduler = Proc(BIN / "dipaco-coordinator", "-v", "start", "--config", config,
                         "--run-dir", root, "--no-eval", "--publish-seconds", "2", "--relay",
                         name="scheduler")  # fmt: skip
        procs.append(scheduler)
        address = wait_for(
            lambda: (
                scheduler.saw("a standby scheduler")
                and (root / "coordinator" / "address").read_text().strip()
            ),
            180,
            told(scheduler),
        )
        owners = [
            start_owner(address, root, folder, share, folder.name, *extra)
            for folder, share, extra in zip(owner_dirs, SHARES, (["--via-relay"], []), strict=True)
        ]
        procs += owners
        for owner in owners:
            owner.until("took over", 240, scheduler)
        standby_dir = standby_copy(root, tmp_path / "standby")
        standby = Proc(BIN / "dipaco-coordinator", "-v", "start", "--standby", "--join", address,
                       "--run-dir", standby_dir, "--no-eval", "--takeover-seconds", "5",
                       "--publish-seconds", "2", "--relay", name="standby")  # fmt: skip
        procs.append(standby)
        wait_for(lambda: standby.saw("standby for run"), 120, told(standby, scheduler))
        peer = start_peer(address, tmp_path, "only")
        procs.append(peer)

        def acked() -> list[dict]:
            return [
                e
                for d in owner_dirs
                for e in read_events(d / "metrics.jsonl")
                if e["event"] == "delta_acked"
            ]

        wait_for(acked, 240, told(peer, scheduler, *owners))
        scheduler.kill_group()  # SIGKILL, its p2pd with it: no goodbye
        wait_for(lambda: standby.saw("taking over"), 60, told(standby, *owners))
        assert standby.finish(600) == 0, standby.output
        assert peer.finish(120) == 0, peer.output
        for owner in owners:
            assert owner.finish(120) == 0, owner.output
    finally:
        for proc in procs:
            proc.kill_group()

    # The standby scheduled from the copied state, in a new epoch, and the peer followed it.
    active_epoch = json.loads((root / "coordinator" / "coordinator.json").read_text())["epoch"]
    standby_epoch = json.loads((standby_dir / "coordinator" / "coordinator.json").read_text())
    assert standby_epoch["epoch"] == active_epoch + 1
    assert standby.saw(f"epoch {active_epoch + 1}"), standby.output
    assert peer.saw("the run's scheduler is now"), peer.output
    # The owner behind NAT was reached through the standby's relay once it took over.
    assert owners[0].saw("reachable through the new scheduler's relay"), owners[0].output
    relayed = re.findall(r"relayed (\d+) requests to module owners", standby.output)
    assert relayed and int(relayed[0]) > 0, standby.output
    issued = [e for e in read_events(standby_dir / "metrics.jsonl") if e["event"] == "task_issued"]
    assert issued, "the standby issued no task"

    # Every acknowledged delta is applied exactly once, by its owner's outer steps.
    pairs = {(e["module"], e["task"]) for e in acked()}
    applied = Counter(
        (e["module"], task)
        for d in owner_dirs
        for e in read_events(d / "metrics.jsonl")
        if e["event"] == "outer_step"
        for task in e["tasks"]
    )
    assert set(applied) == pairs and set(applied.values()) == {1}, (pairs, applied)

    # The schedule is the fault-free run's (one peer, every round waits for every path): the
    # same parameters, bit for bit.
    networked = final_modules(*owner_dirs)
    assert set(networked) == set(reference.store.modules)
    for mid, record in reference.store.modules.items():
        version, frame = networked[mid]
        assert version == record.version == 2
        for name, tensor in record.params.items():
            assert torch.equal(frame.tensors[name], tensor), (mid, name)
