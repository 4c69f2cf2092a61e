"""The peer's links: patient requests to the scheduler, lease heartbeats, and module owners.

With several module owners, the peer fetches each module from its owner and pushes each
module's delta to its owner. The scheduler's own modules use the peer's main transport; another
owner is dialled through ``connect`` at the addresses the scheduler gives, and authenticated
against the key the scheduler vouches for. A request to an owner is retried while the owner is
unreachable or busy handing modules over (an owner that restarts elsewhere is found again by
asking the scheduler where it is now), for up to ``give_up_seconds``; a run that finished
meanwhile ends the retries (``RunOver``). Tasks are claimed from the scheduler
(``claim_tasks``), and their leases kept alive by heartbeats from a thread of their own
(``heartbeating``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dipaco.errors import DipacoError, RejectedError, TransportError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)

Connect = Callable[[str, list[str]], Transport]
# An owner is busy handing modules over, or its disk is full for now: try again shortly.
RETRIABLE = {Reason.HANDOVER, Reason.DISK_FULL}
# A leased task, its progress ("step", sent with each heartbeat) and the event set once the
# scheduler no longer knows the lease as this peer's.
Lease = tuple[m.TaskOffer, dict, threading.Event]


class RunOver(Exception):
    """The run finished while this peer could not reach its coordinators: stop retrying."""


RETRY_SECONDS = 2.0  # a peer's default wait before it asks again (Patience.retry_seconds)


@dataclass
class Patience:
    """How long the peer retries a request, and the events that end its retries early."""

    peer_id: str
    give_up_seconds: float
    retry_seconds: float
    stop: threading.Event
    run_over: threading.Event

    def call(self, call: Callable[[], Any], reasons: tuple[str, ...] = ()) -> Any:
        """Retry ``call`` over transport errors, and refusals for one of ``reasons``, for up to
        ``give_up_seconds``."""
        began = time.monotonic()
        while True:
            try:
                return call()
            except (TransportError, RejectedError) as exc:
                if isinstance(exc, RejectedError) and exc.reason not in reasons:
                    raise
                if self.run_over.is_set():
                    raise RunOver() from None
                if time.monotonic() - began > self.give_up_seconds or self.stop.is_set():
                    raise
                # A refusal we expected (the scheduler has not heard another owner's ack yet)
                # is routine; a transport error is worth a warning.
                level = logging.INFO if isinstance(exc, RejectedError) else logging.WARNING
                log.log(level, "peer %s: %s; retrying", self.peer_id, exc)
                self.stop.wait(self.retry_seconds)

    def claim_failed(self, reply: DipacoError, last_contact: float) -> bool:
        """After a claim that failed (``reply``): True when the run has finished; else wait to
        claim again, or raise ``reply`` once nothing was heard for ``give_up_seconds``."""
        if isinstance(reply, TransportError):
            if self.run_over.is_set():
                log.info("peer %s: the run has finished", self.peer_id)
                return True
            # The coordinator may be restarting: it keeps everything it acknowledged.
            if time.monotonic() - last_contact > self.give_up_seconds:
                raise reply
            log.warning("peer %s: %s; retrying", self.peer_id, reply)
        else:  # rate-limited, or over the key's task quota
            log.warning("peer %s: %s; waiting", self.peer_id, reply)
        self.stop.wait(self.retry_seconds)
        return False


class OwnerLinks:
    """Where each module's owner is, and one authenticated link to each owner."""

    def __init__(
        self,
        transport: Transport,
        identity: auth.Identity,
        patience: Patience,
        connect: Connect | None = None,
    ) -> None:
        self.transport = transport  # the scheduler's: its own modules are served over it
        self.identity = identity
        self.patience = patience
        self.connect = connect
        self.scheduler_id = ""
        # The scheduler's protocol number (messages.PROTOCOL; 1 if its Welcome told none): what
        # this peer may send it.
        self.scheduler_protocol = m.PROTOCOL
        self.owners: dict[str, str] = {}  # module id -> owner id
        self.addresses: dict[str, list[str]] = {}
        self.keys: dict[str, str] = {}  # owner id -> the key the scheduler vouches for
        self._links: dict[str, Transport] = {}
        # A push behind (behind.py) asks owners from its own thread while the peer fetches.
        self._lock = threading.RLock()

    def welcomed(self, welcome: m.Welcome) -> None:
        """What the scheduler's Welcome tells of it: its owner id, and its protocol number."""
        self.scheduler_id = welcome.config.get("owner_id", "")
        self.scheduler_protocol = welcome.protocol or 1

    def link(self, owner: str) -> Transport:
        """The transport to a module owner; the scheduler's own modules use the main one."""
        if owner == self.scheduler_id or self.connect is None:
            return self.transport
        with self._lock:
            if owner not in self._links:
                if owner not in self.addresses or owner not in self.keys:
                    self.refresh()  # where it is, and the key the scheduler vouches for
                link = self.connect(owner, self.addresses.get(owner, []))
                self._links[owner] = link.authenticate(self.identity, self.keys.get(owner))
            return self._links[owner]

    def refresh(self) -> None:
        """Ask the scheduler who owns what, where, under which key; drop links to ex-owners."""
        reply = self.patience.call(lambda: self.transport.request(m.GetOwners()))
        with self._lock:
            self.owners.update(reply.owners)
            self.addresses.update(reply.addresses)
            self.keys.update(reply.keys)
            for owner in list(self._links):
                if owner not in set(reply.owners.values()):
                    self._links.pop(owner).close()

    def by_owner(self, mids: list[str]) -> dict[str, list[str]]:
        """The modules grouped by owner (the scheduler's for a module of no known owner)."""
        groups: dict[str, list[str]] = {}
        for mid in mids:
            groups.setdefault(self.owners.get(mid, self.scheduler_id), []).append(mid)
        return groups

    def ask(self, owner: str, make: Callable[[], m.Message]) -> m.Message:
        """One request to one owner, retried while the owner is unreachable or handing over."""
        patience = self.patience
        began = time.monotonic()
        while True:
            try:
                return self.link(owner).request(make())
            except TransportError as exc:
                problem: DipacoError = exc
                # The owner may have restarted elsewhere: ask the scheduler where it is now.
                with self._lock:
                    link = self._links.pop(owner, None)
                if link is not None:
                    link.close()
                    try:
                        self.refresh()
                    except DipacoError as again:
                        log.warning("peer %s: cannot refresh owners: %s", patience.peer_id, again)
            except RejectedError as exc:
                if exc.reason not in RETRIABLE:
                    raise
                problem = exc
            if patience.run_over.is_set():
                raise RunOver() from None
            if time.monotonic() - began > patience.give_up_seconds or patience.stop.is_set():
                raise problem  # a stopping peer does not retry: Ctrl-C ends it within seconds
            log.warning("peer %s: owner %s: %s; retrying", patience.peer_id, owner, problem)
            patience.stop.wait(patience.retry_seconds)

    def close(self) -> None:
        """Close the links to other owners (the scheduler's transport stays open)."""
        with self._lock:
            for link in self._links.values():
                link.close()


CLAIM_WAIT = 2.0  # seconds a claim may wait at the scheduler for a path (ClaimTask.wait)


def claim_tasks(
    transport: Transport,
    peer_id: str,
    want: int,
    prefer_path: int | None,
    holding: list[str] | None = None,
) -> tuple[list[m.TaskOffer], m.Message | DipacoError | None]:
    """Claim up to ``want`` tasks, naming those claimed already and ``holding`` (a task still
    being pushed), so that the scheduler leases another path for each (``prefer_path``: the
    path to prefer, if any).

    Returns the offers and the reply that ended the claiming: a ``NoTask``, the transport error
    or rejection it met, or None when ``want`` tasks came.
    """
    offers: list[m.TaskOffer] = []
    while len(offers) < want:
        try:
            reply = transport.request(
                m.ClaimTask(
                    peer_id=peer_id,
                    prefer_path=prefer_path,
                    holding=[*(holding or []), *(offer.task_id for offer in offers)],
                    # the first claim waits up to 2 s for a path to open (a long poll)
                    wait=0.0 if offers else CLAIM_WAIT,
                )
            )
        except (TransportError, RejectedError) as exc:
            if offers:
                log.info("peer %s: claimed %d tasks (%s)", peer_id, len(offers), exc)
            return offers, exc
        if not isinstance(reply, m.TaskOffer):
            return offers, reply
        offers.append(reply)
    return offers, None


@contextmanager
def heartbeating(
    transport: Transport, peer_id: str, leases: list[Lease], every: float
) -> Iterator[None]:
    """Heartbeat the leases every ``every`` seconds from one thread while the block runs."""
    done = threading.Event()
    beats = threading.Thread(
        target=_heartbeats,
        args=(transport, peer_id, leases, every, done),
        name=f"{peer_id}-heartbeat",
        daemon=True,
    )
    beats.start()
    try:
        yield
    finally:
        done.set()
        beats.join()


def _heartbeats(
    transport: Transport, peer_id: str, leases: list[Lease], every: float, done: threading.Event
) -> None:
    """Keep the leases alive from a thread of its own, however long a step or a push takes.

    A lease the scheduler no longer knows as ours has its ``lost`` event set and is no longer
    renewed."""
    live = list(leases)
    while live and not done.wait(every):
        for lease in list(live):
            task, progress, lost = lease
            try:
                ack = transport.request(
                    m.Heartbeat(peer_id=peer_id, task_id=task.task_id, step=progress["step"])
                )
            except DipacoError as exc:
                log.warning("peer %s: heartbeat failed: %s", peer_id, exc)
                continue
            if not ack.lease_ok:
                lost.set()
                live.remove(lease)
