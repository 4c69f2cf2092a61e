"""Atomic file writes: data goes to a temporary name, is fsynced, then renamed into place.

A reader therefore sees either the old file or the complete new one, never a partial write,
even if the writer crashes or the machine loses power.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from dipaco.faults import fault_point

_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
MAX_NAME_CHARS = 255
MAX_NAME_DEPTH = 8


def plain_name_error(name: object, depth: int = MAX_NAME_DEPTH) -> str | None:
    """Why ``name``, from outside (a manifest, the DHT, a message), may not become a path under
    one of our folders; None if it may. A plain name is at most ``depth`` parts separated by
    ``/``, each of letters, digits, ``_``, ``-`` and ``.`` not first (so never ``..``, a hidden
    file, an absolute path, a backslash or a NUL), 255 characters in all."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if len(name) > MAX_NAME_CHARS:
        return f"longer than {MAX_NAME_CHARS} characters"
    parts = name.split("/")
    if len(parts) > depth:
        return f"deeper than {depth} folders"
    bad = next((p for p in parts if not _NAME_PART.fullmatch(p)), None)
    if bad is not None:
        return f"part {bad[:40]!r} is not letters, digits, '_', '-' and '.' (not first)"
    assert not PurePosixPath(name).is_absolute()
    return None


class AtomicFile:
    """A binary file that appears at ``path`` only on ``commit`` (or a clean ``with`` exit)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide shared artifacts from other users
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")

    def write(self, *parts: bytes | bytearray | memoryview) -> None:
        """Append ``parts`` in order (several parts spare joining them into one copy)."""
        fault_point("atomic.write")  # a full disk fails here, before anything is visible
        for data in parts:
            self._file.write(data)

    def commit(
        self,
        sync_dir: bool = True,
        replace: Callable[[Path, Path], None] = os.replace,
        sync: bool = True,
    ) -> None:
        """Flush, fsync, rename into place; then fsync the folder, unless the caller moves the
        file again (a staged delta) and syncs the folder it finally lands in. ``replace`` does
        the rename (a writer that must not let an older snapshot replace a newer one checks
        first, durable.py)."""
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self._file.close()
        fault_point("atomic.before_rename")  # a crash here leaves only the temporary file
        replace(self._tmp, self.path)
        if not sync_dir:
            return
        # The rename itself is only durable once the directory entry is on disk.
        fsync_path(self.path.parent)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def finite_number(value: Any) -> bool:
    """A number read from a file (int or float, not bool) that is finite as a float: what a
    duration, a weight or a scale must be. An integer beyond a float's range (10**400, which
    JSON allows) is not one, and ``math.isfinite`` would raise on it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def write_atomic(
    path: str | Path,
    *parts: bytes | bytearray | memoryview,
    sync_dir: bool = True,
    sync: bool = True,
) -> None:
    """Write ``parts``, concatenated, to ``path`` crash-safe: all of it appears, or nothing.
    ``sync=False`` skips the fsync (and the folder's): the caller syncs later (sync_files)."""
    f = AtomicFile(path)
    try:
        f.write(*parts)
    except BaseException:
        f.abort()
        raise
    f.commit(sync_dir=sync_dir and sync, sync=sync)


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a folder (which makes the renames into it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_files(*paths: str | Path) -> None:
    """fsync each file, then each folder holding them: what ``write_atomic(..., sync=False)``
    left undone."""
    for path in paths:
        fsync_path(path)
    for folder in dict.fromkeys(Path(path).parent for path in paths):
        fsync_path(folder)


def json_bytes(obj: object) -> bytes:
    """A small state file's JSON, readable (indented, keys sorted)."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def write_json_atomic(path: str | Path, obj: object) -> None:
    write_atomic(path, json_bytes(obj))


def file_info(path: str | Path) -> dict[str, Any]:
    """A file's size and SHA-256, as run manifests and task offers list them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": Path(path).stat().st_size, "sha256": digest.hexdigest()}


def write_private(path: str | Path, data: bytes | str) -> None:
    """Write a secret (a key, a token) crash-safely, readable by its owner only (mode 0600) from
    the first byte on: a temporary file made by ``mkstemp`` (0600), fsynced, renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.chmod(path, 0o600)
