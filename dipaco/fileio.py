"""Atomic file writes: data goes to a temporary name, is fsynced, then renamed into place.

A reader therefore sees either the old file or the complete new one, never a partial write,
even if the writer crashes or the machine loses power.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import secrets
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


def _umask() -> int:
    """This process's file-creation mask (read once: setting it is the only way to read it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()
# Temporary names are this process's token and a counter: no random draw and no getpid per file.
_TMP = {"token": secrets.token_hex(4), "count": itertools.count()}


def _new_token() -> None:
    _TMP["token"], _TMP["count"] = secrets.token_hex(4), itertools.count()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_token)

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
_IOV_MAX = 512  # parts per writev (POSIX guarantees at least 16; Linux allows 1024)
_BUFFER = 1 << 20  # small writes are gathered up to this many bytes
_SMALL = 64 << 10  # a part below this is copied into the gathered bytes, as a buffered file would


def unique_suffix() -> str:
    """A name part no other call in this process (or another process) returns: this process's
    random token and a counter (no random draw per name)."""
    return f"{_TMP['token']}{next(_TMP['count'])}"


def _new_file(path: str) -> tuple[int, str]:
    """``path``, created (it must not exist), open for writing, mode 0644 whatever the umask;
    its folder is made only when it is missing (the first write there). Paths are strings
    here: this runs for every durable write, and pathlib's objects cost more than the calls."""
    try:
        fd = os.open(path, _CREATE, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, _CREATE, 0o644)
    if _UMASK & 0o644:
        os.fchmod(fd, 0o644)  # shared artifacts stay readable by other users
    return fd, path


def _temporary(path: str) -> tuple[int, str]:
    """A new file next to ``path``, named ``.<name>.<token><n>``: :func:`_new_file`."""
    folder, name = os.path.split(path)
    for _ in range(100):
        try:
            return _new_file(os.path.join(folder, f".{name}.{unique_suffix()}"))
        except FileExistsError:  # left by a crashed process that drew the same token
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def _write_all(fd: int, parts: list[bytes | bytearray | memoryview]) -> None:
    """Write ``parts`` in order with as few system calls as the kernel allows."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        batch = views[:_IOV_MAX]
        done = os.writev(fd, batch)
        total = sum(len(v) for v in batch)
        if done == total:
            del views[: len(batch)]
            continue
        while done >= len(views[0]):  # a short write: go on from where it stopped
            done -= len(views.pop(0))
        views[0] = views[0][done:]


class AtomicFile:
    """A binary file that appears at ``path`` only on ``commit`` (or a clean ``with`` exit).

    Written with plain descriptors: small writes are gathered and go out in one ``writev``
    with the next large part or at the commit, so a file of a header and a few tensors costs
    one system call to write. A coordinator's request threads give the interpreter's lock up
    at every system call, and under load each is a hand-off between them
    (docs/reliability.md, *Load*)."""

    def __init__(self, path: str | Path, in_place: bool = False) -> None:
        """``in_place``: ``path`` is a new name that nobody reads until the caller renames the
        file elsewhere (a staged delta, whose folder is emptied at start): the file is written
        there directly, with no temporary name and no rename of its own."""
        self.path = path if isinstance(path, Path) else Path(path)
        self.in_place = in_place
        name = os.fspath(path)
        fd, tmp = _new_file(name) if in_place else _temporary(name)
        self._fd: int | None = fd
        self._name = name
        self._tmp = tmp
        self._small = bytearray()
        self._parts: list[bytes | bytearray | memoryview] = []

    def write(self, *parts: bytes | bytearray | memoryview) -> None:
        """Append ``parts`` in order (several parts spare joining them into one copy)."""
        fault_point("atomic.write")  # a full disk fails here, before anything is visible
        assert self._fd is not None, "the file is closed"
        for data in parts:
            size = memoryview(data).nbytes
            if size < _SMALL:
                self._small += data
                continue
            if self._small:
                self._parts.append(self._small)
                self._small = bytearray()
            self._parts.append(data)
            self._flush()
        if len(self._small) >= _BUFFER:
            self._flush()

    def _flush(self) -> None:
        assert self._fd is not None
        if self._small:
            self._parts.append(self._small)
            self._small = bytearray()
        parts, self._parts = self._parts, []
        _write_all(self._fd, parts)

    def commit(
        self,
        sync_dir: bool = True,
        replace: Callable[[str, str], None] | None = None,
        sync: bool = True,
    ) -> None:
        """Flush, fsync, rename into place; then fsync the folder, unless the caller moves the
        file again (a staged delta) and syncs the folder it finally lands in. ``replace`` does
        the rename (a writer that must not let an older snapshot replace a newer one checks
        first, durable.py); by default ``os.replace``."""
        assert self._fd is not None, "the file is closed"
        self._flush()
        if sync:
            os.fsync(self._fd)
        fd, self._fd = self._fd, None
        os.close(fd)
        fault_point("atomic.before_rename")  # a crash here leaves only the temporary file
        if self.in_place:
            return  # the caller moves it, and syncs the folder it lands in
        (replace or os.replace)(self._tmp, self._name)
        if not sync_dir:
            return
        # The rename itself is only durable once the directory entry is on disk.
        fsync_path(os.path.dirname(self._name) or ".")

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

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


def write_atomic(
    path: str | Path,
    *parts: bytes | bytearray | memoryview,
    sync_dir: bool = True,
    sync: bool = True,
    in_place: bool = False,
) -> None:
    """Write ``parts``, concatenated, to ``path`` crash-safe: all of it appears, or nothing.
    ``sync=False`` skips the fsync (and the folder's): the caller syncs later (sync_files).
    ``in_place``: as for :class:`AtomicFile`."""
    f = AtomicFile(path, in_place)
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


def compact_json(obj: object) -> str:
    """Compact JSON, keys sorted: how state files rewritten with most requests
    (coordinator.json, validation.json) are encoded. An indented file takes the pure-Python
    encoder, ten times slower."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def compact_json_bytes(obj: object) -> bytes:
    """:func:`compact_json`, as bytes."""
    return compact_json(obj).encode()


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
