"""Generative routers: k-means and product k-means over prefix features, with a balance control.

Implements the paper's generative routing (DiPaCo §2.4.1, Eq. 1): a document with feature z
goes to the path of its nearest centroid, r(z) = argmin_k ||z - c_k||^2. With several levels,
plain k-means fits prod(K_l) clusters on the whole of z and the cluster index is the path id.
Product k-means (§7.3) splits z into L contiguous slices (for two levels: the first and the
last D/2 dimensions), fits one k-means of K_l clusters per level on its slice, and the tuple of
per-level choices (c_0, ..., c_{L-1}) is the path, numbered row-major:
p = ((c_0 * K_1) + c_1) * K_2 + ...

Plain k-means gives imbalanced shards, and the smallest shard's path ends up the weakest, so
every cluster also carries an additive offset: the choice is argmin_k (||z - c_k||^2 + o_k).
The offsets play the role of the bias the paper trains to "match the target document-to-path
distribution" (§7.2.1). Here they are the dual variables of the capacity-constrained
assignment of the training documents, solved so that every cluster's share lies within
[balance / K, (2 - balance) / K] (see ``_balance_offsets``); balance = 0 is plain k-means.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from scipy.sparse.csgraph import csgraph_from_dense, dijkstra
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits

from dipaco.errors import ConfigError, CorruptFileError, DataError
from dipaco.fileio import write_atomic

logger = logging.getLogger(__name__)

FORMAT = "dipaco-kmeans-router/1"
METHODS = ("kmeans", "product")
N_INIT = 4
# Rows scored at once by assign(): bounds the (rows x clusters) score matrix in memory.
ASSIGN_CHUNK = 65536

_R = TypeVar("_R")


class SavedRouter:
    """Canonical JSON, its SHA-256, crash-safe save and validated load, for every router kind.

    A subclass gives ``to_json_dict`` and ``_from_json_dict`` (which raises on anything
    malformed); files are never unpickled.
    """

    def to_json_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_json_dict(cls, obj: Any) -> Any:
        raise NotImplementedError

    def canonical_json(self) -> bytes:
        # json writes floats with repr(), which round-trips float64 exactly.
        return json.dumps(
            self.to_json_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False
        ).encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json()).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the canonical JSON atomically; the file's sha256 equals ``self.sha256``."""
        write_atomic(Path(path), self.canonical_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Any:
        return _parse_router(path, _read_router_json(path), cls._from_json_dict)


@dataclass(eq=False)
class KMeansRouter(SavedRouter):
    """A fitted generative router.

    ``centroids[g]``, ``offsets[g]`` and ``slices[g]`` describe one group of clusters over the
    standardized features ``(x - mean) / scale`` restricted to ``slices[g]``. With
    ``method="product"`` there is one group per level (K_l clusters each); with
    ``method="kmeans"`` there is a single group of ``num_paths`` clusters over all features,
    whose cluster index is the path id.
    """

    levels: list[int]
    method: str
    mean: np.ndarray  # (D,)
    scale: float
    centroids: list[np.ndarray]  # per group: (K_g, D_g) float64
    offsets: list[np.ndarray]  # per group: (K_g,) float64
    slices: list[tuple[int, int]]  # per group: [start, stop) into the feature vector
    balance: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        problem = _router_problem(self)
        if problem is not None:
            raise ConfigError(f"invalid KMeansRouter: {problem}")

    @property
    def num_paths(self) -> int:
        return math.prod(self.levels)

    @property
    def feature_dim(self) -> int:
        return int(self.mean.shape[0])

    def assign_levels(self, features: np.ndarray) -> np.ndarray:
        """Per-level module choices, shape (N, L), int64."""
        z = self._standardize(features)
        choices = np.stack(
            [
                _nearest(z[:, start:stop], cents, offs)
                for cents, offs, (start, stop) in zip(
                    self.centroids, self.offsets, self.slices, strict=True
                )
            ],
            axis=1,
        )
        if self.method == "product":
            return choices
        digits = np.unravel_index(choices[:, 0], tuple(self.levels))
        return np.stack(digits, axis=1).astype(np.int64)

    def assign(self, features: np.ndarray) -> np.ndarray:
        """Path id of every row of ``features`` (N, D), shape (N,), int64."""
        choices = self.assign_levels(features)
        if choices.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return np.ravel_multi_index(tuple(choices.T), tuple(self.levels)).astype(np.int64)

    def path_scores(self, features: np.ndarray) -> np.ndarray:
        """Score of every path for every row of ``features`` (N, D): shape (N, P), higher is better.

        The negated offset squared distance to the path's centroid, ``-(||z - c||^2 + o)``,
        less the per-row constant ``||z||^2`` (which changes no ranking). For product k-means
        a path's score is the sum over levels of its modules' per-level scores, laid out
        row-major over all ``prod(levels)`` paths. ``argmax`` over a row (first index on
        ties) equals ``assign``.
        """
        z = self._standardize(features)
        per_group = [
            -(_scores(z[:, start:stop], cents) + offs)
            for cents, offs, (start, stop) in zip(
                self.centroids, self.offsets, self.slices, strict=True
            )
        ]
        if self.method != "product":
            return per_group[0]
        total = per_group[0]
        for level in per_group[1:]:
            total = (total[:, :, None] + level[:, None, :]).reshape(z.shape[0], -1)
        return total

    def top_paths(self, features: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` best paths of every row, best first, shape (N, n) int64; column 0 is assign."""
        return _top_paths(self.path_scores, features, n, self.num_paths)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "method": self.method,
            "levels": [int(k) for k in self.levels],
            "balance": float(self.balance),
            "seed": int(self.seed),
            "mean": self.mean.tolist(),
            "scale": float(self.scale),
            "slices": [[int(a), int(b)] for a, b in self.slices],
            "centroids": [c.tolist() for c in self.centroids],
            "offsets": [o.tolist() for o in self.offsets],
        }

    @classmethod
    def _from_json_dict(cls, obj: Any) -> KMeansRouter:
        if not isinstance(obj, dict):
            raise ValueError("top level is not an object")
        if obj.get("format") != FORMAT:
            raise ValueError(f"format is {obj.get('format')!r}, expected {FORMAT!r}")
        levels = obj["levels"]
        if not isinstance(levels, list) or not all(_is_int(k) for k in levels):
            raise ValueError("levels must be a list of integers")
        slices = obj["slices"]
        if not isinstance(slices, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(_is_int(v) for v in s) for s in slices
        ):
            raise ValueError("slices must be a list of [start, stop] integer pairs")
        centroids, offsets = obj["centroids"], obj["offsets"]
        if not isinstance(centroids, list) or not isinstance(offsets, list):
            raise ValueError("centroids and offsets must be lists")
        if not _is_number(obj["scale"]) or not _is_number(obj["balance"]):
            raise ValueError("scale and balance must be numbers")
        if not _is_int(obj["seed"]):
            raise ValueError("seed must be an integer")
        return cls(
            levels=list(levels),
            method=obj["method"],
            mean=_float_array(obj["mean"], 1, "mean"),
            scale=float(obj["scale"]),
            centroids=[_float_array(c, 2, "centroids") for c in centroids],
            offsets=[_float_array(o, 1, "offsets") for o in offsets],
            slices=[(int(a), int(b)) for a, b in slices],
            balance=float(obj["balance"]),
            seed=int(obj["seed"]),
        )

    def _standardize(self, features: np.ndarray) -> np.ndarray:
        x = _check_features(features)
        if x.shape[1] != self.feature_dim:
            raise DataError(
                f"features have {x.shape[1]} dimensions, the router expects {self.feature_dim}",
                reason="bad-shape",
            )
        return (x - self.mean) / self.scale


def fit_router(
    features: np.ndarray,
    levels: list[int],
    method: Literal["kmeans", "product"] = "kmeans",
    balance: float = 0.5,
    seed: int = 0,
) -> KMeansRouter:
    """Fit a k-means (or product k-means) router on ``features`` (N, D).

    ``balance`` in [0, 1]: 0 keeps plain k-means (all offsets zero); otherwise the offsets are
    tuned so that every cluster of every group holds between ``balance / K`` and
    ``(2 - balance) / K`` of the training documents (1 = as equal as achievable). For product
    k-means each level is balanced on its own.
    """
    if method not in METHODS:
        raise ConfigError(f"method must be one of {METHODS}, got {method!r}")
    if (
        not isinstance(levels, (list, tuple))
        or not levels
        or not all(_is_int(k) and k >= 1 for k in levels)
    ):
        raise ConfigError(f"levels must be a non-empty list of positive integers, got {levels!r}")
    levels = [int(k) for k in levels]
    if not _is_number(balance) or not 0.0 <= balance <= 1.0:
        raise ConfigError(f"balance must be a number in [0, 1], got {balance!r}")
    x = _check_features(features)
    n, d = x.shape
    if method == "product":
        if d < len(levels):
            raise ConfigError(
                f"product k-means over {len(levels)} levels needs at least {len(levels)} "
                f"feature dimensions, got {d}"
            )
        groups = levels
        slices = _split_dims(d, len(levels))
    else:
        groups = [math.prod(levels)]
        slices = [(0, d)]
    if n < max(groups):
        raise ConfigError(
            f"need at least {max(groups)} documents to fit {max(groups)} clusters, got {n}"
        )

    mean = x.mean(axis=0)
    centered = x - mean
    # One global scale keeps the relative spread of the dimensions, which k-means relies on.
    scale = float(np.sqrt(np.mean(centered * centered)))
    if not (scale > 0.0 and math.isfinite(scale)):
        scale = 1.0
    z = centered / scale

    centroids, offsets = [], []
    for g, (k, (start, stop)) in enumerate(zip(groups, slices, strict=True)):
        zg = np.ascontiguousarray(z[:, start:stop])
        # One thread: sklearn's Lloyd step adds per-thread partial sums under a lock, in
        # arrival order, so threaded runs differ in the last bits from run to run.
        with threadpool_limits(limits=1):
            km = KMeans(n_clusters=k, n_init=N_INIT, random_state=seed).fit(zg)
        cents = np.asarray(km.cluster_centers_, dtype=np.float64)
        what = f"level {g} ({k} modules)" if method == "product" else f"{k} paths"
        offs = _balance_offsets(_scores(zg, cents), balance, what=what)
        centroids.append(cents)
        offsets.append(offs)
    return KMeansRouter(
        levels=levels,
        method=method,
        mean=mean,
        scale=scale,
        centroids=centroids,
        offsets=offsets,
        slices=slices,
        balance=float(balance),
        seed=int(seed),
    )


def routing_stats(
    paths: np.ndarray, doc_tokens: np.ndarray | None, num_paths: int
) -> dict[str, Any]:
    """Documents (and tokens, when ``doc_tokens`` is given; else None) per path, and doc shares."""
    paths = np.asarray(paths)
    if paths.ndim != 1 or (paths.size and not np.issubdtype(paths.dtype, np.integer)):
        raise DataError("paths must be a 1-D integer array", reason="bad-shape")
    paths = paths.astype(np.int64)
    if paths.size and (paths.min() < 0 or paths.max() >= num_paths):
        raise DataError(f"path ids must lie in [0, {num_paths})", reason="bad-path")
    docs = np.bincount(paths, minlength=num_paths)
    tokens: list[int] | None = None
    if doc_tokens is not None:
        doc_tokens = np.asarray(doc_tokens)
        if doc_tokens.shape != paths.shape:
            raise DataError(
                f"doc_tokens has shape {doc_tokens.shape}, paths has {paths.shape}",
                reason="bad-shape",
            )
        if doc_tokens.size and (
            not np.issubdtype(doc_tokens.dtype, np.integer) or doc_tokens.min() < 0
        ):
            raise DataError("doc_tokens must be non-negative integers", reason="bad-data")
        per_path = np.zeros(num_paths, dtype=np.int64)
        np.add.at(per_path, paths, doc_tokens.astype(np.int64))
        tokens = [int(t) for t in per_path]
    total = int(docs.sum())
    shares = docs / total if total else np.zeros(num_paths)
    return {
        "docs": [int(c) for c in docs],
        "tokens": tokens,
        "min_share": float(shares.min()) if num_paths else 0.0,
        "max_share": float(shares.max()) if num_paths else 0.0,
    }


def _read_router_json(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a router file; DataError if missing, CorruptFileError if not JSON."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"router file {path} does not exist", reason="missing-file") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"router file {path} is not valid JSON: {e}") from None
    except RecursionError:  # "[[[[..." deeper than the parser's stack: not a router either
        raise CorruptFileError(f"router file {path} nests too deeply to be a router") from None


def _parse_router(path: str | os.PathLike[str], obj: Any, parse: Callable[[Any], _R]) -> _R:
    """``parse(obj)``, with every validation failure turned into a CorruptFileError naming path."""
    try:
        return parse(obj)
    except (ValueError, TypeError, KeyError, OverflowError, ConfigError) as e:
        raise CorruptFileError(f"router file {path} is malformed: {e}") from None


def _top_paths(
    path_scores: Callable[[np.ndarray], np.ndarray], features: np.ndarray, n: int, num_paths: int
) -> np.ndarray:
    """The ``n`` highest-scoring paths per row, best first (lowest index first on ties)."""
    if not _is_int(n) or not 1 <= n <= num_paths:
        raise ConfigError(f"top_paths needs 1 <= n <= {num_paths} paths, got {n!r}")
    x = _check_features(features)
    out = np.empty((x.shape[0], int(n)), dtype=np.int64)
    for i in range(0, x.shape[0], ASSIGN_CHUNK):
        scores = path_scores(x[i : i + ASSIGN_CHUNK])
        # A stable sort of the negated scores keeps argmax's tie rule: lowest index first.
        out[i : i + ASSIGN_CHUNK] = np.argsort(-scores, axis=1, kind="stable")[:, : int(n)]
    return out


def _split_dims(d: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous slices of [0, d), sizes differing by at most one, larger first."""
    size, extra = divmod(d, parts)
    slices, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        slices.append((start, stop))
        start = stop
    return slices


def _scores(z: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """||z - c||^2 minus the per-row constant ||z||^2, which changes no argmin or margin."""
    return (centroids * centroids).sum(axis=1) - 2.0 * (z @ centroids.T)


def _nearest(z: np.ndarray, centroids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    out = np.empty(z.shape[0], dtype=np.int64)
    for i in range(0, z.shape[0], ASSIGN_CHUNK):
        out[i : i + ASSIGN_CHUNK] = np.argmin(
            _scores(z[i : i + ASSIGN_CHUNK], centroids) + offsets, axis=1
        )
    return out


def _balance_offsets(scores: np.ndarray, balance: float, what: str) -> np.ndarray:
    """Offsets o (K,) so that argmin_k (scores + o) puts every cluster's count in [lo, hi].

    This is the dual of the capacity-constrained assignment (min total distance subject to
    lo <= count_k <= hi), solved in three deterministic stages:

    1. greedy repricing moves the bulk: the cluster furthest outside the band moves its
       offset by exactly enough to bring its count halfway into the band. This is often
       enough on its own; when it is not it ends in a price war, so
    2. successive shortest paths move the rest one document at a time along the cheapest
       chain of clusters (min-cost flow on the K-node cluster graph), which keeps the
       assignment optimal for its counts; and
    3. offsets that reproduce that assignment with a strict margin are read off the same
       cluster graph (difference constraints, margin half its minimum mean cycle).
    """
    n, k = scores.shape
    if balance == 0.0 or k == 1:
        return np.zeros(k)
    lo, hi = _count_band(n, k, balance)

    def violation(offsets: np.ndarray) -> int:
        counts = np.bincount(np.argmin(scores + offsets, axis=1), minlength=k)
        return int(np.maximum(counts - hi, 0).sum() + np.maximum(lo - counts, 0).sum())

    greedy = _greedy_offsets(scores, lo, hi)
    if violation(greedy) == 0:
        return greedy
    choice, potentials = _shortest_path_moves(scores, greedy, lo, hi)
    # Documents with identical features cannot be separated, so stage 3 can fall short;
    # then keep whichever offsets came closest.
    candidates = [_separating_offsets(scores, choice), potentials, greedy]
    misses = [violation(o) for o in candidates]
    best = candidates[int(np.argmin(misses))]
    if min(misses) > 0:
        final = np.bincount(np.argmin(scores + best, axis=1), minlength=k)
        logger.warning(
            "k-means balance for %s not met: cluster sizes %d..%d, wanted %d..%d of %d "
            "documents (documents with identical features cannot be split); keeping the "
            "closest offsets found",
            what,
            final.min(),
            final.max(),
            lo,
            hi,
            n,
        )
    return best


def _count_band(n: int, k: int, balance: float) -> tuple[int, int]:
    """Document counts per cluster allowed by the share band, widened to N/K when too narrow."""
    # The small slack absorbs float fuzz such as 5000 * 0.8 / 4 = 1000.0000000000001.
    lo = math.ceil(n * balance / k - 1e-9)
    hi = math.floor(n * (2.0 - balance) / k + 1e-9)
    return min(lo, n // k), max(hi, -(-n // k))


def _greedy_offsets(scores: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Stage 1: exact single-cluster repricing steps; returns the best offsets seen."""
    n, k = scores.shape
    ideal = n / k
    target_lo = min(math.ceil((lo + ideal) / 2), hi)
    target_hi = max(math.floor((hi + ideal) / 2), lo)
    market = _Market(scores)
    best_total, best_offsets, since_best = math.inf, market.offsets.copy(), 0
    while since_best < 2 * k + 10:
        per_cluster = np.maximum(market.counts - hi, 0) + np.maximum(lo - market.counts, 0)
        total = int(per_cluster.sum())
        if total < best_total:
            best_total, best_offsets, since_best = total, market.offsets.copy(), 0
        else:
            since_best += 1
        if total == 0:
            break
        j = int(np.argmax(per_cluster))
        if market.counts[j] > hi:
            market.shed(j, int(market.counts[j]) - target_hi)
        else:
            market.pull(j, target_lo - int(market.counts[j]))
    return best_offsets


class _Market:
    """Documents choosing argmin_k (scores + offsets), kept current as one offset moves."""

    def __init__(self, scores: np.ndarray) -> None:
        self.k = scores.shape[1]
        self.cost = scores.copy()
        self.offsets = np.zeros(self.k)
        self.choice = np.argmin(self.cost, axis=1)
        self.best = self.cost[np.arange(self.cost.shape[0]), self.choice]
        self.counts = np.bincount(self.choice, minlength=self.k)

    def shed(self, j: int, surplus: int) -> None:
        """Raise offset j so that its ``surplus`` weakest members move to their second choice."""
        members = np.flatnonzero(self.choice == j)
        others = self.cost[members]
        others[:, j] = np.inf
        second = np.argmin(others, axis=1)
        second_cost = others[np.arange(members.size), second]
        margin = second_cost - self.best[members]
        step = _step_past(margin, surplus)
        leaving = margin < step
        self.offsets[j] += step
        self.cost[:, j] += step
        self.best[members] += step
        moved = members[leaving]
        self.best[moved] = second_cost[leaving]
        self.choice[moved] = second[leaving]
        self.counts[j] -= moved.size
        self.counts += np.bincount(second[leaving], minlength=self.k)

    def pull(self, j: int, deficit: int) -> None:
        """Lower offset j so that the ``deficit`` closest outsiders switch to j."""
        outside = np.flatnonzero(self.choice != j)
        gap = self.cost[outside, j] - self.best[outside]
        step = _step_past(gap, deficit)
        self.offsets[j] -= step
        self.cost[:, j] -= step
        self.best[self.choice == j] -= step
        moved = outside[gap < step]
        self.counts -= np.bincount(self.choice[moved], minlength=self.k)
        self.counts[j] += moved.size
        self.choice[moved] = j
        self.best[moved] = self.cost[moved, j]


def _step_past(values: np.ndarray, count: int) -> float:
    """A step with exactly ``count`` of ``values`` (>= 0) below it, halfway to the next one."""
    count = max(1, min(count, values.size))
    if count < values.size:
        part = np.partition(values, [count - 1, count])
        a, b = float(part[count - 1]), float(part[count])
    else:
        a = b = float(values.max())
    if b > a:
        return (a + b) / 2.0
    # Exact ties cannot be split; move the whole tie.
    return a + 1e-9 * (1.0 + abs(a))


def _shortest_path_moves(
    scores: np.ndarray, offsets: np.ndarray, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stage 2: move documents one at a time until every count is in [lo, hi].

    Starts from every document at its argmin under ``offsets``, which then act as Johnson
    potentials: reduced costs stay >= 0 and Dijkstra applies. Edge weight
    W[a, b] is the cheapest reduced cost of moving one member of a to b; repricing by the
    distances shifts W by (shift_b - shift_a), so only the rows of the clusters on the path
    (whose members changed) are recomputed. Moved documents end on exact ties, so the
    assignment is tracked explicitly. First no cluster may end above ``hi`` (surplus flows to
    any cluster below it), then none below ``lo`` (taken from clusters above it); neither
    phase breaks the other's bound.
    """
    n, k = scores.shape
    offsets = offsets.copy()
    choice = np.argmin(scores + offsets, axis=1)
    counts = np.bincount(choice, minlength=k)
    weight = np.stack([_edge_row(scores, offsets, choice, a) for a in range(k)])
    for phase in ("upper", "lower"):
        for step in range(n):
            if phase == "upper":
                sources, sinks = counts > hi, counts < hi
                if not sources.any():
                    break
            else:
                sources, sinks = counts > lo, counts < lo
                if not sinks.any():
                    break
            if step % 64 == 63:  # bound the drift of the incremental updates
                weight = np.stack([_edge_row(scores, offsets, choice, a) for a in range(k)])
            graph = csgraph_from_dense(np.maximum(weight, 0.0), null_value=np.inf)
            dist, parent, _ = dijkstra(
                graph,
                directed=True,
                indices=np.flatnonzero(sources),
                min_only=True,
                return_predecessors=True,
            )
            target = int(np.argmin(np.where(sinks, dist, np.inf)))
            if not (sinks[target] and math.isfinite(dist[target])):
                break
            shift = np.where(dist < dist[target], dist[target] - dist, 0.0)
            offsets += shift
            weight += shift[None, :] - shift[:, None]
            node = target
            while parent[node] >= 0:
                a = int(parent[node])
                members = np.flatnonzero(choice == a)
                gap = scores[members, node] + offsets[node] - scores[members, a] - offsets[a]
                choice[members[np.argmin(gap)]] = node
                weight[node] = _edge_row(scores, offsets, choice, node)
                node = a
            weight[node] = _edge_row(scores, offsets, choice, node)
            counts[node] -= 1
            counts[target] += 1
    return choice, offsets


def _edge_row(scores: np.ndarray, offsets: np.ndarray, choice: np.ndarray, a: int) -> np.ndarray:
    """W[a, :]: the cheapest extra cost of moving one member of cluster a to each cluster."""
    members = np.flatnonzero(choice == a)
    row = np.full(scores.shape[1], np.inf)
    if members.size:
        cost = scores[members] + offsets
        row = (cost - cost[:, a : a + 1]).min(axis=0)
    row[a] = np.inf
    return row


def _separating_offsets(scores: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """Stage 3: offsets o with argmin_k (scores + o) == choice, each by a strict margin.

    A member i of cluster a stays there iff o_a - o_b < s_ib - s_ia for every b, so
    o_a - o_b <= W[a, b] - eps with W[a, b] = min over members of (s_ib - s_ia). Such o exist
    iff every cycle of W has mean weight > eps; eps is half the minimum cycle mean (Karp),
    and o are shortest-path potentials under W - eps. When a cycle has weight zero
    (identical documents split between clusters) eps is 0 and ties remain.
    """
    n, k = scores.shape
    rows = np.arange(n)
    gain = scores - scores[rows, choice][:, None]
    w = np.full((k, k), np.inf)
    for a in range(k):
        members = np.flatnonzero(choice == a)
        if members.size:
            w[a] = gain[members].min(axis=0)
        w[a, a] = np.inf
    # Karp: walks[m, v] = lightest walk of exactly m edges ending at v, starting anywhere.
    walks = np.empty((k + 1, k))
    walks[0] = 0.0
    for m in range(1, k + 1):
        walks[m] = np.min(walks[m - 1][:, None] + w, axis=0)
    cyclic = np.isfinite(walks[k])
    if cyclic.any():
        with np.errstate(invalid="ignore"):
            ratios = (walks[k][None, :] - walks[:k]) / (k - np.arange(k))[:, None]
        per_node = np.where(np.isnan(ratios), -np.inf, ratios).max(axis=0)
        eps = max(float(per_node[cyclic].min()) / 2.0, 0.0)
    else:
        # No cycle at all: any margin is feasible; take half the smallest positive move.
        positive = w[np.isfinite(w) & (w > 0)]
        eps = float(positive.min()) / 2.0 if positive.size else 0.0
    # o_a <= o_b + (W[a, b] - eps): an edge b -> a; Floyd-Warshall from a virtual root.
    dist = np.where(np.isfinite(w.T), w.T - eps, np.inf)
    np.fill_diagonal(dist, 0.0)
    for m in range(k):
        dist = np.minimum(dist, dist[:, m : m + 1] + dist[m : m + 1, :])
    return np.minimum(dist.min(axis=0), 0.0)


def _check_features(features: np.ndarray) -> np.ndarray:
    try:
        x = np.asarray(features, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise DataError(f"features are not numeric: {e}", reason="bad-data") from None
    if x.ndim != 2:
        raise DataError(
            f"features must be a 2-D array (N, D), got shape {x.shape}", reason="bad-shape"
        )
    if x.shape[1] == 0:
        raise DataError("features have zero dimensions", reason="bad-shape")
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise DataError(f"features contain non-finite values in {bad} rows", reason="non-finite")
    return x


def _router_problem(r: KMeansRouter) -> str | None:
    """Why ``r`` is inconsistent, or None."""
    if r.method not in METHODS:
        return f"method must be one of {METHODS}, got {r.method!r}"
    if not r.levels or not all(_is_int(k) and k >= 1 for k in r.levels):
        return f"levels must be a non-empty list of positive integers, got {r.levels!r}"
    if not isinstance(r.mean, np.ndarray) or r.mean.ndim != 1 or r.mean.size == 0:
        return "mean must be a non-empty 1-D array"
    if not (math.isfinite(r.scale) and r.scale > 0.0):
        return f"scale must be positive and finite, got {r.scale!r}"
    if not 0.0 <= r.balance <= 1.0:
        return f"balance must be in [0, 1], got {r.balance!r}"
    d = r.mean.shape[0]
    groups = list(r.levels) if r.method == "product" else [math.prod(r.levels)]
    if not (len(r.centroids) == len(r.offsets) == len(r.slices) == len(groups)):
        return (
            f"method {r.method!r} with levels {r.levels} needs {len(groups)} groups of "
            f"centroids/offsets/slices, got {len(r.centroids)}/{len(r.offsets)}/{len(r.slices)}"
        )
    expected_start = 0
    for g, (k, cents, offs, (start, stop)) in enumerate(
        zip(groups, r.centroids, r.offsets, r.slices, strict=True)
    ):
        if start != expected_start or not start < stop <= d:
            return f"slices must tile [0, {d}) contiguously; group {g} has [{start}, {stop})"
        expected_start = stop
        if not isinstance(cents, np.ndarray) or cents.shape != (k, stop - start):
            shape = getattr(cents, "shape", None)
            return f"centroids[{g}] must have shape {(k, stop - start)}, got {shape}"
        if not isinstance(offs, np.ndarray) or offs.shape != (k,):
            return f"offsets[{g}] must have shape {(k,)}, got {getattr(offs, 'shape', None)}"
        if not (np.isfinite(cents).all() and np.isfinite(offs).all()):
            return f"centroids[{g}] or offsets[{g}] contain non-finite values"
    if expected_start != d:
        return f"slices cover [0, {expected_start}) but features have {d} dimensions"
    if not np.isfinite(r.mean).all():
        return "mean contains non-finite values"
    return None


def _float_array(value: Any, ndim: int, what: str) -> np.ndarray:
    """Nested lists of numbers -> float64 array of ``ndim`` dims; strings and bools rejected."""
    rows = value if ndim == 2 else [value]
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ValueError(f"{what} must be a {ndim}-D list of numbers")
    if not all(_is_number(v) for row in rows for v in row):
        raise ValueError(f"{what} must contain only numbers")
    arr = np.array(value, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{what} is ragged")
    return arr


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
