"""Load: many simulated peers against one coordinator over loopback TCP, for several rounds.

The coordinator runs in its own process (``soak.py serve``), serving a real
``Coordinator.handle`` through ``LoopbackServer``; each simulated peer is a thread with its own
key and ``LoopbackTransport`` that speaks the real protocol: Hello, then ClaimTask, FetchModules
(with its cache of module versions), SubmitDelta with a small random delta (no training), and
claim again, until the run says it is finished. The topology has at least as many paths as peers
(``KxK`` with K = ceil(sqrt(peers))), so every peer gets a task every round.

What it checks, from the coordinator's own metrics events (``delta_acked``, ``outer_step``) and
the peers' replies: the run reaches its last round; every acknowledged (module, task) appears in
exactly one outer step (no delta lost or applied twice); the coordinator process's memory (RSS,
sampled by the coordinator at each round) does not grow with the rounds beyond a constant times
the model's size; its per-task records (``Scheduler.issued``) stay bounded.

What it prints: acknowledged SubmitDelta per second of wall time and request latency percentiles,
and the same number of deltas submitted by one peer sequentially against a fresh coordinator in
the same run, as a ratio, so that the figure shows how the coordinator scales with concurrent
peers rather than how fast this machine is.

    python bench/soak.py --peers 64 --rounds 5          # appends a row to docs/reliability.md
    python bench/soak.py --peers 64 --rounds 2 --no-doc # just print
    python bench/soak.py --peers 64 --peer-processes 4  # the peers in 4 processes
    python bench/soak.py --peers 64 --bound --no-doc    # a diagnosis: see serve()
    python bench/soak.py --peers 64 --owners 1          # a scheduler and a module owner process
    python bench/soak.py --peers 64 --repeat 3          # 3 pairs, alternating; the median ratio

With ``--owners K`` the coordinator is K + 1 processes, as a run with module owners is
(docs/operations.md, "Add a module owner"): the scheduler and K owners, the modules dealt in
turn to each, and the peers fetch each module from its owner, push each module's delta to its
owner (one SubmitDelta per owner) and tell the scheduler TaskDone; the sequential peer runs
against the same K + 1 processes. A *delta* is still a path's (every module of the task
acknowledged), so the figures compare with one coordinator's; no row is appended (the
table's runs are one coordinator process).

It also prints, per delta, the coordinator process's CPU (and kernel) time, context switches and
fsync calls, and the simulated peers' CPU time (their imports happen before the clock starts).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
N_LAYERS = 2


def side_for(peers: int) -> int:
    """K such that a KxK topology has at least one path per peer."""
    return max(2, math.ceil(math.sqrt(peers)))


def _switches() -> int:
    """This process's context switches so far, all threads, voluntary (a wait: a lock, the
    GIL, a socket, the disk) and not."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def _rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; peak RSS elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the coordinator process ------------------------------------------------------------------


def serve(
    root: Path,
    side: int,
    rounds: int,
    dim: int,
    bound: bool = False,
    owner: int | None = None,
    owners: int = 0,
) -> None:
    """Run one coordinator until its run finishes and the driver closes our stdin.

    Writes ``server.json`` (address, loopback key, coordinator key, model bytes) once it listens,
    and every metrics event to ``events.jsonl``; at each round, and once more at the end, an
    ``rss`` event with this process's RSS and the sizes of the coordinator's per-task records.

    ``owner`` = i (``--owner i``): this process is module owner i of ``owners``, beside the
    scheduler that already runs in ``root``, as ``dipaco-coordinator start --join --owns``
    runs one: the scheduler allows its key as an owner (``change_access``, what ``allow
    --owner`` does), it takes its share of the modules over (``take_over``: HandOver, then
    ConfirmOwnership) and reports to the scheduler (``Reporter``). Its share: the sorted module
    ids dealt in turn to the scheduler and the owners, the scheduler first. It writes
    ``owner{i}.json`` and ``events-owner{i}.jsonl``.

    ``bound`` (``--bound``, a diagnosis, never a configuration of dipaco): requests run one at
    a time (a lock around the handler: no two threads ever run it, so no hand-offs between
    them), ``fsync`` does nothing and coordinator.json and validation.json are never written.
    That is what a coordinator with no thread hand-offs, whose durable writes cost nothing
    per request (all batched), could at best do on this machine with this much Python per
    request. Not crash-safe, so never a figure of dipaco itself.
    """
    import torch

    from dipaco.config import SchedulerSection, SecuritySection
    from dipaco.coordinator.access import change_access
    from dipaco.coordinator.core import Coordinator
    from dipaco.coordinator.outer import OuterSettings
    from dipaco.coordinator.owner import Reporter, take_over
    from dipaco.model.topology import Topology
    from dipaco.model.transformer import ModelConfig, new_dense_model
    from dipaco.protocols import auth
    from dipaco.protocols.transport import LoopbackServer, LoopbackTransport

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=256, dim=dim, n_layers=N_LAYERS, n_heads=2, max_seq_len=16)
    topo = Topology.parse(f"{side}x{side}", N_LAYERS)
    fsyncs = [0]
    me = "" if owner is None else f"-owner{owner}"
    events = open(root / f"events{me}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
    write_lock = threading.Lock()
    holder: list[Coordinator] = []

    def sample(kind: str, rnd: int) -> dict[str, Any]:
        """Called from the coordinator's metrics sink, under its lock: a full collection
        here (tens of ms with torch loaded) would stall every request, so only the final
        sample collects first."""
        co = holder[0]
        if kind == "final":
            gc.collect()
        return {
            "event": kind,
            "round": rnd,
            "rss_bytes": _rss_bytes(),
            # a module owner has no scheduler (core.scheduler is None): no tasks to count
            "issued": len(co.scheduler.issued) if co.scheduler else 0,
            "attempts": len(co.scheduler.attempts) if co.scheduler else 0,
            "done": len(co.book.done),
            "peers": len(co.roster.peers),
            "cpu_s": time.process_time(),  # this process's CPU seconds, all threads
            "sys_s": os.times().system,  # of which in the kernel (file system calls, sockets)
            "switches": _switches(),
            "fsyncs": fsyncs[0],
        }

    def on_event(event: dict) -> None:
        lines = [{**event, "t": time.monotonic()}]  # when, on the clock all processes share
        if event.get("event") == "round":
            lines.append(sample("rss", event["round"]))
        with write_lock:
            for e in lines:
                events.write(json.dumps(e) + "\n")

    scheduler = None if owner is None else json.loads((root / "server.json").read_text())
    as_owner: dict[str, Any] = {}
    if scheduler is not None:
        as_owner = {
            "owner_id": f"owner{owner}",
            "identity": auth.Identity.generate(),
            "scheduler_key": scheduler["coordinator_key"],
            "is_scheduler": False,
        }
    co = Coordinator(
        root / ("co" if owner is None else f"owner{owner}"),
        topo,
        **as_owner,
        rounds=rounds,
        inner_steps=1,
        step_offset=0,
        total_steps=rounds,
        seed=0,
        outer=OuterSettings(),
        lease_seconds=600.0,
        run_id="soak",
        peer_config={},
        metrics=on_event,
        # Every round waits for all its paths (no deadlines on a loaded 2-core box), so that
        # the accounting below is exact; quotas sized for one key per simulated peer.
        policy=SchedulerSection(
            lease_seconds=600.0, quorum=1.0, deadline_floor=1e6, min_step_fraction=1.0
        ),
        security=SecuritySection(requests_per_second=1e6, burst=10**6),
    )
    holder.append(co)
    handler = co.handle
    real_fsync = os.fsync

    def counted_fsync(fd: int) -> None:  # every fsync of this process, counted
        fsyncs[0] += 1
        if not bound:
            real_fsync(fd)

    os.fsync = counted_fsync  # type: ignore[assignment]
    if bound:
        from dipaco.coordinator import durable

        durable.GroupWriter.flush = lambda self: None  # type: ignore[method-assign]
        one_at_a_time = threading.Lock()

        def handler(data: bytes) -> bytes:
            with one_at_a_time:
                return co.handle(data)

    stop = threading.Event()
    reporter = None
    if scheduler is None:
        co.start(topo.init_modules(new_dense_model(cfg, 0).state_dict()))
        authkey = secrets.token_bytes(32)
        server = LoopbackServer(handler, authkey)
    else:
        assert owner is not None
        co.start(None)
        authkey = bytes.fromhex(scheduler["authkey"])  # one loopback key for the bench's servers
        server = LoopbackServer(handler, authkey)
        co.reachable_at([server.address])  # what peers learn from GetOwners
        change_access(root / "co", co.identity.public_key, allow=True, owner=True)
        take_over(
            co,
            LoopbackTransport(scheduler["address"], authkey),
            sorted(topo.module_ids())[owner + 1 :: owners + 1],
        )
        reporter = Reporter(co, LoopbackTransport(scheduler["address"], authkey), interval=0.5)
        reporter.start()
    model_bytes = sum(
        t.numel() * t.element_size()
        for mid in co.owned_modules()
        for t in co.store.params(mid).values()
    )

    def ticker() -> None:  # what the CLI's server does: expire leases, close overdue rounds
        while not stop.wait(0.5):
            co.tick()

    threading.Thread(target=ticker, daemon=True).start()
    info = {
        "address": server.address,
        "authkey": authkey.hex(),
        "coordinator_key": co.identity.public_key,
        "model_bytes": model_bytes,
        "modules": len(co.owned_modules()),
        "paths": topo.num_paths,
        "pid": os.getpid(),
        "cpu_s": time.process_time(),
        "sys_s": os.times().system,
        "switches": _switches(),
        "fsyncs": fsyncs[0],
        "bound": bound,
    }
    name = "server" if owner is None else f"owner{owner}"
    tmp = root / f"{name}.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.rename(root / f"{name}.json")
    sys.stdin.read()  # the driver closes our stdin once its peers are done
    stop.set()
    if reporter is not None:
        reporter.close()
    server.close()
    with co.lock:
        final = sample("final", co.round)
    final["finished"] = co.finished
    with write_lock:
        events.write(json.dumps(final) + "\n")
    events.close()


# ---- the simulated peers ----------------------------------------------------------------------


@dataclass
class PeerStats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    acked: list[tuple[str, str]] = field(default_factory=list)  # (module, task) acknowledged
    submits: int = 0  # SubmitDelta answered by a DeltaAck
    errors: Counter[str] = field(default_factory=Counter)
    tasks: int = 0


def peer_loop(
    name: str,
    address: str,
    authkey: bytes,
    server_key: str,
    deadline: float,
    stats: PeerStats,
    long_poll: bool = True,
    owners: bool = False,
) -> None:
    """One simulated peer: the real protocol, with a random delta instead of training.
    Without ``long_poll`` its claims ask for no wait (a NoTask comes back at once). With
    ``owners`` (module owners beside the scheduler) it asks the scheduler where the owners are
    (GetOwners), as ``dipaco-peer join`` does, fetches each module from its owner and pushes
    each module's delta to its owner, one SubmitDelta per owner, then TaskDone to the
    scheduler unless an owner's acknowledgement said the task was done."""
    import torch

    from dipaco.errors import DipacoError, RejectedError
    from dipaco.peer.links import CLAIM_WAIT
    from dipaco.peer.push import REPORT_WAIT
    from dipaco.protocols import auth
    from dipaco.protocols import messages as m
    from dipaco.protocols.reasons import Reason
    from dipaco.protocols.transport import LoopbackTransport

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    me = auth.Identity.generate()  # one key towards the scheduler and every owner

    def timed(tr: LoopbackTransport, msg: Any) -> Any:
        t = time.perf_counter()
        try:
            return tr.request(msg)
        finally:
            stats.latencies[type(msg).__name__].append(time.perf_counter() - t)

    tr: LoopbackTransport | None = None
    links: dict[str, LoopbackTransport] = {}  # owner id -> its link (the scheduler's: tr)
    cache: dict[str, dict[str, torch.Tensor]] = {}
    have: dict[str, int] = {}
    last_path: int | None = None
    while time.monotonic() < deadline:
        try:
            if tr is None:
                tr = LoopbackTransport(address, authkey).authenticate(me, server_key)
                timed(tr, m.Hello(peer_id=name, device="cpu"))
                if owners:
                    where = timed(tr, m.GetOwners())
                    links = {
                        o: LoopbackTransport(addrs[0], authkey).authenticate(me, where.keys[o])
                        for o, addrs in where.addresses.items()
                        if addrs
                    }
            wait = CLAIM_WAIT if long_poll else 0.0
            offer = timed(tr, m.ClaimTask(peer_id=name, prefer_path=last_path, wait=wait))
            if isinstance(offer, m.NoTask):
                if offer.finished:
                    break
                time.sleep(offer.retry_after)
                continue
            groups: dict[str, list[str]] = defaultdict(list)
            for mid in offer.module_versions:
                groups[offer.owners.get(mid, "")].append(mid)
            for owner, mids in groups.items():
                mods = timed(
                    links.get(owner, tr),
                    m.FetchModules(
                        name, offer.task_id, {k: have[k] for k in mids if k in have}, offer.ticket
                    ),
                )
                for key, t in mods.tensors.items():
                    mid, _, pname = key.partition("/")
                    cache.setdefault(mid, {})[pname] = t
                have.update(mods.versions)
            done, accepted = False, []
            for owner, mids in groups.items():
                delta = {
                    f"{mid}/{pname}": torch.randn(t.shape, generator=gen) * 1e-3
                    for mid in mids
                    for pname, t in cache[mid].items()
                }
                ack = timed(
                    links.get(owner, tr),
                    m.SubmitDelta(
                        name,
                        offer.task_id,
                        offer.path,
                        offer.module_versions,
                        64,
                        [3.0],
                        delta,
                        ticket=offer.ticket,
                        codec=offer.codec,
                    ),
                )
                # The submits that close a module's round wait for its outer step: apart, too.
                closing = "SubmitDelta, closing" if ack.closed else "SubmitDelta, other"
                stats.latencies[closing].append(stats.latencies["SubmitDelta"][-1])
                done = done or ack.task_done
                accepted += ack.accepted
            while not done:  # the scheduler hears of the other owners' acks from their reports
                try:
                    timed(
                        tr,
                        m.TaskDone(
                            name,
                            offer.task_id,
                            offer.ticket,
                            64,
                            [3.0],
                            list(offer.module_versions),
                            wait=REPORT_WAIT,  # as dipaco-peer's: a long poll for reports
                        ),
                    )
                    done = True
                except RejectedError as exc:
                    if exc.reason != Reason.NOT_ACKED:
                        raise
                    time.sleep(0.005)
            stats.submits += 1  # a path's delta, every module of it acknowledged
            stats.tasks += 1
            stats.acked += [(mid, offer.task_id) for mid in accepted]
            last_path = offer.path
        except DipacoError as exc:
            stats.errors[exc.reason] += 1
            time.sleep(0.1)
    for link in [tr, *links.values()]:
        if link is not None:
            link.close()


# ---- one run: a coordinator process and its peers ----------------------------------------------


def _child_env() -> dict:
    """The environment of the bench's own processes: the repository first on the path, and the
    caller's PYTHONPATH kept (a machine whose dependencies sit in a folder of their own)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_load(
    root: Path,
    peers: int,
    rounds: int,
    *,
    side: int | None = None,
    dim: int = 32,
    timeout: float = 300.0,
    processes: int = 1,
    bound: bool = False,
    owners: int = 0,
) -> dict[str, Any]:
    """Start a coordinator process, run ``peers`` peer threads until the run ends; the facts.

    ``processes`` > 1 spreads the peer threads over that many processes (``soak.py peers``), so
    that the simulated peers do not all wait for one interpreter lock. ``bound``: the
    coordinator runs as :func:`serve` describes for it, and the peers' claims do not wait.
    ``owners``: that many module owner processes beside the scheduler (``serve --owner i``),
    started one after another once the scheduler listens, each taking its share of the
    modules over before the peers start.

    Returns the figures (wall time, deltas per second, latency percentiles, RSS per round) and
    the facts the soak asserts (rounds reached, acknowledged versus stepped deltas).
    """
    root.mkdir(parents=True, exist_ok=True)
    side = side or side_for(peers)
    serve_args = ["--root", str(root), "--side", str(side), "--rounds", str(rounds)]
    serve_args += ["--dim", str(dim), *(["--bound"] if bound else [])]
    children: list[subprocess.Popen] = []
    try:
        for k in range(-1, owners):  # the scheduler, then each owner once the one before is up
            role = [] if k < 0 else ["--owner", str(k), "--owners", str(owners)]
            children.append(
                subprocess.Popen(
                    [sys.executable, __file__, "serve", *serve_args, *role],
                    stdin=subprocess.PIPE,
                    cwd=REPO,
                    env=_child_env(),
                )
            )
            _wait_for_file(root / ("server.json" if k < 0 else f"owner{k}.json"), children[-1])
        info = json.loads((root / "server.json").read_text())
        info["owners"] = [json.loads((root / f"owner{k}.json").read_text()) for k in range(owners)]
        names = [f"peer{i:03d}" for i in range(peers)]
        if processes > 1:
            stats, wall, peers_cpu, hung = _peer_processes(root, info, names, processes, timeout)
        else:
            stats, wall, peers_cpu, hung = _peer_threads(info, names, timeout)
    finally:
        # The owners first (their reporters still talk to the scheduler), then the scheduler.
        for child in reversed(children):
            if child.stdin is not None:
                child.stdin.close()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    result = _summarise(root, info, stats, rounds, wall, hung=hung)
    result["peers_cpu_s"] = peers_cpu
    return result


def _wait_for_file(file: Path, child: subprocess.Popen, within: float = 120.0) -> None:
    """Wait until a server process has written ``file`` (it listens then)."""
    start = time.monotonic()
    while not file.exists():
        if child.poll() is not None:
            raise RuntimeError(f"the coordinator process exited with {child.returncode}")
        if time.monotonic() - start > within:
            raise RuntimeError(f"no {file.name} from a coordinator process within {within:.0f} s")
        time.sleep(0.05)


def _peer_threads(
    info: dict[str, Any], names: list[str], timeout: float, go: Any = None
) -> tuple[list[PeerStats], float, float, int]:
    """Run a peer thread per name in this process until the run ends: (stats, wall seconds,
    this process's CPU seconds meanwhile, peers still running at the end). ``go``, if given,
    is called just before the threads start (a worker process waits there for the driver)."""
    _peer_imports()  # outside the timing (each peer imports them on its first line)
    stats = [PeerStats() for _ in names]
    if go is not None:
        go()
    deadline = time.monotonic() + timeout
    threads = [
        threading.Thread(
            target=peer_loop,
            args=(
                name,
                info["address"],
                bytes.fromhex(info["authkey"]),
                info["coordinator_key"],
                deadline,
                stats[i],
                not info.get("bound", False),  # the bound's handler must never wait
                bool(info.get("owners")),
            ),
            daemon=True,
        )
        for i, name in enumerate(names)
    ]
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic() + 30))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return stats, wall, cpu, sum(t.is_alive() for t in threads)


def _peer_processes(
    root: Path, info: dict[str, Any], names: list[str], processes: int, timeout: float
) -> tuple[list[PeerStats], float, float, int]:
    """:func:`_peer_threads` in ``processes`` worker processes (``soak.py peers``), the names
    dealt out in turn. Each worker imports what it needs, says it is ready, and starts its
    peers when the driver tells all of them at once; the wall time runs from that word to the
    last worker's end, and the CPU is the workers' own, summed."""
    workers = []
    for k in range(processes):
        out = root / f"peers{k}.json"
        workers.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "peers",
                        "--root",
                        str(root),
                        "--out",
                        str(out),
                        "--timeout",
                        str(timeout),
                        *names[k::processes],
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=REPO,
                    env=_child_env(),
                ),
                out,
            )
        )
    for proc, _ in workers:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a peer worker process did not start")
    t0 = time.perf_counter()
    for proc, _ in workers:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
    for proc, _ in workers:
        proc.wait(timeout + 60)
    wall = time.perf_counter() - t0
    stats, cpu, hung = [], 0.0, 0
    for proc, out in workers:
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"a peer worker process exited with {proc.returncode}")
        got = json.loads(out.read_text())
        cpu += got["cpu_s"]
        hung += got["hung"]
        for s in got["stats"]:
            stats.append(
                PeerStats(
                    latencies=defaultdict(list, s["latencies"]),
                    acked=[tuple(pair) for pair in s["acked"]],
                    submits=s["submits"],
                    errors=Counter(s["errors"]),
                    tasks=s["tasks"],
                )
            )
    return stats, wall, cpu, hung


def _peer_imports() -> None:
    """What :func:`peer_loop` imports, imported (its first import of torch takes seconds)."""
    import torch  # noqa: F401

    from dipaco.peer.links import CLAIM_WAIT  # noqa: F401
    from dipaco.protocols.transport import LoopbackTransport  # noqa: F401


def peers_worker(root: Path, out: Path, names: list[str], timeout: float) -> None:
    """(The ``peers`` subcommand.) Run the named peers against the coordinator of ``root``."""
    info = json.loads((root / "server.json").read_text())
    info["owners"] = [json.loads(f.read_text()) for f in sorted(root.glob("owner*.json"))]

    def go() -> None:
        print("ready", flush=True)
        sys.stdin.readline()

    stats, _, cpu, hung = _peer_threads(info, names, timeout, go)
    doc = {
        "cpu_s": cpu,
        "hung": hung,
        "stats": [
            {
                "latencies": dict(s.latencies),
                "acked": s.acked,
                "submits": s.submits,
                "errors": dict(s.errors),
                "tasks": s.tasks,
            }
            for s in stats
        ],
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(out)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": qs[49] * 1e3, "p90": qs[89] * 1e3, "p99": qs[98] * 1e3, "n": len(values)}


def _summarise(
    root: Path, info: dict, stats: list[PeerStats], rounds: int, wall: float, hung: int
) -> dict[str, Any]:
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    # Module owners' events: their deltas and outer steps (their own rss/final samples apart).
    theirs = [
        [json.loads(line) for line in file.read_text().splitlines()]
        for file in sorted(root.glob("events-owner*.jsonl"))
    ]
    events += [e for log in theirs for e in log if e["event"] in ("delta_acked", "outer_step")]
    ends = [next((e for e in log if e["event"] == "final"), {}) for log in theirs]
    acked = Counter((e["module"], e["task"]) for e in events if e["event"] == "delta_acked")
    stepped = Counter(
        (e["module"], task) for e in events if e["event"] == "outer_step" for task in e["tasks"]
    )
    steps_per_module = Counter(e["module"] for e in events if e["event"] == "outer_step")
    step_seconds = [e["seconds"] for e in events if e["event"] == "outer_step" and "seconds" in e]
    rss = {e["round"]: e for e in events if e["event"] == "rss"}
    final = next((e for e in events if e["event"] == "final"), {})
    peer_acked = Counter(pair for s in stats for pair in s.acked)
    latencies: dict[str, list[float]] = defaultdict(list)
    for s in stats:
        for op, values in s.latencies.items():
            latencies[op] += values
    submits = sum(s.submits for s in stats)
    first = rss.get(1, {})
    return {
        "peers": len(stats),
        "rounds": rounds,
        "paths": info["paths"],
        "modules": info["modules"],
        "model_bytes": info["model_bytes"],
        "wall_s": wall,
        "submits": submits,
        "deltas_per_s": submits / wall if wall > 0 else 0.0,
        "latency_ms": {op: _percentiles(v) for op, v in sorted(latencies.items())},
        "errors": dict(sum((s.errors for s in stats), Counter())),
        "hung_peers": hung,
        "final_round": final.get("round"),
        "finished": final.get("finished", False),
        "acked": acked,
        "stepped": stepped,
        "peer_acked": peer_acked,
        "steps_per_module": steps_per_module,
        "step_ms": _percentiles(step_seconds),
        "rss_round1": first.get("rss_bytes"),
        "rss_final": final.get("rss_bytes"),
        "rss_by_round": {r: e["rss_bytes"] for r, e in sorted(rss.items())},
        "issued_max": max((e["issued"] for e in [*rss.values(), final] if e), default=0),
        "issued_final": final.get("issued"),
        "done_final": final.get("done"),
        "attempts_final": final.get("attempts"),
        "bound": info.get("bound", False),
        # The coordinator processes' (the scheduler's and the owners') from start to end.
        **{
            f"coordinator_{k}": sum(
                end.get(key, 0) - start.get(key, 0)
                for end, start in [(final, info), *zip(ends, info.get("owners", []), strict=True)]
            )
            for k, key in (
                ("cpu_s", "cpu_s"),
                ("sys_s", "sys_s"),
                ("switches", "switches"),
                ("fsyncs", "fsyncs"),
            )
        },
        "owners": len(theirs),
    }


def problems(result: dict[str, Any], rss_slack_bytes: int = 48 << 20) -> list[str]:
    """What the soak promises, as a list of broken promises (empty when all hold).

    Memory: RSS after the last round may exceed RSS after round 1 by at most twice the model
    (a step holds the old and the new parameters, and momentum, briefly) plus ``rss_slack_bytes``
    for the allocator's and the threads' noise; more would mean state that grows per round.
    """
    out = []
    if not result["finished"] or result["final_round"] != result["rounds"]:
        out.append(f"the run stopped at round {result['final_round']} of {result['rounds']}")
    if result["hung_peers"]:
        out.append(f"{result['hung_peers']} peers never saw the run finish")
    if result["errors"]:
        out.append(f"peers got errors: {result['errors']}")
    acked, stepped = result["acked"], result["stepped"]
    twice = sorted(pair for pair, n in acked.items() if n > 1)
    if twice:
        out.append(f"deltas acknowledged twice: {twice[:5]}")
    lost = sorted(set(acked) - set(stepped))
    if lost:
        out.append(f"acknowledged deltas in no outer step (lost): {lost[:5]}")
    double = sorted(pair for pair, n in stepped.items() if n > 1)
    if double:
        out.append(f"deltas applied in more than one outer step: {double[:5]}")
    ghost = sorted(set(stepped) - set(acked))
    if ghost:
        out.append(f"outer steps applied deltas never acknowledged: {ghost[:5]}")
    if set(result["peer_acked"]) != set(acked):
        out.append("the peers' acknowledgements differ from the coordinator's delta_acked events")
    expected_deltas = result["paths"] * result["rounds"]
    if result["submits"] != expected_deltas:
        out.append(f"{result['submits']} deltas acknowledged, expected {expected_deltas}")
    bad_steps = {mid: n for mid, n in result["steps_per_module"].items() if n != result["rounds"]}
    if len(result["steps_per_module"]) != result["modules"] or bad_steps:
        out.append(f"modules without exactly {result['rounds']} outer steps: {bad_steps}")
    if result["rss_round1"] and result["rss_final"]:
        growth = result["rss_final"] - result["rss_round1"]
        bound = 2 * result["model_bytes"] + rss_slack_bytes
        if growth > bound:
            out.append(
                f"coordinator RSS grew by {growth >> 20} MiB over the rounds (> {bound >> 20})"
            )
    else:
        out.append("the coordinator reported no RSS samples")
    # Tasks remembered: at most the rounds a delta can still join (max staleness 1 by default,
    # plus the one being closed) times the paths.
    if result["issued_final"] is None or result["issued_final"] > 3 * result["paths"]:
        out.append(f"the coordinator remembers {result['issued_final']} issued tasks at the end")
    return out


# ---- the report -------------------------------------------------------------------------------

LOAD_HEADING = "## Load"
LOAD_INTRO = """\
`python bench/soak.py --peers 64 --rounds 5`: simulated peers (threads, one key and one
loopback connection each) against one coordinator process over 127.0.0.1, doing the real
protocol (Hello, ClaimTask, FetchModules, SubmitDelta with a small random delta, no training) on
a `KxK` topology with a path per peer. *Deltas/s* is acknowledged SubmitDelta per second of wall
time; *ratio* divides it by the same number of deltas submitted by one peer sequentially against
a fresh coordinator in the same run (above 1: concurrent peers are served faster than one after
another). Latencies are per request, at the peers, in ms (p50 / p90 / p99). *RSS growth* is the
coordinator process's resident memory after the last round minus after round 1. Each run also
checks that every acknowledged (module, task) is applied in exactly one outer step.

| date (UTC) | host | peers | rounds | paths | model | deltas | wall s | deltas/s | 1 peer deltas/s | ratio | SubmitDelta ms | ClaimTask ms | FetchModules ms | RSS growth | issued tasks kept |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


def _ms(p: dict[str, float]) -> str:
    return f"{p['p50']:.0f} / {p['p90']:.0f} / {p['p99']:.0f}" if p else "-"


def table_row(result: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    lat = result["latency_ms"]
    base = baseline["deltas_per_s"] if baseline else None
    growth = (result["rss_final"] or 0) - (result["rss_round1"] or 0)
    cells = [
        datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        f"{os.cpu_count()} CPU",
        str(result["peers"]),
        str(result["rounds"]),
        str(result["paths"]),
        f"{result['model_bytes'] / 2**20:.1f} MiB",
        str(result["submits"]),
        f"{result['wall_s']:.1f}",
        f"{result['deltas_per_s']:.1f}",
        f"{base:.1f}" if base else "-",
        f"{result['deltas_per_s'] / base:.2f}" if base else "-",
        _ms(lat.get("SubmitDelta", {})),
        _ms(lat.get("ClaimTask", {})),
        _ms(lat.get("FetchModules", {})),
        f"{growth / 2**20:+.1f} MiB",
        f"{result['issued_final']}",
    ]
    return "| " + " | ".join(cells) + " |\n"


def append_row(doc: Path, row: str) -> None:
    """Add ``row`` to the table of the "## Load" section, creating the file or section if needed.

    Only the Load section is touched: other sections of the file are written by other benches.
    """
    text = doc.read_text() if doc.exists() else "# Reliability\n"
    start = text.find("\n" + LOAD_HEADING + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + LOAD_HEADING + "\n\n" + LOAD_INTRO + row
    else:
        start += 1
        nxt = text.find("\n## ", start + len(LOAD_HEADING))
        end = len(text) if nxt < 0 else nxt + 1
        section = text[start:end].rstrip("\n") + "\n" + row
        text = text[:start] + section + ("\n" + text[end:] if nxt >= 0 else "")
    doc.write_text(text)


def _print(result: dict[str, Any], label: str) -> None:
    print(
        f"{label}: {result['peers']} peers, {result['rounds']} rounds, {result['submits']} deltas "
        f"in {result['wall_s']:.1f} s = {result['deltas_per_s']:.1f} deltas/s"
    )
    for op, p in result["latency_ms"].items():
        print(
            f"  {op:20s} p50 {p['p50']:7.1f} ms  p90 {p['p90']:7.1f} ms  p99 {p['p99']:7.1f} ms"
            f"  ({p['n']} requests)"
        )
    if result["step_ms"]:  # a module's outer step: reading its deltas and averaging them
        p = result["step_ms"]
        print(
            f"  {'outer step':20s} p50 {p['p50']:7.1f} ms  p90 {p['p90']:7.1f} ms  p99 "
            f"{p['p99']:7.1f} ms  ({p['n']} steps)"
        )
    rss = ", ".join(f"r{r}: {b / 2**20:.0f}" for r, b in result["rss_by_round"].items())
    print(f"  coordinator RSS MiB by round: {rss}; final {result['rss_final'] / 2**20:.0f}")
    print(f"  errors at the peers: {result['errors']}; hung peers: {result['hung_peers']}")
    per = max(result["submits"], 1) / 1000
    print(
        f"  CPU per delta: coordinator {result['coordinator_cpu_s'] / per:.1f} ms (kernel "
        f"{result['coordinator_sys_s'] / per:.1f} ms), simulated "
        f"peers {result['peers_cpu_s'] / per:.1f} ms (of {result['wall_s'] / per:.1f} ms of wall "
        "time per delta)"
    )
    print(
        f"  coordinator context switches per delta: {result['coordinator_switches'] / per / 1000:.0f}"
        f"; fsync calls per delta: {result['coordinator_fsyncs'] / per / 1000:.1f}"
        + (" (made no-ops by --bound)" if result.get("bound") else "")
    )
    print(
        f"  issued tasks remembered: max {result['issued_max']}, final "
        f"{result['issued_final']}; done {result['done_final']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    sv = sub.add_parser("serve", help="(internal) the coordinator process")
    sv.add_argument("--root", type=Path, required=True)
    sv.add_argument("--side", type=int, required=True)
    sv.add_argument("--rounds", type=int, required=True)
    sv.add_argument("--dim", type=int, required=True)
    sv.add_argument("--bound", action="store_true")
    sv.add_argument("--owner", type=int, default=None)
    sv.add_argument("--owners", type=int, default=0)
    pw = sub.add_parser("peers", help="(internal) a process of simulated peers")
    pw.add_argument("--root", type=Path, required=True)
    pw.add_argument("--out", type=Path, required=True)
    pw.add_argument("--timeout", type=float, required=True)
    pw.add_argument("names", nargs="+")
    ap.add_argument("--peers", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=32, help="model width (module size)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-doc", action="store_true", help="do not append to docs/reliability.md")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--bound",
        action="store_true",
        help="diagnosis: the concurrent run's coordinator with one request at a time and no "
        "durable writes (an upper bound for batching; not crash-safe); no row is appended",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the concurrent and the sequential run this many times, alternating, and "
        "print every pair's ratio and their median (the row: the median pair's)",
    )
    ap.add_argument(
        "--owners",
        type=int,
        default=0,
        help="module owner processes beside the scheduler (the modules dealt in turn to the "
        "scheduler and the owners), in both the concurrent and the sequential run",
    )
    ap.add_argument(
        "--peer-processes",
        type=int,
        default=1,
        help="spread the concurrent run's peer threads over this many processes",
    )
    args = ap.parse_args()
    if args.cmd == "serve":
        serve(args.root, args.side, args.rounds, args.dim, args.bound, args.owner, args.owners)
        return
    if args.cmd == "peers":
        peers_worker(args.root, args.out, args.names, args.timeout)
        return
    pairs = []  # (concurrent, sequential or None), alternating: this machine's noise is slow
    for k in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="dipaco-soak-") as tmp:
            result = run_load(
                Path(tmp) / "load",
                args.peers,
                args.rounds,
                dim=args.dim,
                timeout=args.timeout,
                processes=args.peer_processes,
                bound=args.bound,
                owners=args.owners,
            )
            _print(result, "concurrent" + (f" ({k + 1} of {args.repeat})" if k else ""))
            baseline = None
            if not args.no_baseline:
                baseline = run_load(
                    Path(tmp) / "baseline",
                    1,
                    args.rounds,
                    side=side_for(args.peers),
                    dim=args.dim,
                    timeout=args.timeout,
                    owners=args.owners,
                )
                _print(baseline, "1 peer, sequential")
                print(
                    f"ratio (concurrent / sequential deltas per second): "
                    f"{result['deltas_per_s'] / baseline['deltas_per_s']:.2f}"
                )
        pairs.append((result, baseline))
    if args.repeat > 1 and not args.no_baseline:
        ratios = sorted(r["deltas_per_s"] / b["deltas_per_s"] for r, b in pairs if b)
        print(
            f"ratios of {len(ratios)} pairs: {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.2f}"
        )
        # The row: the pair whose ratio is the median (the lower middle of an even count).
        middle = ratios[(len(ratios) - 1) // 2]
        result, baseline = next(
            (r, b) for r, b in pairs if b and r["deltas_per_s"] / b["deltas_per_s"] == middle
        )
    broken = [p for r, b in pairs for p in problems(r) + (problems(b) if b else [])]
    for p in broken:
        print("PROBLEM:", p)
    if not args.no_doc and not args.bound and not args.owners:
        append_row(DOC, table_row(result, baseline))
        print(f"appended a row to {DOC.relative_to(REPO)} (## Load)")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
