"""While a link is down, a process says so in a few lines, not one per failed attempt.

A five-minute coordinator outage, one failed attempt a second on a fake clock, driven through
the code that meets it for real: a peer's heartbeat thread, a module owner's reporter, and a
peer's retries that end. What a user sees without ``-v`` is the CLI's log handler's output: one
line when the link is lost, reminders at 30, 60, 120 and 240 s, one when it is back; each line
one line, without hivemind's raw text (which ``-v`` shows, on one line too).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from dipaco.cli.common import OneLineFormatter
from dipaco.coordinator.owner import Reporter
from dipaco.coordinator.round_book import RoundBook
from dipaco.errors import TransportError
from dipaco.net.joins import dial_loopback
from dipaco.peer.links import Patience, heartbeating
from dipaco.protocols import messages as m
from dipaco.protocols.linkwatch import NOTICE, GaveUp

PEER = "QmPLv6xD9qEbZgKjnjwbsrLSNTX159iJohuZ1spCheYD1r"
ADDRESS = f"/ip4/127.0.0.1/tcp/31377/p2p/{PEER}"
# What the hivemind transport raised while the coordinator was down (its daemon's text, with a
# continuation line), as a peer logged it 909 times in 5 minutes.
RAW = (
    f"cannot reach {PEER}: ControlFailure: Connect failed. msg=failed to dial: failed to dial "
    f"{PEER}: all dials failed\n  * [/ip4/127.0.0.1/tcp/31377] dial backoff"
)
OUTAGE = 300  # seconds


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DownFor:
    """A coordinator that does not answer for ``seconds`` of the fake clock, asked once a
    second, then answers every heartbeat and report."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds
        self.identity = None
        self.answered = threading.Event()
        self.requests = self.answers = 0

    def request(self, msg: m.Message) -> m.Message:
        if self.requests:
            self.clock.now += 1.0
        self.requests += 1
        if self.clock.now < self.seconds:
            raise TransportError(RAW)
        self.answers += 1
        if self.answers >= 3:
            self.answered.set()
        if isinstance(msg, m.Heartbeat):
            return m.HeartbeatAck(lease_ok=True, deadline_in=10.0)
        return m.ReportAck(overdue=[], ended={}, gathered=[])


@contextmanager
def shown(verbose: bool = False) -> Iterator[io.StringIO]:
    """What the CLI's log handler prints (dipaco/cli/common.py) while the block runs."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO if verbose else NOTICE)
    logger = logging.getLogger("dipaco")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def heartbeat_outage(verbose: bool = False) -> list[str]:
    clock = FakeClock()
    patience = Patience("alice", 300.0, 2.0, threading.Event(), threading.Event(), ADDRESS, clock)
    coordinator = DownFor(clock, OUTAGE)
    task = m.TaskOffer(
        task_id="P1-r0-e0-a0", path=1, round=0, module_versions={}, inner_steps=30,
        step_offset=0, total_steps=30, lease_seconds=300.0, seed=0, ticket="t",
    )  # fmt: skip
    lease = (task, {"step": 0}, threading.Event())
    with shown(verbose) as out:
        with heartbeating(coordinator, "alice", [lease], 0.001, patience.watch):
            assert coordinator.answered.wait(60), "the heartbeats did not get through"
    return out.getvalue().splitlines()


def test_a_five_minute_outage_is_a_handful_of_one_line_heartbeat_warnings():
    lines = heartbeat_outage()

    assert len(lines) == 6, lines  # lost, still unreachable at 30, 60, 120 and 240 s, back
    lost, *reminders, back = lines
    assert lost.startswith("WARN") and "peer alice: lost the coordinator at " in lost
    assert "(dial failed); keeps working on P1-r0-e0-a0, heartbeating every 0.001 s" in lost
    assert [r.split("after ")[1].split(" (")[0] for r in reminders] == [
        "30 s", "60 s", "2 min", "4 min"
    ]  # fmt: skip
    assert "241 failed attempts; dial failed" in reminders[-1]
    assert back.startswith("NOTICE") and "the coordinator is back after 5 min (300 failed" in back
    for line in lines:
        assert "ControlFailure" not in line and "/ip4/" not in line, line


def test_under_v_the_raw_error_is_shown_on_one_line():
    lines = heartbeat_outage(verbose=True)

    raw = [line for line in lines if "ControlFailure" in line]
    assert len(raw) == 5  # with the lost line and each reminder
    assert all("all dials failed * [/ip4/127.0.0.1/tcp/31377] dial backoff" in r for r in raw)
    assert not any(line.startswith("  ") for line in lines)


def test_the_owner_tells_a_scheduler_outage_in_a_handful_of_lines():
    clock = FakeClock()
    scheduler = DownFor(clock, OUTAGE)

    class Owner:  # what the reporter reads and writes of its coordinator
        identity = None
        changed, lock = threading.Event(), threading.Lock()
        book = RoundBook()

        def report(self) -> m.Message:
            return m.Ok()

        def tick(self) -> None:
            pass

    reporter = Reporter(Owner(), scheduler, interval=0.001, clock=clock)
    with shown() as out:
        reporter.start()
        try:
            assert scheduler.answered.wait(60), "the reports did not get through"
        finally:
            reporter.close()
    lines = out.getvalue().splitlines()

    assert len(lines) == 6, lines
    assert "lost the scheduler at" in lines[0] and "keeps serving its modules" in lines[0]
    assert "the scheduler is back after 5 min" in lines[-1]
    assert not any("ControlFailure" in line for line in lines)


def test_a_peer_that_gives_up_says_what_it_tried_and_how_to_check():
    clock = FakeClock()
    patience = Patience("alice", 300.0, 0.0, threading.Event(), threading.Event(), ADDRESS, clock)
    with shown() as out, pytest.raises(GaveUp) as gave_up:
        while True:  # a claim every 2 s, none answered since the peer's last contact at 0 s
            clock.now += 2.0
            patience.claim_failed(TransportError(RAW), last_contact=0.0)

    said = str(gave_up.value)
    assert said == (
        "gave up reaching the coordinator after 151 attempts over 5 min (last error: dial "
        f"failed). Check the address with: dipaco-peer doctor {ADDRESS}"
    )
    assert gave_up.value.reason == "transport"
    assert len(out.getvalue().splitlines()) == 5  # lost, and four reminders


def test_a_join_to_a_dead_address_says_so_once_then_what_it_tried():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    said: list[str] = []

    with pytest.raises(GaveUp) as gave_up:
        dial_loopback(address, b"k" * 32, patience=2.5, on_wait=said.append)

    assert len(said) == 1, said
    assert said[0].startswith(f"cannot reach the run at {address} yet (connection refused)")
    assert "retrying every 1 s for up to 2 s" in said[0]
    assert str(gave_up.value).startswith(f"gave up reaching the run at {address} after ")
    assert str(gave_up.value).endswith(f"Check the address with: dipaco-peer doctor {address}")


def test_a_record_with_continuation_lines_is_logged_on_one_line():
    record = logging.LogRecord("dipaco.x", logging.WARNING, "", 0, "failed: %s", (RAW,), None)

    text = OneLineFormatter("%(levelname)s %(message)s").format(record)

    assert "\n" not in text
    assert text.endswith("all dials failed * [/ip4/127.0.0.1/tcp/31377] dial backoff")
