"""What the scheduler's lease bookkeeping costs a request, with 100 to 10,000 live leases.

Every request the scheduler serves runs the ticker's bookkeeping (expire the leases past their
deadline, find the overdue tasks); a claim also asks which paths are leased, what its peer
holds, and, with nothing free, whether a straggler's task can be copied (a hedge); a heartbeat
moves a deadline. This times that mix per request against a scheduler holding N live leases,
with the leases indexed (``dipaco/coordinator/leases.py``) and, as the baseline in the same
run, answered by scanning every live lease (what the scheduler did before the index). It prints
microseconds per request for both and their ratio, and how the indexed cost grows from 100
leases to the largest N (about 1 when a request costs the same whatever the leases).

    python bench/scheduler_leases.py [--leases 100 1000 10000] [--requests 2000] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from dipaco.coordinator.leases import Lease
from dipaco.coordinator.scheduler import DeadlinePolicy, Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clock import Clock  # noqa: E402
from _report import add_report_args, record  # noqa: E402


class Scanning(Scheduler):
    """The same answers by scanning every live lease (the baseline)."""

    def expire(self) -> list[Lease]:
        now = self.clock()
        gone = [x for x in self.leases.values() if x.deadline < now]
        for x in gone:
            self.live.drop(x.task_id)
            self.ended[x.task_id] = x.round
            self.expired += 1
        return gone

    def leased_paths(self) -> set[int]:
        return {x.path for x in self.leases.values()}

    def leases_of(self, peer_id: str) -> list[Lease]:
        return [x for x in self.leases.values() if x.peer_id == peer_id]

    def overdue(self) -> set[tuple[int, int]]:
        deadline = self.task_deadline()
        if deadline is None:
            return set()
        now = self.clock()
        return {(x.path, x.round) for x in self.leases.values() if now - x.issued_at > deadline}

    def hedge(self, peer_id: str, done) -> Lease | None:
        if len(self.durations) < self.policy.min_observations or self.leases_of(peer_id):
            return None
        typical, now = statistics.median(self.durations), self.clock()
        holders = Counter((x.path, x.round) for x in self.leases.values())
        late = [
            x
            for x in self.leases.values()
            if x.peer_id != peer_id
            and holders[(x.path, x.round)] == 1
            and (x.path, x.round) not in done
            and x.module_versions
            and all(v >= x.round for v in x.module_versions.values())
            and now - x.issued_at > typical
        ]
        assert not late, "the bench's leases are younger than the typical task: no hedge"
        return None


def loaded(cls: type[Scheduler], n: int) -> tuple[Scheduler, Clock]:
    """A scheduler with ``n`` live leases (one per peer and path), issued over 100 s, with
    enough finished tasks that deadlines apply and none of the leases yet overdue."""
    clock = Clock()
    s = cls(lease_seconds=600.0, clock=clock, policy=DeadlinePolicy(floor=10.0))
    old = [s.claim(f"old{i}", {10**6 + i: 0}, None) for i in range(8)]
    clock.now += 300.0
    for lease in old:  # finished tasks of 300 s: the task deadline is then 450 s
        s.finish(lease.task_id)
    for i in range(n):
        clock.now += 100.0 / n
        s.claim(f"p{i}", {i: 0}, None).module_versions = {"m": 0}
    return s, clock


def per_request(s: Scheduler, clock: Clock, n: int, requests: int) -> float:
    """Seconds per request of the mix: every request ticks (expire, overdue); a third are idle
    claims (a hedge wanted), the rest heartbeats."""
    leases = list(s.leases)
    began = time.perf_counter()
    for k in range(requests):
        clock.now += 1e-3
        s.expire()
        s.overdue()
        if k % 3 == 0:
            peer = f"idle{k}"
            s.leases_of(peer)
            s.leased_paths()
            s.hedge(peer, ())
        else:
            task = leases[k % n]
            s.heartbeat(task, s.leases[task].peer_id)
    return (time.perf_counter() - began) / requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="CI's short form: 100 and 1000 leases")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.leases, args.requests = [100, 1000], 300
    rows = {}
    for n in args.leases:
        indexed = per_request(*loaded(Scheduler, n), n, args.requests)
        scanned = per_request(*loaded(Scanning, n), n, max(50, args.requests * 100 // n))
        rows[n] = (indexed, scanned)
        print(
            f"{n:6d} live leases: indexed {indexed * 1e6:8.1f} us/request, scanning "
            f"{scanned * 1e6:9.1f} us/request"
        )
    small, large = min(rows), max(rows)
    growth = rows[large][0] / rows[small][0]
    print(f"ratio scanning / indexed at {large} leases: {rows[large][1] / rows[large][0]:.1f}")
    print(f"ratio indexed at {large} leases / at {small}: {growth:.2f}")
    record(
        args,
        "scheduler_leases",
        f"{large} leases: {rows[large][0] * 1e6:.1f} us indexed vs {rows[large][1] * 1e6:.0f} us "
        f"scanning ({rows[large][1] / rows[large][0]:.0f}x); indexed {large} / {small} leases "
        f"{growth:.2f}",
    )


if __name__ == "__main__":
    main()
