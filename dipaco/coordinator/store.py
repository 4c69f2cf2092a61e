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
before the head moves leaves version v and its deltas in place, so the step is redone on start;
a crash after it leaves stale deltas of version v, which are discarded. Files are checksummed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dipaco.coordinator.outer import OuterSettings, nesterov_step, outer_gradient
from dipaco.errors import CorruptFileError
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


class ModuleStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.modules: dict[str, ModuleRecord] = {}

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
        for mid in module_ids:
            folder = self.root / "modules" / mid
            head = self._read_head(folder / "head.json")
            v = head["version"]
            params = read_tensor_file(folder / f"v{v}.dpt").tensors
            if tensors_sha256(params) != head["hash"]:
                raise CorruptFileError(
                    f"{folder / f'v{v}.dpt'}: content hash differs from head.json"
                )
            momentum = read_tensor_file(folder / f"m{v}.dpt").tensors if v > 0 else None
            reported = {int(b): list(ps) for b, ps in head.get("reported", {}).items()}
            record = ModuleRecord(
                v, head["hash"], params, momentum, list(head.get("applied", [])), reported
            )
            self._discard_uncommitted(mid, folder, v)
            record.pending, record.late = self._load_pending(mid, v)
            self.modules[mid] = record

    @staticmethod
    def _read_head(path: Path) -> dict:
        try:
            head = json.loads(path.read_text())
            if not isinstance(head.get("version"), int) or not isinstance(head.get("hash"), str):
                raise ValueError("missing version or hash")
            return head
        except FileNotFoundError:
            raise CorruptFileError(f"{path}: missing (module was never initialised?)") from None
        except (ValueError, AttributeError) as exc:
            raise CorruptFileError(f"{path}: unreadable module head: {exc}") from None

    def _discard_uncommitted(self, mid: str, folder: Path, version: int) -> None:
        """Files of a half-done outer step (newer than the head) and old deltas go away."""
        for f in folder.glob("*.dpt"):
            if _version_of(f.stem) > version:
                log.warning("module %s: rolling back uncommitted %s", mid, f.name)
                f.unlink()
        for d in (self.root / "deltas" / mid).glob("v*"):
            if _version_of(d.name) < version:
                shutil.rmtree(d, ignore_errors=True)

    def _load_pending(
        self, mid: str, version: int
    ) -> tuple[dict[int, PendingDelta], dict[int, PendingDelta]]:
        pending, late = {}, {}
        for f in sorted((self.root / "deltas" / mid / f"v{version}").glob("P*.dpt")):
            fields = read_tensor_file(f).fields
            base = fields.get("base_version", version)
            delta = PendingDelta(
                fields["path"], fields["weight"], fields["task_id"], fields["peer_id"], f, base
            )
            (pending if base == version else late)[fields["path"]] = delta
        return pending, late

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
    ) -> None:
        """Durably record a path's delta (then it may be acked).

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
        }
        write_tensor_file(file, Frame("Delta", meta, delta))
        (record.late if late else record.pending)[path] = PendingDelta(
            path, weight, task_id, peer_id, file, base
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
        """Average the pending deltas (in path order, for determinism), step, commit version v+1."""
        record = self.modules[mid]
        folder = self.root / "modules" / mid
        included = [p for _, p in sorted(record.pending.items())]
        included += [p for _, p in sorted(record.late.items())]
        deltas = [(read_tensor_file(p.file).tensors, p.weight) for p in included]
        grad = outer_gradient(deltas, settings)
        params, momentum = nesterov_step(record.params, record.momentum, grad, settings)
        v = record.version + 1
        write_tensor_file(
            folder / f"v{v}.dpt", Frame("ModuleRelease", {"module": mid, "version": v}, params)
        )
        write_tensor_file(
            folder / f"m{v}.dpt", Frame("OuterMomentum", {"module": mid, "version": v}, momentum)
        )
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
            },
        )
        old_deltas = self.root / "deltas" / mid / f"v{record.version}"
        paths, late = sorted(record.pending), sorted(record.late)
        self.modules[mid] = ModuleRecord(v, digest, params, momentum, applied, reported)
        shutil.rmtree(old_deltas, ignore_errors=True)
        for stale in (f"v{v - KEEP_VERSIONS}.dpt", f"m{v - KEEP_VERSIONS}.dpt"):
            (folder / stale).unlink(missing_ok=True)
        grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grad.values())))
        return {
            "module": mid,
            "version": v,
            "paths": paths,
            "late_paths": late,
            "tasks": [p.task_id for p in included],
            "outer_grad_norm": grad_norm,
        }

    def delta_tensors(self, delta: PendingDelta) -> Tensors:
        return read_tensor_file(delta.file).tensors
