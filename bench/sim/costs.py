"""What the simulation charges in virtual time: the real sizes and speeds behind the tiny
tensors the real code handles.

Sizes: a 150 M-parameter path (``PATH_CONFIG``: Llama-style, 32k vocabulary, width 768, 14
blocks), split into its modules by the real :meth:`Topology.parameter_counts` of the simulated
topology; modules travel to peers in float32 (a ``FetchModules`` reply is lossless) and come
back as int8 deltas (1 byte per parameter plus a float32 scale per block of 256: ``int8``).

Owner CPU per byte, from docs/benchmarks.md's measured rows (AMD EPYC, one core): memcpy
bandwidth follows from the codecs row (int8 encode is 0.17 of memcpy and takes 66 ms per
112.5 MiB, so memcpy moves 10.5 GB/s); int8 decode runs at 0.59 of it (float32 out). A write
that waits for fsync (a delta's durable write at admission) runs at 0.08 of copy bandwidth (the
"synced ratio" of ``bench/outer_step.py --store``: the disk, not the code, 0.05-0.10). An outer
step over P deltas is charged (P + 2) module sizes at the store round's rate with the deltas
read back from their files (0.46 of copy bandwidth; 0.82 when the deltas are held in memory,
which a running owner does within its budget: docs/benchmarks.md, "The whole store round"), and
its version and momentum files (2 module sizes) at the synced rate. Both were charged at the
store round's rate before issue 20 (0.04) until issue 52 corrected it (docs/operations.md,
"The store's rate corrected"): a module that every path crosses (the shared embedding) took
minutes to step in an 800-path run, and the whole grid waited for it.

Peers: a mix of datacenter GPUs, consumer GPUs and a long tail of slow volunteers (step time
of H100-class = 16k tokens at the measured 130.7 M-path H100 row's 330k tokens/s, scaled to 150
M), with links from home broadband to datacenter, latencies, and churn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig

PATH_CONFIG = ModelConfig(vocab_size=32000, dim=768, n_layers=14, n_heads=12, max_seq_len=1024)
INT8_BLOCK = 256
MEMCPY_BPS = 112.5 * 2**20 / (0.066 * 0.17)  # codecs row: int8 encode 0.17 of memcpy, 66 ms
INT8_DECODE_BPS = 0.59 * MEMCPY_BPS  # float32 bytes out per second
SYNCED_BPS = 0.08 * MEMCPY_BPS  # a durable (fsynced) write / copy bandwidth (0.05-0.10)
STEP_BPS = 0.46 * MEMCPY_BPS  # the whole store round, deltas read from files / copy bandwidth


def step_seconds(paths: int, params: int) -> float:
    """The owner CPU an outer step of a module of ``params`` parameters over ``paths`` deltas
    takes: the P deltas, the parameters and the momentum read at the store round's rate, the
    new version and momentum written durably."""
    size = 4 * params
    return (paths + 2) * size / STEP_BPS + 2 * size / SYNCED_BPS


LOSSLESS_ENCODE_BPS = 1.49 * MEMCPY_BPS
H100_TOKENS_PER_S = 329_823 * 130.7 / 150.0  # peer_throughput row, 130.7 M path, scaled
TOKENS_PER_STEP = 16 * 1024
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class Sizes:
    """Bytes of each module as the simulation charges them."""

    params: dict[str, int]

    @classmethod
    def of(cls, topology: Topology, cfg: ModelConfig = PATH_CONFIG) -> Sizes:
        counts = _module_counts(topology, cfg)
        return cls(counts)

    def fp32(self, mids: list[str]) -> int:
        return sum(4 * self.params[m] for m in mids)

    def int8(self, mids: list[str]) -> int:
        return sum(self.params[m] + 4 * math.ceil(self.params[m] / INT8_BLOCK) for m in mids)

    def path_params(self, topology: Topology) -> int:
        return sum(self.params[m] for m in topology.path_modules(0))


def _module_counts(topology: Topology, cfg: ModelConfig) -> dict[str, int]:
    """Parameters per module: the real split of path 0 at ``cfg``'s size (every level module
    of a level has the size of that level's module in path 0)."""
    probe = Topology(
        (1,) * len(topology.levels),
        topology.blocks_per_level,
        topology.shared,
        topology.private_blocks_before,
        topology.private_blocks_after,
    )
    one = probe.parameter_counts(cfg)["modules"]
    out = {}
    for mid in topology.module_ids():
        if mid.startswith("L"):
            level = mid.split(".")[0]
            out[mid] = one[f"{level}.M0"]
        else:
            out[mid] = one.get(mid, one.get(mid.replace(mid.split(".")[0], "P0"), 0))
    return out


@dataclass(frozen=True)
class PeerKind:
    name: str
    share: float  # fraction of the peers
    speed: tuple[float, float]  # speed relative to an H100: lognormal between these (5-95%)
    down_mbit: tuple[float, float]
    up_mbit: tuple[float, float]
    latency_ms: tuple[float, float]


PEER_KINDS = (
    PeerKind("datacenter", 0.10, (0.5, 1.0), (1000, 10000), (1000, 10000), (5, 40)),
    PeerKind("consumer", 0.60, (0.15, 0.35), (100, 1000), (20, 500), (15, 80)),
    PeerKind("slow tail", 0.30, (0.02, 0.12), (25, 300), (5, 50), (30, 250)),
)


def _lognormal(rng: random.Random, lo: float, hi: float) -> float:
    """A lognormal draw with 5% and 95% quantiles ``lo`` and ``hi``."""
    mu = (math.log(lo) + math.log(hi)) / 2
    sigma = (math.log(hi) - math.log(lo)) / (2 * 1.645)
    return math.exp(rng.gauss(mu, sigma))


@dataclass(frozen=True)
class PeerProfile:
    kind: str
    step_seconds: float
    down_bps: float
    up_bps: float
    latency: float  # one way, seconds


def draw_peer(rng: random.Random, kinds: tuple[PeerKind, ...] = PEER_KINDS) -> PeerProfile:
    x, acc = rng.random(), 0.0
    kind = kinds[-1]
    for k in kinds:
        acc += k.share
        if x < acc:
            kind = k
            break
    speed = _lognormal(rng, *kind.speed)
    return PeerProfile(
        kind=kind.name,
        step_seconds=TOKENS_PER_STEP / (H100_TOKENS_PER_S * speed),
        down_bps=_lognormal(rng, *kind.down_mbit) * MBIT,
        up_bps=_lognormal(rng, *kind.up_mbit) * MBIT,
        latency=_lognormal(rng, *kind.latency_ms) / 1000,
    )


@dataclass
class Settings:
    """One simulated configuration."""

    peers: int = 200
    owners: int = 1
    rounds: int = 3
    inner_steps: int = 500
    seed: int = 0
    owner_gbps: float = 10.0  # each owner's NIC, each direction
    owner_latency: float = 0.010  # scheduler <-> owner, one way
    churn: float = 0.05  # chance that a peer leaves during a task
    arrival_seconds: float = 120.0  # mean delay before a leaving peer is replaced
    lease_seconds: float = 300.0
    # Requests a real peer sends often are run once per period here, and charged to the
    # scheduler as the calls of that period: heartbeats (a real peer: every 5 s) and the polls
    # of an idle peer (a real one: the NoTask's retry_after, 0.5 s, longer when many poll).
    heartbeat_seconds: float = 60.0
    real_heartbeat_seconds: float = 5.0
    # An idle peer claims again at least this long after a NoTask, or, if a change of the
    # scheduler's work comes first, then (the long poll). 0: as often as a real peer, the
    # NoTask's retry_after and then the claim's long poll (polls.LONG_POLL_SECONDS); what no
    # change announces (a task that grows late enough to copy, an overdue module) is seen as
    # soon. Up to 2026-12-01 it was 30 s, which hid such work from idle peers for up to 30 s.
    poll_seconds: float = 0.0
    report_seconds: float = 1.0  # owners report at least this often (Reporter's interval)
    tick_seconds: float = 1.0  # each coordinator's ticker
    quorum: float = 0.5
    overlap: bool = False  # scheduler.overlap
    hedge: bool | Literal["last"] = (
        False  # scheduler.hedge (True, or "last": in the last round only)
    )
    push_behind: bool = False  # peers send a task's deltas while they train the next
    fetch_ahead: bool = False  # peers claim and fetch the next task while they train one
    policy: dict = field(default_factory=dict)  # more SchedulerSection fields, as set
    paths_per_peer: float = 1.0  # the topology: W x W with W*W >= this many paths per peer
    max_virtual_seconds: float = 1e6
    stall_seconds: float = 20_000.0  # no round for this long: the run has stalled; stop
    peer_kinds: tuple[PeerKind, ...] = PEER_KINDS
    cache_topology: bool = True  # memoise the topology's module lists (cluster.CachedTopology)
    scheduler_cpu_scale: float = 1.0  # multiplies the measured CPU time of the scheduler
    owner_cpu_scale: float = 1.0  # multiplies every owner's CPU time (measured and modelled)
    # Cores each owner serves its requests on, in arrival order (the real owner steps a module
    # outside its lock while other requests are served: rounds.maybe_step)
    owner_cores: int = 1
    # None: a handler's CPU time is what it took on this machine (thread_time), which a loaded
    # machine moves; a number: each handler call costs that many seconds (and the modelled
    # costs on top), so that a run repeats whatever else the machine does.
    cpu_seconds: float | None = None
