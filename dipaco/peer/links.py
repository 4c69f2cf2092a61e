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

While the scheduler (or an owner) does not answer, each link's ``LinkWatch`` tells it in a few
lines (lost, still unreachable at growing intervals, back), not a line per failed attempt; the
retries that end give the watch's account of them (what was tried, for how long, and the
``dipaco-peer doctor`` command to check the address with).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dipaco.errors import DipacoError, RejectedError, TransportError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.linkwatch import LinkWatch, one_line, short_id
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)

Connect = Callable[[str, list[str]], Transport]
# An owner is busy handing modules over, or its disk is full for now: try again shortly.
RETRIABLE = {Reason.HANDOVER, Reason.DISK_FULL, Reason.NOT_READY}
# A leased task, its progress ("step", sent with each heartbeat) and the event set once the
# scheduler no longer knows the lease as this peer's.
Lease = tuple[m.TaskOffer, dict, threading.Event]


class RunOver(Exception):
    """The run finished while this peer could not reach its coordinators: stop retrying."""


RETRY_SECONDS = 2.0  # a peer's default wait before it asks again (Patience.retry_seconds)


@dataclass
class Patience:
    """How long the peer retries a request, the events that end its retries early, and the
    watch on its link to the scheduler (``address``: the one it joined, for the advice when the
    retries end)."""

    peer_id: str
    give_up_seconds: float
    retry_seconds: float
    stop: threading.Event
    run_over: threading.Event
    address: str | None = None
    clock: Callable[[], float] = time.monotonic  # a test's fake clock
    watch: LinkWatch = field(init=False)

    def __post_init__(self) -> None:
        self.watch = self.link_watch("the coordinator", self.address)

    def link_watch(self, what: str, address: str | None = None) -> LinkWatch:
        """A watch on one of this peer's links."""
        check = f"Check the address with: dipaco-peer doctor {address}" if address else ""
        who = f"peer {self.peer_id}: "
        return LinkWatch(what, self.retrying(), who=who, check=check, logger=log, clock=self.clock)

    def retrying(self, doing: str = "") -> str:
        """What the peer does while a link is down: ``doing``, and its retries."""
        retries = f"retrying every {self.retry_seconds:g} s for up to {self.give_up_seconds:g} s"
        return f"{doing}; {retries}" if doing else retries

    def call(self, call: Callable[[], Any], reasons: tuple[str, ...] = ()) -> Any:
        """Retry ``call`` over transport errors, and refusals for one of ``reasons``, for up to
        ``give_up_seconds``."""
        began = self.clock()
        while True:
            try:
                reply = call()
            except TransportError as exc:
                self.watch.failed(exc, self.retrying())
                if self.run_over.is_set():
                    raise RunOver() from None
                if self.stop.is_set():
                    raise
                if self.clock() - began > self.give_up_seconds:
                    raise self.watch.gave_up(exc) from None
                self.stop.wait(self.retry_seconds)
                continue
            except RejectedError as exc:
                self.watch.ok()  # it answered
                if exc.reason not in reasons:
                    raise
                if self.run_over.is_set():
                    raise RunOver() from None
                if self.clock() - began > self.give_up_seconds or self.stop.is_set():
                    raise
                # A refusal we expected (the scheduler has not heard another owner's ack yet)
                # is routine.
                log.info("peer %s: %s; retrying", self.peer_id, exc)
                self.stop.wait(self.retry_seconds)
                continue
            self.watch.ok()
            return reply

    def claim_failed(self, reply: DipacoError, last_contact: float) -> bool:
        """After a claim that failed (``reply``): True when the run has finished; else wait to
        claim again, or raise the watch's account of the retries once nothing was heard for
        ``give_up_seconds``."""
        if isinstance(reply, TransportError):
            self.watch.failed(reply, self.retrying("waiting for work"))
            if self.run_over.is_set():
                log.info("peer %s: the run has finished", self.peer_id)
                return True
            # The coordinator may be restarting: it keeps everything it acknowledged.
            if self.clock() - last_contact > self.give_up_seconds:
                raise self.watch.gave_up(reply)
        else:  # rate-limited, or over the key's task quota
            self.watch.ok()
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
        self._watches: dict[str, LinkWatch] = {}  # owner id -> the watch on the link to it
        # A push behind (behind.py) asks owners from its own thread while the peer fetches.
        self._lock = threading.RLock()

    def welcomed(self, welcome: m.Welcome) -> None:
        """What the scheduler's Welcome tells of it: its owner id, and its protocol number."""
        self.scheduler_id = welcome.config.get("owner_id", "")
        self.scheduler_protocol = welcome.protocol or 1
        if self.scheduler_id:
            self.patience.watch.what = f"the coordinator {short_id(self.scheduler_id)}"

    def watch(self, owner: str) -> LinkWatch:
        """The watch on the link to ``owner`` (the scheduler's is the patience's)."""
        if owner == self.scheduler_id or self.connect is None:
            return self.patience.watch
        with self._lock:
            if owner not in self._watches:
                what = f"the module owner {short_id(owner)}"
                self._watches[owner] = self.patience.link_watch(what)
            return self._watches[owner]

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

    def ask(self, owner: str, make: Callable[[], m.Message], doing: str = "") -> m.Message:
        """One request to one owner, retried while the owner is unreachable or handing over
        (``doing``: what the peer does meanwhile, said when the link is lost)."""
        patience, watch = self.patience, self.watch(owner)
        doing = patience.retrying(doing)
        began = patience.clock()
        while True:
            try:
                reply = self.link(owner).request(make())
                watch.ok()
                return reply
            except TransportError as exc:
                problem: DipacoError = exc
                watch.failed(exc, doing)
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
                watch.ok()  # it answered
                if exc.reason not in RETRIABLE:
                    raise
                problem = exc
                log.info("peer %s: owner %s: %s; retrying", patience.peer_id, owner, exc)
            if patience.run_over.is_set():
                raise RunOver() from None
            if patience.stop.is_set():
                raise problem  # a stopping peer does not retry: Ctrl-C ends it within seconds
            if patience.clock() - began > patience.give_up_seconds:
                if isinstance(problem, TransportError):
                    raise watch.gave_up(problem) from None
                raise problem
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
    transport: Transport,
    peer_id: str,
    leases: list[Lease],
    every: float,
    watch: LinkWatch | None = None,
) -> Iterator[None]:
    """Heartbeat the leases every ``every`` seconds from one thread while the block runs;
    ``watch``: the watch on the link to the scheduler, told of each heartbeat's outcome."""
    done = threading.Event()
    watch = watch or LinkWatch("the coordinator", who=f"peer {peer_id}: ", logger=log)
    beats = threading.Thread(
        target=_heartbeats,
        args=(transport, peer_id, leases, every, done, watch),
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
    transport: Transport,
    peer_id: str,
    leases: list[Lease],
    every: float,
    done: threading.Event,
    watch: LinkWatch,
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
            except TransportError as exc:
                # Said when the link is lost; what a push or a claim says later is more telling.
                doing = f"keeps working on {task.task_id}, heartbeating every {every:g} s"
                watch.failed(exc, None if watch.down else doing)
                continue
            except DipacoError as exc:
                log.warning("peer %s: heartbeat failed: %s", peer_id, one_line(exc))
                continue
            watch.ok()
            if not ack.lease_ok:
                lost.set()
                live.remove(lease)
