"""What a coordinator trusts in a delta: its size, judged per module, and robust averages.

Two defences against a peer whose delta is finite and well-shaped but wrong (a bug, a diverged
run, or poison):

- :class:`NormTracker` keeps the norms of the last accepted deltas of every module and judges a
  new one against them: far above the usual (median + k * MAD *and* a multiple of the median) or
  above an absolute ``max_norm`` is rejected (reason ``huge-norm``) or clipped. Median and MAD
  are robust: the outliers being judged cannot move the yardstick they are judged by.
- :func:`trimmed_mean`, :func:`coordinate_median` and :func:`clip_to_median_norm` combine the
  deltas of the paths through a module so that one bad path moves the module little, even when
  its delta passed the norm check (in its first rounds, before the tracker has observations).

The combiners are pure functions on named tensors, vectorised: per tensor name the n deltas are
stacked into one (n, ...) tensor and sorted along the first axis.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from dipaco.coordinator.statetext import EntryTexts, dumps
from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic
from dipaco.protocols.wire import host_array

Tensors = dict[str, torch.Tensor]


def _host_flat(tensors: Tensors) -> np.ndarray | None:
    """Every tensor's values in one flat NumPy array (a copy), or None where one is not a
    plain CPU array (wire.host_array): the whole module in a few NumPy calls rather than
    torch operations per tensor, each a hand-off of the interpreter's lock under load."""
    arrays: list[np.ndarray] = []
    for t in tensors.values():
        a = host_array(t)
        if a is None:
            return None
        arrays.append(a)
    return np.concatenate(arrays) if arrays else None


def delta_norm(delta: Tensors) -> float:
    """The L2 norm of a module's whole delta (every tensor together), accumulated in float64:
    NaN or infinite exactly when a value is (a float32's square cannot overflow a float64), so
    the norm is also the delta's finiteness check. One copy of the module (the concatenation);
    the float64 products are formed in NumPy's small buffers, not as a second, double-sized
    copy."""
    flat = _host_flat(delta)
    if flat is not None:  # not np.dot: BLAS's threads would spin on the other cores
        if flat.dtype.kind != "f":
            flat = flat.astype(np.float64)
        return math.sqrt(float(np.einsum("i,i->", flat, flat, dtype=np.float64)))
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in delta.values()))


def nonfinite(tensors: Tensors) -> str | None:
    """The name of the first tensor holding a NaN or an infinity; None if every value is
    finite."""
    flat = _host_flat(tensors)
    if flat is not None and (flat.dtype.kind != "f" or bool(np.isfinite(flat).all())):
        return None
    return next((n for n, t in tensors.items() if not bool(torch.isfinite(t).all())), None)


def _weights(weights: list[float] | None, n: int, dims: int) -> torch.Tensor:
    """Weights as an (n, 1, ..., 1) column; equal when missing or not all positive."""
    w = torch.tensor(weights if weights is not None else [1.0] * n, dtype=torch.float64)
    if len(w) != n:
        raise ValueError(f"{len(w)} weights for {n} deltas")
    if not bool((w > 0).all()):
        w = torch.ones(n, dtype=torch.float64)
    return w.view(n, *([1] * dims))


CHUNK = 1 << 20  # coordinates combined at a time: n x 8 MiB of float64, whatever the module


def _columns(deltas: list[Tensors], name: str) -> Iterator[tuple[slice, torch.Tensor]]:
    """Tensor ``name`` of the n deltas, flattened, as (n, CHUNK) float64 slices: a robust
    combiner's memory stays n x CHUNK values however large the module is."""
    flat = [d[name].reshape(-1) for d in deltas]
    for start in range(0, flat[0].numel(), CHUNK):
        part = slice(start, min(start + CHUNK, flat[0].numel()))
        yield part, torch.stack([f[part].double() for f in flat])


def weighted_mean(deltas: list[Tensors], weights: list[float] | None = None) -> Tensors:
    """Coordinate-wise weighted mean, in float64."""
    if not deltas:
        raise ValueError("no deltas to average")
    w = _weights(weights, len(deltas), 1)
    out = {}
    for name in deltas[0]:
        flat = torch.empty(deltas[0][name].numel(), dtype=torch.float64)
        for part, x in _columns(deltas, name):
            flat[part] = (x * w).sum(0) / w.sum()
        out[name] = flat.reshape(deltas[0][name].shape)
    return out


def trim_count(n: int, trim_fraction: float) -> int:
    """Values dropped at each end: ceil(fraction * n), but at least one value always stays.

    Rounding up makes a fraction of 0.2 trim one of four paths (the case that matters most: few
    paths through a module); rounding down would trim nothing below five.
    """
    if trim_fraction <= 0:
        return 0
    return min(math.ceil(trim_fraction * n - 1e-9), (n - 1) // 2)


def trimmed_mean(
    deltas: list[Tensors], weights: list[float] | None = None, trim_fraction: float = 0.2
) -> Tensors:
    """Coordinate-wise trimmed mean: per coordinate, drop the k lowest and k highest values
    (k = :func:`trim_count`, counted in paths, not in weight, so that a heavy path cannot buy its
    way past the trim) and average the rest with their paths' weights, renormalised."""
    if not deltas:
        raise ValueError("no deltas to average")
    n = len(deltas)
    k = trim_count(n, trim_fraction)
    w = _weights(weights, n, 1)
    out = {}
    for name in deltas[0]:
        flat = torch.empty(deltas[0][name].numel(), dtype=torch.float64)
        for part, x in _columns(deltas, name):
            values, order = x.sort(dim=0)
            kept_v = values[k : n - k]
            kept_w = w.expand_as(x).gather(0, order)[k : n - k]
            flat[part] = (kept_v * kept_w).sum(0) / kept_w.sum(0)
        out[name] = flat.reshape(deltas[0][name].shape)
    return out


def coordinate_median(deltas: list[Tensors]) -> Tensors:
    """Coordinate-wise median (the mean of the two middle values for an even count).

    Unweighted: a weighted median lets any path holding half the weight decide it alone.
    """
    if not deltas:
        raise ValueError("no deltas to average")
    n = len(deltas)
    out = {}
    for name in deltas[0]:
        flat = torch.empty(deltas[0][name].numel(), dtype=torch.float64)
        for part, x in _columns(deltas, name):
            values = x.sort(dim=0).values
            mid = values[n // 2]
            flat[part] = mid if n % 2 else (values[n // 2 - 1] + mid) / 2
        out[name] = flat.reshape(deltas[0][name].shape)
    return out


def lower_median(values: list[float]) -> float:
    """The median, taking the lower middle value for an even count.

    With two paths the midpoint would sit halfway to an outlier; the lower one does not.
    """
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def clip_to_median_norm(
    deltas: list[Tensors], ratio: float = 3.0
) -> tuple[list[Tensors], list[float]]:
    """Scale every delta whose norm exceeds ``ratio`` times the (lower) median norm down to it.

    For modules with too few paths to trim: a poisoned path then counts at most ``ratio`` times
    as much as a typical one. Returns the deltas and the factor each was scaled by (1.0: kept).
    """
    norms = [delta_norm(d) for d in deltas]
    limit = ratio * lower_median(norms) if norms else 0.0
    factors = [limit / norm if norm > limit > 0 else 1.0 for norm in norms]
    clipped = [
        d if f == 1.0 else {k: (v.double() * f).to(v.dtype) for k, v in d.items()}
        for d, f in zip(deltas, factors, strict=True)
    ]
    return clipped, factors


# ---- the norm check --------------------------------------------------------------------------


@dataclass(frozen=True)
class Judgment:
    """What to do with a delta of a given norm: ``ok``, ``clip`` (to ``limit``) or ``reject``."""

    action: Literal["ok", "clip", "reject"]
    norm: float
    limit: float | None = None  # the bound it exceeded (None when ok)
    why: str = ""


class NormTracker:
    """The norms of the last ``window`` accepted deltas of every module, and the judge of new ones.

    A delta is an outlier when, with at least ``min_observations`` norms known for its module,
    its norm exceeds both ``median + mads * MAD`` and ``ratio * median``; the second condition
    keeps a module whose deltas happen to be nearly equal (MAD ~ 0) from rejecting a normal one.
    A delta is judged against the norms of its round and those before (each kept with its
    round): deltas shrink as a run trains, and a straggler's must not be measured against the
    next round's, which tasks ahead (overlap) deliver first. ``max_norm``, when set, bounds
    every delta from the first. ``mode``: what happens to an outlier, ``reject``, ``clip``
    (scaled down to the bound), or ``off`` (only ``max_norm`` applies, and rejects).

    The state persists in a small JSON file (``path``) written atomically after each accepted
    delta. It cannot be rebuilt from the module store: a module's deltas are deleted once its
    outer step is committed. A crash between a delta's ack and this file's write loses one
    observation, which only delays the judgment a little; acknowledged deltas never depend on it.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        mode: Literal["off", "reject", "clip"] = "reject",
        mads: float = 6.0,
        ratio: float = 3.0,
        min_observations: int = 4,
        max_norm: float | None = None,
        window: int = 64,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.mode, self.mads, self.ratio = mode, mads, ratio
        self.min_observations, self.max_norm, self.window = min_observations, max_norm, window
        self.norms: dict[str, deque[float]] = {}
        self.rounds: dict[str, deque[int]] = {}  # each norm's round, in step with ``norms``
        self._texts, self._round_texts = (
            EntryTexts(lambda mid, xs: f"{dumps(mid)}:{dumps(list(xs))}") for _ in range(2)
        )
        if self.path is not None and self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        try:
            saved = json.loads(self.path.read_text())
            norms = saved["norms"]
            self.norms = {
                str(mid): deque((float(x) for x in xs), maxlen=self.window)
                for mid, xs in norms.items()
            }
            rounds = saved.get("rounds", {})  # a file from before 2026-11-30: all round 0
            self.rounds = {
                mid: deque((int(r) for r in rounds.get(mid, [0] * len(xs))), maxlen=self.window)
                for mid, xs in self.norms.items()
            }
            if any(len(self.rounds[mid]) != len(xs) for mid, xs in self.norms.items()):
                raise ValueError("a module's rounds and norms differ in number")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise CorruptFileError(
                f"{self.path}: unreadable delta-norm statistics ({exc}); delete it to start "
                "the statistics afresh"
            ) from None

    def save(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, self.snapshot())

    def snapshot(self) -> dict:
        """The statistics as saved (a copy: it may be written outside the lock)."""
        return {
            "norms": {mid: list(xs) for mid, xs in self.norms.items()},
            "rounds": {mid: list(xs) for mid, xs in self.rounds.items()},
        }

    def snapshot_bytes(self) -> bytes:
        """:meth:`snapshot` as the file holds it (compact JSON, keys sorted), each module's
        norms encoded again only when they changed: an accepted delta adds a norm to its
        path's modules alone, and the file is written for each (statetext.py)."""
        pairs = self._texts.texts((mid, tuple(xs)) for mid, xs in sorted(self.norms.items()))
        rounds = self._round_texts.texts((m, tuple(xs)) for m, xs in sorted(self.rounds.items()))
        return ('{"norms":{' + ",".join(pairs) + '},"rounds":{' + ",".join(rounds) + "}}").encode()

    def stats(self, mid: str, rnd: int | None = None) -> tuple[float, float, int]:
        """Median, MAD and count of a module's norms of rounds up to ``rnd`` (None: all)."""
        xs = list(self.norms.get(mid, ()))
        if rnd is not None:
            xs = [x for x, r in zip(xs, self.rounds.get(mid, ()), strict=True) if r <= rnd]
        if not xs:
            return 0.0, 0.0, 0
        t = torch.tensor(xs, dtype=torch.float64)
        med = float(t.median())
        return med, float((t - med).abs().median()), len(xs)

    def bound(self, mid: str, rnd: int | None = None) -> float | None:
        """The largest norm the statistics allow for this module's delta of round ``rnd``
        (None: too few to judge)."""
        med, mad, count = self.stats(mid, rnd)
        if count < self.min_observations or med <= 0:
            return None
        return max(med + self.mads * mad, self.ratio * med)

    def judge(self, mid: str, norm: float, rnd: int | None = None) -> Judgment:
        """Whether the norm of ``mid``'s delta, trained for round ``rnd``, is an outlier."""
        if not math.isfinite(norm):
            return Judgment("reject", norm, math.inf, "the norm is not finite")
        if self.max_norm is not None and norm > self.max_norm:
            action: Literal["clip", "reject"] = "clip" if self.mode == "clip" else "reject"
            return Judgment(action, norm, self.max_norm, f"above max_norm {self.max_norm:.4g}")
        bound = self.bound(mid, rnd) if self.mode != "off" else None
        if bound is not None and norm > bound:
            med, mad, count = self.stats(mid, rnd)
            why = (
                f"above {bound:.4g} (median {med:.4g} + {self.mads:g} MAD {mad:.4g}, and "
                f"{self.ratio:g}x the median, of the last {count} accepted"
                + (f" of rounds up to {rnd})" if rnd is not None else ")")
            )
            return Judgment("clip" if self.mode == "clip" else "reject", norm, bound, why)
        return Judgment("ok", norm)

    def record(self, mid: str, norm: float, rnd: int = 0) -> None:
        """An accepted delta's norm, and the round it was trained for."""
        self.norms.setdefault(mid, deque(maxlen=self.window)).append(float(norm))
        self.rounds.setdefault(mid, deque(maxlen=self.window)).append(int(rnd))
