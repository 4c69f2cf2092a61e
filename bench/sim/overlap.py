"""A simulated peer's transfers that run beside its training (bench/sim/peers.py): a task's
deltas and TaskDone sent (inline, or behind the next task as ``--push-behind`` does) and the
next task claimed and fetched ahead (``--fetch-ahead``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dipaco.peer.links import RETRY_SECONDS
from dipaco.peer.push import REPORT_WAIT
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from sim import costs
from sim.events import transfer

if TYPE_CHECKING:
    from sim.peers import Peer

AHEAD_FIRST_LEAD = 1.0  # as peer/ahead.py: before a fetch ahead has been timed


def keep_lease(
    peer: Peer, task_id: str, live: Callable[[], bool], lost: Callable[[], object]
) -> None:
    """Heartbeat ``task_id``'s lease every period while ``live()``; ``lost()`` when the
    scheduler says the lease is gone (a task sent behind, or fetched ahead)."""
    s = peer.swarm.settings

    def beat() -> None:
        if not live():
            return

        def ack(r: Any) -> None:
            if isinstance(r, m.HeartbeatAck) and not r.lease_ok:
                lost()

        msg = m.Heartbeat(peer_id=peer.name, task_id=task_id, step=0)
        every = s.heartbeat_seconds / s.real_heartbeat_seconds
        peer.send(peer.scheduler, msg, ack, times=every, live=live)
        peer.loop.after(s.heartbeat_seconds, beat)

    peer.loop.after(s.heartbeat_seconds, beat)


class Send:
    """One task's deltas pushed to its owners, then its TaskDone (held at the scheduler until
    the owners' reports bring every acknowledgement, as the real scheduler holds it). Inline
    (``behind=False``) the peer waits for it ("push", then "done") and its task ends with it;
    behind, the peer claims and trains its next task meanwhile, and the send heartbeats its
    own lease, as the real peer's push thread does (peer/behind.py)."""

    def __init__(self, peer: Peer, behind: bool) -> None:
        self.peer, self.behind = peer, behind
        self.offer, self.trained, self.groups = peer.offer, peer.trained, peer.by_owner()
        self.began = peer.loop.now
        self.token = peer.token
        self.parked: object | None = None
        self.over = False
        self.then: Callable[[], None] | None = None  # the peer's next step once this ends

    def live(self) -> bool:
        peer = self.peer
        if self.behind:
            return not peer.gone and not self.over
        return peer._live(self.token)

    def end(self, reply: Any) -> None:
        if self.live():
            self.over = True
            self.peer.sent(self, reply)

    def start(self) -> None:
        peer, offer = self.peer, self.offer
        sizes = peer.swarm.cluster.sizes
        waiting = set(self.groups)
        tokens = offer.inner_steps * costs.TOKENS_PER_STEP
        over: set[str] = set()  # owners whose modules made all their rounds
        if self.behind:  # the peer's own beats are its next task's
            keep_lease(peer, offer.task_id, self.live, lambda: self.end("lease-lost"))

        def acked(owner: str, reply: Any) -> None:
            if getattr(reply, "reason", None) == Reason.FINISHED:
                # As the real peer (peer/push.py): this owner drops the delta, the path's
                # other modules may still wait for their last round's.
                over.add(owner)
            elif not isinstance(reply, m.DeltaAck):
                self.end(reply)
                return
            waiting.discard(owner)
            if not waiting and over == set(self.groups):
                self.end(reply)  # every module of the path had made all its rounds
            elif not waiting:
                self.trained = 0.0  # acknowledged: not wasted, whatever the TaskDone meets
                if not self.behind:
                    peer.trained = 0.0
                    peer.enter("done")
                self.task_done(
                    m.TaskDone(peer.name, offer.task_id, offer.ticket, tokens, [3.0], [])
                )

        for owner, mids in self.groups.items():
            node = peer.swarm.cluster.by_name[owner]
            tensors = {k: v for mid in mids for k, v in peer.swarm.deltas[mid].items()}
            msg = m.SubmitDelta(
                peer.name,
                offer.task_id,
                offer.path,
                offer.module_versions,
                tokens,
                [3.0],
                tensors,
                ticket=offer.ticket,
                codec="int8",
            )

            def cost(r: Any) -> float:
                if not isinstance(r, m.DeltaAck):
                    return 0.0
                fp32 = sizes.fp32(r.accepted)
                return fp32 / costs.INT8_DECODE_BPS + fp32 / costs.SYNCED_BPS

            def deliver(node=node, msg=msg, owner=owner) -> None:
                peer.send(node, msg, lambda r: acked(owner, r), cost, live=self.live)

            when = transfer(peer.loop, sizes.int8(mids), [peer.up, node.ingress], 0.0)
            peer.loop.at(when, lambda d=deliver: self.live() and d())

    def task_done(self, msg: m.TaskDone, until: float | None = None, held: bool = False) -> None:
        """``until``: when the TaskDone's long poll ends (``TaskDone.wait`` after it reached the
        scheduler); ``held``: the scheduler looks again at one it holds (``park``)."""
        peer = self.peer
        if until is None:
            until = peer.loop.now + peer.profile.latency + REPORT_WAIT
        peer.send(
            peer.scheduler, msg, lambda r: self.done(r, msg, until), held=held, live=self.live
        )

    def done(self, reply: Any, msg: m.TaskDone, until: float = 0.0) -> None:
        if getattr(reply, "reason", None) == Reason.NOT_ACKED:
            if self.peer.loop.now < until:
                self.park(msg, until)
                return
            # the scheduler learns an owner's ack from its next report: the real peer asks
            # again after its retry_seconds, with a new wait (links.Patience)
            self.peer.loop.after(RETRY_SECONDS, lambda: self.live() and self.task_done(msg))
            return
        self.end(reply)

    def park(self, msg: m.TaskDone, until: float) -> None:
        """The long poll of a TaskDone refused for an owner's report not yet in (as the real
        scheduler holds it: ``rounds.await_reports``): the scheduler looks at it again as soon
        as a report lands, or when its wait ends (then a refusal is retried after the peer's
        retry seconds). The message itself asks for no wait: the simulation's one thread must
        never block."""
        ticket = object()
        self.parked = ticket
        stats = self.peer.swarm.stats
        stats.parked += 1

        def again(by_report: bool) -> None:
            if self.parked is ticket and self.live():
                self.parked = None
                stats.unparked_by_report += by_report
                self.task_done(msg, until, held=True)

        self.peer.swarm.cluster.on_report(lambda: again(True))
        self.peer.loop.at(until, lambda: again(False))


class Ahead:
    """The next task, claimed and its modules fetched while the peer trains the last steps of
    the current one (``Settings.fetch_ahead``: the real peer's ``--fetch-ahead``). The claim
    does not wait for a path (no long poll): without an offer, nothing is held, and the peer
    claims as usual after its task. Its lease is heartbeated here until the peer takes it."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.began = peer.loop.now
        self.offer: m.TaskOffer | None = None
        self.fetched = False
        self.over = False
        self.then: Callable[[], None] | None = None  # the peer waiting for the modules

    def live(self) -> bool:
        return not self.peer.gone and not self.over

    def start(self) -> None:
        peer = self.peer
        holding = [peer.offer.task_id]
        if peer.sending is not None:
            holding.append(peer.sending.offer.task_id)
        msg = m.ClaimTask(peer_id=peer.name, prefer_path=None, holding=holding)
        peer.send(peer.scheduler, msg, self.offered, live=self.live)

    def offered(self, reply: Any) -> None:
        peer = self.peer
        if not isinstance(reply, m.TaskOffer):
            self.give_up()
            return
        self.offer = reply
        keep_lease(peer, reply.task_id, self.live, self.give_up)
        peer.fetch(reply, live=self.live, fetched=self.arrived, failed=lambda r: self.give_up())

    def arrived(self) -> None:
        self.fetched = True
        self.peer.lead = 2 * (self.peer.loop.now - self.began)
        if self.then is not None:
            self.then()

    def give_up(self) -> None:
        """No task ahead (none open, or its fetch refused): the peer claims after its task."""
        self.over = True
        if self.peer.ahead is self:
            self.peer.ahead = None
        if self.then is not None:
            self.then()
