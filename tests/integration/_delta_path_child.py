"""One large delta over a real hivemind stream to a coordinator in this process, watched: run by
tests/integration/test_delta_path.py with the allocation counter (_alloc_count.c) preloaded
(``send_one_delta`` is also that test's in-process hash count).
Prints one JSON line: the delta's size in bytes, the sizes of the allocations of at least
``sys.argv[2]`` bytes made while the request ran (both ends, every thread), how many times the
coordinator's lock was taken for it, and the dipaco files whose code ran for it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tiny import delta_message  # noqa: E402

from dipaco.coordinator.core import Coordinator  # noqa: E402
from dipaco.coordinator.outer import OuterSettings  # noqa: E402
from dipaco.model.topology import Topology  # noqa: E402
from dipaco.model.transformer import ModelConfig, new_dense_model  # noqa: E402
from dipaco.protocols import auth  # noqa: E402
from dipaco.protocols import messages as m  # noqa: E402
from dipaco.protocols.hivemind.node import HivemindNode  # noqa: E402

# As test_delta_path.py's in-process test: paths of about 2 M parameters, a delta of 8.5 MB.
CFG = ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, max_seq_len=16)
TOPO = Topology.parse("2x2", 2)

watching = threading.Event()
files: set[str] = set()


def entered(frame, event, arg):  # a profile hook, in every thread
    if event == "call" and watching is not None and watching.is_set():
        name = frame.f_code.co_filename
        if "/dipaco/" in name and "site-packages" not in name:
            files.add(name.rsplit("/dipaco/", 1)[1])


class CountingLock:
    """The coordinator's lock, counting its acquisitions while the request runs."""

    def __init__(self, lock) -> None:
        self.lock, self.taken = lock, 0

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got and watching.is_set():
            self.taken += 1
        return got

    def release(self) -> None:
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __getattr__(self, name):
        return getattr(self.lock, name)


def send_one_delta(root: Path, watch=contextlib.nullcontext):
    """Claim a task of a fresh coordinator at ``root`` over a real hivemind stream and send its
    delta (about 8.5 MB), the request alone inside ``watch()``: (coordinator, task, the
    delta's size in bytes, the reply)."""
    modules = TOPO.init_modules(new_dense_model(CFG, 0).state_dict())
    co = Coordinator(
        root, TOPO, rounds=2, inner_steps=5, step_offset=0, total_steps=100, seed=0,
        outer=OuterSettings(), lease_seconds=60.0, run_id="path", peer_config={},
    )  # fmt: skip
    co.start(modules)
    with HivemindNode() as server:
        server.serve(co.handle, max_request_bytes=co.gate.max_request_bytes)
        with HivemindNode(initial_peers=server.visible_maddrs(), client_mode=True) as client:
            link = client.transport(server.peer_id, server.visible_maddrs(), timeout=60)
            link.authenticate(auth.Identity.generate())
            task = link.request(m.ClaimTask(peer_id="alice"))
            assert isinstance(task, m.TaskOffer), task
            delta = {
                f"{mid}/{k}": torch.full_like(v, 1e-3)
                for mid in TOPO.path_modules(task.path)
                for k, v in co.store.params(mid).items()
            }
            size = sum(t.numel() * t.element_size() for t in delta.values())
            msg = delta_message(task, "alice", delta)
            link.request(m.Heartbeat(peer_id="alice", task_id=task.task_id))  # a warm stream
            with watch(co):
                reply = link.request(msg)
    return co, task, size, reply


def main() -> None:
    root, at_least = Path(sys.argv[1]), int(sys.argv[2])
    counter = ctypes.CDLL(None)  # the preloaded allocation counter's functions
    counter.dipaco_alloc_size.restype = ctypes.c_size_t
    counter.dipaco_alloc_count.restype = ctypes.c_long
    sys.setprofile(entered)
    threading.setprofile(entered)  # the nodes' threads start below
    counted: list[CountingLock] = []

    @contextlib.contextmanager
    def watch(co):
        counted.append(CountingLock(co.lock))
        co.lock = counted[0]
        watching.set()
        counter.dipaco_alloc_arm(ctypes.c_size_t(at_least))
        try:
            yield
        finally:
            counter.dipaco_alloc_disarm()
            watching.clear()

    _, _, size, reply = send_one_delta(root, watch)
    sys.setprofile(None)
    threading.setprofile(None)
    n = min(counter.dipaco_alloc_count(), 4096)
    print(
        json.dumps(
            {
                "size": size,
                "reply": type(reply).__name__,
                "allocations": [counter.dipaco_alloc_size(i) for i in range(n)],
                "lock": counted[0].taken,
                "files": sorted(files),
            }
        )
    )


if __name__ == "__main__":
    main()
