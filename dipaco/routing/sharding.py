"""The shard writer: routed documents to per-path token shards, each with a held-out slice.

DiPaCo section 2.2: documents are routed once, offline, so the corpus is pre-sharded by path.
The held-out slice of a shard (chosen by a hash of the document id, so it is stable) is what
per-path early stopping measures against.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from dipaco.data.shards import ShardWriter
from dipaco.errors import DataError
from dipaco.fileio import write_json_atomic


def is_heldout(doc_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:heldout:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def write_path_shards(
    out_dir: str | Path,
    docs: list[np.ndarray],
    doc_ids: list[str],
    paths: np.ndarray,
    num_paths: int,
    vocab_size: int,
    *,
    heldout_fraction: float,
    seed: int,
    min_train_tokens: int,
) -> dict:
    """Write ``P<p>/train`` and ``P<p>/heldout`` for every path; return routing statistics."""
    out_dir = Path(out_dir)
    writers = {
        (p, part): ShardWriter(out_dir / f"P{p}" / part, vocab_size)
        for p in range(num_paths)
        for part in ("train", "heldout")
    }
    stats = {
        part: {"docs": [0] * num_paths, "tokens": [0] * num_paths} for part in ("train", "heldout")
    }
    for tokens, doc_id, p in zip(docs, doc_ids, paths, strict=True):
        part = "heldout" if is_heldout(doc_id, heldout_fraction, seed) else "train"
        writers[(int(p), part)].add(tokens, doc_id)
        stats[part]["docs"][int(p)] += 1
        stats[part]["tokens"][int(p)] += len(tokens)
    for writer in writers.values():
        writer.close()
    starved = [p for p in range(num_paths) if stats["train"]["tokens"][p] < min_train_tokens]
    if starved:
        raise DataError(
            f"paths {[f'P{p}' for p in starved]} received fewer than {min_train_tokens} training "
            f"tokens; use more data, fewer paths, or a higher routing.balance"
        )
    write_json_atomic(out_dir / "stats.json", stats)
    return stats
