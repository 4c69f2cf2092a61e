"""The scheduler's lease indexes (by peer, by (path, round), by path, the deadline heap, issue
order) give the answers a scan of every live lease gives, through a long random run of claims,
heartbeats, finishes, releases, hedges, expiries, restores and a clock set back."""

from __future__ import annotations

import random

from dipaco.coordinator.scheduler import DeadlinePolicy, Scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scanned_overdue(s: Scheduler) -> set[tuple[int, int]]:
    deadline = s.task_deadline()
    if deadline is None:
        return set()
    now = s.clock()
    # A path-round issued again is as old as its first task (Reissues), else as its lease.
    first = {pr: t for pr, t in s.reissues.first.items() if pr in s.reissues.again}
    return {
        (x.path, x.round)
        for x in s.leases.values()
        if now - min(x.issued_at, first.get((x.path, x.round), x.issued_at)) > deadline
    }


def check(s: Scheduler, peers: list[str]) -> None:
    live = list(s.leases.values())
    for peer in peers:
        assert {x.task_id for x in s.leases_of(peer)} == {
            x.task_id for x in live if x.peer_id == peer
        }
    assert s.leased_paths() == {x.path for x in live}
    for x in live:
        assert {y.task_id for y in s.holders(x.path, x.round)} == {
            y.task_id for y in live if (y.path, y.round) == (x.path, x.round)
        }
    assert s.overdue() == scanned_overdue(s)


def test_indexed_leases_answer_as_a_scan_of_every_lease_does():
    rng = random.Random(5)
    clock = Clock()
    policy = DeadlinePolicy(floor=1.0, min_observations=4)
    s = Scheduler(lease_seconds=30.0, clock=clock, policy=policy)
    peers = [f"p{i}" for i in range(12)]
    rnd, done = 0, set()
    expired_total = 0
    for i in range(3000):
        clock.now += rng.choice([0.0, 0.1, 1.0, 5.0])
        op = rng.random()
        peer = rng.choice(peers)
        if op < 0.35:
            open_paths = {p: rnd for p in range(16) if (p, rnd) not in done}
            lease = s.claim(peer, open_paths, rng.choice([None, 3]), steps=10)
            if lease is not None:
                lease.module_versions = {"m": rnd}
        elif op < 0.5 and s.leases:
            t = rng.choice(list(s.leases))
            s.heartbeat(t, s.leases[t].peer_id)
        elif op < 0.65 and s.leases:
            x = rng.choice(list(s.leases.values()))
            s.finish(x.task_id)
            done.add((x.path, x.round))
            if len(done) >= 16 * (rnd + 1):
                rnd += 1
        elif op < 0.72 and s.leases:
            x = rng.choice(list(s.leases.values()))
            assert s.release(x.task_id, x.peer_id)
        elif op < 0.8:
            s.hedge(peer, done)
        elif op < 0.85:
            clock.now += 40.0  # past every lease not heartbeaten since
        elif op < 0.87:
            saved = s.snapshot()
            s = Scheduler(lease_seconds=30.0, clock=clock, policy=policy)
            s.restore(saved)
        elif op < 0.9:
            clock.now -= 25.0  # a clock set back: leases issued out of order
        before = {t: x for t, x in s.leases.items()}
        gone = s.expire()
        expired_total += len(gone)
        assert {x.task_id for x in gone} == {
            t for t, x in before.items() if x.deadline < clock.now
        }, i
        assert all(x.deadline >= clock.now for x in s.leases.values())
        check(s, peers)
    assert expired_total > 50 and s.expired > 0  # the run did expire leases, in numbers
    assert rnd > 3  # and moved through rounds


def test_a_heartbeat_keeps_a_lease_past_its_first_deadline():
    clock = Clock()
    s = Scheduler(lease_seconds=10.0, clock=clock)
    lease = s.claim("a", {0: 0, 1: 0}, None)
    other = s.claim("b", {0: 0, 1: 0}, None)
    assert lease is not None and other is not None
    for _ in range(5):
        clock.now += 6.0
        s.heartbeat(lease.task_id, "a")
        assert [x.task_id for x in s.expire()] == ([other.task_id] if _ == 1 else [])
    assert s.leases_of("a") == [lease] and not s.leases_of("b")
    assert s.leased_paths() == {lease.path}
