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

import logging
import shutil
import sys
from pathlib import Path

import torch

from dipaco.coordinator.outer import OuterSettings, apply_round, at_step
from dipaco.coordinator.store_open import (
    APPLIED_KEPT,
    KEEP_VERSIONS,
    REPORTED_KEPT,
    ModuleRecord,
    PendingDelta,
    StoreOpener,
    Tensors,
    head_fields,
)
from dipaco.faults import fault_point
from dipaco.fileio import write_json_atomic
from dipaco.protocols.wire import (
    Frame,
    read_tensor_file,
    tensors_sha256,
    write_tensor_file,
)

log = logging.getLogger(__name__)


class ModuleStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.modules: dict[str, ModuleRecord] = {}
        self.opener = StoreOpener(self.root)
        # what opening the store repaired (the coordinator logs and counts it, then clears it)
        self.quarantined = self.opener.quarantined
        self.rolled_back = self.opener.rolled_back
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
        """Open each module at its committed head, verifying every checksum (store_open.py)."""
        for mid in module_ids:
            self.modules[mid] = self.opener.open(mid)

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
                "previous": head_fields(record),  # the fallback if v+1 is found corrupt
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
