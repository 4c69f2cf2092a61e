"""Prefix features for routing (DiPaCo section 7.2.1), of two kinds (``routing.features``).

- ``hidden``, the paper's: "The feature for the router is always the average of the hidden state
  from the last transformer block from the initial LM over the first 32 tokens of a document."
- ``tokens``: a bag of the same tokens' ids (each id folded into ``TOKEN_FEATURE_DIM`` buckets),
  square-rooted counts scaled to unit length; no model is run. The paper's initial LM is well
  trained; a small run's is not (100 dense steps in ``--preset capacity``), and its hidden states
  lose what the tokens say: on ``builtin:mixed`` a logistic regression tells a validation
  document's source from the hidden features 52% of the time and from the bag of tokens 90%;
  k-means shards made from the bag are 0.59 pure by source against 0.36 (docs/results.md).

Every reader of a span of tokens (the prefix route, re-routing every few tokens, the learned
chunk router, generation) computes its features through :func:`position_features` (one vector
per position), a mean over the span's positions, and :func:`finish_features`, so that a kind
means the same thing everywhere.

Boilerplate openings (``routing.skip_openings``): real corpora open many documents with the same
lines (a licence header, an include block), so their prefixes are identical and say nothing of
what follows. :func:`shared_openings` finds the blocks of ``prefix_tokens`` tokens that open at
least a given number of training documents (block 0; then, among those, block 1; up to
``MAX_SKIPPED_BLOCKS``), and :func:`skip_opening` routes a document by the first block after
its shared ones. The openings are saved with the run, so validation documents and prompts skip
the same ones.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.model.transformer import PathModel

FeatureKind = Literal["hidden", "tokens"]
FEATURE_KINDS: tuple[str, ...] = ("hidden", "tokens")
TOKEN_FEATURE_DIM = 1024  # buckets of a token bag: token ids are folded (id % dim) beyond it
MAX_SKIPPED_BLOCKS = 8  # opening blocks a document's route may skip
Openings = list[set[str]]  # per block index: the digests of the shared blocks there


def _digest(block: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(block, dtype=np.int64).tobytes()).hexdigest()[:32]


def shared_openings(docs: Sequence[np.ndarray], prefix_tokens: int, min_docs: int) -> Openings:
    """The opening blocks shared by at least ``min_docs`` documents: block k (tokens
    ``[k * prefix_tokens, (k + 1) * prefix_tokens)``) counts among the documents whose blocks
    before it are all shared ones. Empty when no opening is that common."""
    levels: Openings = []
    alive = range(len(docs))
    for k in range(MAX_SKIPPED_BLOCKS):
        keys: dict[int, str] = {}
        for i in alive:
            block = docs[i][k * prefix_tokens : (k + 1) * prefix_tokens]
            if len(block) == prefix_tokens:
                keys[i] = _digest(block)
        counts = Counter(keys.values())
        shared = {key for key, n in counts.items() if n >= max(2, min_docs)}
        if not shared:
            break
        levels.append(shared)
        alive = [i for i, key in keys.items() if key in shared]
    return levels


def skip_opening(doc: np.ndarray, prefix_tokens: int, openings: Openings) -> np.ndarray:
    """``doc`` from its first block that is not a shared opening (never past its last token)."""
    k = 0
    while k < len(openings) and len(doc) > (k + 1) * prefix_tokens:
        block = doc[k * prefix_tokens : (k + 1) * prefix_tokens]
        if _digest(block) not in openings[k]:
            break
        k += 1
    return doc[k * prefix_tokens :]


def feature_dim(model: PathModel, kind: FeatureKind = "hidden") -> int:
    """The width of ``kind``'s features under ``model``."""
    if kind == "tokens":
        return min(model.cfg.vocab_size, TOKEN_FEATURE_DIM)
    return model.cfg.dim


def position_features(
    model: PathModel, tokens: torch.Tensor, kind: FeatureKind = "hidden"
) -> torch.Tensor:
    """(B, T, D) per-position features of ``tokens`` (B, T) on the model's device: the model's
    last-block hidden states, or (``tokens``) each token's one-hot bucket."""
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    if kind == "tokens":
        return F.one_hot(tokens % feature_dim(model, kind), feature_dim(model, kind)).float()
    if kind != "hidden":
        raise ValueError(f"unknown feature kind {kind!r}; expected one of {FEATURE_KINDS}")
    _, hidden = model(tokens, return_hidden=True)
    return hidden.float()


def finish_features(means: torch.Tensor, kind: FeatureKind = "hidden") -> torch.Tensor:
    """Span means (N, D) into features: hidden means as they are; token frequencies
    square-rooted and scaled to unit length (frequent tokens weigh less)."""
    if kind != "tokens":
        return means
    roots = means.clamp_min(0).sqrt()
    return roots / roots.norm(dim=1, keepdim=True).clamp_min(1e-9)


@torch.no_grad()
def prefix_features(
    model: PathModel,
    docs: list[np.ndarray],
    prefix_tokens: int = 32,
    batch_size: int = 64,
    kind: FeatureKind = "hidden",
    openings: Openings | None = None,
) -> np.ndarray:
    """(N, D) float32: ``kind``'s features of each document's first ``prefix_tokens`` (after
    its shared ``openings``, when given: :func:`skip_opening`)."""
    if openings:
        docs = [skip_opening(np.asarray(d), prefix_tokens, openings) for d in docs]
    model.eval()
    device = next(model.parameters()).device
    out = np.zeros((len(docs), feature_dim(model, kind)), dtype=np.float32)
    for start in range(0, len(docs), batch_size):
        chunk = [np.asarray(d[:prefix_tokens]) for d in docs[start : start + batch_size]]
        lengths = torch.tensor([len(c) for c in chunk])
        if (lengths == 0).any():
            raise ValueError("cannot route an empty document")
        tokens = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long)
        for i, c in enumerate(chunk):
            tokens[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
        # Right padding is harmless: attention is causal, so padded positions never feed real
        # ones, and the mask leaves them out of the mean.
        per_position = position_features(model, tokens, kind)
        mask = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).to(device).unsqueeze(-1)
        mean = (per_position * mask).sum(1) / lengths.to(device)[:, None]
        out[start : start + len(chunk)] = finish_features(mean, kind).cpu().numpy()
    return out
