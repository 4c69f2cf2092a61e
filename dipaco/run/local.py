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
) -> list[threading.Thread]:
    """Start ``n_peers`` peers in threads over the local transport; they stop when the run ends.

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
        coordinator.security = coordinator.security.model_copy(
            update={"max_tasks_per_key": parallel}
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
        t = threading.Thread(target=peer.run, name=f"peer-{i}", daemon=True)
        t.start()
        threads.append(t)
    return threads


def wait_for_end(
    coordinator: Coordinator, threads: list[threading.Thread], stopped_early: str
) -> None:
    """Until the coordinator's run finishes (``finished_event``); ``DipacoError(stopped_early)``
    if every thread (the local peers) stops first. Peers stop as soon as the last round is
    complete, and the event is set after that round's validation (coordinator/serial.py): a
    finished run is not an early stop."""
    while not coordinator.finished_event.wait(0.5):
        if not any(t.is_alive() for t in threads) and not coordinator.finished:
            raise DipacoError(stopped_early)


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
