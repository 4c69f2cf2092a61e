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
    """Write ``P<p>/train`` and ``P<p>/heldout`` for every path; return routing statistics.

    ``paths`` is (N,) path ids, or (N, n) each document's top-n paths, best first. With n > 1
    the training shards overlap (DiPaCo §2.4.4): a training document goes to the train shard of
    every path in its row, while a held-out document goes only to the held-out slice of its
    best path, so the held-out data does not depend on n. The statistics count documents and
    tokens per path per part (an overlapping document counts once in each of its paths) and
    record ``"overlap": n``.
    """
    out_dir = Path(out_dir)
    choices = _path_choices(paths, len(docs), num_paths)
    if len(doc_ids) != len(docs):
        raise DataError(f"{len(doc_ids)} document ids for {len(docs)} documents")
    writers = {
        (p, part): ShardWriter(out_dir / f"P{p}" / part, vocab_size)
        for p in range(num_paths)
        for part in ("train", "heldout")
    }
    stats: dict = {
        part: {"docs": [0] * num_paths, "tokens": [0] * num_paths} for part in ("train", "heldout")
    }
    stats["overlap"] = int(choices.shape[1])
    for tokens, doc_id, row in zip(docs, doc_ids, choices, strict=True):
        if is_heldout(doc_id, heldout_fraction, seed):
            part, targets = "heldout", row[:1]
        else:
            part, targets = "train", row
        for p in targets:
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


def _path_choices(paths: np.ndarray, n_docs: int, num_paths: int) -> np.ndarray:
    """``paths`` as an (N, n) int64 array of distinct valid path ids per row."""
    a = np.asarray(paths)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.shape[0] != n_docs or a.shape[1] == 0:
        raise DataError(
            f"paths must have shape ({n_docs},) or ({n_docs}, n) with n >= 1, got "
            f"{np.shape(paths)}",
            reason="bad-shape",
        )
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise DataError(f"paths must be integers, got dtype {a.dtype}", reason="bad-data")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= num_paths):
        raise DataError(f"path ids must lie in [0, {num_paths})", reason="bad-path")
    if a.shape[1] > 1:
        ordered = np.sort(a, axis=1)
        repeats = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if repeats.size:
            i = int(repeats[0])
            raise DataError(
                f"{repeats.size} documents list a path twice (first: document {i}, paths "
                f"{a[i].tolist()}); each row must hold n distinct paths",
                reason="bad-path",
            )
    return a
