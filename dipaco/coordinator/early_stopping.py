"""Per-path early stopping (DiPaCo Table 3): each path keeps the parameters of the round with the
lowest loss on its own shard's held-out slice.

Layout under the folder::

    best.json    {"paths": {"<p>": {"round", "loss", "tokens", "phase", "serial"}}}   the record
    P<p>.dpt     the kept parameters of path p: Frame("PathSnapshot",
                 {"path", "round", "loss", "tokens", "phase", "serial"}, tensors), checksummed

An improvement writes ``P<p>.dpt`` first (atomically) and only then ``best.json``. ``serial``
counts a path's snapshots: a crash between the two writes leaves a snapshot whose serial is ahead
of the record's, and reopening the folder adopts it from the snapshot's header, so the record
and the files always agree after a restart.

A routing phase re-shards the data, so a path's held-out slice changes with it. Losses are only
comparable within a phase: :meth:`EarlyStopping.rescore` replaces the kept snapshot's loss by its
loss on the new phase's slice (the snapshot itself is unchanged) before new rounds compete.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import threading
from pathlib import Path

import torch

from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic
from dipaco.protocols.wire import MAGIC, Frame, read_tensor_file, write_tensor_file

logger = logging.getLogger(__name__)

FRAME_TYPE = "PathSnapshot"
_SNAPSHOT = re.compile(r"P(\d+)\.dpt")
_PREFIX = struct.Struct("<4sBI")  # the wire frame's prefix: magic, version, header length
_MAX_HEADER = 4 << 20
_PUBLIC = ("round", "loss", "tokens", "phase")


class EarlyStopping:
    """The best snapshot of every path so far; survives restarts. Thread-safe."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._best: dict[int, dict] = self._load_record()
        if self._reconcile():
            self._write_record()

    # ---- queries ------------------------------------------------------------------------------

    def best(self, path: int) -> dict | None:
        """``{"round", "loss", "tokens", "phase"}`` of the kept snapshot of ``path``, or None."""
        with self._lock:
            rec = self._best.get(int(path))
            return {k: rec[k] for k in _PUBLIC} if rec is not None else None

    def state(self, path: int) -> dict[str, torch.Tensor]:
        """The kept parameters of ``path``: KeyError if it has none, CorruptFileError if the
        snapshot file is missing, damaged or not the one the record names."""
        path = int(path)
        with self._lock:
            rec = self._best.get(path)
            if rec is None:
                raise KeyError(f"path {path} has no early-stopping snapshot")
            frame = read_tensor_file(self._snapshot(path))
        fields = frame.fields
        if (
            frame.type != FRAME_TYPE
            or fields.get("path") != path
            or fields.get("round") != rec["round"]
            or fields.get("serial", 0) != rec["serial"]
        ):
            raise CorruptFileError(
                f"{self._snapshot(path)}: snapshot {frame.type} {fields} does not match "
                f"the record {rec} of path {path}"
            )
        return frame.tensors

    def paths(self) -> list[int]:
        """Paths that have a kept snapshot, ascending."""
        with self._lock:
            return sorted(self._best)

    def summary(self) -> dict:
        """``{"paths": {"<p>": best(p)}, "num_paths", "mean_loss"}``; ``mean_loss`` is the plain
        mean over paths, None while no path has a snapshot."""
        with self._lock:
            records = {str(p): {k: self._best[p][k] for k in _PUBLIC} for p in sorted(self._best)}
        losses = [r["loss"] for r in records.values()]
        return {
            "paths": records,
            "num_paths": len(records),
            "mean_loss": sum(losses) / len(losses) if losses else None,
        }

    # ---- updates ------------------------------------------------------------------------------

    def update(
        self,
        path: int,
        round: int,
        loss: float,
        state: dict[str, torch.Tensor],
        tokens: int = 0,
        *,
        phase: int = 0,
    ) -> bool:
        """Keep ``state`` as the snapshot of ``path`` if ``loss`` is strictly below the kept one.

        A NaN or infinite loss never becomes best. Returns whether the snapshot was replaced.
        The kept loss is compared as it stands: after a routing phase, :meth:`rescore` it first.
        """
        path, round, loss, tokens, phase = (
            int(path),
            int(round),
            float(loss),
            int(tokens),
            int(phase),
        )
        if not math.isfinite(loss):
            logger.warning("path %d round %d: held-out loss %s ignored", path, round, loss)
            return False
        with self._lock:
            kept = self._best.get(path)
            if kept is not None and not loss < kept["loss"]:
                return False
            rec = {
                "round": round,
                "loss": loss,
                "tokens": tokens,
                "phase": phase,
                "serial": (kept["serial"] if kept is not None else 0) + 1,
            }
            tensors = {name: t.detach() for name, t in state.items()}
            # The snapshot goes first: a crash before the record is rewritten leaves a snapshot
            # ahead of the record, which reopening adopts (see _reconcile).
            write_tensor_file(
                self._snapshot(path), Frame(FRAME_TYPE, {"path": path, **rec}, tensors)
            )
            self._best[path] = rec
            self._write_record()
        return True

    def rescore(self, path: int, loss: float, tokens: int = 0, *, phase: int = 0) -> None:
        """Replace the kept snapshot's loss by its loss on ``phase``'s held-out slice.

        The snapshot is not touched. A NaN or infinite loss is kept as +inf, so that any finite
        loss of a later round replaces the snapshot.
        """
        path, loss = int(path), float(loss)
        with self._lock:
            kept = self._best.get(path)
            if kept is None:
                raise KeyError(f"path {path} has no early-stopping snapshot to rescore")
            kept.update(
                loss=loss if math.isfinite(loss) else math.inf,
                tokens=int(tokens),
                phase=int(phase),
            )
            self._write_record()

    # ---- persistence --------------------------------------------------------------------------

    def _snapshot(self, path: int) -> Path:
        return self.folder / f"P{path}.dpt"

    def _record_file(self) -> Path:
        return self.folder / "best.json"

    def _write_record(self) -> None:
        write_json_atomic(
            self._record_file(),
            {"paths": {str(p): self._best[p] for p in sorted(self._best)}},
        )

    def _load_record(self) -> dict[int, dict]:
        file = self._record_file()
        if not file.exists():
            return {}
        try:
            obj = json.loads(file.read_text())
            return {int(key): _record(rec) for key, rec in obj["paths"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptFileError(f"{file}: malformed early-stopping record: {exc}") from None

    def _reconcile(self) -> bool:
        """Adopt snapshots written after the record (a crash between the two writes)."""
        changed = False
        for file in sorted(self.folder.iterdir()):
            m = _SNAPSHOT.fullmatch(file.name)
            if m is None:
                continue
            path = int(m.group(1))
            fields = _peek_fields(file)
            if fields is None or fields.get("path") != path:
                continue  # unreadable: state() reports it when asked
            try:
                rec = _record(fields)
            except (KeyError, TypeError, ValueError):
                continue
            kept = self._best.get(path)
            if kept is None or rec["serial"] > kept["serial"]:
                logger.info("path %d: adopting the snapshot of round %d", path, rec["round"])
                self._best[path] = rec
                changed = True
        return changed


def _record(fields: dict) -> dict:
    return {
        "round": int(fields["round"]),
        "loss": float(fields["loss"]),
        "tokens": int(fields.get("tokens", 0)),
        "phase": int(fields.get("phase", 0)),
        "serial": int(fields.get("serial", 0)),
    }


def _peek_fields(file: Path) -> dict | None:
    """The header fields of a snapshot file without reading its tensors (no checksum check)."""
    try:
        with open(file, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return None
            magic, _, header_len = _PREFIX.unpack(prefix)
            if magic != MAGIC or header_len > _MAX_HEADER:
                return None
            header = json.loads(f.read(header_len))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("type") != FRAME_TYPE:
        return None
    fields = header.get("fields")
    return fields if isinstance(fields, dict) else None
