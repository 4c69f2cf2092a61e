"""One simulated run: build the cluster and the peers, run the loop to the last round, and say
what it did: rounds' virtual wall time, who was busy, which resource saturates first, and
whether every acknowledged delta was applied exactly once (from the coordinators' own metrics
events, as bench/soak.py checks them).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sim import costs
from sim.cluster import Cluster
from sim.events import Busy, Loop
from sim.peers import Swarm

SATURATED = 0.8  # a resource busy this much of the time is the bottleneck


def side_for(peers: int, per_peer: float = 1.0) -> int:
    """W such that a WxW topology has at least ``per_peer`` paths per peer."""
    return max(2, math.ceil(math.sqrt(peers * per_peer)))


@dataclass
class Result:
    settings: costs.Settings
    paths: int
    modules: int
    path_params: int
    rounds_done: int
    round_seconds: list[float]
    virtual_seconds: float
    wall_seconds: float
    utilization: dict[str, float]  # resource -> busy fraction over the run
    peers_busy: float  # fraction of the peers' present time holding a task
    peers_compute: float  # ... training
    acked: int
    applied: int
    lost: int  # acknowledged, never applied
    duplicated: int  # applied more than once, or applied without an acknowledgement
    stats: dict = field(default_factory=dict)
    # peer class ("all" for every peer) -> state -> share of the class's present time
    # (peers.STATES), and "wasted": training whose delta was never acknowledged
    shares: dict[str, dict[str, float]] = field(default_factory=dict)
    # the same over the run's middle rounds (from the first round's end to the last round's
    # start: what a long run's every round looks like, without the first fetch and the last
    # round's drain); empty with fewer than three rounds
    steady: dict[str, dict[str, float]] = field(default_factory=dict)
    requests: dict[str, float] = field(default_factory=dict)  # mean CPU ms per request kind

    def training(self, kind: str = "all", steady: bool = False) -> float:
        """The share of the present time the peers of ``kind`` spent training (``steady``: in
        the middle rounds)."""
        return (self.steady if steady else self.shares).get(kind, {}).get("train", 0.0)

    @property
    def median_round(self) -> float:
        return statistics.median(self.round_seconds) if self.round_seconds else float("nan")

    @property
    def bottleneck(self) -> str:
        """The busiest server-side resource if it is saturated; else the peers themselves
        (their compute and links set the round time)."""
        name, util = max(self.utilization.items(), key=lambda kv: kv[1])
        return name if util >= SATURATED else "none (peers' compute and links)"

    @property
    def busiest(self) -> tuple[str, float]:
        return max(self.utilization.items(), key=lambda kv: kv[1])


def _kind(resource: str) -> str:
    """'owner3 nic in' -> 'owner nic in' (the worst owner stands for all)."""
    first, _, rest = resource.partition(" ")
    return ("owner " + rest) if first.startswith("owner") else resource


def run(
    settings: costs.Settings,
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """Simulate ``settings`` to its last round (or ``max_virtual_seconds``)."""
    say = progress or (lambda line: None)
    own_root = root is None
    base = Path(tempfile.mkdtemp(prefix="dipaco-sim-", dir=_tmp())) if own_root else root
    t0 = time.perf_counter()
    try:
        loop = Loop()
        side = side_for(settings.peers, settings.paths_per_peer)
        cluster = Cluster(loop, base, settings, side)
        swarm = Swarm(loop, cluster, settings)
        for _ in range(settings.peers):
            swarm.spawn()
        sched = cluster.scheduler
        seen = [0]
        last = [0.0]  # when the last round ended: a run with no round for stall_seconds stops

        def stop() -> bool:  # cheap: the scheduler's own round events
            if len(sched.events) > seen[0]:
                for e in sched.events[seen[0] :]:
                    if e["event"] == "round":
                        last[0] = loop.now
                        say(
                            f"  round {e['round']}/{settings.rounds} at {loop.now:,.0f} s "
                            f"virtual ({time.perf_counter() - t0:,.0f} s wall, "
                            f"{loop.events:,} events)"
                        )
                seen[0] = len(sched.events)
            if loop.now - last[0] > settings.stall_seconds:
                say(f"  stalled: no round for {settings.stall_seconds:,.0f} s virtual")
                return True
            return cluster.finished

        loop.run(until=settings.max_virtual_seconds, stop=stop)
        swarm.finish()
        return _result(settings, cluster, swarm, loop, side, time.perf_counter() - t0)
    finally:
        if own_root:
            shutil.rmtree(base, ignore_errors=True)


def _tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


def _result(
    settings: costs.Settings,
    cluster: Cluster,
    swarm: Swarm,
    loop: Loop,
    side: int,
    wall: float,
) -> Result:
    end = loop.now
    rounds = sorted((e["round"], e["t"]) for e in cluster.scheduler.events if e["event"] == "round")
    times = [0.0] + [t for _, t in rounds]
    resources: list[Busy] = [cluster.scheduler.cpu]
    for node in cluster.owners:
        resources += [node.cpu, node.ingress, node.egress]
    util: dict[str, float] = {}
    for res in resources:
        key = _kind(res.name)
        util[key] = max(util.get(key, 0.0), res.utilization(end))
    acked = Counter((e["module"], e["task"]) for e in cluster.events("delta_acked"))
    applied = Counter((e["module"], t) for e in cluster.events("outer_step") for t in e["tasks"])
    st = swarm.stats
    shares = {"all": st.share()}
    for kind in settings.peer_kinds:
        shares[kind.name] = st.share(kind.name)
    closed = dict(rounds)  # round -> when the round before it closed (round r opened)
    steady = {}
    if settings.rounds >= 3 and 1 in closed and settings.rounds - 1 in closed:
        window = (closed[1], closed[settings.rounds - 1])
        steady = {"all": st.share(window=window)}
        for kind in settings.peer_kinds:
            steady[kind.name] = st.share(kind.name, window)
        for kind, by_state in steady.items():
            if by_state:
                who = None if kind == "all" else kind
                present = sum(st.spent(who, window).values())
                by_state["wasted"] = st.wasted_in(who, window) / present
    for kind, by_state in shares.items():
        if by_state:
            present = sum(t for (k, _), t in st.time.items() if kind in ("all", k))
            lost = sum(st.wasted.values()) if kind == "all" else st.wasted[kind]
            by_state["wasted"] = lost / present
    return Result(
        settings=settings,
        paths=cluster.topology.num_paths,
        modules=len(cluster.topology.module_ids()),
        path_params=cluster.sizes.path_params(cluster.topology),
        rounds_done=cluster.scheduler.core.round,
        round_seconds=[b - a for a, b in zip(times, times[1:], strict=False)],
        virtual_seconds=end,
        wall_seconds=wall,
        utilization=util,
        peers_busy=st.busy / st.alive if st.alive else 0.0,
        peers_compute=st.compute / st.alive if st.alive else 0.0,
        shares=shares,
        steady=steady,
        acked=sum(acked.values()),
        applied=sum(applied.values()),
        lost=sum(1 for k in acked if k not in applied),
        duplicated=sum(n - 1 for n in applied.values() if n > 1)
        + sum(1 for k in applied if k not in acked),
        stats={
            "arrived": st.arrived,
            "left": st.left,
            "tasks": st.tasks,
            "finished": st.finished,
            "polls": st.polls,
            "task_done_parked": st.parked,
            "task_done_unparked_by_report": st.unparked_by_report,
            "refused": dict(st.refused),
            "kinds": dict(st.kinds),
            "side": side,
            "events": loop.events,
            "scheduler_jobs": cluster.scheduler.cpu.jobs,
            "scheduler_ms_per_job": 1000
            * cluster.scheduler.cpu.busy
            / max(1, cluster.scheduler.cpu.jobs),
            "scheduler_max_queue": cluster.scheduler.cpu.max_queue,
            "scheduler_cpu_share": {
                k: round(v / max(cluster.scheduler.cpu.busy, 1e-9), 3)
                for k, v in sorted(cluster.scheduler.by_kind.items(), key=lambda kv: -kv[1])
            },
            "lease_expired": len(cluster.events("lease_expired")),
            "done_after_ack_s": _done_after_ack(cluster),
        },
    )


def _done_after_ack(cluster: Cluster) -> dict[str, float]:
    """How long after a task's last acknowledged delta (at its owners) the scheduler took it
    as done (its ``delta`` event): the report's way and the TaskDone's, p50 and max over the
    tasks done."""
    last: dict[str, float] = {}
    for e in cluster.events("delta_acked"):
        last[e["task"]] = max(last.get(e["task"], 0.0), e["t"])
    gaps = sorted(
        e["t"] - last[e["task"]]
        for e in cluster.scheduler.events
        if e["event"] == "delta" and e["task"] in last
    )
    if not gaps:
        return {}
    return {"p50": round(statistics.median(gaps), 3), "max": round(gaps[-1], 3)}
