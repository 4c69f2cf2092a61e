"""Push behind (``dipaco-peer join --push-behind``): a task's deltas go out while the peer claims,
fetches and trains its next task.

The peer computes and encodes the task's deltas (the path's error-feedback residuals updated),
writes its inner state and drops its checkpoint on its own thread, as it does without; only the
sending (each owner's ``SubmitDelta`` until acknowledged, then ``TaskDone``) runs on a thread of
its own, the task's lease heartbeated meanwhile. One task is sent at a time. A task of the same
path waits for the send (it continues that path's inner state and, with overlap, its end). The
peer's claims name the task being sent (``ClaimTask.holding``), so that the scheduler leases it
another path rather than that one again. On a thin link the upload of one task overlaps the
training of the next, instead of idling the device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from dipaco.errors import RejectedError, TransportError
from dipaco.peer.links import RunOver
from dipaco.peer.modules import TaskAborted
from dipaco.protocols import messages as m


class Behind:
    """At most one task's send in flight, on a thread of its own; what it raised is raised again
    to the peer's loop (:meth:`poll`, :meth:`wait`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.task: m.TaskOffer | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # time the sends took on the push thread

    @property
    def holding(self) -> list[str]:
        """The task being sent, if any: a claim names it."""
        return [self.task.task_id] if self.task is not None else []

    def start(
        self,
        task: m.TaskOffer,
        send: Callable[[], None],
        *,
        beating: Callable[[], AbstractContextManager],
        undo: Callable[[], None],
        failed: Callable[[Exception], None],
        done: Callable[[], None],
    ) -> None:
        """Once the send before it is over, run ``send`` for ``task`` on the push thread, inside
        ``beating()`` (the task's heartbeats). Then ``done()``; if it fails, ``undo()`` (the
        path's residuals back), and for a lost link, a refusal or a stop, ``failed(exc)``, as
        the loop handles a failed push; anything else is raised again to the loop."""
        self.wait()
        self.task = task

        def work() -> None:
            began = time.monotonic()
            try:
                with beating():
                    send()
            except (TaskAborted, TransportError, RejectedError) as exc:
                undo()
                failed(exc)
                return
            except BaseException as exc:  # RunOver, or a bug: raised on the loop's thread
                undo()
                self._error = exc
                return
            finally:
                self.seconds += time.monotonic() - began
            done()

        self._thread = threading.Thread(target=work, name=self.name, daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """If the send has ended: its outcome (see :meth:`wait`); else nothing."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def drain(self) -> bool:
        """:meth:`wait`, for a peer that leaves: True if the send met the run's end."""
        try:
            self.wait()
        except RunOver:
            return True
        return False

    def wait(self, path: int | None = None) -> None:
        """Until the send in flight is over (only if it is for ``path``, when given); raises
        what it raised."""
        if path is not None and (self.task is None or self.task.path != path):
            return
        if self._thread is not None:
            self._thread.join()
            self._thread, self.task = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
