"""What the peer keeps on disk for its tasks: the task checkpoint and each path's inner state.

``TaskCheckpoint``: the task in progress (``task/checkpoint.dpt``: model and optimizer state at
an inner step; ``task/task.json``: its id and losses), snapshotted while it trains, so that a
peer restarted with the same id and state folder resumes it.

``InnerState``: each path's inner AdamW state, with the path's error-feedback residuals, after
each round it trained (``inner/P<path>-r<round>.dpt``), in a pickle-free file, so that a path
trained again continues its own optimizer (DiLoCo does not synchronise inner state). The state
of the round before stays too: a retried round starts where its first try did.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch

from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic
from dipaco.model import optim
from dipaco.protocols import feedback
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file

log = logging.getLogger(__name__)


class TaskCheckpoint:
    """The checkpoint of the task in progress, in ``folder`` (``<state-dir>/task``)."""

    def __init__(self, folder: Path, peer_id: str) -> None:
        self.folder = folder
        self.peer_id = peer_id
        self._writing: threading.Thread | None = None  # a checkpoint being written

    def save(
        self,
        task_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        names: list[str],
        step: int,
        losses: list[float],
    ) -> None:
        """Snapshot the task (a copy of the model and optimizer state), written in the background.

        Copying takes milliseconds; encoding, hashing, writing and fsync-ing the file run in a
        thread while training goes on (one write at a time; the next snapshot, dropping the
        checkpoint and leaving wait for it). A failed write is logged: the task trains on, and
        a restart would resume from the last checkpoint that was written whole.
        """
        tensors = optim.training_state(model, optimizer, names, copy=True)
        self.wait()
        frame = Frame("TaskCheckpoint", {"task_id": task_id, "step": step}, tensors)
        meta = {"task_id": task_id, "losses": list(losses)}
        self._writing = threading.Thread(
            target=self._write, args=(frame, meta), name="checkpoint", daemon=True
        )
        self._writing.start()

    def _write(self, frame: Frame, meta: dict) -> None:
        try:
            write_tensor_file(self.folder / "checkpoint.dpt", frame)
            write_json_atomic(self.folder / "task.json", meta)
        except OSError as exc:
            log.warning("peer %s: could not write a checkpoint: %s", self.peer_id, exc)

    def wait(self) -> None:
        """Wait for the checkpoint being written, if any."""
        writer, self._writing = self._writing, None
        if writer is not None:
            writer.join()

    def resume(
        self,
        task_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        names: list[str],
    ) -> tuple[int, list[float]]:
        """Load the task's checkpoint into ``model`` and ``optimizer``: (the steps it had done,
        their losses), or (0, []) when there is none for this task (another task's is dropped)."""
        try:
            meta = json.loads((self.folder / "task.json").read_text())
            frame = read_tensor_file(self.folder / "checkpoint.dpt")
        except (OSError, ValueError, CorruptFileError):
            return 0, []
        if meta.get("task_id") != task_id or frame.fields.get("task_id") != task_id:
            self.drop()
            return 0, []
        optim.load_training_state(model, optimizer, names, frame.tensors, own=True)
        step = int(frame.fields["step"])
        return step, list(meta.get("losses", []))[:step]

    def drop(self) -> None:
        """Delete the checkpoint (once a write under way has finished)."""
        self.wait()
        for name in ("checkpoint.dpt", "task.json"):
            (self.folder / name).unlink(missing_ok=True)


class InnerState:
    """Each path's inner optimizer state and error-feedback residuals, in ``folder``
    (``<state-dir>/inner``); ``feedback`` holds the residuals while the peer runs."""

    def __init__(self, folder: Path, feedback: feedback.ErrorFeedback, peer_id: str) -> None:
        self.folder = folder
        self.feedback = feedback
        self.peer_id = peer_id

    def file(self, path: int, round_: int) -> Path:
        """The path's inner state after training its round ``round_``."""
        return self.folder / f"P{path}-r{round_}.dpt"

    def files(self, path: int) -> dict[int, Path]:
        """The path's state files by round."""
        found = {}
        for file in self.folder.glob(f"P{path}-r*.dpt"):
            stem = file.stem.rpartition("-r")[2]
            if stem.isdigit():
                found[int(stem)] = file
        return found

    def stamp(self, path: int, round_: int) -> tuple[int, ...] | None:
        """What :meth:`load` would read for round ``round_`` of ``path``: its file's round,
        inode, size and modification time (None: no file), so that a kept state can tell
        whether it is still that file's (no other process sharing the folder wrote since)."""
        before = self._latest_before(path, round_)
        if before is None:
            return None
        try:
            info = self.file(path, before).stat()
        except FileNotFoundError:
            return None
        return (before, info.st_ino, info.st_size, info.st_mtime_ns)

    def _latest_before(self, path: int, round_: int) -> int | None:
        """The newest round before ``round_`` with a state file of ``path``, if any."""
        return max((r for r in self.files(path) if r < round_), default=None)

    def load(
        self, path: int, round_: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        """The state left by the path's latest earlier round (a retried round starts where the
        first try did); a state folder written before round-named files: its ``P<path>.dpt``."""
        before = self._latest_before(path, round_)
        file = self.folder / f"P{path}.dpt" if before is None else self.file(path, before)
        if not file.exists():
            return
        try:
            tensors = read_tensor_file(file).tensors
            optim.load_optimizer_state_tensors(
                optimizer,
                names,
                {k: v for k, v in tensors.items() if not k.startswith("ef|")},
                own=True,
            )
            key = f"ef|P{path}|"
            residuals = {k[len(key) :]: v for k, v in tensors.items() if k.startswith(key)}
            if residuals:  # this path's stream only (another's may be in use: push behind)
                self.feedback.set_stream(f"P{path}", residuals)
        except (CorruptFileError, KeyError, IndexError, ValueError) as exc:
            log.warning("peer %s: ignoring unusable inner state %s: %s", self.peer_id, file, exc)

    def save(
        self, path: int, round_: int, optimizer: torch.optim.Optimizer, names: list[str]
    ) -> None:
        """This round's state; the one before it stays (a retry of this round loads it)."""
        tensors = optim.optimizer_state_tensors(optimizer, names)
        key = f"P{path}|"
        tensors.update(
            {f"ef|{k}": v for k, v in self.feedback.state_tensors().items() if k.startswith(key)}
        )
        write_tensor_file(
            self.file(path, round_), Frame("InnerState", {"path": path, "round": round_}, tensors)
        )
        for r, file in self.files(path).items():
            if r < round_ - 1:
                file.unlink(missing_ok=True)
        (self.folder / f"P{path}.dpt").unlink(missing_ok=True)
