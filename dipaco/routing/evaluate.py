"""Routed evaluation (DiPaCo section 2.4): each held-out document goes to the path its first 32
tokens choose, and perplexity counts only the tokens after them, for every model alike.

Paths are scored one at a time, so evaluation never holds more than one path in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.model.transformer import PathModel


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
    per_path = {}
    total_nll, total_count = 0.0, 0
    for p in sorted({int(x) for x in paths}):
        model = load_path(p)
        model.eval()
        chosen = [docs[i] for i in np.flatnonzero(paths == p)]
        nll, count = 0.0, 0
        for start in range(0, len(chosen), batch_size):
            window = [
                np.asarray(d[: seq_len + 1], dtype=np.int64)
                for d in chosen[start : start + batch_size]
            ]
            length = max(len(w) for w in window)
            tokens = torch.zeros(len(window), length, dtype=torch.long)
            valid = torch.zeros(len(window), length - 1, dtype=torch.bool)
            for i, w in enumerate(window):
                tokens[i, : len(w)] = torch.from_numpy(w)
                # target position j predicts token j+1; tokens 0..prefix_tokens-1 are not scored
                valid[i, max(prefix_tokens - 1, 0) : len(w) - 1] = True
            logits = model(tokens[:, :-1])
            losses = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                tokens[:, 1:].reshape(-1),
                reduction="none",
            ).view_as(valid)
            nll += float(losses[valid].sum())
            count += int(valid.sum())
        per_path[p] = {
            "loss": nll / max(count, 1),
            "ppl": math.exp(nll / max(count, 1)),
            "docs": len(chosen),
            "tokens": count,
        }
        total_nll += nll
        total_count += count
    loss = total_nll / max(total_count, 1)
    return {"loss": loss, "ppl": math.exp(loss), "tokens": total_count, "per_path": per_path}
