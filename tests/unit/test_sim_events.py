"""The simulator's event loop and queues (bench/sim/events.py)."""

from __future__ import annotations

from sim.events import Cpu, Loop, Pipe, transfer


def test_loop_runs_in_time_order_and_ties_in_order_scheduled():
    loop, seen = Loop(), []
    loop.at(2.0, seen.append, "b")
    loop.at(1.0, seen.append, "a")
    loop.at(2.0, seen.append, "c")
    loop.after(0.5, lambda: loop.after(1.0, seen.append, "a2"))
    loop.run()
    assert seen == ["a", "a2", "b", "c"] and loop.now == 2.0


def test_loop_stops_at_until_and_keeps_later_events():
    loop, seen = Loop(), []
    loop.at(1.0, seen.append, 1)
    loop.at(5.0, seen.append, 5)
    loop.run(until=3.0)
    assert seen == [1] and len(loop) == 1


def test_cpu_serves_one_job_at_a_time_in_arrival_order():
    loop, done = Loop(), []
    cpu = Cpu(loop, "cpu")
    for name, cost in (("x", 2.0), ("y", 1.0)):
        cpu.submit(lambda name=name, cost=cost: (cost, lambda: done.append((name, loop.now))))
    loop.run()
    assert done == [("x", 2.0), ("y", 3.0)]
    assert cpu.busy == 3.0 and cpu.utilization(6.0) == 0.5


def test_pipe_queues_transfers_and_the_slowest_pipe_decides():
    loop = Loop()
    nic, slow = Pipe(loop, "nic", 100.0), Pipe(loop, "peer", 10.0)
    assert nic.reserve(100) == 1.0 and nic.reserve(100) == 2.0  # queued behind the first
    assert transfer(loop, 50, [nic, slow], latency=0.5) == 5.5  # the peer's 10 B/s
    assert nic.bytes == 250


def test_a_cpu_of_two_cores_serves_two_jobs_at_once_and_queues_the_third():
    loop, done = Loop(), []
    cpu = Cpu(loop, "cpu", cores=2)
    for name, cost in (("x", 2.0), ("y", 1.0), ("z", 1.0)):
        cpu.submit(lambda name=name, cost=cost: (cost, lambda: done.append((name, loop.now))))
    loop.run()
    assert done == [("y", 1.0), ("x", 2.0), ("z", 2.0)]  # z waited for y's core
    assert cpu.busy == 4.0 and cpu.utilization(4.0) == 0.5  # per core
