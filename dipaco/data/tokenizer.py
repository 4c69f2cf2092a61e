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
from collections import Counter
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
        byte_fallback: bool = True,
    ) -> Tokenizer:
        """Train a BPE model on a sample of ``texts`` and write it atomically to ``path``.

        The same texts, in any order, with the same settings give a byte-identical model.
        ``byte_fallback`` spells characters without a piece of their own in bytes, which takes
        256 pieces of the vocabulary; without it they become the unknown token, and a vocabulary
        of a few hundred pieces is all characters and merges (tiny models: the regime ladder).
        """
        path = Path(path)
        sample = _sample_texts(texts, sample_chars, seed)
        n_chars = sum(map(len, sample))
        if not n_chars:
            raise DataError("no text to train the tokenizer on")
        log.info("training tokenizer: vocab %d on %d chars", vocab_size, n_chars)
        sample, coverage = _character_coverage(sample, vocab_size, byte_fallback)
        model = io.BytesIO()
        interrupted: list[BaseException] = []
        try:
            # Lines are sentencepiece's sentences; fed from memory (not a temp file) so that no
            # temporary path is recorded in the model and the bytes stay reproducible.
            spm.SentencePieceTrainer.train(
                sentence_iterator=_lines(sample, interrupted),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                character_coverage=coverage,
                byte_fallback=byte_fallback,
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
            if interrupted:  # Ctrl-C while sentencepiece read the lines: a stop, not bad data
                raise interrupted[0] from None
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


def _lines(texts: list[str], interrupted: list[BaseException]) -> Iterator[str]:
    """The training lines. sentencepiece turns an exception raised while it reads them into a
    RuntimeError of its own ("INTERNAL: KeyboardInterrupt"); a stop signal's is kept in
    ``interrupted`` so that the caller raises it again as itself."""
    try:
        for text in texts:
            yield from text.splitlines()
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted.append(exc)
        raise


# Pieces every model holds besides characters and merges: unk, bos, eos, "\n" and 256 bytes.
_FIXED_PIECES = 4  # unknown, begin, end, newline; and 256 byte pieces with byte fallback
_MIN_COVERAGE = 0.98  # sentencepiece refuses a lower character_coverage


def _character_coverage(
    sample: list[str], vocab_size: int, byte_fallback: bool = True
) -> tuple[list[str], float]:
    """The tokenizer's training sample and character coverage: every character gets a piece
    (coverage 1.0) when the vocabulary has room for them all.

    Text in many scripts can hold more distinct characters than a small vocabulary has pieces
    (2,300 in ``builtin:mixed`` against 1,024). Then the most frequent characters get half of the
    room left after the fixed pieces and the rarer ones are spelled in bytes (byte fallback; or
    become the unknown token without it):
    by a coverage below 1 when the kept characters cover at least 98% of the text, else (the
    least sentencepiece accepts) by leaving the rare characters out of the training sample.
    """
    counts: Counter[str] = Counter()
    for text in sample:
        counts.update(text)
    room = vocab_size - _FIXED_PIECES - (256 if byte_fallback else 0)
    if len(counts) <= room:
        return sample, 1.0
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    keep = max(1, room // 2)
    total = sum(counts.values())
    covered = sum(n for _, n in ranked[:keep]) / total
    log.info(
        "tokenizer: %d distinct characters for %d free pieces; the %d most frequent (%.4f of the "
        "text) get pieces, the rest %s",
        *(len(counts), room, keep, covered, "byte fallback" if byte_fallback else "unknown"),
    )
    if covered >= _MIN_COVERAGE:
        return sample, covered * (1 - 1e-6)
    drop = dict.fromkeys(map(ord, (ch for ch, _ in ranked[keep:])))
    return [text.translate(drop) for text in sample], 1.0
