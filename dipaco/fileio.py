"""Atomic file writes: data goes to a temporary name, is fsynced, then renamed into place.

A reader therefore sees either the old file or the complete new one, never a partial write,
even if the writer crashes or the machine loses power. A writer that writes many small files
may recycle them (:class:`Spares`) rather than create and delete one per write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, TypeGuard

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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2() -> Any:
    """libc's renameat2, where the system has one (Linux, glibc 2.28 on); else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the files named ``a`` and ``b`` in one atomic step (Linux's RENAME_EXCHANGE): a
    reader of either name sees one file or the other, never none. False, with nothing changed,
    where ``b`` does not exist or the system or the filesystem cannot exchange; other errors
    raise, as a rename's would."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


class Spares:
    """Emptied files kept to be written again: a writer of many small files renames one of
    these next to the file it writes instead of creating a file, and gives back the file it
    replaced (or no longer needs) instead of deleting it.

    Why: ext4 without a journal (the disks of many cloud machines, and of ours) passes over
    every inode deleted in the last minutes each time it creates a file, so creating costs in
    proportion to the files deleted lately. A coordinator that creates and deletes several
    files per delta spent a large share of its CPU there at a few hundred files a second
    (``perf`` on ``bench/soak.py``: ``ext4_create``, ``recently_deleted``), and more the longer
    and faster it ran. Renaming moves no inode, and a file kept here is never deleted.

    A file given back is renamed into ``folder`` as it is: a reader who opened it under its
    old name goes on reading it, as it would a deleted file. It is emptied and handed out
    again only after ``age`` seconds, when such a reader has long finished. Files of
    ``max_bytes`` or more are deleted as before (a reader may have mapped one into memory, and
    reading a mapping of a file emptied under it kills the reader), and so is any file that
    would take the folder past ``keep`` files or ``keep_bytes`` bytes. The folder must be on
    the filesystem of the files it serves (renames cannot cross two; where one fails, the file
    is created or deleted as before). Spares left by an earlier process are used again.
    Thread-safe.
    """

    def __init__(
        self,
        folder: str | Path,
        max_bytes: int,
        keep: int = 4096,
        keep_bytes: int = 64 << 20,
        age: float = 2.0,
    ) -> None:
        self.folder = Path(folder)  # made by the first file given back: a reader writes nothing
        self.max_bytes, self.keep, self.keep_bytes, self.age = max_bytes, keep, keep_bytes, age
        self._lock = threading.Lock()
        self._free: deque[tuple[float, str | Path, int]] = deque()  # (given at, file, bytes)
        self._bytes = 0
        self.reused = 0  # files written in a spare rather than created (tests, benchmarks)
        self._made = False  # whether this object has made (or found) the folder
        self._where = os.fspath(self.folder)
        earlier = sorted(self.folder.iterdir()) if self.folder.is_dir() else []
        for f in earlier:  # an earlier process's (emptied when reused); the rest left as is
            try:
                info = f.lstat()
            except OSError:  # taken meanwhile by another process on this folder
                continue
            if (
                stat.S_ISREG(info.st_mode)
                and len(self._free) < keep
                and self._bytes + info.st_size <= keep_bytes
            ):
                self._free.append((0.0, f, info.st_size))
                self._bytes += info.st_size

    def __len__(self) -> int:
        return len(self._free)

    def take(self, path: str, in_place: bool = False) -> tuple[int, str] | None:
        """An aged spare, renamed to a temporary name next to ``path`` (or, ``in_place``, to
        ``path`` itself) and opened empty for writing: (descriptor, name); None if there is
        none (the caller creates a file)."""
        with self._lock:
            if not self._free or time.monotonic() - self._free[0][0] < self.age:
                return None
            _, spare, size = self._free.popleft()
            self._bytes -= size
        if in_place:
            tmp = path
        else:
            folder, name = os.path.split(path)
            tmp = os.path.join(folder, f".{name}.{unique_suffix()}")
        try:
            os.rename(spare, tmp)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(spare)
            return None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        self.reused += 1
        return fd, tmp

    def give(self, path: str | Path) -> None:
        """Keep the file at ``path`` as a spare (emptied when handed out again), or delete it if
        it cannot be kept."""
        path = os.fspath(path)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode):
                return  # a folder, a link: not a spare, and not ours to delete
            size = info.st_size
            with self._lock:
                kept = (
                    size < self.max_bytes
                    and len(self._free) < self.keep
                    and self._bytes + size <= self.keep_bytes
                )
                if kept:
                    self._bytes += size  # reserved before the rename, released if it fails
            if not kept:
                os.unlink(path)
                return
            spare = os.path.join(self._where, f"s{unique_suffix()}")
            try:
                self._rename_in(path, spare)
            except OSError:
                with self._lock:
                    self._bytes -= size
                raise
        except FileNotFoundError:
            return
        except OSError:  # cannot be kept (the rename failed): deleted, as without spares
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        with self._lock:
            self._free.append((time.monotonic(), spare, size))

    def _rename_in(self, path: str, spare: str) -> None:
        """Rename ``path`` to ``spare`` in the folder, made on the first file (or again, should
        someone have removed it)."""
        if not self._made:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._made = True
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            if self.folder.is_dir():
                raise  # the file itself is gone
            self.folder.mkdir(parents=True, exist_ok=True)
            os.rename(path, spare)

    def give_folder(self, folder: str | Path) -> None:
        """Give back every file in ``folder`` (not below it), then remove the folder."""
        folder = Path(folder)
        try:
            with os.scandir(folder) as it:  # the entries' types come with them: no stat each
                entries = list(it)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                self.give(entry.path)
        shutil.rmtree(folder, ignore_errors=True)

    def replace(self, tmp: str | Path, path: str | Path) -> None:
        """Put ``tmp`` in place of ``path`` atomically, keeping the replaced file as a spare."""
        if exchange(tmp, path):
            self.give(tmp)  # now the old file
        else:
            os.replace(tmp, path)


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
    With ``spares``, it is written in a recycled file, and the file it replaces is kept.

    Written with plain descriptors: small writes are gathered and go out in one ``writev``
    with the next large part or at the commit, so a file of a header and a few tensors costs
    one system call to write. A coordinator's request threads give the interpreter's lock up
    at every system call, and under load each is a hand-off between them
    (docs/reliability.md, *Load*)."""

    def __init__(
        self, path: str | Path, spares: Spares | None = None, in_place: bool = False
    ) -> None:
        """``in_place``: ``path`` is a new name that nobody reads until the caller renames the
        file elsewhere (a staged delta, whose folder is emptied at start): the file is written
        there directly, with no temporary name and no rename of its own."""
        self.path = path if isinstance(path, Path) else Path(path)
        self.in_place = in_place
        name = os.fspath(path)
        got = spares.take(name, in_place) if spares is not None else None
        if got is None:
            fd, tmp = _new_file(name) if in_place else _temporary(name)
        else:
            fd, tmp = got  # a recycled file: written by this class, so already 0644
        self._fd: int | None = fd
        self._name = name
        self._tmp = tmp
        self._spares = spares
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
        first, durable.py); by default, :meth:`Spares.replace` with spares, else ``os.replace``."""
        assert self._fd is not None, "the file is closed"
        self._flush()
        if sync:
            os.fsync(self._fd)
        fd, self._fd = self._fd, None
        os.close(fd)
        fault_point("atomic.before_rename")  # a crash here leaves only the temporary file
        if self.in_place:
            return  # the caller moves it, and syncs the folder it lands in
        if replace is None:
            replace = self._spares.replace if self._spares is not None else os.replace
        replace(self._tmp, self._name)
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


def finite_number(value: Any) -> TypeGuard[float]:
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
    spares: Spares | None = None,
    in_place: bool = False,
) -> None:
    """Write ``parts``, concatenated, to ``path`` crash-safe: all of it appears, or nothing.
    ``sync=False`` skips the fsync (and the folder's): the caller syncs later (sync_files).
    ``in_place``: as for :class:`AtomicFile`."""
    f = AtomicFile(path, spares, in_place)
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


def write_json_atomic(path: str | Path, obj: object, spares: Spares | None = None) -> None:
    write_atomic(path, json_bytes(obj), spares=spares)


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
