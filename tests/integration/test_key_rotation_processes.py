"""Rotating the scheduler's key mid-run, with real processes on 127.0.0.1 (hivemind).

A scheduler, a second module owner (``L1.M0,L1.M1``) and one peer that pinned the scheduler's key
on first use. Mid-run the operator runs ``dipaco-coordinator rotate-key``, stops the scheduler
with Ctrl-C and runs its start command again: it signs with the new key, in a new epoch. Neither
the owner nor the peer is restarted: each follows the signed rotation by itself, tasks go on,
and the run finishes with every module at its final version and every acknowledged delta
applied exactly once. (``tests/unit/test_key_rotation.py`` covers the rest in one process: a
forged rotation refused, the old key's tickets still good.)
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections import Counter

import pytest
from _waiting import alive, helper_pids, wait_for
from test_hivemind_run import (
    BIN,
    Proc,
    config_file,
    final_modules,
    owner_key,
    read_events,
    start_coordinator,
    start_owner,
    start_peer,
    told,
)

pytestmark = pytest.mark.slow


def coordinator_key(proc: Proc) -> str:
    """The key the scheduler's "peers join with" line names (the one it signs with)."""
    keys = re.findall(r"--coordinator-key (ed25519:\S+)", proc.output)
    assert keys, proc.output
    return keys[-1]


def test_owner_and_peer_follow_a_rotated_scheduler_key_without_restarting(
    run_copy, tmp_path, monkeypatch
):
    monkeypatch.setattr(Proc, "log_dir", tmp_path)  # each process's output, to read after a failure
    root, owner_dir, peer_dir = run_copy(), tmp_path / "owner", tmp_path / "peer"
    config = config_file(tmp_path)  # 2 rounds of 4 tasks
    # The same address before and after the restart, as an operator's start command has.
    listen = ("--listen", "127.0.0.1:0")  # the first start: the system picks a free port
    procs: list[Proc] = []
    try:
        key = owner_key(owner_dir)
        scheduler, address = start_coordinator(root, config, False, *listen)
        # the restart listens where the first start did: the address owner and peer dial
        listen = ("--listen", "127.0.0.1:" + re.search(r"/tcp/(\d+)/", address).group(1))
        procs.append(scheduler)
        old_key = coordinator_key(scheduler)
        owner = start_owner(address, root, owner_dir, key())
        procs.append(owner)
        owner.until("took over", 240, scheduler)
        # 0.1 s a step (3 s a task): work is left when the scheduler comes back.
        slowly = {"DIPACO_FAULTS": "peer.inner_step=sleep:0.1"}
        peer = start_peer(address, tmp_path, "peer", env=slowly)  # pins the key on first use
        procs.append(peer)
        metrics = root / "metrics.jsonl"
        wait_for(
            lambda: sum(e["event"] == "delta" for e in read_events(metrics)) >= 2,
            240,
            told(peer, scheduler, owner),
        )
        assert json.loads((peer_dir / "known_coordinators.json").read_text()) == {address: old_key}

        rotated = subprocess.run(
            [BIN / "dipaco-coordinator", "rotate-key", "--run-dir", root],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert rotated.returncode == 0, rotated.stdout + rotated.stderr
        new_key = re.search(r"scheduler key rotated \(1\): (ed25519:\S+)", rotated.stdout)
        assert new_key, rotated.stdout
        new_key = new_key.group(1)
        helpers = helper_pids(scheduler.p.pid)
        scheduler.p.send_signal(signal.SIGINT)  # Ctrl-C: it stops in order, the run not done
        assert scheduler.finish(60) == 130, scheduler.output
        wait_for(lambda: not any(alive(p) for p in helpers), 30, "the scheduler's helpers")
        issued_before = len([e for e in read_events(metrics) if e["event"] == "task_issued"])
        procs.remove(scheduler)
        scheduler, _ = start_coordinator(root, config, False, *listen)  # the same command
        procs.append(scheduler)
        assert coordinator_key(scheduler) == new_key and "epoch 1" in scheduler.output

        # A peer that stops early (a refused reply) fails the test at once, not by a timeout.
        wait_for(
            lambda: scheduler.p.poll() is not None or peer.p.poll() not in (None, 0),
            600,
            told(scheduler, peer, owner),
        )
        assert peer.p.poll() in (None, 0), peer.output
        assert scheduler.finish(60) == 0, scheduler.output
        assert owner.finish(120) == 0, owner.output
        assert peer.finish(120) == 0, peer.output
    finally:
        for proc in procs:
            proc.kill_group()

    # The owner followed without a restart, and keeps the new key (its coordinator.json).
    assert owner.saw(f"the scheduler's key is now {new_key}"), owner.output
    saved = json.loads((owner_dir / "coordinator" / "coordinator.json").read_text())
    assert [s["new"] for s in saved["scheduler_rotations"]] == [new_key]
    assert saved.get("rejections", {}).get("bad-rotation", 0) == 0
    # The peer too: it said so, and its pin moved to the new key.
    assert peer.saw("the coordinator's key moved from"), peer.output
    assert not peer.saw("reply refused"), peer.output
    assert json.loads((peer_dir / "known_coordinators.json").read_text()) == {address: new_key}

    # Tasks went on under the new key: issued in epoch 1, done by the same peer.
    events = read_events(root / "metrics.jsonl")
    issued = [e for e in events if e["event"] == "task_issued"]
    later = [e for e in issued[issued_before:] if "-e1-" in e["task"]]
    assert later and {e["peer"] for e in later} == {"peer"}, issued
    # Every module at the final version; each version made once; every acknowledged delta
    # applied exactly once by its module's outer steps.
    modules = final_modules(root, owner_dir)
    assert sorted(modules) == ["L0.M0", "L0.M1", "L1.M0", "L1.M1", "S.embed", "S.head"]
    assert {v for v, _ in modules.values()} == {2}
    steps = [
        e for e in events + read_events(owner_dir / "metrics.jsonl") if e["event"] == "outer_step"
    ]
    made = [(e["module"], e["version"]) for e in steps]
    assert len(made) == len(set(made)) == 6 * 2, sorted(made)
    applied = Counter((e["module"], task) for e in steps for task in e["tasks"])
    assert set(applied.values()) == {1}, applied
    acks = [json.loads(line) for line in (peer_dir / "acks.jsonl").read_text().splitlines()]
    assert {(a["module"], a["task"]) for a in acks} <= set(applied), (acks, applied)
    assert len({a["task"] for a in acks}) >= 4 * 2
