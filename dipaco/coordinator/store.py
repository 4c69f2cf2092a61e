"""The module store: every module's parameters, versioned, with its outer momentum, on disk.

Layout under the store folder, per module id ``mid``::

    modules/<mid>/head.json          {"version": v, "hash": ..., "applied": [task ids],
                                      "reported": {base version: [paths]}}
                                     the commit point; "applied" lists the tasks of the last
                                     steps, so a retried delta is acknowledged, not applied twice,
                                     and "reported" the paths each step had on time, so a second
                                     task of the same path and round is not applied late
    modules/<mid>/v<v>.dpt           parameters at version v
    modules/<mid>/m<v>.dpt           outer momentum after producing version v (absent for v0)
    deltas/<mid>/v<v>/P<p>.dpt       a path's delta against version v, durable before it is acked
    deltas/<mid>/v<v>/P<p>-b<b>.dpt  a late delta (against an older version b), damped, waiting for v

An outer step writes v+1 and m(v+1) (temp, fsync, rename), then rewrites head.json: a crash
before the head moves leaves version v and its deltas in place, so the step is redone on start.
The new head keeps the old one under "previous", and the step's deltas stay until the next step:
if v+1 or m(v+1) is later found corrupt or missing, load falls back to v and the step is redone
(the bad files are moved aside as ``*.corrupt``). Files are checksummed; a corrupt pending delta
is quarantined the same way, and its path is trained again. docs/reliability.md has the whole
crash-safety design.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dipaco.coordinator.outer import OuterSettings, apply_round, at_step
from dipaco.errors import CorruptFileError
from dipaco.faults import fault_point
from dipaco.fileio import write_json_atomic
from dipaco.protocols.wire import (
    Frame,
    read_tensor_file,
    tensors_sha256,
    write_tensor_file,
)

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
    voter: str = ""  # the key that sent it (one vote per key in a robust combiner); "": peer_id

    @property
    def vote(self) -> str:
        return self.voter or self.peer_id


@dataclass
class ModuleRecord:
    version: int
    hash: str
    params: Tensors
    momentum: Tensors | None
    applied: list[str] = field(default_factory=list)  # task ids of the last outer steps
    reported: dict[int, list[int]] = field(default_factory=dict)  # base version -> on-time paths
    pending: dict[int, PendingDelta] = field(default_factory=dict)  # on time: base == version
    late: dict[int, PendingDelta] = field(default_factory=dict)  # late: base < version, damped


def _version_of(name: str) -> int:
    """3 for "v3" or "m3"; -1 (never newer, always old) for a name that is not ours."""
    match = re.fullmatch(r"[vm](\d+)", name)
    return int(match.group(1)) if match else -1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_head(head: object) -> dict:
    """A head.json object with its fields checked (ValueError names the bad one)."""
    if not isinstance(head, dict):
        raise ValueError("not a JSON object")
    version, applied = head.get("version"), head.get("applied", [])
    reported = head.get("reported", {})
    if not _is_int(version) or version < 0 or not isinstance(head.get("hash"), str):
        raise ValueError("missing version or hash")
    if not isinstance(applied, list) or not all(isinstance(t, str) for t in applied):
        raise ValueError("'applied' is not a list of task ids")
    if not isinstance(reported, dict) or not all(
        isinstance(b, str)
        and b.isdecimal()
        and isinstance(ps, list)
        and all(_is_int(p) for p in ps)
        for b, ps in reported.items()
    ):
        raise ValueError("'reported' is not {version: [paths]}")
    head["reported"] = {int(b): list(ps) for b, ps in reported.items()}
    head["applied"] = list(applied)
    return head


def _head_fields(record: ModuleRecord) -> dict:
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


class ModuleStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.modules: dict[str, ModuleRecord] = {}
        self.quarantined: list[str] = []  # corrupt files moved aside by load (for the log)
        self.rolled_back: dict[str, tuple[int, int]] = {}  # module -> (bad version, used one)
        # The version before the head, per module, whose buffers the next outer step writes
        # into (see _spare_buffers). Off, every step allocates its results afresh: half the
        # memory, and on 2 CPU cores about three times slower for large modules (page faults).
        self.reuse_buffers = True
        self._spare: dict[str, tuple[Tensors, Tensors | None]] = {}

    # ---- lifecycle ----------------------------------------------------------------------------
    def initialize(self, modules: dict[str, Tensors]) -> None:
        """Write version 0 of every module not already in the store, then load them all."""
        for mid, tensors in modules.items():
            folder = self.root / "modules" / mid
            if (folder / "head.json").exists():
                continue
            tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
            write_tensor_file(
                folder / "v0.dpt", Frame("ModuleRelease", {"module": mid, "version": 0}, tensors)
            )
            write_json_atomic(folder / "head.json", {"version": 0, "hash": tensors_sha256(tensors)})
        self.load(list(modules))

    def load(self, module_ids: list[str]) -> None:
        """Open each module at its committed head, verifying every checksum.

        A head whose version or momentum file is corrupt or missing falls back to the version
        before it (kept in head.json under "previous", with its files and deltas), so the step
        is redone on start; the bad files are moved aside as ``*.corrupt`` and named in the log.
        """
        for mid in module_ids:
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
            record = ModuleRecord(
                v, head["hash"], params, momentum, head["applied"], head["reported"]
            )
            self._discard_uncommitted(mid, folder, v)
            record.pending, record.late = self._load_pending(mid, v, params)
            self.modules[mid] = record

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

    def _load_pending(
        self, mid: str, version: int, params: Tensors
    ) -> tuple[dict[int, PendingDelta], dict[int, PendingDelta]]:
        """The acknowledged deltas waiting for this version's step, each checked now: a bad
        one found only at the step would stop the module for good. A corrupt or truncated one
        is quarantined rather than stopping the start: its path is then open again, so the
        task is trained once more (or its peer's retry is stored afresh)."""
        pending, late = {}, {}
        for f in sorted((self.root / "deltas" / mid / f"v{version}").glob("P*.dpt")):
            try:
                path, delta = self._read_pending(f, version, params)
                table = pending if delta.base_version == version else late
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
        fields = frame.fields
        base = fields.get("base_version", version)
        path, weight = fields.get("path"), fields.get("weight")
        if not (
            _is_int(path)
            and path >= 0
            and _is_int(base)
            and 0 <= base <= version
            and isinstance(weight, int | float)
            and not isinstance(weight, bool)
            and math.isfinite(weight)
            and weight > 0
            and isinstance(fields.get("task_id"), str)
            and isinstance(fields.get("peer_id"), str)
            and isinstance(fields.get("voter", ""), str)
        ):
            raise CorruptFileError(f"{f}: delta metadata is damaged: {fields!r:.200}")
        _check_like(f, frame.tensors, params)
        return path, PendingDelta(
            path,
            float(weight),
            fields["task_id"],
            fields["peer_id"],
            f,
            base,
            fields.get("voter", ""),
        )

    # ---- reads --------------------------------------------------------------------------------
    def version(self, mid: str) -> int:
        return self.modules[mid].version

    def params(self, mid: str) -> Tensors:
        return self.modules[mid].params

    # ---- writes -------------------------------------------------------------------------------
    def add_delta(
        self,
        mid: str,
        path: int,
        weight: float,
        task_id: str,
        peer_id: str,
        delta: Tensors,
        base_version: int | None = None,
        voter: str = "",
    ) -> None:
        """Durably record a path's delta (then it may be acked).

        ``voter`` is the key that sent it: a robust combiner gives each key one vote.

        A delta against the module's current version is on time; one against an older version
        (``base_version``) is late: it joins the current version's step with the (already damped)
        ``weight`` but does not count as the path's report for this version.
        """
        record = self.modules[mid]
        base = record.version if base_version is None else base_version
        late = base != record.version
        name = f"P{path}-b{base}.dpt" if late else f"P{path}.dpt"
        file = self.root / "deltas" / mid / f"v{record.version}" / name
        meta = {
            "path": path,
            "weight": weight,
            "task_id": task_id,
            "peer_id": peer_id,
            "base_version": base,
            "voter": voter,
        }
        write_tensor_file(file, Frame("Delta", meta, delta))
        (record.late if late else record.pending)[path] = PendingDelta(
            path, weight, task_id, peer_id, file, base, voter
        )

    def adopt(
        self,
        mid: str,
        version: int,
        params: Tensors,
        momentum: Tensors | None,
        deltas: list[tuple[dict, Tensors]],
    ) -> None:
        """Take over a module from another owner: write its state and pending deltas, then the head."""
        folder = self.root / "modules" / mid
        write_tensor_file(
            folder / f"v{version}.dpt",
            Frame("ModuleRelease", {"module": mid, "version": version}, params),
        )
        if momentum is not None:
            write_tensor_file(
                folder / f"m{version}.dpt",
                Frame("OuterMomentum", {"module": mid, "version": version}, momentum),
            )
        for meta, tensors in deltas:
            base = meta["base_version"]
            name = f"P{meta['path']}-b{base}.dpt" if base != version else f"P{meta['path']}.dpt"
            write_tensor_file(
                self.root / "deltas" / mid / f"v{version}" / name, Frame("Delta", meta, tensors)
            )
        write_json_atomic(
            folder / "head.json", {"version": version, "hash": tensors_sha256(params)}
        )
        self.load([mid])

    def owned_on_disk(self) -> list[str]:
        """Module ids this store holds a committed head for."""
        return sorted(p.parent.name for p in (self.root / "modules").glob("*/head.json"))

    def outer_step(self, mid: str, settings: OuterSettings) -> dict:
        """Average the pending deltas (in path order, for determinism), step, commit version v+1.

        With a robust ``settings.aggregation`` the result also names the combiner used and the
        deltas the clipped mean scaled down ("clipped": path, task, factor).
        """
        record = self.modules[mid]
        folder = self.root / "modules" / mid
        included = [p for _, p in sorted(record.pending.items())]
        included += [p for _, p in sorted(record.late.items())]
        deltas = [(read_tensor_file(p.file).tensors, p.weight) for p in included]
        how: dict = {}
        out = self._spare_buffers(mid, record.params)
        params, momentum, norm = apply_round(
            deltas,
            record.params,
            record.momentum,
            at_step(settings, record.version),
            how,
            out,
            voters=[p.vote for p in included],
        )
        v = record.version + 1
        write_tensor_file(
            folder / f"v{v}.dpt", Frame("ModuleRelease", {"module": mid, "version": v}, params)
        )
        fault_point("outer_step.params_written")
        write_tensor_file(
            folder / f"m{v}.dpt", Frame("OuterMomentum", {"module": mid, "version": v}, momentum)
        )
        fault_point("outer_step.momentum_written")
        digest = tensors_sha256(params)
        applied = (record.applied + [p.task_id for p in included])[-APPLIED_KEPT:]
        reported = {**record.reported, record.version: sorted(record.pending)}
        reported = {b: ps for b, ps in reported.items() if b > record.version - REPORTED_KEPT}
        write_json_atomic(
            folder / "head.json",
            {
                "version": v,
                "hash": digest,
                "applied": applied,
                "reported": {str(b): ps for b, ps in reported.items()},
                "previous": _head_fields(record),  # the fallback if v+1 is found corrupt
            },
        )
        fault_point("outer_step.committed")
        # This step's deltas stay one step longer: a corrupt v+1 is redone from v and them.
        old_deltas = self.root / "deltas" / mid / f"v{record.version - 1}"
        paths, late = sorted(record.pending), sorted(record.late)
        self.modules[mid] = ModuleRecord(v, digest, params, momentum, applied, reported)
        if self.reuse_buffers:
            self._spare[mid] = (record.params, record.momentum)
        shutil.rmtree(old_deltas, ignore_errors=True)
        for stale in (f"v{v - KEEP_VERSIONS}.dpt", f"m{v - KEEP_VERSIONS}.dpt"):
            (folder / stale).unlink(missing_ok=True)
        info = {
            "module": mid,
            "version": v,
            "paths": paths,
            "late_paths": late,
            "tasks": [p.task_id for p in included],
            "outer_grad_norm": norm,
            "rescale": how.get("rescale", 1.0),
        }
        if settings.aggregation != "mean":
            factors = how.get("clip_factors", [1.0] * len(included))
            info["aggregation"] = how["aggregation"]
            info["voters"] = how.get("voters", len(included))
            info["clipped"] = [
                {"path": p.path, "task": p.task_id, "peer": p.peer_id, "factor": f}
                for p, f in zip(included, factors, strict=True)
                if f < 1.0
            ]
        return info

    def _spare_buffers(self, mid: str, like: Tensors) -> tuple[Tensors, Tensors] | None:
        """The previous version's tensors, to be overwritten, if nothing else can see them.

        Each must be float32, contiguous, shaped like the module, and referenced by nobody but
        the store: no other Python reference to the tensor, no view or NumPy array on its
        storage (a reply being encoded, an evaluation holding it). Anything less: None, and the
        step allocates its results afresh.
        """
        spare = self._spare.pop(mid, None)
        if spare is None or spare[1] is None:
            return None
        try:
            for tensors in spare:
                # the tuple's reference, the loop's and getrefcount's: nobody holds the dict
                if sys.getrefcount(tensors) > 3 or tensors.keys() != like.keys():
                    return None
                for name, ref in like.items():
                    t = tensors[name]
                    if (
                        t.dtype != torch.float32
                        or t.shape != ref.shape
                        or not t.is_contiguous()
                        or t.device != ref.device
                        # the dict's reference, t's and getrefcount's own: nobody else's
                        or sys.getrefcount(t) > 3
                        or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2
                    ):
                        return None
        except AttributeError:  # a torch without the storage count: never share
            return None
        return spare[0], spare[1]

    def delta_tensors(self, delta: PendingDelta) -> Tensors:
        return read_tensor_file(delta.file).tensors
