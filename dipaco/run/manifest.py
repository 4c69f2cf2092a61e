"""The run manifest a prepared run hands to peers and other owners, and the files it serves.

``peer_config`` is the Welcome config (the whole run config, the model and topology, the run id
and each path's training tokens); ``run_files`` and ``phase_files`` are the files peers fetch
(``FetchFile``) by name: the tokenizer and each routing phase's per-path training shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dipaco.data.shards import SHARD_SUFFIXES, shard_name
from dipaco.fileio import file_info
from dipaco.prepare.folder import PreparedRun, phase_prefix


def peer_config(prep: PreparedRun) -> dict[str, Any]:
    c = prep.config
    return {
        "model": c.build_model_config().to_dict(),
        "topology": c.build_topology().to_dict(),
        "train": c.train.model_dump(),
        "shards_dir": str(prep.shards_dir.resolve()),
        "heartbeat_seconds": c.scheduler.heartbeat_seconds,
        "files": {name: file_info(path) for name, path in run_files(prep).items()},
        # The whole run, so that another module owner can join: the run manifest.
        "run": c.to_dict(),
        "run_id": prep.run_id,
        "shard_tokens": shard_tokens(prep),
    }


def shard_tokens(prep: PreparedRun) -> list[int]:
    """Phase 0's training tokens per path: the outer step's weights (later phases bring theirs)."""
    return prep.routings[0].stats["shards"]["train"]["tokens"]


def run_files(prep: PreparedRun) -> dict[str, Path]:
    """The files a remote peer downloads (``FetchFile``): the tokenizer and each path's shard."""
    return {"tokenizer.model": prep.root / "tokenizer.model", **phase_files(prep, 0)}


def phase_files(prep: PreparedRun, phase: int) -> dict[str, Path]:
    """A routing phase's training shard files, by the names peers fetch them under."""
    prefix = phase_prefix(phase)
    names = [
        shard_name(p, prefix=prefix) + suffix
        for p in range(prep.config.build_topology().num_paths)
        for suffix in SHARD_SUFFIXES
    ]
    return {name: prep.root / name for name in names}
