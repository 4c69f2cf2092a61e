"""The simulated peers: the real protocol's requests, in the order a real peer sends them, as a
state machine on the virtual clock.

A peer says Hello, claims a task (preferring its last path), fetches the path's modules from
their owners (only those whose version it lacks), trains for the offer's steps at its own step
time, heartbeats its lease meanwhile, pushes each owner its modules' int8 delta, and sends
TaskDone to the scheduler once every owner acknowledged (held there, as the real scheduler
holds it, until an owner's report brings a missing acknowledgement); then it claims again.
Refused or idle (``NoTask``), it retries after the reply's ``retry_after`` and a long poll.
With probability ``churn`` it leaves during a task, silently (its lease expires and the task is
re-issued), and a new peer arrives after an exponential delay.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dipaco.coordinator import polls, rounds
from dipaco.protocols import auth, codecs
from dipaco.protocols import messages as m
from sim import costs
from sim.cluster import Cluster, Node
from sim.events import Loop, Pipe, transfer
from sim.overlap import AHEAD_FIRST_LEAD, Ahead, Send


def moved_past(offer: m.TaskOffer, versions: dict[str, int]) -> bool:
    """Whether a fetch's ``versions`` leave the task untrainable, by the real peer's rule
    (peer/modules.fetch_modules): a module at another version than the task's base, unless a
    newer one no later than the task's round (the peer then trains from it, its new base)."""
    moved = False
    for mid, version in versions.items():
        if mid not in offer.module_versions:
            continue
        base = m.trains_from(offer.module_versions[mid], offer.round, version)
        if base is None:
            moved = True
        else:
            offer.module_versions[mid] = base
    return moved


@dataclass
class PeerStats:
    arrived: int = 0
    left: int = 0  # churned away mid-task
    tasks: int = 0  # offers taken
    finished: int = 0  # tasks whose every delta was acknowledged
    polls: int = 0  # NoTask replies
    parked: int = 0  # TaskDones held for an owner's report (Peer.park)
    unparked_by_report: int = 0  # ... looked at again as a report landed (not at the wait's end)
    refused: Counter[str] = field(default_factory=Counter)
    busy: float = 0.0  # peer-seconds holding a task
    compute: float = 0.0  # peer-seconds training
    alive: float = 0.0  # peer-seconds present
    kinds: Counter[str] = field(default_factory=Counter)
    # peer-seconds per (peer class, state): where each class's time goes (STATES)
    time: dict[tuple[str, str], float] = field(default_factory=dict)
    # the same as spans (class, state, start, end), so that a window of the run can be read
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    # training whose delta was never acknowledged (a task refused, lost or copied by a hedge)
    wasted: Counter[str] = field(default_factory=Counter)
    wasted_at: list[tuple[str, float, float]] = field(default_factory=list)  # (class, when, s)

    def waste(self, kind: str, seconds: float, now: float) -> None:
        """Training of a peer of ``kind`` whose delta will never be acknowledged."""
        if seconds:
            self.wasted[kind] += seconds
            self.wasted_at.append((kind, now, seconds))

    def wasted_in(self, kind: str | None, window: tuple[float, float]) -> float:
        """The training wasted by peers of ``kind`` (all if None) found wasted in ``window``."""
        lo, hi = window
        return sum(x for k, t, x in self.wasted_at if kind in (None, k) and lo <= t < hi)

    def share(
        self, kind: str | None = None, window: tuple[float, float] | None = None
    ) -> dict[str, float]:
        """Each state's share of the present time of the peers of ``kind`` (all if None), over
        the run or the part of it in ``window`` (virtual seconds from, to)."""
        spent = self.spent(kind, window)
        total = sum(spent.values())
        return {s: spent[s] / total for s in STATES} if total else {}

    def spent(
        self, kind: str | None = None, window: tuple[float, float] | None = None
    ) -> Counter[str]:
        """Peer-seconds per state of the peers of ``kind`` (all if None), as :meth:`share`."""
        spent: Counter[str] = Counter()
        if window is None:
            for (k, state), t in self.time.items():
                if kind is None or k == kind:
                    spent[state] += t
        else:
            lo, hi = window
            for k, state, start, end in self.spans:
                if (kind is None or k == kind) and end > lo and start < hi:
                    spent[state] += min(end, hi) - max(start, lo)
        return spent


# Where a present peer's time goes. "hello": saying hello; "claim": a claim's round trip;
# then, answered NoTask, "last tasks": paths of the round are still open but all leased (the
# round waits for its last deltas), or "round closing": no path is open (the modules' steps
# and the owners' reports that open the next round); "fetch": from the offer to the last
# module in; "train": the task's steps; "push": its deltas' upload and acknowledgement;
# "done": the TaskDone (held until the owners' reports land).
STATES = ("hello", "claim", "last tasks", "round closing", "fetch", "train", "push", "done")


class Swarm:
    """Every peer of the run, and what they share: the loop, the cluster, the random draws."""

    def __init__(self, loop: Loop, cluster: Cluster, settings: costs.Settings) -> None:
        self.loop, self.cluster, self.settings = loop, cluster, settings
        self.rng = random.Random(settings.seed)
        self.stats = PeerStats()
        self.count = 0
        self.live: set[Peer] = set()
        gen = torch.Generator().manual_seed(settings.seed)
        self.deltas = {}  # module -> its int8 wire tensors (the same small delta for everyone)
        for mid in cluster.topology.module_ids():
            like = cluster.initial[mid]
            raw = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in like.items()}
            self.deltas[mid] = {f"{mid}/{k}": v for k, v in codecs.encode("int8", raw).items()}

    def spawn(self) -> None:
        Peer(self, self.count, costs.draw_peer(self.rng, self.settings.peer_kinds)).arrive()
        self.count += 1

    def finish(self) -> None:
        """Close the books at the end of the run."""
        for peer in list(self.live):
            peer.close()


class Peer:
    def __init__(self, swarm: Swarm, index: int, profile: costs.PeerProfile) -> None:
        self.swarm, self.profile = swarm, profile
        self.loop = swarm.loop
        self.name = f"peer{index:05d}"
        self.identity = auth.Identity.generate()
        self.down = Pipe(self.loop, f"{self.name} down", profile.down_bps)
        self.up = Pipe(self.loop, f"{self.name} up", profile.up_bps)
        self.token = 0  # bumped when a task ends or the peer leaves: stale callbacks stop
        self.gone = False
        self.have: dict[str, int] = {}
        self.last_path: int | None = None
        self.since = 0.0
        self.task_start: float | None = None
        self.waiting: object | None = None  # the claim waiting for a change of work (idle)
        self.woken = False  # the claim in flight was woken by a change of work
        self.served = 0  # the serving node's polls.generation when it served the last reply
        self.state, self.state_since = "hello", 0.0
        self.trained = 0.0  # seconds trained in the task at hand (wasted if it ends unacked)
        self.sending: Send | None = None  # the task being sent behind (push_behind)
        self.ahead: Ahead | None = None  # the next task, claimed and fetched ahead (fetch_ahead)
        self.lead = AHEAD_FIRST_LEAD  # seconds before a task's end to fetch the next

    def enter(self, state: str) -> None:
        """Book the time since the last change of state to that state, and move on."""
        key = (self.profile.kind, self.state)
        times = self.swarm.stats.time
        times[key] = times.get(key, 0.0) + self.loop.now - self.state_since
        if self.loop.now > self.state_since:
            self.swarm.stats.spans.append((*key, self.state_since, self.loop.now))
        self.state, self.state_since = state, self.loop.now

    # ---- plumbing ------------------------------------------------------------------------------
    def send(
        self,
        node: Node,
        msg: m.Message,
        then: Callable[[Any], None],
        extra: Callable[[Any], float] = lambda r: 0.0,
        times: float = 1.0,
        held: bool = False,
        live: Callable[[], bool] | None = None,
    ) -> None:
        """``msg`` to ``node`` over this peer's latency; ``then(reply)`` when the reply is back,
        unless the task it was sent for is over by then (``live``: another test of that, for a
        task sent behind). ``held``: the request is at the node already (a long poll it held,
        looked at again), so only the reply travels."""
        token, lat = self.token, self.profile.latency
        if live is None:
            live = lambda: self._live(token)  # noqa: E731

        def reply(r: Any) -> None:  # called as the node serves the request
            served = node.core.polls.generation

            def back() -> None:
                if live():
                    self.served = served
                    then(r)

            self.loop.after(lat, back)

        self.loop.after(0.0 if held else lat, node.request, self.identity, msg, extra, reply, times)

    def _live(self, token: int) -> bool:
        return not self.gone and token == self.token

    @property
    def scheduler(self) -> Node:
        return self.swarm.cluster.scheduler

    # ---- the protocol --------------------------------------------------------------------------
    def arrive(self) -> None:
        self.swarm.live.add(self)
        self.since = self.state_since = self.loop.now
        self.swarm.stats.arrived += 1
        self.swarm.stats.kinds[self.profile.kind] += 1
        self.send(self.scheduler, m.Hello(peer_id=self.name, device="cuda"), lambda r: self.claim())

    def claim(self, times: float = 1.0, held: bool = False) -> None:
        holding = [self.sending.offer.task_id] if self.sending is not None else []
        msg = m.ClaimTask(peer_id=self.name, prefer_path=self.last_path, holding=holding)
        self.send(self.scheduler, msg, self.offered, times=times, held=held)

    def offered(self, reply: Any) -> None:
        st = self.swarm.stats
        woken, self.woken = self.woken, False
        if isinstance(reply, m.TaskOffer):
            if woken:  # the long poll that leased a path wakes the next (LongPolls.wake_next)
                self.swarm.cluster.wake_one()
            st.tasks += 1
            self.task_start = self.loop.now
            self.offer = reply
            self.last_path = reply.path
            self.enter("fetch")
            self.loop.after(self.swarm.settings.heartbeat_seconds, self.beat, self.token)
            self.fetch()
            return
        if isinstance(reply, m.NoTask):
            if reply.finished:
                self.close()
                return
            st.polls += 1
            self.idle(reply.retry_after)
            return
        self.enter("claim")
        st.refused[getattr(reply, "reason", "error")] += 1
        self.loop.after(1.0, lambda token=self.token: self._live(token) and self.claim())

    def idle(self, retry_after: float) -> None:
        """No path for this peer now. A real one claims again after ``retry_after`` with a long
        poll (``ClaimTask.wait``) that the scheduler answers as soon as a change of its work
        opens a path: here the peer waits in the cluster's queue of claims and is woken, in
        turn, by such a change (``Cluster.work_changed``), or claims again after ``retry_after``
        and a long poll, as a real one does (or after ``poll_seconds``, if longer). Its claims
        meanwhile are charged as the ones a real peer sends, one per ``retry_after`` and long
        poll."""
        if self.scheduler.core.polls.generation != self.served:
            # its work changed while the NoTask travelled: the long poll would have seen it
            self.enter("claim")
            self.claim()
            return
        self.enter("last tasks" if rounds.open_paths(self.scheduler.core) else "round closing")
        ticket = object()
        self.waiting = ticket
        token, since = self.token, self.loop.now
        # a real idle peer claims once per NoTask's wait and long poll
        every = retry_after + polls.LONG_POLL_SECONDS

        def again(woken: bool) -> bool:
            if self.waiting is not ticket or not self._live(token):
                return False  # claimed already (or gone): the next waiting claim looks
            self.waiting = None
            self.woken = woken
            self.enter("claim")
            self.claim(max(1.0, (self.loop.now - since) / every), held=woken)
            return True

        self.swarm.cluster.on_work(lambda: again(True))
        self.loop.after(max(self.swarm.settings.poll_seconds, every), again, False)

    def by_owner(self, offer: m.TaskOffer | None = None) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for mid, owner in (offer or self.offer).owners.items():
            out.setdefault(owner, []).append(mid)
        return out

    def fetch(
        self,
        offer: m.TaskOffer | None = None,
        live: Callable[[], bool] | None = None,
        fetched: Callable[[], None] | None = None,
        failed: Callable[[Any], None] | None = None,
    ) -> None:
        """The offer's modules from their owners (those whose version this peer lacks), then
        ``fetched()`` (by default: train the task at hand; ``failed(reply)``: abandon it)."""
        offer = offer or self.offer
        fetched, failed = fetched or self.train, failed or self.abandon
        sizes = self.swarm.cluster.sizes
        groups = self.by_owner(offer)
        waiting = set(groups)
        token = self.token
        if live is None:
            live = lambda: self._live(token)  # noqa: E731

        def got(owner: str, reply: Any) -> None:
            if not isinstance(reply, m.Modules):
                failed(reply)
                return
            moved = moved_past(offer, reply.versions)
            if not moved:
                self.have.update(reply.versions)
            sent = sorted({k.partition("/")[0] for k in reply.tensors})
            node = self.swarm.cluster.by_name[owner]
            when = transfer(self.loop, sizes.fp32(sent), [node.egress, self.down], 0.0)

            def arrived() -> None:
                if moved:
                    # what the real peer does once the reply is in (peer/modules.fetch_modules
                    # raises TaskAborted): a module moved past the task's base cannot be
                    # trained from; the task is handed back
                    release = m.ReleaseTask(peer_id=self.name, task_id=offer.task_id)
                    self.send(self.scheduler, release, lambda r: None, live=lambda: True)
                    failed("moved")
                    return
                waiting.discard(owner)
                if not waiting:
                    fetched()

            self.loop.at(when, lambda: live() and arrived())

        for owner, mids in groups.items():
            node = self.swarm.cluster.by_name[owner]
            have = {mid: v for mid, v in self.have.items() if mid in mids}
            msg = m.FetchModules(self.name, offer.task_id, have, offer.ticket)

            def encode(r: Any) -> float:
                if not isinstance(r, m.Modules):
                    return 0.0
                sent = {k.partition("/")[0] for k in r.tensors}
                return sizes.fp32(sorted(sent)) / costs.LOSSLESS_ENCODE_BPS

            self.send(node, msg, lambda r, owner=owner: got(owner, r), encode, live=live)

    def train(self) -> None:
        seconds = self.offer.inner_steps * self.profile.step_seconds
        st, s = self.swarm.stats, self.swarm.settings
        self.enter("train")
        if self.swarm.rng.random() < s.churn:
            at = self.swarm.rng.random() * seconds
            st.compute += at
            self.trained = at
            self.loop.after(at, self.leave, self.token)
            return
        st.compute += seconds
        self.trained = seconds
        token = self.token
        self.loop.after(seconds, lambda: self._live(token) and self.trained_all())
        if s.fetch_ahead:
            lead = max(0.0, seconds - self.lead)
            self.loop.after(lead, lambda: self._live(token) and self.fetch_ahead())

    def fetch_ahead(self) -> None:
        """Near the end of the task's steps (the last claim and fetch ahead's time, doubled,
        before it), claim the next task, naming this one and any being sent as held, and fetch
        its modules meanwhile, as the real peer's ``--fetch-ahead`` does (peer/ahead.py)."""
        if self.ahead is None:
            self.ahead = Ahead(self)
            self.ahead.start()

    def next_task(self) -> None:
        """The task at hand is over: train the one fetched ahead (waiting for its modules,
        "fetch", if they are still coming), or claim one."""
        ahead = self.ahead
        if ahead is not None and not ahead.over and ahead.offer is not None:
            if ahead.fetched:
                self.ahead = None
                ahead.over = True  # the peer's own heartbeats take its lease over
                self.swarm.stats.tasks += 1
                self.offer, self.task_start = ahead.offer, ahead.began
                self.last_path = ahead.offer.path
                self.loop.after(self.swarm.settings.heartbeat_seconds, self.beat, self.token)
                self.train()
                return
            self.enter("fetch")
            token = self.token
            ahead.then = lambda: self._live(token) and self.next_task()
            return
        if ahead is not None:
            ahead.over = True
            self.ahead = None
        self.enter("claim")
        self.claim()

    def trained_all(self) -> None:
        """The task's steps are done: push its deltas, and wait for them (the default), or
        send them behind (``Settings.push_behind``: the real peer's ``--push-behind``) and
        claim the next task meanwhile; one task is sent at a time, so a peer whose last send
        is still going waits for it ("push") first."""
        if not self.swarm.settings.push_behind:
            self.enter("push")
            Send(self, behind=False).start()
            return
        if self.sending is not None:
            self.enter("push")
            token = self.token
            self.sending.then = lambda: self._live(token) and self.trained_all()
            return
        self.sending = Send(self, behind=True)
        self.sending.start()
        self.swarm.stats.busy += self.loop.now - (self.task_start or self.loop.now)
        self.task_start, self.trained = None, 0.0  # the send holds it now
        self.token += 1  # the task's heartbeats are the send's now
        self.next_task()

    def sent(self, send: Send, reply: Any) -> None:
        """``send`` ended: its TaskDone taken (``reply`` an Ok) or its task given up."""
        st, ok = self.swarm.stats, isinstance(reply, m.Ok)
        st.finished += ok
        if not send.behind:  # the task at hand: end it
            if ok:
                self.end_task()
                self.next_task()
            else:
                self.abandon(reply)
            return
        if not ok:
            reason = reply if isinstance(reply, str) else getattr(reply, "reason", None)
            st.refused[str(reason or type(reply).__name__)] += 1
            st.waste(self.profile.kind, send.trained, self.loop.now)
        st.busy += self.loop.now - send.began
        self.sending = None
        if send.then is not None:
            send.then()

    def beat(self, token: int) -> None:
        if not self._live(token):
            return
        step = 0  # the steps trained so far, as a real peer's heartbeat says
        if self.state == "train":
            step = int((self.loop.now - self.state_since) / self.profile.step_seconds)
        msg = m.Heartbeat(peer_id=self.name, task_id=self.offer.task_id, step=step)

        def ack(r: Any) -> None:
            if isinstance(r, m.HeartbeatAck) and not r.lease_ok:
                self.abandon("lease-lost")

        s = self.swarm.settings
        self.send(self.scheduler, msg, ack, times=s.heartbeat_seconds / s.real_heartbeat_seconds)
        self.loop.after(s.heartbeat_seconds, self.beat, token)

    # ---- ends ----------------------------------------------------------------------------------
    def abandon(self, reply: Any) -> None:
        """The task cannot go on (refused, lease lost): claim a new one."""
        reason = reply if isinstance(reply, str) else getattr(reply, "reason", None)
        reason = reason or type(reply).__name__
        self.swarm.stats.refused[str(reason)] += 1
        self.end_task()
        self.drop_ahead()
        self.enter("claim")
        self.loop.after(1.0, lambda token=self.token: self._live(token) and self.claim())

    def drop_ahead(self) -> None:
        """Forget the task fetched ahead: its lease stays, and the next claim gets it back."""
        if self.ahead is not None:
            self.ahead.over = True
            self.ahead = None

    def end_task(self) -> None:
        if self.trained:
            self.swarm.stats.waste(self.profile.kind, self.trained, self.loop.now)
            self.trained = 0.0
        if self.task_start is not None:
            self.swarm.stats.busy += self.loop.now - self.task_start
            self.task_start = None
        self.token += 1

    def leave(self, token: int) -> None:
        if not self._live(token):
            return
        self.swarm.stats.left += 1
        self.close()
        delay = self.swarm.rng.expovariate(1.0 / self.swarm.settings.arrival_seconds)
        self.loop.after(delay, self.swarm.spawn)

    def close(self) -> None:
        if self.gone:
            return
        if self.sending is not None:  # gone with the peer: its training never acknowledged
            self.swarm.stats.waste(self.profile.kind, self.sending.trained, self.loop.now)
            self.sending = None
        self.drop_ahead()
        self.end_task()
        self.enter("gone")
        self.gone = True
        self.swarm.stats.alive += self.loop.now - self.since
        self.swarm.live.discard(self)
