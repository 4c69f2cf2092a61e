"""Saved routers: the base class every router kind shares, and the checks their files go through.

:class:`SavedRouter` gives a router canonical JSON, its SHA-256, a crash-safe save and a validated
load, path count, standardized features and top-n paths. The helpers here are shared by the
router kinds (:mod:`dipaco.routing.kmeans`, :mod:`dipaco.routing.discriminative`) and by
:mod:`dipaco.routing.routers`, which loads a file of either kind: reading and parsing a router
file and its header, checking a feature matrix, levels and balance, reading JSON numbers and
arrays, and the top-n paths by score.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from dipaco.errors import ConfigError, CorruptFileError, DataError
from dipaco.fileio import write_atomic

# Rows scored at once by assign(): bounds the (rows x clusters) score matrix in memory.
ASSIGN_CHUNK = 65536

_R = TypeVar("_R")


class SavedRouter:
    """Canonical JSON, its SHA-256, crash-safe save and validated load, for every router kind.

    A subclass gives ``levels``, ``mean`` and ``scale`` (the features are scored as
    ``(x - mean) / scale``), ``path_scores``, ``to_json_dict`` and ``_from_json_dict`` (which
    raises on anything malformed); files are never unpickled.
    """

    levels: list[int]
    mean: np.ndarray  # (D,)
    scale: Any  # one float, or one per feature dimension (D,)

    @property
    def num_paths(self) -> int:
        return math.prod(self.levels)

    @property
    def feature_dim(self) -> int:
        return int(self.mean.shape[0])

    def path_scores(self, features: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def top_paths(self, features: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` best paths of every row, best first, shape (N, n) int64; column 0 is assign."""
        return top_paths(self.path_scores, features, n, self.num_paths)

    def _standardize(self, features: np.ndarray) -> np.ndarray:
        x = check_features(features)
        if x.shape[1] != self.feature_dim:
            raise DataError(
                f"features have {x.shape[1]} dimensions, the router expects {self.feature_dim}",
                reason="bad-shape",
            )
        return (x - self.mean) / self.scale

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
        return parse_router(path, read_router_json(path), cls._from_json_dict)


def read_router_json(path: str | os.PathLike[str]) -> Any:
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


def parse_router(path: str | os.PathLike[str], obj: Any, parse: Callable[[Any], _R]) -> _R:
    """``parse(obj)``, with every validation failure turned into a CorruptFileError naming path."""
    try:
        return parse(obj)
    except (ValueError, TypeError, KeyError, OverflowError, ConfigError) as e:
        raise CorruptFileError(f"router file {path} is malformed: {e}") from None


def levels_problem(levels: Any) -> str | None:
    """Why ``levels`` is not a non-empty list (or tuple) of positive integers, or None."""
    if (
        not isinstance(levels, (list, tuple))
        or not levels
        or not all(is_int(k) and k >= 1 for k in levels)
    ):
        return f"levels must be a non-empty list of positive integers, got {levels!r}"
    return None


def fit_levels(levels: Any, balance: Any) -> list[int]:
    """A fit's ``levels`` as a list of ints, once they and ``balance`` (in [0, 1]) are checked."""
    problem = levels_problem(levels)
    if problem is not None:
        raise ConfigError(problem)
    if not is_number(balance) or not 0.0 <= balance <= 1.0:
        raise ConfigError(f"balance must be a number in [0, 1], got {balance!r}")
    return [int(k) for k in levels]


def header_levels(obj: Any, fmt: str, fields: set[str] | None = None) -> list[int]:
    """The integer levels of router JSON ``obj`` of format ``fmt`` (keys ``fields``, if given)."""
    if not isinstance(obj, dict):
        raise ValueError("top level is not an object")
    if obj.get("format") != fmt:
        raise ValueError(f"format is {obj.get('format')!r}, expected {fmt!r}")
    if fields is not None and set(obj) != fields:
        missing, extra = sorted(fields - set(obj)), sorted(set(obj) - fields)
        raise ValueError(f"fields do not match: missing {missing}, unexpected {extra}")
    levels = obj["levels"]
    if not isinstance(levels, list) or not all(is_int(k) for k in levels):
        raise ValueError("levels must be a list of integers")
    return [int(k) for k in levels]


def top_paths(
    path_scores: Callable[[np.ndarray], np.ndarray], features: np.ndarray, n: int, num_paths: int
) -> np.ndarray:
    """The ``n`` highest-scoring paths per row, best first (lowest index first on ties)."""
    if not is_int(n) or not 1 <= n <= num_paths:
        raise ConfigError(f"top_paths needs 1 <= n <= {num_paths} paths, got {n!r}")
    x = check_features(features)
    out = np.empty((x.shape[0], int(n)), dtype=np.int64)
    for i in range(0, x.shape[0], ASSIGN_CHUNK):
        scores = path_scores(x[i : i + ASSIGN_CHUNK])
        # A stable sort of the negated scores keeps argmax's tie rule: lowest index first.
        out[i : i + ASSIGN_CHUNK] = np.argsort(-scores, axis=1, kind="stable")[:, : int(n)]
    return out


def check_features(features: np.ndarray) -> np.ndarray:
    """``features`` as a finite float64 (N, D) array with D >= 1; DataError otherwise."""
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


def float_array(value: Any, ndim: int, what: str) -> np.ndarray:
    """Nested lists of numbers -> float64 array of ``ndim`` dims; strings and bools rejected."""
    rows = value if ndim == 2 else [value]
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ValueError(f"{what} must be a {ndim}-D list of numbers")
    if not all(is_number(v) for row in rows for v in row):
        raise ValueError(f"{what} must contain only numbers")
    arr = np.array(value, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{what} is ragged")
    return arr


def is_int(v: Any) -> bool:
    """An integer, numpy's included, but not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or float, numpy's included, but not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
