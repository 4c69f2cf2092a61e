"""Opening the module store on a start, after a clean stop or a crash: each module's head.json
checked field by field, its version and momentum verified against their checksums (falling back to
the version before a corrupt head), the files of a half-done outer step rolled back, and its
acknowledged deltas read back, a corrupt one quarantined (``*.corrupt``) so that its path is
trained again. store.py's docstring has the layout and the commit protocol.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictInt, StrictStr

from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic
from dipaco.protocols.wire import read_tensor_file, tensors_sha256

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
KEEP_VERSIONS = 2
APPLIED_KEPT = 512  # task ids remembered per module (many rounds' worth)
REPORTED_KEPT = 8  # versions for which the paths that reported on time are remembered


@dataclass
class PendingDelta:
    path: int
    weight: float  # the path's shard size in tokens (DiPaCo eq. 2-3)
    task_id: str
    peer_id: str
    file: Path
    base_version: int = -1
    round: int = -1  # the version whose step it belongs to (-1: its base, as before overlap)
    voter: str = ""  # the key that sent it (one vote per key in a robust combiner); "": peer_id
    # The file's tensors, held in memory since admission (ModuleStore.commit_delta, within
    # its budget): the step reads them instead of the file. None: read the file (a restart).
    tensors: Tensors | None = field(default=None, compare=False, repr=False)
    scored: bool = False  # it came with the scheduler's verdict on its whole path (scoring.py)

    @property
    def held_bytes(self) -> int:
        return 0 if self.tensors is None else sum(t.nbytes for t in self.tensors.values())

    @property
    def for_round(self) -> int:
        """The version whose step this delta counts for as its path's report."""
        return self.base_version if self.round < 0 else self.round

    @property
    def vote(self) -> str:
        return self.voter or self.peer_id


@dataclass
class ModuleRecord:
    version: int
    digest: Any  # the release hash (SHA-256 hex), or the job computing it (store.py)
    params: Tensors
    momentum: Tensors | None
    applied: list[str] = field(default_factory=list)  # task ids of the last outer steps
    reported: dict[int, list[int]] = field(default_factory=dict)  # base version -> on-time paths
    pending: dict[int, PendingDelta] = field(default_factory=dict)  # on time: base == version
    late: dict[int, PendingDelta] = field(default_factory=dict)  # late: base < version, damped
    # Ahead (overlap): a path's delta for the next version's step, trained from this one while
    # this round waits for others; it becomes pending when the module steps.
    ahead: dict[int, PendingDelta] = field(default_factory=dict)

    def table_for(self, rnd: int) -> dict[int, PendingDelta]:
        """Where a delta for round ``rnd`` waits for its step: ahead, pending (on time) or late."""
        lateness = self.version - rnd
        return self.ahead if lateness < 0 else self.pending if lateness == 0 else self.late

    def holds_path(self, path: int, rnd: int) -> bool:
        """Whether a delta of ``path`` for round ``rnd`` was applied here or waits for a step."""
        return path in self.reported.get(rnd, []) or path in self.table_for(rnd)

    @property
    def hash(self) -> str:
        """The release hash peers check (``tensors_sha256`` of the parameters)."""
        if not isinstance(self.digest, str):
            self.digest = self.digest.result()
        return self.digest

    @hash.setter
    def hash(self, value: str) -> None:
        self.digest = value


def _version_of(name: str) -> int:
    """3 for "v3" or "m3"; -1 (never newer, always old) for a name that is not ours."""
    match = re.fullmatch(r"[vm](\d+)", name)
    return int(match.group(1)) if match else -1


class _Head(BaseModel):
    """head.json: ``reported`` maps a base version (a decimal string in the file) to paths."""

    model_config = ConfigDict(extra="ignore")
    version: Annotated[StrictInt, Field(ge=0)]
    hash: StrictStr
    applied: list[StrictStr] = []
    reported: dict[int, list[StrictInt]] = {}
    previous: Any = None  # checked on its own: a damaged one is dropped, not the head


class _DeltaMeta(BaseModel):
    """A delta file's header (store.delta_meta)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    path: Annotated[int, Field(ge=0)]
    weight: Annotated[FiniteFloat, Field(gt=0)]
    task_id: str
    peer_id: str
    voter: str = ""
    base_version: Annotated[int, Field(ge=0)] | None = None
    round: Annotated[int, Field(ge=0)] | None = None
    scored: bool = False


def _checked_head(head: object) -> dict:
    """A head.json object with its fields checked (ValueError names the bad one)."""
    return _Head.model_validate(head).model_dump()


def head_fields(record: ModuleRecord) -> dict:
    """head.json's fields for ``record``'s committed version (without a "previous")."""
    return {
        "version": record.version,
        "hash": record.hash,
        "applied": list(record.applied),
        "reported": {str(b): list(ps) for b, ps in record.reported.items()},
    }


def _head_fields_of(head: dict) -> dict:
    """A checked head (``reported`` keyed by int) as head.json stores it, without "previous"."""
    fields = {k: head[k] for k in ("version", "hash", "applied")}
    return fields | {"reported": {str(b): ps for b, ps in head["reported"].items()}}


def _check_like(file: Path, tensors: Tensors, params: Tensors) -> None:
    """CorruptFileError unless ``tensors`` (momentum, a delta) has the parameters' names,
    shapes and dtypes, and finite values: the outer step combines them element by element."""
    if set(tensors) != set(params):
        raise CorruptFileError(
            f"{file}: tensors {sorted(tensors)[:4]} do not match the module's {sorted(params)[:4]}"
        )
    for name, t in tensors.items():
        ref = params[name]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise CorruptFileError(
                f"{file}: {name} is {list(t.shape)} {t.dtype}, expected {list(ref.shape)} "
                f"{ref.dtype}"
            )
        if not bool(torch.isfinite(t).all()):
            raise CorruptFileError(f"{file}: {name} holds NaN or infinity")


class StoreOpener:
    """Reads modules back from a store folder, and keeps what it had to repair for the log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.quarantined: list[str] = []  # corrupt files moved aside (for the log)
        self.rolled_back: dict[str, tuple[int, int]] = {}  # module -> (bad version, used one)

    def open(self, mid: str) -> ModuleRecord:
        """Open each module at its committed head, verifying every checksum.

        A head whose version or momentum file is corrupt or missing falls back to the version
        before it (kept in head.json under "previous", with its files and deltas), so the step
        is redone on start; the bad files are moved aside as ``*.corrupt`` and named in the log.
        """
        folder = self.root / "modules" / mid
        head = self._read_head(folder / "head.json")
        try:
            params, momentum = self._read_version(folder, head)
        except CorruptFileError as exc:
            previous = head.get("previous")
            if previous is None:
                raise
            bad, head = head["version"], previous
            log.error(
                "module %s: %s; falling back to the last good version v%d",
                mid,
                exc,
                head["version"],
            )
            params, momentum = self._read_version(folder, head)
            for name in (f"v{bad}.dpt", f"m{bad}.dpt"):
                if (folder / name).exists():
                    self._quarantine(mid, folder / name, "rolled back")
            write_json_atomic(folder / "head.json", _head_fields_of(head))
            self.rolled_back[mid] = (bad, head["version"])
        v = head["version"]
        record = ModuleRecord(v, head["hash"], params, momentum, head["applied"], head["reported"])
        self._discard_uncommitted(mid, folder, v)
        record.pending, record.late = self.pending(mid, v, params)
        record.ahead, _ = self.pending(mid, v + 1, params)  # acked for the next step
        return record

    @staticmethod
    def _read_version(folder: Path, head: dict) -> tuple[Tensors, Tensors | None]:
        """The parameters and momentum of the version ``head`` names, checked against it."""
        v = head["version"]
        params = read_tensor_file(folder / f"v{v}.dpt").tensors
        if tensors_sha256(params) != head["hash"]:
            raise CorruptFileError(f"{folder / f'v{v}.dpt'}: content hash differs from head.json")
        momentum = read_tensor_file(folder / f"m{v}.dpt").tensors if v > 0 else None
        if momentum is not None:
            _check_like(folder / f"m{v}.dpt", momentum, params)
        return params, momentum

    @staticmethod
    def _read_head(path: Path) -> dict:
        """head.json, checked field by field: ``applied`` and ``reported`` come back as the
        record holds them (a list of task ids; base version -> paths), so that a damaged head
        is refused here instead of breaking a later submission or outer step. A damaged
        "previous" (the fallback version) is dropped with a warning: the head itself is fine."""
        try:
            head = _checked_head(json.loads(path.read_text()))
        except FileNotFoundError:
            raise CorruptFileError(f"{path}: missing (module was never initialised?)") from None
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptFileError(f"{path}: unreadable module head: {exc}") from None
        previous = head.get("previous")
        if previous is not None:
            try:
                head["previous"] = _checked_head(previous)
                if head["previous"]["version"] >= head["version"]:
                    raise ValueError("it is not older than the head")
            except (ValueError, RecursionError) as exc:
                log.warning("%s: ignoring its damaged 'previous' version: %s", path, exc)
                head["previous"] = None
        return head

    def _discard_uncommitted(self, mid: str, folder: Path, version: int) -> None:
        """Files of a half-done outer step (newer than the head), temporary files a crash left
        behind, and deltas older than the last step's go away."""
        for f in folder.glob("*.dpt"):
            if _version_of(f.stem) > version:
                log.warning("module %s: rolling back uncommitted %s", mid, f.name)
                f.unlink()
        deltas = self.root / "deltas" / mid
        for d in deltas.glob("v*"):
            if _version_of(d.name) < version - 1:
                shutil.rmtree(d, ignore_errors=True)
        # Deltas staged by admission but never committed (never acknowledged) go too.
        shutil.rmtree(deltas / "incoming", ignore_errors=True)
        # AtomicFile's temporary names start with a dot: a crash before the rename left them.
        for tmp in [*folder.glob(".*"), *deltas.glob("v*/.*")]:
            log.info("module %s: removing %s, left by an interrupted write", mid, tmp)
            tmp.unlink(missing_ok=True)

    def _quarantine(self, mid: str, file: Path, why: str) -> None:
        """Move a bad file aside (``*.corrupt``, kept for inspection), log it and count it."""
        aside = file.with_name(file.name + ".corrupt")
        file.replace(aside)
        log.error("module %s: %s: %s; moved aside to %s", mid, file, why, aside.name)
        self.quarantined.append(str(aside))

    def pending(
        self, mid: str, version: int, params: Tensors
    ) -> tuple[dict[int, PendingDelta], dict[int, PendingDelta]]:
        """The acknowledged deltas waiting for this version's step, each checked now: a bad
        one found only at the step would stop the module for good. A corrupt or truncated one
        is quarantined rather than stopping the start: its path is then open again, so the
        task is trained once more (or its peer's retry is stored afresh)."""
        pending: dict[int, PendingDelta] = {}
        late: dict[int, PendingDelta] = {}
        for f in sorted((self.root / "deltas" / mid / f"v{version}").glob("P*.dpt")):
            try:
                path, delta = self._read_pending(f, version, params)
                table = pending if delta.for_round == version else late
                if path in table:
                    raise CorruptFileError(f"{f}: a second delta of path {path} for v{version}")
            except CorruptFileError as exc:
                self._quarantine(mid, f, str(exc).removeprefix(f"{f}: "))
                continue
            table[path] = delta
        return pending, late

    @staticmethod
    def _read_pending(f: Path, version: int, params: Tensors) -> tuple[int, PendingDelta]:
        frame = read_tensor_file(f)
        try:
            meta = _DeltaMeta.model_validate(frame.fields)
            base = version if meta.base_version is None else meta.base_version
            rnd = base if meta.round is None else meta.round
            if not base <= rnd <= version:
                raise ValueError(f"base {base}, round {rnd} against version {version}")
        except ValueError as exc:
            raise CorruptFileError(f"{f}: delta metadata is damaged: {exc!s:.200}") from None
        _check_like(f, frame.tensors, params)
        m = meta
        return m.path, PendingDelta(
            m.path, m.weight, m.task_id, m.peer_id, f, base, rnd, m.voter, scored=m.scored
        )
