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
    deltas/<mid>/incoming/<task>.dpt a delta written by admission outside the coordinator's lock,
                                     moved under one of the names above when it is committed
                                     (never acknowledged before; removed on start)

Admission writes a delta in two parts (``stage_delta`` outside the coordinator's lock, with its
fsync; ``commit_delta`` under it, a rename), so that many deltas are written at once. An outer
step runs in three (``begin_step`` under the lock, ``run_step`` outside it, ``finish_step``
under it again): while one module steps, others admit deltas. The step computes v+1 in memory;
then (on a background thread, except for a run's last step) it writes v+1 and m(v+1) without
fsync, rewrites head.json with fsync, deletes the fallback of the step before, and fsyncs v+1 and
m(v+1); the module's next step waits for that. A crash before the head moves leaves version v and
its deltas in place, so the step is redone on start, and yields the same v+1. The new head keeps
the old one under "previous", and the step's deltas stay until the next step: if v+1 or m(v+1)
is later found corrupt or missing, load falls back to v and the step is redone (the bad files
are moved aside as ``*.corrupt``). Files are checksummed (XXH3); a corrupt pending delta is
quarantined the same way, and its path is trained again. docs/reliability.md has the whole
crash-safety design.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from dipaco.fileio import fsync_path, sync_files, unique_suffix, write_json_atomic
from dipaco.protocols.wire import (
    Frame,
    read_tensor_file,
    tensors_sha256,
    write_tensor_file,
)

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """An outer step begun: the module, its record then, and the deltas it averages."""

    mid: str
    record: ModuleRecord
    included: list[PendingDelta]


@dataclass
class StepResult:
    plan: StepPlan
    record: ModuleRecord  # the module at v+1, committed on disk
    info: dict  # the outer_step metrics event


def delta_meta(
    path: int,
    weight: float,
    task_id: str,
    peer_id: str,
    base_version: int,
    voter: str,
    round: int | None = None,
    scored: bool = False,
) -> dict:
    """A delta file's header fields. ``round``: the version whose step the delta is its path's
    report for, when that is not its base (an ahead task's: overlap); ``scored``: it came with
    the scheduler's verdict on its whole path (scoring.py)."""
    meta = {
        "path": path,
        "weight": weight,
        "task_id": task_id,
        "peer_id": peer_id,
        "base_version": base_version,
        "voter": voter,
    }
    if round is not None and round != base_version:
        meta["round"] = round
    if scored:
        meta["scored"] = True
    return meta


# Long-lived threads: starting one per job made the caller wait for it to take the GIL, about
# 5 ms per job (the switch interval), twice per outer step. Enough of them that a job that waits
# for another (the head's write waits for the release hash) never waits behind it.
_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="dipaco-store")


class _Job:
    """A function run on a pool thread (file writes, syncs and hashing release the GIL), or on
    the caller's when it asks for the result (``start=False``)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, start: bool = True) -> None:
        self._fn, self._args = fn, args
        self._future: Future | None = _POOL.submit(self.run_here) if start else None

    def result(self) -> Any:
        return self.run_here() if self._future is None else self._future.result()

    def run_here(self) -> Any:
        """Run the function (again) on this thread; its error is raised."""
        value = self._fn(*self._args)
        self._args = ()  # drop the tensors it held: the store reuses their buffers
        return value


class ModuleStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.modules: dict[str, ModuleRecord] = {}
        self.opener = StoreOpener(self.root)
        self.quarantined = self.opener.quarantined  # repairs: logged, counted, then cleared
        self.rolled_back = self.opener.rolled_back
        # The version before the head, per module, whose buffers the next outer step writes
        # into (spare_buffers). Off: every step allocates afresh, half the memory, about three
        # times slower for large modules on 2 CPU cores (page faults).
        self.reuse_buffers = True
        self._spare: dict[str, tuple[Tensors, Tensors]] = {}
        self._syncing: dict[str, _Job] = {}  # module -> the sync of its last step's files
        # Modules of at least this many bytes have their steps written in the background (the
        # coordinator's choice, rounds.py); smaller ones write in milliseconds, in line.
        self.background_bytes = int(os.environ.get("DIPACO_BACKGROUND_STEP_BYTES", 16 << 20))
        # Deltas admitted by this process are kept in memory, up to this many bytes in all, so
        # that a step does not read back (and checksum) what it wrote: the file stays the
        # durable copy that a restart reads. 0: every step reads its deltas' files. Default: an
        # eighth of the machine's memory.
        eighth = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
        self.held_budget = int(os.environ.get("DIPACO_DELTA_MEMORY_BYTES", eighth))
        self.held = 0  # bytes of deltas held (recounted at every step)

    # ---- lifecycle ----------------------------------------------------------------------------
    def initialize(self, modules: dict[str, Tensors]) -> None:
        """Write version 0 of every module not already in the store, then load them all."""
        for mid, tensors in modules.items():
            folder = self.root / "modules" / mid
            if (folder / "head.json").exists():
                continue
            tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
            write_version(folder, mid, 0, tensors)
            write_json_atomic(folder / "head.json", {"version": 0, "hash": tensors_sha256(tensors)})
        self.load(list(modules))

    def load(self, module_ids: list[str]) -> None:
        """Open each module at its committed head, verifying every checksum (store_open.py)."""
        for mid in module_ids:
            self.modules[mid] = self.opener.open(mid)
            # The head's files may be a step's that a crashed process never synced.
            folder, v = self.root / "modules" / mid, self.modules[mid].version
            files = [f for f in (folder / f"v{v}.dpt", folder / f"m{v}.dpt") if f.exists()]
            self._syncing[mid] = _Job(sync_files, *files)

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
        base = self.modules[mid].version if base_version is None else base_version
        meta = delta_meta(path, weight, task_id, peer_id, base, voter)
        staged = self.stage_delta(mid, task_id, meta, delta)
        fsync_path(self.commit_delta(mid, staged, meta, delta))

    def stage_delta(self, mid: str, task_id: str, meta: dict, delta: Tensors) -> str:
        """Write a delta durably under a private name (``deltas/<mid>/incoming``); it joins no
        step until :meth:`commit_delta`. Safe outside the coordinator's lock. Written in place:
        nothing reads ``incoming`` (emptied at start), and the commit's rename is the one that
        makes the delta count."""
        file = f"{self.root}/deltas/{mid}/incoming/{task_id}-{unique_suffix()}.dpt"  # no pathlib
        write_tensor_file(file, Frame("Delta", meta, delta), sync_dir=False, in_place=True)
        return file

    def commit_delta(
        self, mid: str, staged: str | Path, meta: dict, tensors: Tensors | None = None
    ) -> str:
        """Move a staged delta under its name for the module's current version and count it
        pending. Returns the folder whose entry must reach the disk (``fileio.fsync_path``) before
        the delta is acknowledged. Under the coordinator's lock: the version must not move.

        ``tensors`` (what was staged, which nobody may change afterwards) are held for the step
        while the store's ``held_budget`` allows."""
        record = self.modules[mid]
        base, path = meta["base_version"], meta["path"]
        rnd = meta.get("round", base)
        table = record.table_for(rnd)  # on time, ahead (overlap) or late
        late = table is record.late
        name = f"P{path}-b{base}.dpt" if late else f"P{path}.dpt"
        folder = f"{self.root}/deltas/{mid}/v{record.version + (table is record.ahead)}"
        file = f"{folder}/{name}"
        try:
            os.replace(staged, file)
        except FileNotFoundError:  # the version's first delta makes its folder
            os.makedirs(folder, exist_ok=True)
            os.replace(staged, file)
        delta = PendingDelta(
            path, meta["weight"], meta["task_id"], meta["peer_id"], Path(file), base, rnd,
            meta["voter"], tensors, meta.get("scored") is True,
        )  # fmt: skip
        if self.held + delta.held_bytes > self.held_budget:
            delta.tensors = None  # past the budget: the step reads the file
        self.held += delta.held_bytes
        table[path] = delta
        return folder

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
        write_version(folder, mid, version, params)
        if momentum is not None:
            write_version(folder, mid, version, momentum, momentum=True)
        for meta, tensors in deltas:
            base, rnd = meta["base_version"], meta.get("round", meta["base_version"])
            late = rnd not in (version, version + 1)  # else its round's: on time or ahead
            name = f"P{meta['path']}-b{base}.dpt" if late else f"P{meta['path']}.dpt"
            at = f"v{version + 1}" if rnd == version + 1 else f"v{version}"
            write_tensor_file(self.root / "deltas" / mid / at / name, Frame("Delta", meta, tensors))
        write_json_atomic(
            folder / "head.json", {"version": version, "hash": tensors_sha256(params)}
        )
        self.load([mid])

    def owned_on_disk(self) -> list[str]:
        """Module ids this store holds a committed head for."""
        return sorted(p.parent.name for p in (self.root / "modules").glob("*/head.json"))

    def outer_step(self, mid: str, settings: OuterSettings, background: bool = False) -> dict:
        """Average the pending deltas (in path order, for determinism), step, commit version v+1.

        With a robust ``settings.aggregation`` the result also names the combiner used and the
        deltas the clipped mean scaled down ("clipped": path, task, factor). ``background``:
        see :meth:`run_step`.
        """
        return self.finish_step(self.run_step(self.begin_step(mid), settings, background))

    def begin_step(self, mid: str) -> StepPlan:
        """What the step of ``mid`` will average: its pending and late deltas now. Under the
        coordinator's lock; no delta may be committed to ``mid`` until :meth:`finish_step`."""
        record = self.modules[mid]
        included = [p for _, p in sorted(record.pending.items())]
        included += [p for _, p in sorted(record.late.items())]
        return StepPlan(mid, record, included)

    def run_step(
        self,
        plan: StepPlan,
        settings: OuterSettings,
        background: bool = False,
        on_disk: Callable[[dict], None] | None = None,
    ) -> StepResult:
        """The step's work: read the deltas, average and step; then write v+1 and its momentum
        and move the head (:func:`persist_step`), on a background thread if ``background``.

        Outside the coordinator's lock: it reads and writes only this module's files and the
        buffers of the version before the head, which nobody else sees. With ``background``
        the module is at v+1 in memory (peers may fetch it) before head.json says so. That is
        safe because the step is a function of version v and its deltas, which stay on disk
        until v+1 is (docs/reliability.md, "Outer steps"): a crash before the head moves
        makes the start redo the step, which yields the same v+1, and the deltas acknowledged
        against v+1 meanwhile are read back after it. ``on_disk(info)`` is called once the
        step is committed on disk (the coordinator logs the outer step then: a step that a
        crash undid is never logged).
        """
        mid, record, included = plan.mid, plan.record, plan.included
        self._synced(mid)  # the step before this one is on disk (or fails again, here)
        started = time.perf_counter()
        deltas = [(self.delta_tensors(p), p.weight) for p in included]
        how: dict = {}
        out = spare_buffers(self._spare.pop(mid, None), record.params)
        params, momentum, norm = apply_round(
            deltas,
            record.params,
            record.momentum,
            at_step(settings, record.version),
            how,
            out,
            voters=[p.vote for p in included],
        )
        del deltas
        v = record.version + 1
        applied = (record.applied + [p.task_id for p in included])[-APPLIED_KEPT:]
        # The paths' reports for v (by round: an ahead task's base is older), and the late.
        on_time = sorted(p.path for p in included if p.for_round == record.version)
        reported = {**record.reported, record.version: on_time}
        reported = {b: ps for b, ps in reported.items() if b > record.version - REPORTED_KEPT}
        # The release hash (SHA-256, what peers check) on another core; readers of
        # ``new.hash`` wait for it.
        new = ModuleRecord(v, _Job(tensors_sha256, params), params, momentum, applied, reported)
        # The deltas acknowledged for v+1 already: ahead tasks' (overlap), and after a restart
        # that redoes the step, those acknowledged against v+1 before the crash (above).
        new.pending = dict(record.ahead)
        info = {
            "module": mid,
            "version": v,
            "paths": on_time,
            "late_paths": sorted(p.path for p in included if p.for_round != record.version),
            "tasks": [p.task_id for p in included],
            "weights": [p.weight for p in included],
            "outer_grad_norm": norm,
            "rescale": how.get("rescale", 1.0),
            "seconds": round(time.perf_counter() - started, 6),  # reading and averaging
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
        job = _Job(persist_step, self.root, mid, record, new, info, on_disk, start=background)
        if background:
            self._syncing[mid] = job
        else:
            job.result()
        return StepResult(plan, new, info)

    def finish_step(self, result: StepResult) -> dict:
        """Make the committed step the module's state (under the coordinator's lock)."""
        mid, old = result.plan.mid, result.plan.record
        self.modules[mid] = result.record
        self._spare.pop(mid, None)  # a first step's old version has no momentum to reuse
        if self.reuse_buffers and old.momentum is not None:
            self._spare[mid] = (old.params, old.momentum)
        # The step's deltas go with the old record: count what is still held (also what left
        # with a module handed over since the last step).
        self.held = sum(
            d.held_bytes
            for r in self.modules.values()
            for d in (*r.pending.values(), *r.late.values(), *r.ahead.values())
        )
        return result.info

    def _synced(self, mid: str) -> None:
        """Wait until ``mid``'s last step is on disk. A background write that failed (a full
        disk) is tried again here; if it fails again the OSError is raised, and the job stays
        to be tried at the next step (the ticker retries failed steps every second)."""
        job = self._syncing.get(mid)
        if job is None:
            return
        try:
            job.result()
        except OSError as exc:
            log.error("writing the last outer step of %s failed (%s); trying again", mid, exc)
            job.run_here()
        del self._syncing[mid]

    def sync_all(self) -> None:
        """Wait for every background sync (at shutdown, and in the benchmarks' timings)."""
        for mid in list(self._syncing):
            self._synced(mid)

    def delta_tensors(self, delta: PendingDelta) -> Tensors:
        """A pending delta's tensors: held since admission, else read from its file (checked)."""
        if delta.tensors is not None:
            return delta.tensors
        return read_tensor_file(delta.file).tensors


def write_version(
    folder: Path,
    mid: str,
    version: int,
    tensors: Tensors,
    momentum: bool = False,
    sync: bool = True,
) -> None:
    """A module's release ``v<version>.dpt`` (or its outer momentum, ``m<version>.dpt``)."""
    kind, prefix = ("OuterMomentum", "m") if momentum else ("ModuleRelease", "v")
    frame = Frame(kind, {"module": mid, "version": version}, tensors)
    write_tensor_file(folder / f"{prefix}{version}.dpt", frame, sync=sync)


def persist_step(
    root: Path,
    mid: str,
    old: ModuleRecord,
    new: ModuleRecord,
    info: dict,
    on_disk: Callable[[dict], None] | None,
) -> None:
    """Write a step's version and momentum files (not synced yet), then commit head.json
    (synced), then delete what the step before needed as its fallback,
    then sync the files. Each step's files are therefore on disk before the next step deletes
    its fallback."""
    folder, v = root / "modules" / mid, new.version
    # ``new`` is run_step's record, whose momentum apply_round has just made: never None.
    assert new.momentum is not None
    write_version(folder, mid, v, new.params, sync=False)
    fault_point("outer_step.params_written")
    write_version(folder, mid, v, new.momentum, momentum=True, sync=False)
    fault_point("outer_step.momentum_written")
    write_json_atomic(
        folder / "head.json",
        {
            "version": v,
            "hash": new.hash,
            "applied": new.applied,
            "reported": {str(b): ps for b, ps in new.reported.items()},
            "previous": head_fields(old),  # the fallback if v+1 is found corrupt
        },
    )
    fault_point("outer_step.committed")
    # This step's deltas stay one step longer: a corrupt v+1 is redone from v and them.
    done = root / "deltas" / mid / f"v{old.version - 1}"
    for stale in (f"v{v - KEEP_VERSIONS}.dpt", f"m{v - KEEP_VERSIONS}.dpt"):
        (folder / stale).unlink(missing_ok=True)
    shutil.rmtree(done, ignore_errors=True)
    sync_files(folder / f"v{v}.dpt", folder / f"m{v}.dpt")
    if on_disk is not None:
        on_disk(info)


def spare_buffers(
    spare: tuple[Tensors, Tensors] | None, like: Tensors
) -> tuple[Tensors, Tensors] | None:
    """The previous version's tensors, to be overwritten, if nothing else can see them.

    Each must be float32, contiguous, shaped like the module, and referenced by nobody but
    the store: no other Python reference to the tensor, no view or NumPy array on its
    storage (a reply being encoded, an evaluation holding it). Anything less: None, and the
    step allocates its results afresh.
    """
    if spare is None:
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
