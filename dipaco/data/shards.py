"""Token shards on disk: the documents of one path, written once and read by random access.

A shard ``<prefix>`` is three files: ``<prefix>.tokens`` (all documents' tokens back to back,
raw uint16 or uint32), ``<prefix>.index.npy`` (int64 offsets, one per document plus the end)
and ``<prefix>.json`` (metadata with checksums of the other two). The metadata is written
last, so a shard is complete if and only if its ``.json`` exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from dipaco.errors import CorruptFileError, DataError
from dipaco.fileio import AtomicFile, file_info, write_atomic

log = logging.getLogger(__name__)

# A shard's three files: its prefix with each of these appended.
SHARD_SUFFIXES = (".tokens", ".index.npy", ".json")


def shard_name(path: int, split: str = "train", prefix: str = "shards") -> str:
    """Path ``path``'s shard of ``split`` ("train" or "heldout") in a routing phase's shard
    folder ``prefix`` ("shards", "shards/phase1", ...), relative to the run folder:
    ``shards/P3/train``. Peers fetch its files under this name with :data:`SHARD_SUFFIXES`."""
    return f"{prefix}/P{path}/{split}"


def _paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    # Appended, not with_suffix: a prefix like "shards/P3.train" must keep its dots.
    prefix = str(prefix)
    return Path(prefix + ".tokens"), Path(prefix + ".index.npy"), Path(prefix + ".json")


class ShardWriter:
    """Appends documents to a new shard.

    Nothing is visible until ``close`` publishes the shard; an exception inside ``with``
    discards it instead.
    """

    def __init__(self, path_prefix: str | Path, vocab_size: int) -> None:
        self.prefix = path_prefix
        self.vocab_size = vocab_size
        self.dtype = np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)
        self._tokens = AtomicFile(_paths(path_prefix)[0])
        self._sha = hashlib.sha256()
        self._offsets = [0]
        self._doc_ids: list[str] = []

    def add(self, tokens: Sequence[int] | np.ndarray, doc_id: str) -> None:
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise DataError(f"document {doc_id!r} has token ids outside [0, {self.vocab_size})")
        data = array.astype(self.dtype).tobytes()
        self._tokens.write(data)
        self._sha.update(data)
        self._offsets.append(self._offsets[-1] + array.size)
        self._doc_ids.append(doc_id)

    def close(self) -> None:
        tokens_path, index_path, meta_path = _paths(self.prefix)
        self._tokens.commit()
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(self._offsets, dtype=np.int64), allow_pickle=False)
        write_atomic(index_path, buffer.getvalue())
        meta = {
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "n_docs": len(self._doc_ids),
            "n_tokens": self._offsets[-1],
            "doc_ids": self._doc_ids,
            "tokens_sha256": self._sha.hexdigest(),
            "index_sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
        }
        write_atomic(meta_path, json.dumps(meta).encode())
        log.debug(
            "wrote shard %s: %d docs, %d tokens", self.prefix, meta["n_docs"], meta["n_tokens"]
        )

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._tokens.abort()


class TokenShard:
    """A written shard, memory-mapped read-only; ``shard[i]`` is document i's tokens."""

    def __init__(self, path_prefix: str | Path, verify: bool = False) -> None:
        self.prefix = path_prefix
        self.tokens_path, self.index_path, meta_path = _paths(path_prefix)
        if not meta_path.is_file():
            raise DataError(f"no complete shard at {path_prefix} ({meta_path} is missing)")
        self.meta = json.loads(meta_path.read_text())
        self.vocab_size: int = self.meta["vocab_size"]
        self.doc_ids: list[str] = self.meta["doc_ids"]
        self.n_tokens: int = self.meta["n_tokens"]
        dtype = np.dtype(self.meta["dtype"])
        expected = self.n_tokens * dtype.itemsize
        size = self.tokens_path.stat().st_size if self.tokens_path.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size} bytes"
            raise CorruptFileError(f"{self.tokens_path} is {found}, expected {expected} bytes")
        try:
            self._offsets = np.load(self.index_path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CorruptFileError(f"{self.index_path} is unreadable: {exc}") from exc
        if self._offsets.shape != (len(self.doc_ids) + 1,) or self._offsets[-1] != self.n_tokens:
            raise CorruptFileError(f"{self.index_path} does not match {meta_path}")
        # np.memmap refuses empty files, and an empty shard has nothing to map.
        self.tokens = (
            np.memmap(self.tokens_path, dtype=dtype, mode="r", shape=(self.n_tokens,))
            if self.n_tokens
            else np.zeros(0, dtype=dtype)
        )
        if verify:
            self.verify()

    @staticmethod
    def exists(path_prefix: str | Path) -> bool:
        return _paths(path_prefix)[2].is_file()

    def verify(self) -> None:
        """Recompute both checksums; raise CorruptFileError naming the file that differs."""
        for path, key in ((self.tokens_path, "tokens_sha256"), (self.index_path, "index_sha256")):
            if file_info(path)["sha256"] != self.meta[key]:
                raise CorruptFileError(f"{path} fails its checksum")

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self._offsets)

    def __len__(self) -> int:
        return len(self.doc_ids)

    def __getitem__(self, i: int) -> np.ndarray:
        i = range(len(self))[i]  # negative indices and IndexError, as for a list
        return np.asarray(self.tokens[self._offsets[i] : self._offsets[i + 1]], dtype=np.int64)

    def docs(self) -> list[np.ndarray]:
        """Every document's tokens, in order."""
        return [self[i] for i in range(len(self))]


def sample_windows(
    shard: TokenShard, rng: np.random.Generator, batch: int, length: int
) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens from the shard's concatenated documents."""
    if shard.n_tokens < length:
        raise DataError(
            f"shard {shard.prefix} has {shard.n_tokens} tokens, fewer than a window of {length}"
        )
    starts = rng.integers(0, shard.n_tokens - length + 1, size=batch)
    return shard.tokens[starts[:, None] + np.arange(length)].astype(np.int64)


def window_batches(
    shard: TokenShard, seed: Sequence[int], batch: int, seq_len: int, device: str = "cpu"
) -> Iterator[torch.Tensor]:
    """Endless (batch, seq_len + 1) training batches, drawn by a generator seeded with ``seed``."""
    rng = np.random.default_rng(list(seed))
    pinned = device.startswith("cuda") and torch.cuda.is_available()
    while True:
        windows = torch.from_numpy(sample_windows(shard, rng, batch, seq_len + 1))
        if pinned:  # page-locked, so the copy to the GPU overlaps the step still running there
            yield windows.pin_memory().to(device, non_blocking=True)
        else:
            yield windows.to(device)
