"""Fetch ahead (``dipaco-peer join --fetch-ahead``): the next task is claimed, and its modules
downloaded, while the peer trains the last steps of the current one.

Near the end of a task (once the steps left take about as long as the last download did, or
less), a thread claims one more task, naming the task in training and any task still being
pushed in ``ClaimTask.holding`` so that the scheduler leases another path; it heartbeats that
lease and fetches its modules, checked as every fetch is. When the current task is done, the
peer trains the task fetched ahead at once instead of claiming and downloading it then: the
device idles for neither. The claim does not wait for a path to open (no long poll): when none
is open, nothing is held and the peer claims as usual after its task. A fetch that fails is
handled as a failed fetch (the task is handed back). A peer that stops hands back the task it
holds ahead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols import messages as m

# The first task's lead (seconds before its end to start fetching the next), before a fetch
# ahead has been timed.
FIRST_LEAD_SECONDS = 1.0


class Ahead:
    """At most one task claimed and fetched ahead, on a thread of its own (:meth:`start`);
    the loop takes it (:meth:`take`) when its task is done."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._result: tuple[m.TaskOffer, dict | Exception] | None = None
        self._fetched = threading.Event()
        self._taken = threading.Event()
        self.lead = FIRST_LEAD_SECONDS  # the last claim and fetch's time, doubled
        self.seconds = 0.0  # time the claims and fetches ahead took, on their thread
        self.tasks = 0  # tasks fetched ahead

    @property
    def started(self) -> bool:
        return self._thread is not None

    def due(self, steps_left: int, seconds_per_step: float) -> bool:
        """Time to start: nothing started yet, and the steps left take at most ``lead``."""
        return self._thread is None and steps_left * seconds_per_step <= self.lead

    def start(
        self,
        claim: Callable[[], m.Message],
        fetch: Callable[[m.TaskOffer], dict],
        beating: Callable[[m.TaskOffer], AbstractContextManager],
    ) -> None:
        """On the fetch thread: ``claim()`` one task; if it is a ``TaskOffer``, ``fetch`` its
        modules inside ``beating(offer)`` (its heartbeats), which go on until it is taken."""
        self._fetched.clear()
        self._taken.clear()
        self._result = None

        def work() -> None:
            began = time.monotonic()
            try:
                try:
                    offer = claim()
                except (TransportError, RejectedError):
                    offer = None  # the loop claims as usual after the task
                if not isinstance(offer, m.TaskOffer):
                    return
                with beating(offer):
                    result: dict | Exception
                    try:
                        result = fetch(offer)
                    except Exception as exc:  # raised again where the task is set up
                        result = exc
                    took = time.monotonic() - began
                    self.seconds += took
                    self.lead = 2 * took
                    self.tasks += 1
                    self._result = (offer, result)
                    self._fetched.set()
                    self._taken.wait()  # heartbeat it until the loop trains it or hands it back
            finally:
                self._fetched.set()  # whatever happened, take() does not wait for ever

        self._thread = threading.Thread(target=work, name=self.name, daemon=True)
        self._thread.start()

    def take(self) -> tuple[m.TaskOffer, dict | Exception] | None:
        """The task fetched ahead and its modules (or the error its fetch met), once the fetch
        is over; None if none was started or the claim found no task. Its heartbeats stop:
        the caller heartbeats it from now on, or hands it back."""
        if self._thread is None:
            return None
        self._fetched.wait()
        result, self._result = self._result, None
        self._taken.set()
        self._thread.join()
        self._thread = None
        return result

    def hand_back(self, release: Callable[[m.TaskOffer], None]) -> None:
        """For a peer that leaves: ``release`` the task held ahead, if any."""
        held = self.take()
        if held is not None:
            release(held[0])
