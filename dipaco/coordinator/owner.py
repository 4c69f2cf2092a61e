"""Running a module owner that is not the scheduler: take modules over, then report.

``take_over`` moves modules from their current owner (the scheduler) to this coordinator:
``HandOver`` returns their state and pending deltas (the old owner holds new deltas for them
meanwhile), the new owner writes them durably, then ``ConfirmOwnership`` moves them for good. A
crash in between leaves the old owner in charge. A restarted owner finds its modules on disk
and skips the hand-over. A request whose reply is lost on the way (a hivemind stream that ends
early, a timeout) is sent again: a HandOver repeats harmlessly, and a ConfirmOwnership the
scheduler had already carried out is recognised by asking it who owns the modules.

``Reporter`` sends the owner's state to the scheduler after every change and every
``interval`` seconds; the scheduler answers with the overdue tasks, which let this owner close
a round with a quorum. A reply signed by a key the owner does not trust (the scheduler rotated
its key) makes it ask for the rotation statements and follow them (``rotation.follow``), or
refuse them (``bad-rotation``, counted) and keep the key it has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from dipaco.coordinator import rotation, tickets
from dipaco.coordinator.core import Coordinator
from dipaco.errors import ConfigError, DipacoError, RejectedError, TransportError, WireError
from dipaco.protocols import messages as m
from dipaco.protocols.linkwatch import LinkWatch
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")

HAND_OVER_PATIENCE = 60.0  # seconds take_over keeps sending a request whose reply was lost


def take_over(
    coordinator: Coordinator,
    scheduler: Transport,
    modules: list[str],
    patience: float = HAND_OVER_PATIENCE,
) -> list[str]:
    """Own ``modules`` (those not already on disk); returns the ones handed over now. A request
    that fails on the way is sent again for up to ``patience`` seconds."""
    unknown = sorted(set(modules) - set(coordinator.topology.module_ids()))
    if unknown:
        raise ConfigError(
            f"--owns names modules this run does not have: {unknown}; "
            f"its modules are {coordinator.topology.module_ids()}"
        )
    wanted = [mid for mid in modules if not coordinator.owns(mid)]
    if not wanted:
        return []
    speak_as_owner(coordinator, scheduler)
    owner, identity = coordinator.owner_id, coordinator.identity
    hand_over = m.HandOver(
        owner_id=owner, proof=tickets.prove(identity, "handover", owner, wanted), modules=wanted
    )
    state = resending(lambda: scheduler.request(hand_over), patience)
    hashes = coordinator.adopt(state)
    confirm = m.ConfirmOwnership(
        owner_id=owner, proof=tickets.prove(identity, "confirm", owner, hashes), hashes=hashes
    )
    try:
        resending(lambda: scheduler.request(confirm), patience)
    except RejectedError as exc:
        # Sent again after a lost reply: the first one may have moved the modules already.
        owners = resending(lambda: scheduler.request(m.GetOwners()), patience).owners
        if exc.reason != Reason.NOT_OWNER or any(owners.get(mid) != owner for mid in wanted):
            raise
    log.info("took over %s", ", ".join(wanted))
    return wanted


def resending(call: Callable[[], T], patience: float) -> T:
    """``call``, made again after a transport error (a reply lost or cut short on the way) for
    up to ``patience`` seconds; a refusal is raised at once."""
    began = time.monotonic()
    while True:
        try:
            return call()
        except TransportError as exc:
            if time.monotonic() - began > patience:
                raise
            log.warning("the scheduler's reply was lost (%s); sending the request again", exc)
            time.sleep(1.0)


def speak_as_owner(coordinator: Coordinator, scheduler: Transport) -> None:
    """Sign what goes to the scheduler with this owner's key, and trust only the scheduler's."""
    if scheduler.identity is not coordinator.identity:
        scheduler.authenticate(coordinator.identity, coordinator.scheduler_key)


class Reporter(threading.Thread):
    """Keeps the scheduler informed of this owner's modules; learns the overdue tasks back."""

    def __init__(
        self,
        coordinator: Coordinator,
        scheduler: Transport,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="dipaco-reporter", daemon=True)
        speak_as_owner(coordinator, scheduler)
        self.coordinator, self.scheduler, self.interval = coordinator, scheduler, interval
        self.stop = threading.Event()
        self.sent = 0
        # While the scheduler is away: a line when it is lost, a few reminders, one when back.
        self.watch = LinkWatch(
            "the scheduler",
            f"keeps serving its modules; reporting again every {interval:g} s",
            logger=log,
            clock=clock,
        )

    def run(self) -> None:
        co = self.coordinator
        while not self.stop.is_set():
            co.changed.wait(self.interval)
            co.changed.clear()
            try:
                ack = self.scheduler.request(co.report())
            except RejectedError as exc:
                self.watch.ok()  # it answered
                log.error("the scheduler refused our report: %s (%s)", exc, exc.reason)
                self.stop.wait(self.interval)
                continue
            except WireError as exc:
                if exc.reason == "untrusted-reply" and self.follow_rotation():
                    co.changed.set()  # report again at once, to the new key
                    continue
                log.warning("the scheduler's reply was refused: %s", exc)
                self.stop.wait(self.interval)
                co.changed.set()
                continue
            except DipacoError as exc:
                self.watch.failed(exc)
                self.stop.wait(self.interval)
                co.changed.set()  # report again as soon as it is back
                continue
            self.watch.ok()
            self.sent += 1
            with co.lock:
                co.book.follow(ack.overdue, ack.ended)  # void tickets: refused here too
                co.gathered = set(ack.gathered)  # the scheduler holds these at their final version
            co.tick()

    def follow_rotation(self) -> bool:
        """The scheduler answered with a key we do not trust: follow its signed rotation."""
        try:
            return rotation.follow(self.coordinator, self.scheduler)
        except DipacoError as exc:
            log.warning("cannot ask the scheduler for its key rotations: %s", exc)
            return False

    def close(self) -> None:
        self.stop.set()
        self.coordinator.changed.set()
        self.join(10)
