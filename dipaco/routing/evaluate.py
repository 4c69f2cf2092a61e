"""Routed evaluation (DiPaCo section 2.4): each held-out document goes to the path its first 32
tokens choose, and perplexity counts only the tokens after them, for every model alike.

Test-time re-routing (section 2.4.3): :func:`chunk_routes` routes every chunk of W tokens from
the chunk before it, and :func:`rerouted_perplexity` scores each chunk with its own path.

Paths are scored one at a time, so evaluation never holds more than one path in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.model.transformer import PathModel
from dipaco.routing.features import (
    FeatureKind,
    Openings,
    feature_dim,
    finish_features,
    position_features,
    prefix_features,
)


@torch.no_grad()
def routed_perplexity(
    load_path: Callable[[int], PathModel],
    docs: list[np.ndarray],
    paths: np.ndarray,
    *,
    seq_len: int,
    prefix_tokens: int = 32,
    batch_size: int = 32,
) -> dict:
    """Perplexity over the first ``seq_len`` predicted tokens of each document, prefix excluded.

    Returns ``{"ppl", "loss", "tokens", "per_path": {p: {"ppl", "loss", "docs", "tokens"}}}``.
    A dense model is evaluated by routing every document to path 0.
    """
    per_path: dict[int, tuple[float, int, int]] = {}
    for p in sorted({int(x) for x in paths}):
        model = load_path(p)
        model.eval()
        chosen = [docs[i] for i in np.flatnonzero(paths == p)]
        nll, count = 0.0, 0
        for start in range(0, len(chosen), batch_size):
            windows = [_window(d, seq_len) for d in chosen[start : start + batch_size]]
            losses, valid = token_losses(model, windows, prefix_tokens)
            nll += float(losses[valid].double().sum())
            count += int(valid.sum())
        per_path[p] = (nll, count, len(chosen))
    return _summary(per_path)


# ---- shared pieces ----------------------------------------------------------------------------


def _window(doc: np.ndarray, seq_len: int) -> np.ndarray:
    """The evaluated window of a document: its first ``seq_len + 1`` tokens."""
    return np.asarray(doc[: seq_len + 1], dtype=np.int64)


def _pad(rows: list[np.ndarray], length: int) -> torch.Tensor:
    """Right-padded (B, length) token batch; each row is cut to ``length``."""
    tokens = torch.zeros(len(rows), max(length, 0), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:length]
        tokens[i, : len(r)] = torch.from_numpy(r)
    return tokens


def _summary(per_path: dict[int, tuple[float, int, int]]) -> dict:
    """Perplexity results from each path's (summed loss, tokens scored, documents)."""
    nll = sum(v[0] for v in per_path.values())
    count = sum(v[1] for v in per_path.values())
    loss = nll / max(count, 1)
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "tokens": count,
        "per_path": {
            p: {"loss": n / max(c, 1), "ppl": math.exp(n / max(c, 1)), "docs": d, "tokens": c}
            for p, (n, c, d) in per_path.items()
        },
    }


def token_losses(
    model: PathModel, windows: list[np.ndarray], prefix_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target losses (B, T) on the CPU, and the mask of scored targets (the same ``valid`` rule
    as :func:`routed_perplexity`: target position j predicts token j+1, tokens 0..prefix_tokens-1
    are never scored)."""
    device = next(model.parameters()).device
    length = max(len(w) for w in windows)
    tokens = _pad(windows, length)
    valid = torch.zeros(len(windows), max(length - 1, 0), dtype=torch.bool)
    for i, w in enumerate(windows):
        valid[i, max(prefix_tokens - 1, 0) : len(w) - 1] = True
    if length < 2:
        return torch.zeros(valid.shape), valid
    logits = model(tokens[:, :-1].to(device))
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        tokens[:, 1:].reshape(-1).to(device),
        reduction="none",
    ).view(valid.shape)
    return losses.cpu(), valid


def _check_eval_args(seq_len: int, prefix_tokens: int, batch_size: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if prefix_tokens < 0:
        raise ValueError(f"prefix_tokens must be >= 0, got {prefix_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")


@torch.no_grad()
def heldout_loss(
    model: PathModel,
    docs: list[np.ndarray],
    *,
    seq_len: int,
    prefix_tokens: int = 32,
    batch_size: int = 32,
) -> tuple[float, int]:
    """Mean loss of ``model`` over the scored tokens of ``docs``, and how many tokens were scored.

    The tokens scored are those of :func:`routed_perplexity` (the first ``seq_len`` predicted
    tokens, the first ``prefix_tokens`` excluded); per-path early stopping measures this on the
    path's own held-out shard. No scored token gives a loss of NaN.
    """
    _check_eval_args(seq_len, prefix_tokens, batch_size)
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, len(docs), batch_size):
        windows = [_window(d, seq_len) for d in docs[start : start + batch_size]]
        losses, valid = token_losses(model, windows, prefix_tokens)
        nll += float(losses[valid].double().sum())
        count += int(valid.sum())
    return (nll / count if count else math.nan), count


# ---- test-time re-routing (DiPaCo section 2.4.3) ----------------------------------------------


def num_chunks(seq_len: int, window: int) -> int:
    """How many chunks of ``window`` target positions cover ``seq_len`` targets."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    return -(-seq_len // window)


def _covering_chunks(n_targets: int, window: int) -> int:
    """Chunks that cover at least one target position of a window with ``n_targets`` targets;
    at least 1 (chunk 0 holds the document's route even when nothing is scored)."""
    return max(1, -(-n_targets // window))


@torch.no_grad()
def chunk_routes(
    initial_model: PathModel,
    assign: Callable[[np.ndarray], np.ndarray],
    docs: list[np.ndarray],
    *,
    window: int,
    seq_len: int,
    prefix_tokens: int = 32,
    batch_size: int = 32,
    assign_later: Callable[[np.ndarray], np.ndarray] | None = None,
    kind: FeatureKind = "hidden",
    openings: Openings | None = None,
) -> np.ndarray:
    """(N, ceil(seq_len / window)) int64: the path of every chunk of every document.

    Chunk i covers target positions [i * window, (i + 1) * window) of the document's evaluated
    window (its first ``seq_len + 1`` tokens). Chunk 0 takes the usual prefix route,
    ``assign(prefix_features(initial_model, docs, prefix_tokens))``. Chunk i >= 1 is routed by
    ``assign`` on the mean last-block hidden state of ``initial_model`` over the last
    ``min(window, prefix_tokens)`` positions of chunk i - 1, all from one causal forward pass per
    document, so the route of chunk i reads only tokens before position i * window and no token
    that chunk scores. Chunks past the end of a short document repeat the previous route.
    ``assign_later``, when given, routes chunks i >= 1 instead of ``assign`` (a chunk router
    trained on such windows, see ``window_features``). ``kind`` is the routing features' kind
    (``dipaco.routing.features``): for ``tokens`` the spans' token bags stand for hidden states.
    ``openings``: the run's shared openings, skipped by chunk 0's prefix route as in prepare.
    """
    _check_eval_args(seq_len, prefix_tokens, batch_size)
    if prefix_tokens < 1:
        raise ValueError("re-routing needs prefix_tokens >= 1")
    n_chunks = num_chunks(seq_len, window)
    routes = np.zeros((len(docs), n_chunks), dtype=np.int64)
    if not docs:
        return routes
    routes[:, 0] = np.asarray(
        assign(prefix_features(initial_model, docs, prefix_tokens, batch_size, kind, openings)),
        dtype=np.int64,
    )
    if n_chunks == 1:
        return routes
    initial_model.eval()
    device = next(initial_model.parameters()).device
    span = min(window, prefix_tokens)
    for start in range(0, len(docs), batch_size):
        windows = [_window(d, seq_len) for d in docs[start : start + batch_size]]
        n_targets = np.array([max(len(w) - 1, 0) for w in windows])
        length = int(n_targets.max())
        covered = np.zeros((len(windows), n_chunks), dtype=bool)  # chunk i >= 1 has a target
        feats, where = [], []
        if length > window:
            # Positions 0..length-1 are the inputs of the target positions; right padding is
            # harmless because attention is causal.
            hidden = position_features(initial_model, _pad(windows, length), kind)
            for i in range(1, n_chunks):
                s = i * window
                rows = np.flatnonzero(n_targets > s)
                if rows.size == 0:
                    break
                mean = hidden[torch.from_numpy(rows).to(device), s - span : s].mean(1)
                feats.append(finish_features(mean, kind).cpu().numpy())
                where.extend((int(b), i) for b in rows)
                covered[rows, i] = True
        later = assign_later or assign
        chosen = (
            np.asarray(later(np.concatenate(feats)), dtype=np.int64)
            if feats
            else np.zeros(0, dtype=np.int64)
        )
        block = routes[start : start + len(windows)]
        for (b, i), p in zip(where, chosen, strict=True):
            block[b, i] = p
        for i in range(1, n_chunks):
            block[~covered[:, i], i] = block[~covered[:, i], i - 1]
    return routes


@torch.no_grad()
def rerouted_perplexity(
    load_path: Callable[[int], PathModel],
    docs: list[np.ndarray],
    routes: np.ndarray,
    *,
    window: int,
    seq_len: int,
    prefix_tokens: int = 32,
    batch_size: int = 32,
) -> dict:
    """Perplexity when every chunk of ``window`` target positions is scored by its own path.

    ``routes`` is (N, ceil(seq_len / window)), as from :func:`chunk_routes`. The tokens scored are
    exactly those of :func:`routed_perplexity`; with ``window >= seq_len`` the two agree. Paths
    are streamed one at a time: path p runs causally over the whole window of every document that
    scores tokens with it (recomputing the context, as the paper re-computes the KV-cache after a
    re-route) and adds the losses of the targets whose chunk is routed to p.

    Returns :func:`routed_perplexity`'s result plus ``"window"`` and ``"switches"`` (mean number
    of route changes per document, over the chunks that cover a target). ``per_path[p]["docs"]``
    counts the documents that use p in a covering chunk and ``"tokens"`` the tokens p scored.
    """
    _check_eval_args(seq_len, prefix_tokens, batch_size)
    n_chunks = num_chunks(seq_len, window)
    routes = np.asarray(routes)
    if routes.shape != (len(docs), n_chunks):
        raise ValueError(
            f"routes has shape {routes.shape}, expected ({len(docs)}, {n_chunks}) for "
            f"{len(docs)} documents, seq_len {seq_len} and window {window}"
        )
    routes = routes.astype(np.int64)
    first = max(prefix_tokens - 1, 0)
    uses: dict[int, set[int]] = {}  # path -> docs that use it in a covering chunk
    scores: dict[int, list[int]] = {}  # path -> docs in which it scores at least one token
    switches = 0
    for d, doc in enumerate(docs):
        n_t = max(min(len(doc), seq_len + 1) - 1, 0)
        cover = routes[d, : _covering_chunks(n_t, window)]
        switches += int((cover[1:] != cover[:-1]).sum())
        for p in np.unique(cover):
            uses.setdefault(int(p), set()).add(d)
        if n_t > first:
            for p in np.unique(routes[d, np.arange(first, n_t) // window]):
                scores.setdefault(int(p), []).append(d)
    per_path: dict[int, tuple[float, int, int]] = {}
    for p in sorted(uses):
        chosen = scores.get(p, [])
        nll, count = 0.0, 0
        if chosen:
            model = load_path(p)
            model.eval()
            for start in range(0, len(chosen), batch_size):
                idx = chosen[start : start + batch_size]
                losses, valid = token_losses(
                    model, [_window(docs[d], seq_len) for d in idx], prefix_tokens
                )
                chunk_of = torch.arange(valid.shape[1]) // window
                mine = torch.from_numpy(routes[idx][:, chunk_of.numpy()] == p) & valid
                nll += float(losses[mine].double().sum())
                count += int(mine.sum())
        per_path[p] = (nll, count, len(uses[p]))
    return {
        **_summary(per_path),
        "window": window,
        "switches": switches / max(len(docs), 1),
    }


@torch.no_grad()
def window_features(
    initial_model: PathModel,
    docs: list[np.ndarray],
    *,
    seq_len: int,
    span: int = 32,
    stride: int = 16,
    batch_size: int = 32,
    kind: FeatureKind = "hidden",
) -> tuple[np.ndarray, np.ndarray]:
    """What a chunk router reads, at every ``stride`` tokens of each document's evaluated window.

    For each document and each end position e = span, span + stride, ... up to the window's
    length, the mean of ``initial_model``'s last-block hidden states over positions [e - span, e)
    (the same causal forward pass ``chunk_routes`` uses). Returns (features (M, dim), doc index
    (M,)): the training inputs of a learned chunk router.
    """
    initial_model.eval()
    device = next(initial_model.parameters()).device
    feats: list[np.ndarray] = []
    index: list[int] = []
    for start in range(0, len(docs), batch_size):
        windows = [_window(d, seq_len) for d in docs[start : start + batch_size]]
        n_inputs = np.array([max(len(w) - 1, 0) for w in windows])
        length = int(n_inputs.max()) if len(windows) else 0
        if length < span:
            continue
        hidden = position_features(initial_model, _pad(windows, length), kind)
        for end in range(span, length + 1, stride):
            rows = np.flatnonzero(n_inputs >= end)
            if rows.size == 0:
                break
            mean = hidden[torch.from_numpy(rows).to(device), end - span : end].mean(1)
            feats.append(finish_features(mean, kind).cpu().numpy())
            index.extend(int(start + b) for b in rows)
    dim = feature_dim(initial_model, kind)
    if not feats:
        return np.zeros((0, dim), dtype=np.float32), np.zeros(0, dtype=np.int64)
    return np.concatenate(feats).astype(np.float32), np.array(index, dtype=np.int64)
