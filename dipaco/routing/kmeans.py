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
[balance / K, (2 - balance) / K] (see :mod:`dipaco.routing.balance`); balance = 0 is plain
k-means. Saving and loading go through :class:`dipaco.routing.saved.SavedRouter`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from threadpoolctl import threadpool_limits

from dipaco.errors import ConfigError, DataError
from dipaco.routing.balance import balanced_assignment
from dipaco.routing.saved import (
    ASSIGN_CHUNK,
    SavedRouter,
    check_features,
    fit_levels,
    float_array,
    header_levels,
    is_int,
    is_number,
    levels_problem,
)

FORMAT = "dipaco-kmeans-router/1"
METHODS = ("kmeans", "product")
N_INIT = 4


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
    # The path of each document the router was fitted on, from the balanced assignment, where
    # it differs from ``assign`` (not saved): it meets the balance band even where documents
    # share their features, which the offsets alone cannot split (routing.balance).
    fit_choice: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        problem = _router_problem(self)
        if problem is not None:
            raise ConfigError(f"invalid KMeansRouter: {problem}")

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
        levels = header_levels(obj, FORMAT)
        slices = obj["slices"]
        if not isinstance(slices, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(is_int(v) for v in s) for s in slices
        ):
            raise ValueError("slices must be a list of [start, stop] integer pairs")
        centroids, offsets = obj["centroids"], obj["offsets"]
        if not isinstance(centroids, list) or not isinstance(offsets, list):
            raise ValueError("centroids and offsets must be lists")
        if not is_number(obj["scale"]) or not is_number(obj["balance"]):
            raise ValueError("scale and balance must be numbers")
        if not is_int(obj["seed"]):
            raise ValueError("seed must be an integer")
        return cls(
            levels=levels,
            method=obj["method"],
            mean=float_array(obj["mean"], 1, "mean"),
            scale=float(obj["scale"]),
            centroids=[float_array(c, 2, "centroids") for c in centroids],
            offsets=[float_array(o, 1, "offsets") for o in offsets],
            slices=[(int(a), int(b)) for a, b in slices],
            balance=float(obj["balance"]),
            seed=int(obj["seed"]),
        )


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
    levels = fit_levels(levels, balance)
    x = check_features(features)
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

    # Imported here: scikit-learn takes ~0.8 s to import, and only fitting needs it.
    from sklearn.cluster import KMeans

    centroids, offsets, choices, split = [], [], [], False
    for g, (k, (start, stop)) in enumerate(zip(groups, slices, strict=True)):
        zg = np.ascontiguousarray(z[:, start:stop])
        # One thread: sklearn's Lloyd step adds per-thread partial sums under a lock, in
        # arrival order, so threaded runs differ in the last bits from run to run.
        with threadpool_limits(limits=1):
            km = KMeans(n_clusters=k, n_init=N_INIT, random_state=seed).fit(zg)
        cents = np.asarray(km.cluster_centers_, dtype=np.float64)
        what = f"level {g} ({k} modules)" if method == "product" else f"{k} paths"
        scores = _scores(zg, cents)
        # Each level of product k-means spreads documents that share their features in its own
        # order (a permutation seeded by the level): in one order, the same documents would
        # land together on every level, and so on one path.
        order = (
            np.random.default_rng([seed, g]).permutation(n) if method == "product" else np.arange(n)
        )
        offs, permuted = balanced_assignment(scores[order], balance, what=what)
        choice = np.empty(n, dtype=np.int64)
        choice[order] = permuted
        centroids.append(cents)
        offsets.append(offs)
        choices.append(choice)
        split |= bool((choice != np.argmin(scores + offs, axis=1)).any())
    # Kept only where it differs from what the offsets give (identical features split).
    fit_choice = None
    if split:
        fit_choice = (
            np.ravel_multi_index(tuple(choices), tuple(levels))
            if method == "product"
            else choices[0]
        ).astype(np.int64)
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
        fit_choice=fit_choice,
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


def _router_problem(r: KMeansRouter) -> str | None:
    """Why ``r`` is inconsistent, or None."""
    if r.method not in METHODS:
        return f"method must be one of {METHODS}, got {r.method!r}"
    if (problem := levels_problem(r.levels)) is not None:
        return problem
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
