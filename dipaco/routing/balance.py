"""Balanced offsets: the per-cluster additive offsets that keep every cluster's share in a band.

A router sends a document with per-cluster scores s (lower is better) to argmin_k (s_k + o_k).
:func:`balanced_assignment` chooses the offsets o, and an assignment of the training documents,
so that every cluster receives between ``balance / K`` and ``(2 - balance) / K`` of them. They are the dual variables
of the capacity-constrained assignment, and play the role of the bias the paper trains to "match
the target document-to-path distribution" (DiPaCo §7.2.1). The k-means router
(:mod:`dipaco.routing.kmeans`) uses them on squared distances, the discriminative router
(:mod:`dipaco.routing.discriminative`) on negated logits.
"""

from __future__ import annotations

import logging
import math

import numpy as np

logger = logging.getLogger(__name__)


def balance_offsets(scores: np.ndarray, balance: float, what: str) -> np.ndarray:
    """Offsets o (K,) so that argmin_k (scores + o) puts every cluster's count in [lo, hi]
    (:func:`balanced_assignment`'s offsets)."""
    return balanced_assignment(scores, balance, what)[0]


def balanced_assignment(
    scores: np.ndarray, balance: float, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Offsets o (K,) and an assignment of the N documents, every cluster's count in [lo, hi].

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

    The assignment is argmin_k (scores + o) whenever the offsets reproduce it. Documents with
    identical scores (the same features: a licence header or an include block opening many
    documents) cannot be told apart by any offsets; stage 2 still spreads them over clusters,
    the lowest-numbered documents first, so the assignment meets the band however many there
    are, and a new document with those features goes to one of the clusters that got some.
    """
    n, k = scores.shape
    if balance == 0.0 or k == 1:
        return np.zeros(k), np.argmin(scores, axis=1)
    lo, hi = _count_band(n, k, balance)

    def misses(counts: np.ndarray) -> int:
        return int(np.maximum(counts - hi, 0).sum() + np.maximum(lo - counts, 0).sum())

    def violation(offsets: np.ndarray) -> int:
        return misses(np.bincount(np.argmin(scores + offsets, axis=1), minlength=k))

    greedy = _greedy_offsets(scores, lo, hi)
    if violation(greedy) == 0:
        return greedy, np.argmin(scores + greedy, axis=1)
    choice, potentials = _shortest_path_moves(scores, greedy, lo, hi)
    # Documents with identical features cannot be separated, so stage 3 can fall short;
    # then keep whichever offsets came closest.
    candidates = [_separating_offsets(scores, choice), potentials, greedy]
    by_offsets = [violation(o) for o in candidates]
    best = candidates[int(np.argmin(by_offsets))]
    counts = np.bincount(choice, minlength=k)
    if misses(counts) == 0:
        if min(by_offsets) > 0:
            logger.info(
                "k-means balance for %s met by spreading documents with identical features "
                "over clusters (the offsets alone reach %d..%d, wanted %d..%d of %d)",
                *(what, *_extremes(scores + best), lo, hi, n),
            )
        return best, choice
    final = np.argmin(scores + best, axis=1)
    logger.warning(
        "k-means balance for %s not met: cluster sizes %d..%d, wanted %d..%d of %d documents; "
        "keeping the closest offsets found",
        *(what, *_extremes(scores + best), lo, hi, n),
    )
    return best, final


def _extremes(cost: np.ndarray) -> tuple[int, int]:
    """The smallest and largest cluster under argmin of ``cost`` (N, K)."""
    counts = np.bincount(np.argmin(cost, axis=1), minlength=cost.shape[1])
    return int(counts.min()), int(counts.max())


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
    from scipy.sparse.csgraph import csgraph_from_dense, dijkstra  # only when balancing

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
