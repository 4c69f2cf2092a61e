"""What a peer prints while its coordinator is down, with real processes on 127.0.0.1.

A hivemind coordinator is SIGKILLed (with its p2pd) while a peer trains, and started again on
the same address a few seconds later. The peer, run as a volunteer runs it (no ``-v``, plain
lines), says once that it lost the coordinator and once that it is back, each on one line,
without the daemon's raw text (``ControlFailure: ... dial backoff`` and its continuation line),
where it used to print two lines for every failed heartbeat.
"""

from __future__ import annotations

import re
import time

import pytest
from test_hivemind_run import BIN, Proc, config_file, start_coordinator, told

pytestmark = pytest.mark.slow
OUTAGE = 8.0  # seconds the coordinator is away: 16 failed heartbeats at 0.5 s


def test_a_peer_says_once_that_the_coordinator_is_lost_and_once_that_it_is_back(run_copy, tmp_path):
    root, config = run_copy("run"), config_file(tmp_path)
    # Port 0: the system picks one no other process can take meanwhile; the restart listens on
    # the port it was given (the same address the peer dials).
    coordinator, address = start_coordinator(root, config, False, "--listen", "127.0.0.1:0")
    listen = ("--listen", "127.0.0.1:" + re.search(r"/tcp/(\d+)/", address).group(1))
    peer = Proc(BIN / "dipaco-peer", "--log-format", "plain", "join", address,
                "--peer-id", "alice", "--state-dir", tmp_path / "alice", name="alice")  # fmt: skip
    again = None
    try:
        peer.until("training path", 120, coordinator)
        coordinator.kill_group()  # SIGKILL, its p2pd with it
        time.sleep(OUTAGE)
        again, _ = start_coordinator(root, config, False, *listen)
        peer.until("is back", 120, again)
    finally:
        for proc in (peer, coordinator, again):
            if proc is not None:
                proc.kill_group()

    lines = peer.output.splitlines()
    # (not the clock line at Hello, "... from the coordinator's (measured at Hello)")
    outage = [line for line in lines if "the coordinator " in line and "clock:" not in line]
    lost = [line for line in outage if "lost the coordinator" in line]
    back = [line for line in outage if "is back after" in line]
    assert len(lost) == 1 and len(back) == 1, peer.output
    assert "keeps working on" in lost[0] or "retrying every" in lost[0], lost[0]
    assert len(outage) <= 3, peer.output  # lost, perhaps a reminder (at 30 s), back
    assert not any("ControlFailure" in line or "dial backoff" in line for line in lines)
    stamped = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ")
    assert all(stamped.match(line) for line in lines if line.strip()), told(peer)()
