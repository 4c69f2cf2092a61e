"""Text sources: turn local files, Hugging Face datasets or the built-in corpus into documents.

Every reader yields ``Document`` records with a stable ``doc_id``, which routing, sharding and
the train/val split key on. Problems with the source itself (a missing path, a missing column,
an unknown dataset) are raised when the reader is called; a malformed record is raised, naming
its file and line, when iteration reaches it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dipaco.data.corpus import builtin_corpus
from dipaco.data.document import Document
from dipaco.data.mixed import KIND_BUDGET_CHARS, mixed_corpus
from dipaco.errors import DataError

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py"})


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"data source not found: {path}")
    return path


def read_text(path: str | Path) -> Iterator[Document]:
    """One file as one document, or every text file under a folder (sorted), one per file."""
    path = _existing(path)
    if path.is_file():
        return iter([Document(str(path), path.read_text(encoding="utf-8", errors="replace"))])
    files = sorted(
        (p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    return (
        Document(p.relative_to(path).as_posix(), p.read_text(encoding="utf-8", errors="replace"))
        for p in files
    )


def read_jsonl(path: str | Path, field: str = "text") -> Iterator[Document]:
    """One JSON object per line; the document text is ``record[field]``."""
    path = _existing(path)
    return _jsonl_documents(path, field)


def _jsonl_documents(path: Path, field: str) -> Iterator[Document]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({exc.msg})") from exc
            yield _record_document(record, field, f"{path.name}:{lineno}", f"{path}: line {lineno}")


def _record_document(record: Any, field: str, default_id: str, where: str) -> Document:
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where} has no string field {field!r}")
    doc_id = record.get("id")
    return Document(doc_id if isinstance(doc_id, str) else default_id, text)


def read_parquet(path: str | Path, field: str = "text") -> Iterator[Document]:
    """A parquet file, or every ``*.parquet`` file under a folder (sorted)."""
    import pyarrow.parquet as pq

    path = _existing(path)
    files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
    if not files:
        raise DataError(f"no .parquet files under {path}")
    for file in files:
        columns = pq.read_schema(file).names
        if field not in columns:
            raise DataError(f"{file} has no column {field!r}; columns: {', '.join(columns)}")
    return _parquet_documents(files, field)


def _parquet_documents(files: list[Path], field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    for file in files:
        parquet = pq.ParquetFile(file)
        columns = [field] + (["id"] if "id" in parquet.schema_arrow.names and field != "id" else [])
        row = 0
        for batch in parquet.iter_batches(columns=columns):
            for record in batch.to_pylist():
                yield _record_document(record, field, f"{file.name}:{row}", f"{file}: row {row}")
                row += 1


def read_hf(name: str, split: str = "train", field: str = "text") -> Iterator[Document]:
    """A Hugging Face dataset: a folder written by ``save_to_disk``, or a hub dataset name."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            "reading Hugging Face datasets needs the datasets package: pip install 'dipaco[hf]'"
        ) from exc
    if Path(name).is_dir():
        try:
            ds = datasets.load_from_disk(name)
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(f"{name} is not a dataset saved with save_to_disk: {exc}") from exc
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{name} has no split {split!r}; splits: {', '.join(ds)}")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name, split=split)
        except Exception as exc:  # network, auth and naming failures all surface differently
            raise DataError(
                f"Hugging Face dataset {name!r} (split {split!r}) is unreachable or unknown: {exc}"
            ) from exc
    if field not in ds.column_names:
        raise DataError(f"{name} has no column {field!r}; columns: {', '.join(ds.column_names)}")
    return _hf_documents(ds, name, field)


def _hf_documents(ds: Iterable[dict[str, Any]], name: str, field: str) -> Iterator[Document]:
    for row, record in enumerate(ds):
        yield _record_document(record, field, f"{name}:{row}", f"{name}: row {row}")


def open_source(spec: str, field: str = "text") -> Iterator[Document]:
    """Open a source by spec: ``hf:NAME[:split]``, ``builtin[:stdlib]``, ``builtin:mixed``, or a
    local path.

    A path ending in ``.jsonl`` is JSON lines, a ``.parquet`` file or a folder holding parquet
    files is parquet, any other file or folder is plain text.
    """
    if spec.startswith("hf:"):
        name, split = spec[3:], "train"
        if ":" in name and not Path(name).exists():
            name, split = name.rsplit(":", 1)
        return read_hf(name, split=split, field=field)
    if spec in ("builtin", "builtin:stdlib"):
        return iter(builtin_corpus())
    if spec == "builtin:mixed":
        return iter(mixed_corpus())
    if spec.startswith("builtin:mixed:"):  # builtin:mixed:48: 48 M characters of each kind
        millions = spec.rsplit(":", 1)[1]
        try:
            budget = int(float(millions) * 1e6)
        except ValueError:
            budget = 0
        if budget <= 0:
            raise DataError(
                f"{spec!r}: builtin:mixed:N takes N, the millions of characters of each kind "
                f"(builtin:mixed is {KIND_BUDGET_CHARS // 1_000_000})"
            )
        return iter(mixed_corpus(budget_chars=budget))
    if spec.startswith("builtin:"):
        raise DataError(
            f"unknown built-in corpus {spec!r}; available: builtin:stdlib, builtin:mixed, "
            f"builtin:mixed:N (N million characters of each kind)"
        )
    path = _existing(spec)
    if path.suffix == ".jsonl":
        return read_jsonl(path, field)
    if path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        return read_parquet(path, field)
    return read_text(path)
