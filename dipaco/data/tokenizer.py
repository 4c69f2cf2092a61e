"""The run's tokenizer: a sentencepiece BPE model trained once and pinned by its sha256.

Settings are chosen so that code round-trips exactly: no normalization, whitespace kept as is,
newlines as their own piece, and byte fallback for any character outside the vocabulary.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from dipaco.errors import DataError
from dipaco.fileio import write_atomic

log = logging.getLogger(__name__)

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


class Tokenizer:
    """A loaded sentencepiece model; build one with ``Tokenizer.train`` or ``Tokenizer.load``."""

    def __init__(self, path: Path, model: bytes) -> None:
        self._path = path
        self._sha256 = hashlib.sha256(model).hexdigest()
        self._sp = spm.SentencePieceProcessor(model_proto=model)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            return cls(path, path.read_bytes())
        except FileNotFoundError as exc:
            raise DataError(f"tokenizer model not found: {path}") from exc
        except RuntimeError as exc:
            raise DataError(f"{path} is not a sentencepiece model: {exc}") from exc

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        path: str | Path,
        vocab_size: int,
        sample_chars: int = 3_000_000,
        seed: int = 0,
    ) -> Tokenizer:
        """Train a BPE model on a sample of ``texts`` and write it atomically to ``path``.

        The same texts, in any order, with the same settings give a byte-identical model.
        """
        path = Path(path)
        sample = _sample_texts(texts, sample_chars, seed)
        n_chars = sum(map(len, sample))
        if not n_chars:
            raise DataError("no text to train the tokenizer on")
        log.info("training tokenizer: vocab %d on %d chars", vocab_size, n_chars)
        model = io.BytesIO()
        try:
            # Lines are sentencepiece's sentences; fed from memory (not a temp file) so that no
            # temporary path is recorded in the model and the bytes stay reproducible.
            spm.SentencePieceTrainer.train(
                sentence_iterator=_lines(sample),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=1.0,
                byte_fallback=True,
                split_digits=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                # A dummy prefix would give every training line a leading space that the same
                # line never has after a newline inside a document.
                add_dummy_prefix=False,
                user_defined_symbols=["\n"],
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                pad_id=-1,
                num_threads=2,
                max_sentence_length=1 << 16,
                minloglevel=2,
            )
        except RuntimeError as exc:
            if "Vocabulary size too high" in str(exc):
                raise DataError(
                    f"vocab_size={vocab_size} is too large for {n_chars} chars of training text; "
                    f"use a smaller vocab_size or more text ({exc})"
                ) from exc
            raise DataError(f"tokenizer training failed: {exc}") from exc
        write_atomic(path, model.getvalue())
        return cls(path, model.getvalue())

    @property
    def path(self) -> Path:
        return self._path

    @property
    def sha256(self) -> str:
        return self._sha256

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _sample_texts(texts: Iterable[str], sample_chars: int, seed: int) -> list[str]:
    """Texts with the smallest seeded hashes that fit in ``sample_chars``, in hash order.

    Keyed by content, not position, so the sample is spread over the whole input and does
    not depend on its order; memory stays bounded by ``sample_chars``.
    """
    heap: list[tuple[int, str]] = []  # negated hashes: heapq pops the smallest, we drop the largest
    total = 0
    for text in texts:
        text = text[:sample_chars]
        digest = hashlib.blake2b(text.encode(), key=str(seed).encode(), digest_size=16).digest()
        heapq.heappush(heap, (-int.from_bytes(digest, "big"), text))
        total += len(text)
        while total > sample_chars:
            total -= len(heapq.heappop(heap)[1])
    return [text for _, text in sorted(heap, reverse=True)]


def _lines(texts: list[str]) -> Iterator[str]:
    for text in texts:
        yield from text.splitlines()
