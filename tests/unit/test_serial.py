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


def test_a_backlog_of_skippable_work_drops_the_oldest_waiting_and_says_so():
    """Round work that falls behind holds its round's tensors: beyond ``max_waiting`` waiting
    pieces the oldest waiting one is skipped (its ``on_skip`` called); the running one, the
    newest ones and unskippable work (``then``) always run."""
    serial, gate, seen, skipped = Serial("t", max_waiting=2), threading.Event(), [], []
    serial.submit(lambda: (gate.wait(10), seen.append(1)), on_skip=lambda: skipped.append(1))
    assert _started(serial)
    for r in (2, 3, 4, 5):
        serial.submit(lambda r=r: seen.append(r), on_skip=lambda r=r: skipped.append(r))
    serial.then(lambda: seen.append("end"))
    assert skipped == [2, 3]  # said at once, on the submitter's thread
    gate.set()
    assert serial.drain(10)
    assert seen == [1, 4, 5, "end"]
    unbounded = Serial("u")  # without max_waiting nothing is skipped
    hold = threading.Event()
    unbounded.submit(lambda: hold.wait(10), on_skip=lambda: skipped.append("u"))
    for _ in range(5):
        unbounded.submit(lambda: None, on_skip=lambda: skipped.append("u"))
    hold.set()
    assert unbounded.drain(10) and "u" not in skipped


def _started(serial: Serial) -> bool:
    """Whether the first piece of work has left the queue (it is running)."""
    import time

    for _ in range(1000):
        with serial._lock:
            if not serial._queue:
                return True
        time.sleep(0.01)
    return False
