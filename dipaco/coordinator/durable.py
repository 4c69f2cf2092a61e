"""Group commit of the coordinator's small state files (coordinator.json, validation.json).

A request that changes what such a file holds (a claim leases a task, a delta is admitted)
*marks* it under the coordinator's lock and, before its reply goes out, *flushes* it outside the
lock. Concurrent flushes share one write: the first caller to flush takes a snapshot under the
lock (covering every mark made so far) and writes it with fsync; the others wait for a write
that covers their mark, or make the next one. So 64 peers claiming at once cost a few fsyncs,
not 64, and no request's reply leaves before the state it changed is on disk.

A caller outside a request (a test, the start, the ticker, the shutdown) writes at once, under
whatever lock it holds, as before; :func:`deferring` is what the service wraps a request in.
Every snapshot is numbered when it is taken, and a write only replaces the file if no later
snapshot has replaced it already, so the file never goes back in time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from dipaco.fileio import AtomicFile

log = logging.getLogger(__name__)

_DEFERRED: ContextVar[bool] = ContextVar("dipaco_deferred_writes", default=False)


@contextmanager
def deferring() -> Iterator[None]:
    """Within the block, :meth:`GroupWriter.save` only marks; the caller flushes after it."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class GroupWriter:
    """The file at ``path``, written by group commit. ``snapshot`` runs under ``lock`` (the
    coordinator's) and returns the bytes to write."""

    def __init__(self, lock: Any, snapshot: Callable[[], bytes], path: Path) -> None:
        self.lock, self.snapshot, self.path = lock, snapshot, Path(path)
        self._cv = threading.Condition()
        self._marked = 0  # changes made so far
        self._written = 0  # changes on disk
        self._writing = False
        self._taken = 0  # snapshots numbered so far
        self._placed = 0  # the number of the snapshot the file holds
        self._rename = threading.Lock()
        self.writes = 0  # files written (the benchmarks print it)

    def save(self) -> None:
        """Mark a change; inside a request (:func:`deferring`) that is all, else write now."""
        if _DEFERRED.get():
            self.mark()
        else:
            self.write_now()

    def write_now(self) -> None:
        """Write the state now (under the caller's lock, if it holds one)."""
        self.mark()
        self._write(*self._take())

    def mark(self) -> None:
        with self._cv:
            self._marked += 1

    def flush(self) -> None:
        """Return once every change marked before this call is on disk. An OSError of the
        write this caller made is raised to it; a waiting caller then makes the next write."""
        with self._cv:
            wanted = self._marked
            while self._written < wanted:
                if not self._writing:
                    self._writing = True
                    break
                self._cv.wait()
            else:
                return
        done = 0
        try:
            number, covered, data = self._take()
            self._write(number, covered, data)
            done = covered
        finally:
            with self._cv:
                self._written = max(self._written, done)
                self._writing = False
                self._cv.notify_all()

    def _take(self) -> tuple[int, int, bytes]:
        with self.lock:
            with self._cv:
                self._taken += 1
                number, covered = self._taken, self._marked
            return number, covered, self.snapshot()

    def _write(self, number: int, covered: int, data: bytes) -> None:
        def replace(tmp: str, path: str) -> None:
            with self._rename:
                if number > self._placed:
                    os.replace(tmp, path)
                    self._placed = number
                    return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a later snapshot is already in place

        f = AtomicFile(self.path)
        try:
            f.write(data)
        except BaseException:
            f.abort()
            raise
        f.commit(replace=replace)
        self.writes += 1
        with self._cv:
            self._written = max(self._written, covered)


class Journal:
    """The coordinator's state files, a part of it: ``state`` (coordinator.json) and ``norms``
    (validation.json), each a :class:`GroupWriter`. Any part marks a change (``save``); the
    service writes what a request marked once, before its reply (``flush``)."""

    def __init__(self, state: GroupWriter, norms: GroupWriter) -> None:
        self.state, self.norms = state, norms

    def save(self, required: bool = False) -> None:
        """Save coordinator.json. Outside ``start`` a failure (a full disk) is logged, not
        raised: the file holds counters and ownership, which the next save brings up to date,
        and raising would drop the reply to a request whose deltas are already durable. Inside
        a request this only marks the file changed (``flush`` writes it, outside the lock).
        ``required`` (the start: the epoch must be on disk) writes it now and raises."""
        try:
            if required:
                self.state.write_now()
            else:
                self.state.save()
        except OSError as exc:
            if required:
                raise
            log.error("cannot save %s: %s", self.state.path, exc)

    def flush(self) -> None:
        """Write what the request marked (coordinator.json, the norm statistics), if anything."""
        for writer in (self.state, self.norms):
            try:
                writer.flush()
            except OSError as exc:
                log.error("cannot save %s: %s", writer.path, exc)
