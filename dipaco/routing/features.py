"""Prefix features for routing (DiPaCo section 7.2.1).

"The feature for the router is always the average of the hidden state from the last transformer
block from the initial LM over the first 32 tokens of a document."
"""

from __future__ import annotations

import numpy as np
import torch

from dipaco.model.transformer import PathModel


@torch.no_grad()
def prefix_features(
    model: PathModel, docs: list[np.ndarray], prefix_tokens: int = 32, batch_size: int = 64
) -> np.ndarray:
    """(N, dim) float32: mean last-block state over each document's first ``prefix_tokens``."""
    model.eval()
    device = next(model.parameters()).device
    out = np.zeros((len(docs), model.cfg.dim), dtype=np.float32)
    for start in range(0, len(docs), batch_size):
        chunk = [np.asarray(d[:prefix_tokens]) for d in docs[start : start + batch_size]]
        lengths = torch.tensor([len(c) for c in chunk])
        if (lengths == 0).any():
            raise ValueError("cannot route an empty document")
        tokens = torch.zeros(len(chunk), int(lengths.max()), dtype=torch.long)
        for i, c in enumerate(chunk):
            tokens[i, : len(c)] = torch.from_numpy(c.astype(np.int64))
        # Right padding is harmless: attention is causal, so padded positions never feed real ones.
        _, hidden = model(tokens.to(device), return_hidden=True)
        mask = (torch.arange(tokens.shape[1])[None, :] < lengths[:, None]).to(device).unsqueeze(-1)
        mean = (hidden.float() * mask).sum(1) / lengths.to(device)[:, None]
        out[start : start + len(chunk)] = mean.cpu().numpy()
    return out
