"""What encoding the coordinator's state files costs a request, with 64 to 4,096 peers.

coordinator.json (the scheduler's remembered tasks, live leases, attempts, the peers' paces,
who trained each path's rounds) and validation.json (the last norms of each module) are
written for most requests, encoded under the coordinator's lock. Each entry's JSON text is
kept until the entry changes (``dipaco/coordinator/statetext.py``); the baseline, in the same
run, encodes the whole state for every write (what the coordinator did before). Each write
follows what one delta changes: a lease's deadline moved by a heartbeat, a peer's pace, a
path's trainer, a new task, and a norm for two modules. It prints microseconds per write of
both files, kept and whole, and their ratio.

    python bench/state_files.py [--peers 64 256 1024 4096] [--writes 400] [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

from dipaco.coordinator.round_book import RoundBook
from dipaco.coordinator.scheduler import Scheduler
from dipaco.coordinator.statetext import dumps
from dipaco.coordinator.validation import NormTracker
from dipaco.fileio import compact_json_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clock import Clock  # noqa: E402
from _report import add_report_args, record  # noqa: E402


class State:
    """A scheduler with one live lease per peer and a round of finished tasks remembered, the
    paths' trainers, and the norms of a KxK topology's modules (K = sqrt(peers))."""

    def __init__(self, peers: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.clock = Clock(1000.0)
        self.s = Scheduler(lease_seconds=600.0, clock=self.clock)
        side = max(2, math.ceil(math.sqrt(peers)))
        mids = [f"L{level}.M{m}" for level in range(2) for m in range(side)]
        self.book = RoundBook()  # who trained each path's rounds
        for rnd in (0, 1):  # round 0 finished, round 1 live
            for p in range(peers):
                versions = {mids[p % side]: rnd, mids[side + p // side % side]: rnd}
                lease = self.s.claim(f"peer{p}", {p: rnd}, None)
                lease.module_versions = versions
                self.clock.now += 0.01
                if rnd == 0:
                    self.s.finish(lease.task_id)
                    self.book.finish(p, 0, f"peer{p}")
        self.norms = NormTracker(None)
        for mid in mids:
            for _ in range(64):
                self.norms.record(mid, self.rng.random(), 1)
        self.mids, self.peers, self.next_path = mids, peers, 0

    def change(self) -> None:
        """What one delta changes."""
        self.clock.now += 0.05
        live = list(self.s.leases.values())
        lease = live[self.rng.randrange(len(live))]
        self.s.heartbeat(lease.task_id, lease.peer_id)
        peer = f"peer{self.rng.randrange(self.peers)}"
        self.s.paces.setdefault(peer, deque(maxlen=3)).append(self.rng.random())
        self.book.finish(self.rng.randrange(self.peers), 1, peer)
        self.s.attempts[(self.next_path, 2)] = 1
        self.s.texts.attempts.mark((self.next_path, 2))  # as Scheduler.claim marks it
        self.next_path = (self.next_path + 1) % self.peers
        for mid in self.rng.sample(self.mids, 2):
            self.norms.record(mid, self.rng.random(), 2)

    def kept(self) -> int:
        text = self.s.snapshot_text() + self.book.trained_by_json()
        return len(text) + len(self.norms.snapshot_bytes())

    def whole(self) -> int:
        text = dumps(self.s.snapshot()) + dumps(self.book.trained_by_list())
        return len(text) + len(compact_json_bytes(self.norms.snapshot()))


def per_write(peers: int, writes: int, kept: bool) -> tuple[float, int]:
    """Seconds per write (the changes of a delta, then both files encoded), and the bytes."""
    state = State(peers)
    encode = state.kept if kept else state.whole
    size = encode()  # the first write encodes every entry either way
    began = time.perf_counter()
    for _ in range(writes):
        state.change()
        size = encode()
    return (time.perf_counter() - began) / writes, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--writes", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="CI's short form: 64 and 256 peers")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.peers, args.writes = [64, 256], 100
    rows = {}
    for n in args.peers:
        kept, size = per_write(n, args.writes, kept=True)
        whole, _ = per_write(n, args.writes, kept=False)
        rows[n] = (kept, whole)
        print(
            f"{n:5d} peers ({size / 1024:7.1f} KiB): kept {kept * 1e6:8.1f} us/write, "
            f"whole {whole * 1e6:8.1f} us/write"
        )
    large = max(rows)
    ratio = rows[large][1] / rows[large][0]
    print(f"ratio whole / kept at {large} peers: {ratio:.1f}")
    record(
        args,
        "state_files",
        f"{large} peers: {rows[large][0] * 1e6:.0f} us per write kept vs "
        f"{rows[large][1] * 1e6:.0f} us whole ({ratio:.1f}x)",
    )


if __name__ == "__main__":
    main()
