"""Fetching the run's files (tokenizer, a path's shard) from the scheduler, checked and cached.

The manifest lists every file with its size and SHA-256. A file is fetched in chunks of at most
4 MiB (``FetchFile``) into a temporary name, checked against both, and renamed into place; a
cached file that still matches is not fetched again. A peer downloads only the shards of the
paths it trains.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from dipaco.data.shards import TokenShard
from dipaco.errors import DataError, TransportError
from dipaco.fileio import file_info, plain_name_error
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)
CHUNK = 4 << 20
CHUNK_TRIES = 3  # a chunk asked again after a transport error, from the same byte
CHUNK_RETRY_SECONDS = 1.0
DISK_MARGIN = 256 << 20  # a download never leaves less than this free


def _check_entry(name: Any, info: Any) -> None:
    """DataError unless a manifest entry names a file inside the run folder, with an integer
    size and a SHA-256: the manifest comes over the network, and a name such as ``../x`` or
    ``/etc/x`` would otherwise have us write outside the folder (and one too long, or naming a
    folder, would fail with a raw OS error)."""
    why = plain_name_error(name)
    if why is not None:
        raise DataError(f"refusing file name {str(name)[:80]!r} outside the run folder: {why}")
    size, digest = (info.get("size"), info.get("sha256")) if isinstance(info, dict) else (0, 0)
    if (
        not isinstance(size, int)
        or isinstance(size, bool)
        or size < 0
        or not isinstance(digest, str)
        or len(digest) != 64
        or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise DataError(f"the manifest entry of {name!r} is malformed: {info!r:.120}")


def _chunk_bytes(name: str, chunk: Any) -> bytes:
    """The bytes of a FileChunk reply; DataError for any other reply or a malformed chunk."""
    data = chunk.tensors.get("data") if isinstance(chunk, m.FileChunk) else None
    if data is None or data.dtype != torch.uint8 or data.dim() != 1:
        raise DataError(f"{name}: the coordinator's reply is not a chunk of bytes")
    return data.numpy().tobytes()


class RunFiles:
    def __init__(
        self, transport: Transport, peer_id: str, files: dict[str, Any], folder: str | Path
    ) -> None:
        self.transport, self.peer_id, self.files = transport, peer_id, files
        self.folder = Path(folder)
        self.downloaded = 0  # bytes fetched over the network

    def get(self, name: str, info: dict[str, Any] | None = None) -> Path:
        info = info or self.files.get(name)
        if info is None:
            raise DataError(f"the run manifest has no file {name!r}")
        _check_entry(name, info)
        dest = self.folder / name
        if dest.is_dir():
            raise DataError(f"cannot write {name}: {dest} is a folder")
        if (
            dest.exists()
            and dest.stat().st_size == info["size"]
            and file_info(dest)["sha256"] == info["sha256"]
        ):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if info["size"] + DISK_MARGIN > free:  # the manifest's size, checked before any byte
            raise DataError(
                f"{name} needs {info['size'] / 2**30:.2f} GiB and {dest.parent} has "
                f"{free / 2**30:.2f} GiB free (keeping {DISK_MARGIN >> 20} MiB spare)"
            )
        tmp = dest.with_name(dest.name + ".part")
        digest = hashlib.sha256()
        offset = 0
        with open(tmp, "wb") as f:
            while offset < info["size"]:
                chunk = self._chunk(name, offset, min(CHUNK, info["size"] - offset))
                data = _chunk_bytes(name, chunk)
                want = min(CHUNK, info["size"] - offset)
                if chunk.offset != offset or not data or len(data) > want:
                    raise DataError(f"{name}: the coordinator sent a wrong range at {offset}")
                f.write(data)
                digest.update(data)
                offset += len(data)
                self.downloaded += len(data)
            f.flush()
            os.fsync(f.fileno())
        if offset != info["size"] or digest.hexdigest() != info["sha256"]:
            tmp.unlink(missing_ok=True)
            raise DataError(f"{name}: downloaded file does not match the manifest's size and hash")
        os.replace(tmp, dest)
        log.info("downloaded %s (%d bytes)", name, offset)
        return dest

    def _chunk(self, name: str, offset: int, length: int) -> m.Message:
        """One FetchFile, asked again from the same byte after a transport error (a stream
        reset on the way, which the first request of a join met once in CI), at most
        CHUNK_TRIES times: a refusal is not retried."""
        for attempt in range(CHUNK_TRIES):
            try:
                return self.transport.request(
                    m.FetchFile(peer_id=self.peer_id, name=name, offset=offset, length=length)
                )
            except TransportError as exc:
                if attempt + 1 == CHUNK_TRIES:
                    raise
                log.info("%s: asking again for the bytes from %d (%s)", name, offset, exc)
                time.sleep(CHUNK_RETRY_SECONDS)
        raise AssertionError("unreachable")

    def shard(self, prefix: str, infos: dict[str, Any] | None = None) -> TokenShard:
        """A task's shard (``shards/P3/train``), fetched once; ``infos`` (from the task offer)
        give the sizes and hashes of shards the manifest does not list (later routing phases).
        The .json, written last, marks a shard whole."""
        why = plain_name_error(prefix)
        if why is not None:
            raise DataError(
                f"refusing shard name {str(prefix)[:80]!r} outside the run folder: {why}"
            )
        for suffix in (".tokens", ".index.npy", ".json"):
            self.get(prefix + suffix, (infos or {}).get(prefix + suffix))
        return TokenShard(self.folder / prefix)
