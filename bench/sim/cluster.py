"""The real coordinators of a simulated run: one scheduler and K module owners, in-process,
on the virtual clock, each behind a CPU queue that charges what its real requests cost.

Every request goes through the real ``Coordinator.handle`` (signed envelope, admission, store
writes to a temporary folder, outer steps) via :class:`LocalTransport`; the CPU time the
handler took on this machine (``time.thread_time``) is its virtual cost, plus, on an owner,
what the tiny tensors stand for at the real size (costs.py): encoding a fetch, decoding and
writing a delta, an outer step over its deltas. Owners report to the scheduler as the real
:class:`~dipaco.coordinator.owner.Reporter` does (after every change, and every
``report_seconds``), and every coordinator ticks every ``tick_seconds``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dipaco.config import SchedulerSection, SecuritySection, ValidationSection
from dipaco.coordinator.access import change_access
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.owner import take_over
from dipaco.errors import DipacoError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from sim import costs
from sim.events import Cpu, Loop, Pipe

TINY = ModelConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, max_seq_len=8)
SCHEDULER = "scheduler"


class FixedCpu:
    """A CPU clock that advances ``seconds`` each time it is read twice (a call's start and its
    end): every handler call costs the same, whatever this machine's load."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.reads = seconds, 0

    def __call__(self) -> float:
        self.reads += 1
        return (self.reads // 2) * self.seconds


class Node:
    """One coordinator: the real core, its CPU queue, its NIC (owners), its metrics events."""

    def __init__(
        self, loop: Loop, core: Coordinator, name: str, cpu_scale: float, cores: int = 1
    ) -> None:
        self.loop, self.core, self.name = loop, core, name
        self.cpu = Cpu(loop, f"{name} cpu", cores)
        self.cpu_scale = cpu_scale
        self.ingress: Pipe | None = None
        self.egress: Pipe | None = None
        self.events: list[dict] = []
        self.last_cost = 0.0
        self.transports: dict[str, LocalTransport] = {}
        self.reporting = False
        self.report_gen = 0
        self.after: Callable[[Node], None] = lambda node: None  # after every request served
        self.by_kind: dict[str, float] = {}  # CPU seconds per request kind
        # What a handler's CPU costs: measured (this thread's CPU seconds), or, with
        # Settings.cpu_seconds, a fixed charge per call (a run that repeats to the bit).
        self.cpu_time: Callable[[], float] = time.thread_time

    def on_event(self, event: dict) -> None:
        self.events.append({**event, "t": self.loop.now, "node": self.name})

    def handle(self, data: bytes) -> bytes:
        """The real handler, timed: its CPU seconds are kept in ``last_cost``."""
        t = self.cpu_time()
        try:
            return self.core.handle(data)
        finally:
            self.last_cost = self.cpu_time() - t

    def transport(self, identity: auth.Identity) -> LocalTransport:
        tr = self.transports.get(identity.public_key)
        if tr is None:
            tr = LocalTransport(self.handle).authenticate(identity, self.core.identity.public_key)
            self.transports[identity.public_key] = tr
        return tr

    def request(
        self,
        identity: auth.Identity,
        msg: m.Message,
        extra: Callable[[Any], float],
        reply_to: Callable[[Any], None],
        times: float = 1.0,
    ) -> None:
        """Queue ``msg`` on this node's CPU; ``reply_to(reply or RejectedError)`` once served.
        ``extra(reply)`` gives the modelled seconds beyond the measured ones; ``times`` > 1
        charges the measured ones that many times (a request that stands for several: the
        polls and heartbeats a real peer sends more often than the simulation runs them)."""
        tr = self.transport(identity)

        def work() -> tuple[float, Callable[[], None]]:
            before = len(self.events)
            try:
                reply: Any = tr.request(msg)
            except DipacoError as exc:
                reply = exc
            cost = self.last_cost * times + extra(reply) + self.stepped_cost(before)
            kind = type(msg).__name__ + ("/NoTask" if isinstance(reply, m.NoTask) else "")
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + cost * self.cpu_scale
            return cost * self.cpu_scale, lambda: (reply_to(reply), self.after(self))

        self.cpu.submit(work)

    def stepped_cost(self, before: int) -> float:
        """The modelled cost of the outer steps the last call made (from its events)."""
        return sum(
            costs.step_seconds(
                len(e["paths"]) + len(e.get("late_paths", [])), self.sizes.params[e["module"]]
            )
            for e in self.events[before:]
            if e.get("event") == "outer_step"
        )

    sizes: costs.Sizes


def assign(topology: Topology, sizes: costs.Sizes, owners: int) -> list[list[str]]:
    """Modules to owners, heaviest first to the least loaded (load: the delta bytes a round
    brings, parameters times the paths through the module)."""
    load = {
        mid: sizes.params[mid] * len(topology.paths_through(mid)) for mid in topology.module_ids()
    }
    shares: list[list[str]] = [[] for _ in range(owners)]
    totals = [0] * owners
    for mid in sorted(load, key=lambda x: (-load[x], x)):
        i = totals.index(min(totals))
        shares[i].append(mid)
        totals[i] += load[mid]
    return shares


class Cluster:
    """The scheduler and the owners of one simulated run."""

    def __init__(self, loop: Loop, root: Path, settings: costs.Settings, side: int) -> None:
        s = self.settings = settings
        self.loop = loop
        kind = CachedTopology if s.cache_topology else Topology
        self.topology = kind.parse(f"{side}x{side}", TINY.n_layers)
        self.sizes = costs.Sizes.of(Topology.parse(f"{side}x{side}", costs.PATH_CONFIG.n_layers))
        policy = SchedulerSection(
            lease_seconds=s.lease_seconds,
            heartbeat_seconds=s.heartbeat_seconds,
            quorum=s.quorum,
            overlap=s.overlap,
            hedge=s.hedge,
            **s.policy,
        )
        security = SecuritySection(requests_per_second=1e6, burst=10**6)
        common: dict[str, Any] = {
            "rounds": s.rounds,
            "inner_steps": s.inner_steps,
            "step_offset": 0,
            "total_steps": s.rounds * s.inner_steps,
            "seed": s.seed,
            "outer": OuterSettings(),
            "lease_seconds": s.lease_seconds,
            "run_id": "sim",
            "peer_config": {},
            "clock": lambda: loop.now,
            "policy": policy,
            "security": security,
            # The simulated peers send one fixed delta per module (what it holds is not what the
            # simulator measures): the copy check (copies.py) would refuse all but the first.
            "validation": ValidationSection(copy_cosine=None),
            "codec": "int8",
        }
        sched_id = auth.Identity.generate()
        self.scheduler = self._node(
            Coordinator(
                root / SCHEDULER, self.topology, owner_id=SCHEDULER, identity=sched_id, **common
            ),
            SCHEDULER,
            s.scheduler_cpu_scale,
        )
        self.initial = self.topology.init_modules(new_dense_model(TINY, 0).state_dict())
        self.scheduler.core.start(self.initial)
        self.owners: list[Node] = []
        rate = s.owner_gbps * 1e9 / 8
        for i, mids in enumerate(assign(self.topology, self.sizes, s.owners)):
            name = f"owner{i}"
            ident = auth.Identity.generate()
            co = Coordinator(
                root / name,
                self.topology,
                owner_id=name,
                identity=ident,
                scheduler_key=sched_id.public_key,
                is_scheduler=False,
                **common,
            )
            co.start(None)
            node = self._node(co, name, s.owner_cpu_scale, s.owner_cores)
            node.ingress = Pipe(loop, f"{name} nic in", rate)
            node.egress = Pipe(loop, f"{name} nic out", rate)
            change_access(self.scheduler.core.root, ident.public_key, allow=True, owner=True)
            take_over(co, LocalTransport(self.scheduler.handle), mids)
            self.owners.append(node)
        self.by_name = {n.name: n for n in self.owners}
        self.report_waiters: list[Callable[[], None]] = []  # parked TaskDones (on_report)
        self.work_waiters: deque[Callable[[], bool]] = deque()  # idle claims (on_work)
        self.generation = 0  # the scheduler's polls.generation last seen
        self.scheduler.after = self.work_changed
        for node in self.owners:
            node.after = self.changed
        for node in [self.scheduler, *self.owners]:
            node.events.clear()  # the set-up is not part of the run
            node.core.changed.clear()
            loop.after(s.tick_seconds, self._tick, node)
        for node in self.owners:
            loop.at(0.0, self._report, node, node.report_gen)

    def _node(self, core: Coordinator, name: str, scale: float, cores: int = 1) -> Node:
        node = Node(self.loop, core, name, scale, cores)
        node.sizes = self.sizes
        if self.settings.cpu_seconds is not None:
            node.cpu_time = FixedCpu(self.settings.cpu_seconds)
        core.metrics = node.on_event
        return node

    @property
    def finished(self) -> bool:
        return self.scheduler.core.finished_event.is_set()

    # ---- the ticker and the reporter ---------------------------------------------------------
    def _tick(self, node: Node) -> None:
        def work() -> tuple[float, Callable[[], None]]:
            before = len(node.events)
            t = node.cpu_time()
            node.core.tick()
            cost = node.cpu_time() - t + node.stepped_cost(before)
            return cost * node.cpu_scale, lambda: (self.changed(node), self.work_changed(node))

        node.cpu.submit(work)
        if not self.finished:
            self.loop.after(self.settings.tick_seconds, self._tick, node)

    def changed(self, node: Node) -> None:
        """After a request to an owner: a change wakes its reporter at once."""
        if node is self.scheduler or node.reporting or not node.core.changed.is_set():
            return
        node.report_gen += 1
        self._report(node, node.report_gen)

    def _report(self, node: Node, gen: int) -> None:
        if gen != node.report_gen or node.reporting or self.finished:
            return
        node.reporting = True
        lat = self.settings.owner_latency

        def build() -> tuple[float, Callable[[], None]]:
            t = node.cpu_time()
            node.core.changed.clear()
            msg = node.core.report()
            cost = (node.cpu_time() - t) * node.cpu_scale
            return cost, lambda: self.loop.after(lat, send, msg)

        def send(msg: m.OwnerReport) -> None:
            self.scheduler.request(
                node.core.identity, msg, lambda r: 0.0, lambda r: self._landed(lat, back, r)
            )

        def back(ack: Any) -> None:
            def apply() -> tuple[float, Callable[[], None]]:
                before = len(node.events)
                t = node.cpu_time()
                co = node.core
                if isinstance(ack, m.ReportAck):
                    with co.lock:
                        co.book.follow(ack.overdue, ack.ended)
                        co.gathered = set(ack.gathered)
                co.tick()
                cost = node.cpu_time() - t + node.stepped_cost(before)
                return cost * node.cpu_scale, done

            node.cpu.submit(apply)

        def done() -> None:
            node.reporting = False
            node.report_gen += 1
            if node.core.changed.is_set():
                self._report(node, node.report_gen)
            else:
                self.loop.after(self.settings.report_seconds, self._report, node, node.report_gen)

        node.cpu.submit(build)

    def on_report(self, call: Callable[[], None]) -> None:
        """Call ``call`` once the next owner's report has been applied at the scheduler (a
        TaskDone's long poll: peers.py ``park``)."""
        self.report_waiters.append(call)

    def on_work(self, call: Callable[[], bool]) -> None:
        """Call ``call`` when a change of the scheduler's work may have opened a path (a
        claim's long poll, ``ClaimTask.wait``), in the order the claims came; ``call`` says
        whether it still waited."""
        self.work_waiters.append(call)

    def work_changed(self, node: Node) -> None:
        """After a request or a tick at the scheduler: if its work changed
        (``polls.generation``), the first waiting claim looks; one that leases a path wakes
        the next (``wake_one``), as the real long polls do."""
        gen = self.scheduler.core.polls.generation
        if node is self.scheduler and gen != self.generation:
            self.generation = gen
            self.wake_one()

    def wake_one(self) -> None:
        while self.work_waiters and not self.work_waiters.popleft()():
            pass

    def _landed(self, lat: float, back: Callable[[Any], None], reply: Any) -> None:
        """An owner's report was served at the scheduler: the TaskDones it parked look again,
        and its reply travels back to the owner."""
        waiters, self.report_waiters = self.report_waiters, []
        for call in waiters:
            call()
        self.work_changed(self.scheduler)
        self.loop.after(lat, back, reply)

    # ---- what the run did ----------------------------------------------------------------------
    def events(self, kind: str) -> list[dict]:
        return [e for n in [self.scheduler, *self.owners] for e in n.events if e["event"] == kind]


class CachedTopology(Topology):
    """A topology whose module lists are computed once (``--cache-topology``).

    The coordinator asks ``module_ids()`` (for its round), ``path_modules()`` and
    ``paths_through()`` on most requests; on :class:`Topology` each walks every path, so a
    request costs O(paths) and a tick O(overdue leases x paths). With this cache the same real
    code runs with those answers memoised: what the coordinator would cost with that fix.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_memo", {})

    def _cached(self, key: tuple, make) -> list:
        memo = self._memo  # type: ignore[attr-defined]
        got = memo.get(key)
        if got is None:
            got = memo[key] = make()
        return list(got)

    def path_modules(self, path: int) -> list[str]:
        return self._cached(("p", path), lambda: super(CachedTopology, self).path_modules(path))

    def module_ids(self) -> list[str]:
        return self._cached(("m",), lambda: super(CachedTopology, self).module_ids())

    def paths_through(self, module_id: str) -> list[int]:
        if "through" not in self._memo:  # type: ignore[attr-defined]
            through: dict[str, list[int]] = {}
            for p in range(self.num_paths):
                for mid in self.path_modules(p):
                    through.setdefault(mid, []).append(p)
            self._memo["through"] = through  # type: ignore[attr-defined]
        paths = self._memo["through"].get(module_id)  # type: ignore[attr-defined]
        return list(paths) if paths else super().paths_through(module_id)
