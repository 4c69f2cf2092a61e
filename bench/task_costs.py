"""Where a task's time goes besides training: each phase of a real peer's task, against its limit.

A real ``Peer`` claims tasks from a real coordinator (in this process, through ``LocalTransport``:
its requests run on this thread, so each phase is timed where it runs) and trains each for H
inner steps (1 by default: the cost of a step is bench/peer_throughput.py's business). Every
phase is timed on its own by wrapping the function that does it, exclusive of the phases it
calls (a fetch that waits for the coordinator to serve the modules counts the serving apart):

  peer         claim, fetch, verify (release hashes), build (the path's model from the modules),
               open (optimizer, data), load state (inner AdamW state from disk), steps, deltas,
               encode (codec and error feedback), save state (inner state to disk), send,
               frame (the message encoded), seal (BLAKE3 and Ed25519), open reply, decode reply
  coordinator  a request's handling (the rest of it: envelope, gate, decoding), open request
               (hash and signature checked), each operation
               (ClaimTask, FetchModules, SubmitDelta: the delta's checks), stage (the delta's
               durable file), commit, fsync, the outer step (a round's last delta makes it,
               here on the peer's request), seal reply, coordinator.json

Each phase is printed against the limit under it, measured in the same run on the same bytes:
a copy of the path's float32 parameters into touched memory (memcpy), the same into fresh
memory (clone: page faults), SHA-256, BLAKE3 and XXH3 over them, and a write of them with
fsync. The sum of the non-training phases is printed against the budget the issue sets: 5% of
an H = 150 task at the paper path's H100 rate in docs/benchmarks.md.

    python bench/task_costs.py --paper-path         # the paper's 130.7M path (~4 min, ~10 GiB)
    python bench/task_costs.py                      # a 10M path (~1 min)
    python bench/task_costs.py --paper-path --no-keep   # every task builds and loads (before)
    python bench/task_costs.py --paper-path --loopback  # the peer in its own process: its RSS
    python bench/task_costs.py --quick              # CI's short form
    python bench/task_costs.py --paper-path --loopback --trace  # the RSS as each task goes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import torch
import xxhash

from dipaco.coordinator import admission, service
from dipaco.coordinator.durable import GroupWriter
from dipaco.coordinator.store import ModuleStore
from dipaco.model.optim import InnerSettings, make_optimizer, train_step
from dipaco.model.transformer import ModelConfig, PathModel
from dipaco.peer import modules as peer_modules
from dipaco.peer import training as peer_training
from dipaco.peer.peer import Peer
from dipaco.peer.push import Pusher
from dipaco.peer.state import InnerState
from dipaco.peer.training import PathTrainer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth, transport
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport, LoopbackServer, LoopbackTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, record  # noqa: E402
from peer_throughput import path_config  # noqa: E402

# The paper path's bare-loop rate on an H100 (docs/benchmarks.md, peer_throughput, 2026-11-25/26:
# 384,535-396,485 tok/s at batch 16 x 1024): an H = 150 task trains 150 x 16,384 tokens.
H100_TOKENS_PER_SECOND = 390_000
PAPER_TASK_TOKENS = 150 * 16 * 1024
TRAINING = {"steps"}  # every other phase is a task's fixed cost


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: Linux's VmHWM, the high-water mark of
    this process's own memory. Not ``ru_maxrss``, which a process started by another keeps from
    the forked copy of its parent (a child of this bench read 4 GiB before it did anything)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


TRACED = ("fetch", "build", "steps")  # --trace: the phases at whose start the RSS is printed


def resident() -> int:
    """This process's resident set now, in bytes (Linux's VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


class Probe:
    """Exclusive seconds per phase: each wrapped function's time, less that of wrapped functions
    it calls. Only this thread's calls count (the coordinator's background writes do not).
    ``raised``: by how many bytes the process's peak RSS rose while each phase ran (exclusive
    too), so that the phase that sets the peak is named."""

    def __init__(self, trace: bool = False) -> None:
        self.trace = trace  # print the RSS as each fetch, build and steps phase begins
        self._traced = ""
        self.seconds: dict[str, float] = defaultdict(float)
        self.raised: dict[str, int] = defaultdict(int)
        self.calls: Counter[str] = Counter()
        self.peak = peak_rss()  # the peak so far, as last read
        self._stack: list[str] = []
        self._since = 0.0
        self._thread = threading.get_ident()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        fn = original.__func__ if isinstance(original, staticmethod) else original

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            return self.run(phase, fn, *args, **kwargs)

        setattr(owner, attr, staticmethod(timed) if isinstance(original, staticmethod) else timed)
        self._undo.append((owner, attr, original))

    def run(self, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self._thread:
            return fn(*args, **kwargs)
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
            self._rss(self._stack[-1])
        if self.trace and phase in TRACED and phase != self._traced:
            self._traced = phase  # once per run of a phase (the steps are many calls)
            print(f"  rss {resident() / 2**30:.2f} GiB as {phase} begins", file=sys.stderr)
        self._stack.append(phase)
        self._since = now
        try:
            return fn(*args, **kwargs)
        finally:
            now = time.perf_counter()
            self.seconds[self._stack[-1]] += now - self._since
            self._rss(self._stack.pop())
            self._since = now
            self.calls[phase] += 1

    def _rss(self, phase: str) -> None:
        peak = peak_rss()
        if peak > self.peak:
            self.raised[phase] += peak - self.peak
            self.peak = peak

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def close(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def install(probe: Probe) -> None:
    """Wrap the functions behind each phase (module attributes where they are looked up)."""
    for owner, attr, phase in [
        (Peer, "_claim_batch", "claim"),
        (peer_training, "trim_heap", "trim heap"),
        (Peer, "fetch", "fetch"),
        (peer_modules, "tensors_sha256", "verify"),
        (PathTrainer, "build", "build"),
        (PathTrainer, "open", "open"),
        (InnerState, "load", "load state"),
        (PathTrainer, "step", "steps"),
        (PathTrainer, "stepped", "steps"),
        (PathTrainer, "deltas", "deltas"),
        (Pusher, "encode", "encode"),
        (InnerState, "save", "save state"),
        (Pusher, "send", "send"),
        (transport, "encode_message_gathered", "frame"),
        (auth, "seal_request", "seal"),
        (auth, "open_reply", "open reply"),
        (transport, "decode_message", "decode reply"),
        (service, "handle_in_slot", "coord: request (envelope, gate, decode)"),
        (auth, "open_split", "coord: open request"),
        (auth, "seal_reply", "coord: seal reply"),
        (ModuleStore, "stage_delta", "coord: stage"),
        (ModuleStore, "commit_delta", "coord: commit"),
        (ModuleStore, "run_step", "coord: outer step (a round's last delta)"),
        (admission, "fsync_path", "coord: fsync"),
        (GroupWriter, "_write", "coord: coordinator.json"),
    ]:
        probe.wrap(owner, attr, phase)
    for kind in (m.ClaimTask, m.FetchModules, m.SubmitDelta, m.TaskDone):
        op = service.OPS[kind]
        run = functools.partial(probe.run, f"coord: {kind.__name__}", op.run)
        service.OPS[kind] = op._replace(run=run)


def limits(n_bytes: int, folder: Path) -> dict[str, float]:
    """Seconds of each reference operation on ``n_bytes`` (best of three)."""
    src = torch.rand(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    raw = src.numpy().view("uint8")
    out: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: dst.copy_(src),
        "clone": lambda: src.clone(),
        "sha256": lambda: hashlib.sha256(raw).digest(),
        "blake3": lambda: blake3.blake3(raw, max_threads=blake3.blake3.AUTO).digest(),
        "xxh3": lambda: xxhash.xxh3_128(raw).digest(),
        "write+fsync": lambda: _write_synced(folder / "limit.bin", raw),
    }
    best = {}
    for name, fn in out.items():
        times = []
        for _ in range(3):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        best[name] = min(times)
    (folder / "limit.bin").unlink(missing_ok=True)
    return best


def _write_synced(path: Path, data: Any) -> None:
    with open(path, "wb", buffering=0) as f:
        f.write(data)
        os.fsync(f.fileno())


# Each phase's limit: (reference operation, how many path-sizes of it). Fetch and the delta's
# checks move the path's bytes once; verify and seal hash them; state files are the AdamW
# moments (two path-sizes) written with fsync. The frame is a message's head only (a delta is
# sent from its tensors' own memory): no limit.
LIMIT_OF = {
    "fetch": ("memcpy", 1),
    "verify": ("sha256", 1),
    "build": ("clone", 1),
    "load state": ("memcpy", 2),
    "deltas": ("clone", 1),
    "encode": ("memcpy", 1),
    "save state": ("write+fsync", 2),
    "seal": ("blake3", 1),
    "coord: open request": ("blake3", 1),
    "coord: SubmitDelta": ("memcpy", 1),
    "coord: FetchModules": ("memcpy", 1),
    "coord: stage": ("write+fsync", 1),
}


def main() -> None:
    if sys.argv[1:2] == ["--peer-child"]:
        address, state, n_tasks, keep = sys.argv[2:6]
        return peer_child(address, state, int(n_tasks), keep == "--keep")
    if sys.argv[1:2] == ["--bare-child"]:
        return bare_child(json.loads(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1, help="inner steps H per task")
    ap.add_argument(
        "--tasks",
        type=int,
        default=6,
        help="tasks timed after a warm-up task (2x2: the 4th is the first of a path again)",
    )
    ap.add_argument(
        "--paper-path",
        action="store_true",
        help="the paper's path: 12 blocks, width 896, 16 heads, sequence 1024 (130.7M)",
    )
    ap.add_argument(
        "--no-keep",
        action="store_true",
        help="every task builds its path and reads its inner state (as before 2026-11-29)",
    )
    ap.add_argument(
        "--loopback",
        action="store_true",
        help="the peer in a process of its own over 127.0.0.1 (its own peak RSS; no "
        "coordinator phases)",
    )
    ap.add_argument("--quick", action="store_true", help="CI's short form: a tiny path")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="print the peer's RSS as each fetch, build and steps phase begins (stderr)",
    )
    add_report_args(ap)
    args = ap.parse_args()
    if args.trace:
        os.environ["DIPACO_BENCH_TRACE"] = "1"  # the peer's process too, with --loopback
    if args.paper_path:
        args.dim, args.layers, args.heads, args.seq = 896, 12, 16, 1024
    if args.quick:
        args.dim, args.layers, args.heads, args.seq, args.vocab, args.tasks = 64, 2, 2, 64, 512, 4
    with tempfile.TemporaryDirectory(prefix="dipaco-task-costs-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> None:
    config = path_config(args, args.tasks // 4 + 2)  # a task per path per round
    print(f"preparing a run in {work} (tokenizer, router, shards)...", flush=True)
    prep = prepare(work / "run", config)
    coordinator = build_coordinator(
        prep, MetricsLog(work / "run" / "metrics.jsonl"), evaluate=False
    )
    cfg = prep.config.build_model_config()
    modules = {mid: coordinator.store.params(mid) for mid in coordinator.store.modules}
    n_params = sum(t.numel() for t in coordinator.topology.join_modules(0, modules).values())
    n_bytes = 4 * n_params
    print(
        f"path: {n_params / 1e6:.1f}M parameters ({n_bytes / 2**20:,.0f} MiB float32; width "
        f"{cfg.dim}, {cfg.n_layers} blocks, vocab {cfg.vocab_size}); H = {args.steps}, batch "
        f"{args.batch} x {args.seq}; codec lossless; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    ref = limits(n_bytes, work)
    print(
        "limits on the path's bytes: "
        + ", ".join(f"{k} {v:.3f} s ({n_bytes / v / 1e9:.2f} GB/s)" for k, v in ref.items()),
        flush=True,
    )
    if args.loopback:  # the peer in a process of its own, over 127.0.0.1
        authkey = secrets.token_bytes(32)
        server = LoopbackServer(coordinator.handle, authkey)
        try:
            child = subprocess.run(
                [sys.executable, __file__, "--peer-child", server.address, str(work / "peer"),
                 str(args.tasks + 1), "--no-keep" if args.no_keep else "--keep"],
                env={**os.environ, "DIPACO_BENCH_AUTHKEY": authkey.hex()},
                stdout=subprocess.PIPE, text=True, check=True,
            )  # fmt: skip
        finally:
            server.close()
        lines = child.stdout.splitlines()
        print("\n".join(lines[:-1]))
        result = json.loads(lines[-1])
        tasks, rss, raised = result["tasks"], result["rss"], result["raised"]
        who = "the peer's process"
    else:
        transport = LocalTransport(coordinator.handle).authenticate(Identity.generate())
        tasks, raised = train_tasks(transport, work / "peer", args.tasks + 1, not args.no_keep)
        rss = peak_rss()
        who = "this process (peer and coordinator)"
    bare = bare_peak(cfg, args.batch)
    report(
        args, tasks[1:], ref, n_params, rss, who, raised, bare
    )  # the first warmed up (allocator, caches)


def bare_peak(cfg: ModelConfig, batch: int) -> int:
    """The peak RSS of a bare training process of the path (``bare_child``), in bytes."""
    out = subprocess.run(
        [sys.executable, __file__, "--bare-child", json.dumps(dataclasses.asdict(cfg)), str(batch)],
        stdout=subprocess.PIPE, text=True, check=True,
    )  # fmt: skip
    return int(json.loads(out.stdout.splitlines()[-1])["rss"])


def bare_child(cfg: dict[str, Any], batch: int) -> None:
    """The least a process that trains this path holds: its model, AdamW (moments made by a
    first step) and two steps' gradients and activations, with nothing of dipaco's around
    them; its peak RSS as a JSON line."""
    config = ModelConfig(**cfg)
    model = PathModel(config)
    model.train()
    settings = InnerSettings(
        lr=1e-4, warmup_steps=1, total_steps=10, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0
    )
    optimizer = make_optimizer(model, settings)
    windows = torch.randint(config.vocab_size, (batch, config.max_seq_len + 1))
    for step in range(2):
        train_step(model, optimizer, windows, settings, step=step)
    print(json.dumps({"rss": peak_rss()}))


def peer_child(address: str, state: str, n_tasks: int, keep: bool) -> None:
    """--loopback's peer process: its tasks' phases and its peak RSS, as a JSON line."""
    authkey = bytes.fromhex(os.environ["DIPACO_BENCH_AUTHKEY"])
    transport = LoopbackTransport(address, authkey).authenticate(Identity.generate())
    tasks, raised = train_tasks(transport, Path(state), n_tasks, keep)
    print(json.dumps({"tasks": tasks, "rss": peak_rss(), "raised": raised}))


Task = tuple[bool, float, dict[str, float], dict[str, int]]  # again, not training, phases, calls


def train_tasks(
    transport: Any, state: Path, n_tasks: int, keep: bool
) -> tuple[list[Task], dict[str, int]]:
    """One run of a real peer, as `dipaco-peer join` trains (a task of the path it trained
    last continues what it holds); each task's phases, those since the last task ended; and
    by how much each phase raised the process's peak RSS over the run (outside any: "other")."""
    peer = Peer(transport, "bench", state, checkpoint_seconds=3600.0)
    peer.keep_path = keep
    probe = Probe(trace=bool(os.environ.get("DIPACO_BENCH_TRACE")))
    start = probe.peak  # imports, the peer's set-up
    install(probe)
    tasks: list[Task] = []
    ended = [time.perf_counter()]
    run_task = Peer.run_task

    def task_then_record(self: Peer, *a: Any, **kw: Any) -> None:
        run_task(self, *a, **kw)
        now = time.perf_counter()
        wall, ended[0] = now - ended[0], now
        seconds = dict(probe.seconds)
        seconds["other"] = wall - sum(seconds.values())
        fixed = wall - seconds.get("steps", 0.0)
        i = len(tasks)
        again = self.trainer.counts["reused"] > sum(t[0] for t in tasks)
        print(
            f"{'warm-up' if i == 0 else f'task {i}':>8}: path P{self.last_path}"
            f"{' again' if again else ''}, {wall:.2f} s, of which not training {fixed:.2f} s",
            flush=True,
        )
        tasks.append((again, fixed, seconds, dict(probe.calls)))
        probe.reset()

    Peer.run_task = task_then_record  # type: ignore[method-assign]
    try:
        peer.max_tasks = n_tasks
        peer.run()
    finally:
        Peer.run_task = run_task  # type: ignore[method-assign]
        probe.close()
    raised = {"before the run": start, **probe.raised}
    raised["other"] = raised.get("other", 0) + peak_rss() - probe.peak
    return tasks, raised


def report(
    args: argparse.Namespace,
    tasks: list[Task],
    ref: dict[str, float],
    n_params: int,
    rss: int,
    who: str,
    raised: dict[str, int],
    bare: int,
) -> None:
    n_bytes = 4 * n_params
    kinds = {"new path": False, "same path again": True}
    best = {}
    for kind, again in kinds.items():
        done = [t for t in tasks if t[0] == again]
        if done:
            best[kind] = min(done, key=lambda t: t[1])
    print("\nseconds by phase (exclusive), the task of each kind with the least fixed cost:")
    print(f"  {'phase':<40}" + "".join(f"{k:>17}" for k in best) + "   limit")
    phases = {p for t in best.values() for p in t[2]}
    for phase in sorted(phases, key=lambda p: -max(t[2].get(p, 0.0) for t in best.values())):
        row = "".join(
            f"{t[2].get(phase, 0.0):>11.3f} s{t[3].get(phase, 0):>3}x" for t in best.values()
        )
        limit = LIMIT_OF.get(phase)
        against = ""
        if limit is not None:
            op, times = limit
            floor = ref[op] * times
            ratio = max(t[2].get(phase, 0.0) for t in best.values()) / floor
            against = f"   {times} x {op} {floor:.3f} s (worst {ratio:.1f}x)"
        print(f"  {phase:<40}{row}{against}")
    print(
        "  " + " " * 40 + "".join(f"{t[1]:>11.3f} s    " for t in best.values()) + "   not training"
    )
    budget = 0.05 * PAPER_TASK_TOKENS / H100_TOKENS_PER_SECOND
    floor = sum(ref[op] * k for op, k in LIMIT_OF.values())
    print(
        f"\nbudget for what is not training: 5% of an H = 150 task at {H100_TOKENS_PER_SECOND:,} "
        f"tok/s on an H100 = {budget:.2f} s; the limits under the phases add up to {floor:.2f} s"
    )
    bound = bare + n_bytes
    print(
        f"peak RSS of {who}: {rss / 2**30:.2f} GiB; the path's weights, AdamW state and one "
        f"delta: {4 * n_bytes / 2**30:.2f} GiB; a bare training process of the path (interpreter, "
        f"weights, AdamW, gradients, activations) {bare / 2**30:.2f} GiB, and one delta more "
        f"{bound / 2**30:.2f} GiB: the peak over that {rss / bound:.2f}"
    )
    rises = sorted(((b, p) for p, b in raised.items() if b >= 1 << 20), reverse=True)
    print(
        "the peak RSS rose, over the whole run, while: "
        + ", ".join(f"{p} {b / 2**30:.2f} GiB" for b, p in rises)
    )
    fixed = {k: t[1] for k, t in best.items()}
    for kind, s in fixed.items():
        print(f"ratio not training / budget ({kind}): {s / budget:.2f}")
    top = {
        k: sorted(((s, p) for p, s in t[2].items() if p not in TRAINING), reverse=True)[:4]
        for k, t in best.items()
    }
    record(
        args,
        "task_costs",
        f"{n_params / 1e6:.1f}M path, H={args.steps}, cpu, "
        + ("peer over loopback" if args.loopback else "in-process")
        + (", --no-keep" if args.no_keep else "")
        + ": not training "
        + "; ".join(
            f"{k} {fixed[k]:.2f} s ({fixed[k] / budget:.1f}x the budget {budget:.2f} s; "
            + ", ".join(f"{p} {s:.2f}" for s, p in top[k])
            + ")"
            for k in best
        )
        + f"; limits {floor:.2f} s; peak RSS {rss / 2**30:.2f} GiB, {rss / bound:.2f} of a bare "
        + f"training process and one delta ({bound / 2**30:.2f} GiB; rose in "
        + ", ".join(f"{p} {b / 2**30:.2f}" for b, p in rises[:4])
        + ")",
    )


if __name__ == "__main__":
    main()
