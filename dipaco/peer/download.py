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
from pathlib import Path
from typing import Any

from dipaco.data.shards import TokenShard
from dipaco.errors import DataError
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport

log = logging.getLogger(__name__)
CHUNK = 4 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        dest = self.folder / name
        if (
            dest.exists()
            and dest.stat().st_size == info["size"]
            and _sha256(dest) == info["sha256"]
        ):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        digest = hashlib.sha256()
        offset = 0
        with open(tmp, "wb") as f:
            while offset < info["size"]:
                chunk = self.transport.request(
                    m.FetchFile(
                        peer_id=self.peer_id,
                        name=name,
                        offset=offset,
                        length=min(CHUNK, info["size"] - offset),
                    )
                )
                data = chunk.tensors["data"].numpy().tobytes()
                if chunk.offset != offset or not data:
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

    def shard(self, prefix: str, infos: dict[str, Any] | None = None) -> TokenShard:
        """A task's shard (``shards/P3/train``), fetched once; ``infos`` (from the task offer)
        give the sizes and hashes of shards the manifest does not list (later routing phases).
        The .json, written last, marks a shard whole."""
        if ".." in Path(prefix).parts or Path(prefix).is_absolute():
            raise DataError(f"refusing shard name {prefix!r} outside the run folder")
        for suffix in (".tokens", ".index.npy", ".json"):
            self.get(prefix + suffix, (infos or {}).get(prefix + suffix))
        return TokenShard(self.folder / prefix)
