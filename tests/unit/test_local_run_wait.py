"""LocalRun.wait: peers that stopped because the last round is complete are not an early stop,
even while that round's callbacks (a per-round evaluation) still hold back ``finished_event``."""

import threading
import time

import pytest

from dipaco.errors import DipacoError
from dipaco.run.local import LocalRun


class Stand:
    """The two things LocalRun.wait reads of a coordinator."""

    def __init__(self, finished: bool) -> None:
        self.finished = finished
        self.finished_event = threading.Event()


def stopped_peer() -> threading.Thread:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return t


def test_peers_that_saw_the_last_round_wait_for_its_evaluation():
    co = Stand(finished=True)  # every round stepped; the last evaluation still runs
    run = LocalRun(co, prep=None, n_peers=0)
    run.threads = [stopped_peer()]
    threading.Timer(1.5, co.finished_event.set).start()
    began = time.monotonic()
    run.wait()  # no DipacoError: it waits for the event
    assert time.monotonic() - began >= 1.0


def test_peers_that_stop_mid_run_are_an_early_stop():
    run = LocalRun(Stand(finished=False), prep=None, n_peers=0)
    run.threads = [stopped_peer()]
    with pytest.raises(DipacoError, match="stopped before the run finished"):
        run.wait()
