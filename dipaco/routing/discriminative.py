"""Discriminative routing: one EM-like phase (DiPaCo §2.4.2, §7.2.1).

After the paths have been trained on generatively (k-means) sharded data:

1. ``score_documents`` scores each router document under each path with the summed
   autoregressive log-likelihood of its tokens (the ones evaluation scores: the first
   ``seq_len`` predicted tokens, the ``prefix_tokens`` routing prefix excluded);
2. ``best_paths`` takes the label i* = argmax_p of those scores;
3. ``fit_logistic_router`` trains a P-class linear logistic classifier that predicts i* from the
   document's prefix features, so that unseen documents can be routed from their first tokens;
4. the corpus is re-sharded with the classifier (``LogisticRouter.assign`` / ``top_paths``).

A plain classifier can leave paths empty (paths that win no document get no training data), so,
as the paper "trained a bias term to match the target document-to-path distribution", every
path's logit carries an additive offset, chosen with the same capacity-constrained dual as the
k-means router so that every path's share of the re-sharded documents lies within
``[balance / P, (2 - balance) / P]``.

Scoring every document under every path does not scale with the number of paths (the paper says
so too); ``candidates`` restricts scoring to a few paths per document, e.g. the top k-means
choices.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from dipaco.errors import ConfigError, DataError
from dipaco.model.transformer import PathModel
from dipaco.routing.balance import balance_offsets
from dipaco.routing.evaluate import token_losses
from dipaco.routing.saved import (
    SavedRouter,
    check_features,
    fit_levels,
    float_array,
    header_levels,
    is_int,
    is_number,
    levels_problem,
)

logger = logging.getLogger(__name__)

FORMAT = "dipaco-logistic-router/1"
MAX_ITER = 1000
# Logit margin by which a path that no training document chose sits below every other logit
# (on the fitting and assignment documents) before the bias correction.
ABSENT_MARGIN = 1000.0
_FIELDS = {"format", "levels", "balance", "seed", "mean", "scale", "weights", "bias", "offsets"}


@torch.no_grad()
def score_documents(
    load_path: Callable[[int], PathModel],
    docs: list[np.ndarray],
    num_paths: int,
    *,
    seq_len: int,
    prefix_tokens: int = 32,
    candidates: np.ndarray | None = None,
    batch_size: int = 32,
    device: str = "cpu",
    on_path: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Summed log-likelihood of every document under every path, shape (N, P), float64.

    A document's score counts the tokens of its first ``seq_len + 1`` that a path predicts, less
    the first ``prefix_tokens`` (targets at positions >= ``prefix_tokens``): exactly the tokens
    routed evaluation scores. Paths are loaded one at a time with ``load_path(p)`` and dropped
    before the next, so at most one path is ever in memory. With ``candidates`` (N, c) only the
    listed (document, path) pairs are scored and a path no document lists is never loaded;
    every other entry is -inf. ``on_path(p)`` is called after path p has been scored.
    """
    if not is_int(num_paths) or num_paths < 1:
        raise ConfigError(f"num_paths must be a positive integer, got {num_paths!r}")
    if not is_int(prefix_tokens) or prefix_tokens < 0:
        raise ConfigError(f"prefix_tokens must be a non-negative integer, got {prefix_tokens!r}")
    if not is_int(seq_len) or seq_len <= prefix_tokens:
        raise ConfigError(
            f"seq_len ({seq_len!r}) must be an integer above prefix_tokens ({prefix_tokens}), "
            "or no token would be scored"
        )
    if not is_int(batch_size) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    windows = [_window(d, i, seq_len, prefix_tokens) for i, d in enumerate(docs)]
    n = len(windows)
    wanted = _candidate_mask(candidates, n, num_paths)
    scores = np.full((n, num_paths), -np.inf, dtype=np.float64)
    top_token = max((int(w.max()) for w in windows), default=-1)
    for p in range(num_paths):
        rows = np.flatnonzero(wanted[:, p])
        if rows.size == 0:
            continue
        model = load_path(p)
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
        if vocab is not None and top_token >= vocab:
            raise DataError(
                f"documents contain token id {top_token}, outside path P{p}'s vocabulary of "
                f"{vocab}",
                reason="bad-data",
            )
        model.to(device)
        model.eval()
        # Longest first, stable: little padding, and the same batches on every run.
        order = rows[np.argsort([-len(windows[i]) for i in rows], kind="stable")]
        for start in range(0, order.size, batch_size):
            chunk = order[start : start + batch_size]
            # The tokens evaluation scores; a path's score is their summed log-likelihood.
            losses, valid = token_losses(model, [windows[i] for i in chunk], prefix_tokens)
            scores[chunk, p] = -(losses.double() * valid).sum(dim=1).numpy()
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if on_path is not None:
            on_path(p)
    return scores


def best_paths(scores: np.ndarray) -> np.ndarray:
    """Discriminative labels: the highest-scoring path of every row, (N,) int64.

    Ties go to the lowest path index. A row with no finite score (no candidate path was scored)
    or a NaN is a DataError.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[1] == 0:
        raise DataError(
            f"scores must be a 2-D array (N, P), got shape {s.shape}", reason="bad-shape"
        )
    if np.isnan(s).any():
        raise DataError("scores contain NaN", reason="non-finite")
    unscored = np.flatnonzero(~(s > -np.inf).any(axis=1))
    if unscored.size:
        raise DataError(
            f"{unscored.size} documents (first: row {int(unscored[0])}) have no scored path; "
            "every document needs at least one candidate path",
            reason="non-finite",
        )
    return np.argmax(s, axis=1).astype(np.int64)


@dataclass(eq=False)
class LogisticRouter(SavedRouter):
    """A fitted discriminative router: a P-class linear logistic classifier plus offsets.

    A document with features x gets ``path_scores = W z + bias + offsets`` with
    ``z = (x - mean) / scale``, and goes to the highest-scoring path. Path ids are row-major in
    the per-level module choices, as for ``KMeansRouter``.
    """

    levels: list[int]
    mean: np.ndarray  # (D,)
    scale: np.ndarray  # (D,)
    weights: np.ndarray  # (P, D) float64
    bias: np.ndarray  # (P,) float64: the logistic intercepts
    offsets: np.ndarray  # (P,) float64: the bias correction that balances the paths
    balance: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        problem = _router_problem(self)
        if problem is not None:
            raise ConfigError(f"invalid LogisticRouter: {problem}")

    def logits(self, features: np.ndarray) -> np.ndarray:
        """The classifier's logits (N, P), before the bias correction."""
        return self._standardize(features) @ self.weights.T + self.bias

    def path_scores(self, features: np.ndarray) -> np.ndarray:
        """Score of every path for every row of ``features`` (N, D): (N, P), higher is better."""
        return self.logits(features) + self.offsets

    def assign(self, features: np.ndarray) -> np.ndarray:
        """Path id of every row of ``features`` (N, D), shape (N,), int64."""
        return np.argmax(self.path_scores(features), axis=1).astype(np.int64)

    def assign_levels(self, features: np.ndarray) -> np.ndarray:
        """Per-level module choices, shape (N, L), int64."""
        digits = np.unravel_index(self.assign(features), tuple(self.levels))
        return np.stack(digits, axis=1).astype(np.int64).reshape(-1, len(self.levels))

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "levels": [int(k) for k in self.levels],
            "balance": float(self.balance),
            "seed": int(self.seed),
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "weights": self.weights.tolist(),
            "bias": self.bias.tolist(),
            "offsets": self.offsets.tolist(),
        }

    @classmethod
    def _from_json_dict(cls, obj: Any) -> LogisticRouter:
        levels = header_levels(obj, FORMAT, _FIELDS)
        if not is_number(obj["balance"]):
            raise ValueError("balance must be a number")
        if not is_int(obj["seed"]):
            raise ValueError("seed must be an integer")
        return cls(
            levels=levels,
            mean=float_array(obj["mean"], 1, "mean"),
            scale=float_array(obj["scale"], 1, "scale"),
            weights=float_array(obj["weights"], 2, "weights"),
            bias=float_array(obj["bias"], 1, "bias"),
            offsets=float_array(obj["offsets"], 1, "offsets"),
            balance=float(obj["balance"]),
            seed=int(obj["seed"]),
        )


def fit_logistic_router(
    features: np.ndarray,
    labels: np.ndarray,
    levels: list[int],
    *,
    balance: float = 0.5,
    assign_features: np.ndarray | None = None,
    seed: int = 0,
    C: float = 1.0,
) -> LogisticRouter:
    """Fit the discriminative router: predict ``labels`` (N,) from ``features`` (N, D).

    The features are standardized per dimension and a multinomial logistic regression (L2,
    inverse strength ``C``) is fitted on the paths present in ``labels``; a path no document
    chose gets a seeded random weight direction (so that such paths can be told apart) and an
    intercept that puts its logit far below every other on these documents. Then the bias
    correction: with ``balance`` > 0 every path gets an offset so that, on ``assign_features``
    (the documents that will be re-sharded; default ``features``), every path's share of the
    documents lies within ``[balance / P, (2 - balance) / P]`` and no path is empty.
    ``balance`` = 0 keeps the plain classifier (all offsets zero).
    """
    levels = fit_levels(levels, balance)
    num_paths = math.prod(levels)
    if not is_number(C) or not (math.isfinite(C) and C > 0.0):
        raise ConfigError(f"C must be a positive finite number, got {C!r}")
    x = check_features(features)
    n, d = x.shape
    y = np.asarray(labels)
    if y.shape != (n,):
        raise DataError(
            f"labels have shape {y.shape}, expected ({n},) to match the features",
            reason="bad-shape",
        )
    if n == 0:
        raise DataError("no documents to fit the router on", reason="bad-data")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"labels must be integers, got dtype {y.dtype}", reason="bad-data")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= num_paths:
        raise DataError(f"labels must lie in [0, {num_paths})", reason="bad-path")
    xa = x if assign_features is None else check_features(assign_features)
    if xa.shape[1] != d:
        raise DataError(
            f"assign_features have {xa.shape[1]} dimensions, features have {d}",
            reason="bad-shape",
        )

    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(np.isfinite(scale) & (scale > 0.0), scale, 1.0)
    z = (x - mean) / scale
    present = np.unique(y)
    weights = np.zeros((num_paths, d))
    bias = np.zeros(num_paths)
    if present.size > 1:
        # Imported here: scikit-learn takes ~0.8 s to import, and only fitting needs it.
        from sklearn.linear_model import LogisticRegression

        # One thread keeps the fit bit-for-bit reproducible.
        with threadpool_limits(limits=1):
            clf = LogisticRegression(C=float(C), solver="lbfgs", max_iter=MAX_ITER).fit(z, y)
        coef = np.asarray(clf.coef_, dtype=np.float64)
        intercept = np.asarray(clf.intercept_, dtype=np.float64)
        classes = np.asarray(clf.classes_, dtype=np.int64)
        if coef.shape[0] == 1:
            # Binary: sklearn fits one logit for classes[1] against classes[0]; split it
            # symmetrically so that the softmax over the two is the same classifier.
            coef = np.concatenate([-coef / 2.0, coef / 2.0])
            intercept = np.concatenate([-intercept / 2.0, intercept / 2.0])
        weights[classes] = coef
        bias[classes] = intercept
    absent = np.setdiff1d(np.arange(num_paths), present)
    if absent.size:
        weights[absent] = _absent_directions(weights[present], absent.size, d, seed)
        both = np.concatenate([z, (xa - mean) / scale])
        seen = float((both @ weights[present].T + bias[present]).min())
        reach = (both @ weights[absent].T).max(axis=0)
        bias[absent] = min(seen, 0.0) - reach - ABSENT_MARGIN

    router = LogisticRouter(
        levels=levels,
        mean=mean,
        scale=scale,
        weights=weights,
        bias=bias,
        offsets=np.zeros(num_paths),
        balance=float(balance),
        seed=int(seed),
    )
    if balance > 0.0:
        # balance_offsets minimizes scores + o; our scores are maximized, hence both signs.
        offsets = -balance_offsets(
            -router.logits(xa), float(balance), what=f"{num_paths} paths (logistic router)"
        )
        router = dataclasses.replace(router, offsets=offsets)
        counts = np.bincount(router.assign(xa), minlength=num_paths)
        empty = np.flatnonzero(counts == 0)
        if empty.size:
            raise DataError(
                f"the bias correction left paths {[f'P{p}' for p in empty]} without documents "
                f"among {xa.shape[0]} (identical features cannot be split, and every path needs "
                f"at least one of the {num_paths} documents); use more documents",
                reason="starved-path",
            )
    label_counts = np.bincount(y, minlength=num_paths)
    train_acc = float(np.mean(np.argmax(z @ weights.T + bias, axis=1) == y))
    final = np.bincount(router.assign(xa), minlength=num_paths)
    logger.info(
        "logistic router: %d docs, %d features, %d of %d paths labelled (label counts %s), "
        "train accuracy %.3f, balance %.2f gives %d..%d of %d documents per path",
        n,
        d,
        present.size,
        num_paths,
        label_counts.tolist(),
        train_acc,
        balance,
        final.min(),
        final.max(),
        xa.shape[0],
    )
    return router


def _absent_directions(present: np.ndarray, count: int, d: int, seed: int) -> np.ndarray:
    """Weights for paths that no document chose: seeded random directions.

    Paths with identical weights have identical logits up to a constant, so no offset could
    ever split documents between them; distinct directions let the bias correction give each
    such path the documents that lean its way. Their norm is the typical norm of the fitted
    weights (1 when there are none), so they neither dominate nor vanish.
    """
    norms = np.linalg.norm(present, axis=1)
    norm = float(norms.mean()) if norms.size and norms.mean() > 0 else 1.0
    directions = np.random.default_rng([int(seed), 0x10615]).normal(size=(count, d))
    lengths = np.linalg.norm(directions, axis=1, keepdims=True)
    return directions / np.where(lengths > 0, lengths, 1.0) * norm


def _window(doc: np.ndarray, i: int, seq_len: int, prefix_tokens: int) -> np.ndarray:
    w = np.asarray(doc)
    if w.ndim != 1 or (w.size and not np.issubdtype(w.dtype, np.integer)):
        raise DataError(f"document {i} is not a 1-D array of token ids", reason="bad-data")
    if w.size < prefix_tokens + 2:
        raise DataError(
            f"document {i} has {w.size} tokens; scoring needs at least prefix_tokens + 2 = "
            f"{prefix_tokens + 2} (the {prefix_tokens}-token routing prefix is not scored)",
            reason="short-document",
        )
    w = w[: seq_len + 1].astype(np.int64)
    if w.min() < 0:
        raise DataError(f"document {i} has negative token ids", reason="bad-data")
    return w


def _candidate_mask(candidates: np.ndarray | None, n: int, num_paths: int) -> np.ndarray:
    """(N, P) bool: which (document, path) pairs to score."""
    if candidates is None:
        return np.ones((n, num_paths), dtype=bool)
    c = np.asarray(candidates)
    if c.ndim != 2 or c.shape[0] != n or c.shape[1] == 0:
        raise DataError(
            f"candidates must have shape ({n}, c) with c >= 1, got {c.shape}", reason="bad-shape"
        )
    if not np.issubdtype(c.dtype, np.integer):
        raise DataError(f"candidates must be integers, got dtype {c.dtype}", reason="bad-data")
    if c.size and (c.min() < 0 or c.max() >= num_paths):
        raise DataError(f"candidate path ids must lie in [0, {num_paths})", reason="bad-path")
    mask = np.zeros((n, num_paths), dtype=bool)
    mask[np.repeat(np.arange(n), c.shape[1]), c.reshape(-1).astype(np.int64)] = True
    return mask


def _router_problem(r: LogisticRouter) -> str | None:
    """Why ``r`` is inconsistent, or None."""
    if not isinstance(r.levels, list) or levels_problem(r.levels) is not None:
        return f"levels must be a non-empty list of positive integers, got {r.levels!r}"
    if not is_number(r.balance) or not 0.0 <= r.balance <= 1.0:
        return f"balance must be in [0, 1], got {r.balance!r}"
    if not is_int(r.seed):
        return f"seed must be an integer, got {r.seed!r}"
    if not isinstance(r.mean, np.ndarray) or r.mean.ndim != 1 or r.mean.size == 0:
        return "mean must be a non-empty 1-D array"
    d, p = r.mean.shape[0], math.prod(r.levels)
    shapes = {
        "scale": (r.scale, (d,)),
        "weights": (r.weights, (p, d)),
        "bias": (r.bias, (p,)),
        "offsets": (r.offsets, (p,)),
    }
    for name, (value, shape) in shapes.items():
        if not isinstance(value, np.ndarray) or value.shape != shape:
            return f"{name} must have shape {shape}, got {getattr(value, 'shape', None)}"
    for name, value in {"mean": r.mean, **{k: v for k, (v, _) in shapes.items()}}.items():
        if not np.isfinite(value).all():
            return f"{name} contains non-finite values"
    if not (r.scale > 0.0).all():
        return "scale must be positive"
    return None
