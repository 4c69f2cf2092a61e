"""coordinator/serial.py: work after a round runs in order on its own thread; what is queued with
``then`` runs after it (at once when nothing is queued); a failure is logged, the next work runs."""

import threading

from dipaco.coordinator.serial import Serial


def test_work_runs_in_order_off_the_callers_thread_and_then_follows_it():
    serial, seen, gate = Serial("t"), [], threading.Event()
    caller = threading.get_ident()
    serial.submit(lambda: (gate.wait(10), seen.append(("one", threading.get_ident()))))
    serial.submit(lambda: seen.append(("two", threading.get_ident())))
    serial.then(lambda: seen.append(("end", threading.get_ident())))
    assert serial.busy and seen == []  # held: nothing ran on the caller's thread
    gate.set()
    assert serial.drain(10) and not serial.busy
    assert [what for what, _ in seen] == ["one", "two", "end"]
    assert all(thread != caller for _, thread in seen)
    serial.then(lambda: seen.append(("idle", threading.get_ident())))  # nothing queued: at once
    assert seen[-1] == ("idle", caller)


def test_a_failing_piece_of_work_is_logged_and_the_next_one_runs(caplog):
    serial, seen = Serial("t"), []
    serial.submit(lambda: 1 / 0)
    serial.submit(lambda: seen.append("after"))
    assert serial.drain(10)
    assert seen == ["after"]
    assert "a round's work failed" in caplog.text


def test_drain_gives_up_after_its_timeout():
    serial, gate = Serial("t"), threading.Event()
    serial.submit(lambda: gate.wait(10))
    assert not serial.drain(0.2)
    gate.set()
    assert serial.drain(10)
