"""dipaco frames inside Flower records: bytes in ``Array``s of uint8, small fields in a
``ConfigRecord``. Nothing is unpickled: Flower's ``Array`` loads with ``allow_pickle=False`` and
dipaco's own decoder reads the frames."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from dipaco.errors import WireError

META = "dipaco"  # the ConfigRecord with the small fields
BLOBS = "blobs"  # the ArrayRecord with the frames (modules, envelope)
FILES = "files"  # the ArrayRecord with run files a node lacks (shards)
MAX_STATE_BYTES = 1 << 20  # a node's state report is a small JSON document


def to_array(data: bytes | bytearray | memoryview) -> Array:
    return Array(np.frombuffer(bytes(data), dtype=np.uint8))


def from_array(array: Any, what: str) -> bytes:
    """The bytes an ``Array`` of uint8 holds; WireError for anything else."""
    try:
        values = array.numpy()
    except Exception as exc:  # Flower raises several types for a malformed array
        raise WireError(f"{what}: not a readable array: {exc}") from None
    if values.dtype != np.uint8 or values.ndim != 1:
        raise WireError(f"{what}: expected a 1-D uint8 array, got {values.dtype} {values.shape}")
    return values.tobytes()


def pack(
    meta: dict[str, Any],
    blobs: dict[str, bytes | bytearray] | None = None,
    files: dict[str, bytes] | None = None,
) -> RecordDict:
    records: dict[str, Any] = {META: ConfigRecord(meta)}
    if blobs:
        records[BLOBS] = ArrayRecord({k: to_array(v) for k, v in blobs.items()})
    if files:
        records[FILES] = ArrayRecord({k: to_array(v) for k, v in files.items()})
    return RecordDict(records)


def meta_of(content: Any) -> dict[str, Any]:
    try:
        record = content.config_records[META]
    except Exception:
        raise WireError("the message carries no dipaco record") from None
    return dict(record)


def blob(content: Any, name: str) -> bytes:
    try:
        record = content.array_records[BLOBS]
        array = record[name]
    except Exception:
        raise WireError(f"the message carries no {name!r} frame") from None
    return from_array(array, name)


def blobs_of(content: Any) -> dict[str, bytes]:
    return _all_bytes(content, BLOBS)


def files_of(content: Any) -> dict[str, bytes]:
    return _all_bytes(content, FILES)


def _all_bytes(content: Any, record_name: str) -> dict[str, bytes]:
    """Every array of one ArrayRecord as bytes (none if the message has no such record)."""
    try:
        record = content.array_records.get(record_name)
    except Exception:
        raise WireError(f"the message's {record_name} are not an ArrayRecord") from None
    if record is None:
        return {}
    return {name: from_array(array, name) for name, array in record.items()}


def text(meta: dict[str, Any], name: str, default: str = "") -> str:
    value = meta.get(name, default)
    if not isinstance(value, str):
        raise WireError(f"field {name!r} must be text, got {type(value).__name__}")
    return value


def raw(meta: dict[str, Any], name: str) -> bytes:
    value = meta.get(name)
    if not isinstance(value, bytes):
        raise WireError(f"field {name!r} must be bytes")
    return value


def state_report(meta: dict[str, Any]) -> dict[str, Any]:
    """A node's report of what it holds: cached module versions, the paths whose inner state it
    keeps (most recent first) and the run files it has (name -> SHA-256). Checked field by field:
    it comes from the network."""
    doc = text(meta, "state", "{}")
    if len(doc) > MAX_STATE_BYTES:
        raise WireError(f"a node state report of {len(doc)} bytes is too large")
    try:
        state = json.loads(doc)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"a node state report is not JSON: {exc}") from None
    if not isinstance(state, dict):
        raise WireError("a node state report must be a JSON object")
    modules = state.get("modules", {})
    paths = state.get("paths", [])
    files = state.get("files", {})
    if not (
        isinstance(modules, dict)
        and all(isinstance(k, str) and type(v) is int for k, v in modules.items())
        and isinstance(paths, list)
        and all(type(p) is int for p in paths)
        and isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise WireError("a node state report has malformed fields")
    return {"modules": modules, "paths": paths, "files": files}
