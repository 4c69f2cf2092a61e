"""The local run: in-process peers for a coordinator on this machine.

This is the one place where the coordinator and the peer meet outside the protocols: each local
peer talks to the coordinator through ``LocalTransport(coordinator.handle)``, as a remote one
does through its transport. ``LocalRun`` starts them, waits for the run and stops them:

    with LocalRun(coordinator, prep, n_peers) as local:
        local.wait()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from dipaco.coordinator.core import Coordinator
from dipaco.errors import DipacoError
from dipaco.peer.peer import Peer
from dipaco.prepare.folder import PreparedRun
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

# How long leaving the block waits for the local peers' threads, in seconds, all together: after
# the run (they stop at once) and when interrupted (Ctrl-C; a peer stops between two steps, and a
# thread still busy is a daemon: the process does not wait for it).
JOIN_SECONDS = 30
STOP_SECONDS = 2


class PeerThread(threading.Thread):
    """A local peer's thread. An exception that ends ``peer.run`` stays on ``peer.error`` and
    ends the thread as any thread's does (``threading.excepthook`` prints it), so that the
    runner (:func:`failed_peers`) and a test both see that this peer failed, whichever peer
    finishes the run."""

    def __init__(self, peer: Peer, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.peer = peer

    def run(self) -> None:
        self.peer.run()


def failed_peers(threads: list[threading.Thread]) -> DipacoError | None:
    """A DipacoError naming every local peer that stopped on an exception (with the first as
    its cause), or None when none did."""
    failed = [t.peer for t in threads if isinstance(t, PeerThread) and t.peer.error is not None]
    if not failed:
        return None
    said = "; ".join(f"{p.peer_id}: {type(p.error).__name__}: {p.error}" for p in failed)
    error = DipacoError(f"a local peer stopped on an error (see the log above): {said}")
    error.__cause__ = failed[0].error
    return error


def run_local_peers(
    coordinator: Coordinator,
    prep: PreparedRun,
    n_peers: int,
    *,
    stop: threading.Event,
    on_progress: Callable[[dict], None] | None = None,
    device: str = "cpu",
    parallel: int = 1,
    batching: str = "stacked",
    compile: str = "auto",
) -> list[PeerThread]:
    """Start ``n_peers`` peers in threads over the local transport; they stop when the run ends.
    Each thread's ``peer`` is its :class:`Peer`: ``peer.run_finished`` once it saw the run end,
    ``peer.error`` if something else stopped it.

    Local peers share one state folder, so a path's inner optimizer state follows the path,
    whichever local peer trains it: results then do not depend on thread timing.

    ``parallel`` > 1 makes each peer path-parallel (``peer.train_batch``): it claims up to that
    many tasks of a round and trains them together on its device, as one stacked model
    (``batching`` "stacked": module parameters equal to one sequential peer's up to float
    rounding, several times faster for small paths) or step-interleaved ("streams": each path on
    its own CUDA stream on a GPU; bit for bit a sequential peer's on a CPU). Meant for
    ``n_peers=1``: one peer that trains every path of a round at once. The coordinator's task
    quota per key is raised to ``parallel`` if it is lower. ``compile``: the peers'
    ``torch.compile`` setting ("auto": on a GPU).
    """
    if parallel > coordinator.security.max_tasks_per_key:
        # The local peer holds a whole batch of leases on its one key: let it.
        coordinator.set_security(
            coordinator.security.model_copy(update={"max_tasks_per_key": parallel})
        )
    threads = []
    for i in range(n_peers):
        peer = Peer(
            # Each local peer is its own party, with its own key (and its own task quota), kept
            # so that a resumed run knows it again.
            LocalTransport(coordinator.handle).authenticate(
                Identity.load_or_create(prep.root / "peers" / "keys" / f"local-{i}.key")
            ),
            f"local-{i}",
            prep.root / "peers",
            stop=stop,
            on_progress=on_progress,
            device=device,
            parallel=parallel,
            batching=batching,
            compile=compile,
        )
        t = PeerThread(peer, name=f"peer-{i}")
        t.start()
        threads.append(t)
    return threads


def wait_for_end(
    coordinator: Coordinator, threads: list[threading.Thread], stopped_early: str
) -> None:
    """Until the coordinator's run finishes (``finished_event``); ``DipacoError(stopped_early)``
    if every thread (the local peers) stops first. Peers stop as soon as the last round is
    complete, and the event is set after that round's validation (coordinator/serial.py): a
    finished run is not an early stop. A local peer that stopped on an exception fails the run:
    the DipacoError of :func:`failed_peers`, as soon as it is seen."""
    while not coordinator.finished_event.wait(0.5):
        if (error := failed_peers(threads)) is not None:
            raise error
        if not any(t.is_alive() for t in threads) and not coordinator.finished:
            raise DipacoError(stopped_early)
    if (error := failed_peers(threads)) is not None:  # the others finished the run without it
        raise error


class LocalRun:
    """``n_peers`` in-process peers (``run_local_peers``) for the length of a ``with`` block.

    Entering starts them (none when ``n_peers`` is 0); :meth:`wait` waits until the run
    finishes; leaving the block, by any way, tells them to stop and waits for them for up to
    ``JOIN_SECONDS`` in all (``STOP_SECONDS`` when it is left by an exception: Ctrl-C). The
    keyword arguments are ``run_local_peers``'s.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        prep: PreparedRun,
        n_peers: int,
        *,
        on_progress: Callable[[dict], None] | None = None,
        device: str = "cpu",
        parallel: int = 1,
        batching: str = "stacked",
    ) -> None:
        self.coordinator, self.prep, self.n_peers = coordinator, prep, n_peers
        self.on_progress, self.device, self.parallel = on_progress, device, parallel
        self.batching = batching
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> LocalRun:
        if self.n_peers:
            self.threads = run_local_peers(
                self.coordinator,
                self.prep,
                self.n_peers,
                stop=self.stop,
                on_progress=self.on_progress,
                device=self.device,
                parallel=self.parallel,
                batching=self.batching,
            )
        return self

    def wait(
        self,
        stopped_early: str = "every local peer stopped before the run finished (see the log above)",
    ) -> None:
        """Until the coordinator's run finishes; ``DipacoError(stopped_early)`` if every local
        peer stops first. (A failed run finishes too: the caller reads ``coordinator.failure``.)"""
        wait_for_end(self.coordinator, self.threads, stopped_early)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop.set()
        deadline = time.monotonic() + (JOIN_SECONDS if exc_type is None else STOP_SECONDS)
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if exc_type is None and (error := failed_peers(self.threads)) is not None:
            raise error  # a run served to its end by others (the coordinator's --local-peers)
