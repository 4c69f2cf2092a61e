"""The built-in sample corpus: the Python standard library's sources and pydoc topics.

Every Python installation ships these, so demos and tests have a few thousand real documents
without downloading anything. Texts are cut into documents of a few thousand characters, and
``split_train_val`` assigns each document to a side by a hash of its id alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from dipaco.data.document import Document

log = logging.getLogger(__name__)

# Installed packages are not the standard library, and test suites are mostly fixtures and
# generated data rather than code people write.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# The same text as the pydoc topics, which are added one document per topic.
_SKIP_FILES = frozenset({"pydoc_data/topics.py"})
_MIN_TEXT_CHARS = 300


def stdlib_root() -> Path:
    """The folder holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by their path relative to the stdlib root.

    ``root`` is the running interpreter's standard library unless given.
    """
    root = stdlib_root() if root is None else root
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.isdisjoint(rel.parts[:-1]) and rel.as_posix() not in _SKIP_FILES:
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_text(text: str, min_chars: int = 2000, max_chars: int = 4000) -> list[str]:
    """Cut ``text`` at line boundaries into pieces of about ``min_chars`` to ``max_chars``.

    Once a piece has ``min_chars`` it ends at the next blank line, so pieces tend to start at a
    definition or paragraph: that start is what the router sees. A text shorter than 300
    characters gives nothing; a tail shorter than ``min_chars`` joins the previous piece.
    """
    if len(text) < _MIN_TEXT_CHARS:
        return []
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for line in _bounded_lines(text, max_chars):
        if size and (size + len(line) > max_chars or (size >= min_chars and not line.strip())):
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if pieces and size < min_chars:
        pieces[-1] += "".join(current)
    else:
        pieces.append("".join(current))
    return pieces


def _bounded_lines(text: str, max_chars: int) -> Iterator[str]:
    # A single huge line (a data table, a minified blob) would otherwise make one huge piece.
    for line in text.splitlines(keepends=True):
        for start in range(0, len(line), max_chars):
            yield line[start : start + max_chars]


def _source_texts() -> Iterator[tuple[str, str]]:
    root = stdlib_root()
    for path in stdlib_files():
        name = "stdlib/" + path.relative_to(root).as_posix()
        yield name, path.read_text(encoding="utf-8", errors="replace")
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        yield f"pydoc/{topic}", topics[topic]


@functools.lru_cache(maxsize=4)
def _full_corpus(min_chars: int, max_chars: int) -> tuple[Document, ...]:
    docs = tuple(
        Document(doc_id=f"{name}#{i}", text=piece)
        for name, text in _source_texts()
        for i, piece in enumerate(split_text(text, min_chars, max_chars))
    )
    log.debug("built-in corpus: %d documents, %d chars", len(docs), sum(len(d.text) for d in docs))
    return docs


def builtin_corpus(
    max_docs: int | None = None, min_chars: int = 2000, max_chars: int = 4000
) -> list[Document]:
    """The built-in corpus in a fixed order; ``max_docs`` takes an even spread over all of it."""
    docs = _full_corpus(min_chars, max_chars)
    if max_docs is None or max_docs >= len(docs):
        return list(docs)
    # Evenly spaced picks, so a small sample still covers every part of the library.
    return [docs[i * len(docs) // max_docs] for i in range(max_docs)]


def split_train_val(
    docs: Iterable[Document], val_fraction: float = 0.03, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Split into (train, val) by a hash of (seed, doc_id).

    A document's side depends only on its id and the seed, never on the order or on which
    other documents are present, so held-out data stays held out as a corpus grows.
    """
    train: list[Document] = []
    val: list[Document] = []
    for doc in docs:
        digest = hashlib.sha256(f"{seed}:{doc.doc_id}".encode()).digest()
        side = val if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else train
        side.append(doc)
    return train, val
