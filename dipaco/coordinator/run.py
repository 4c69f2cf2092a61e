"""Running a prepared run on one machine: the coordinator, local peers, evaluation, the baseline.

This is what ``dipaco demo`` and ``dipaco-coordinator start`` drive. Everything it keeps lives in
the run folder, so stopping at any point and starting again continues the run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.config import RunConfig, load_config_dict
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.prepare import (
    PreparedRun,
    discriminative_phase,
    inner_settings,
    phase_prefix,
)
from dipaco.data.shards import TokenShard, window_batches
from dipaco.errors import ConfigError, DipacoError
from dipaco.fileio import file_info, write_json_atomic
from dipaco.model.optim import (
    load_optimizer_state_tensors,
    make_optimizer,
    optimizer_state_tensors,
    param_names_in_optimizer_order,
    train_steps,
)
from dipaco.model.transformer import PathModel
from dipaco.peer.peer import Peer
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file
from dipaco.routing.evaluate import (
    chunk_routes,
    heldout_loss,
    rerouted_perplexity,
    routed_perplexity,
)

log = logging.getLogger(__name__)


class MetricsLog:
    """Append-only metrics as JSON lines in the run folder (thread-safe)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[dict], None]] = []

    def __call__(self, event: dict) -> None:
        event = {"time": round(time.time(), 3), **event}
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        for listener in self.listeners:
            listener(event)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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


def aggregation(c: RunConfig) -> str:
    """The combiner of the run: ``validation.aggregation``, with "auto" resolved by who may
    join (a robust trimmed mean when anyone may, the paper's mean on an allow-list)."""
    a = c.validation.aggregation
    if a != "auto":
        return a
    return "trimmed_mean" if c.security.join == "open" else "mean"


def outer_settings(c: RunConfig) -> OuterSettings:
    """The outer step of the run config, with the validation section's aggregation."""
    v = c.validation
    return OuterSettings(
        **c.outer.model_dump(),
        aggregation=aggregation(c),
        trim_fraction=v.trim_fraction,
        min_paths_for_robust=v.min_paths_for_robust,
        norm_ratio=v.norm_ratio,
    )


def coordinator_for(c: RunConfig, root: Path, **kwargs: Any) -> Coordinator:
    """A coordinator core with the run config's schedule, outer step, policy and codec."""
    return Coordinator(
        root,
        c.build_topology(),
        rounds=c.train.rounds,
        inner_steps=c.train.inner_steps,
        step_offset=c.train.pretrain_steps,
        total_steps=c.total_steps,
        seed=c.train.seed,
        outer=outer_settings(c),
        validation=c.validation,
        lease_seconds=c.scheduler.lease_seconds,
        policy=c.scheduler,
        codec=c.network.codec,
        phase_rounds=c.routing.discriminative_after,
        security=c.security,
        **kwargs,
    )


def build_owner(
    root: str | Path,
    manifest: dict[str, Any],
    metrics: MetricsLog,
    *,
    owner_id: str,
    identity: Identity | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Coordinator:
    """A coordinator that owns modules for a run another coordinator schedules.

    ``manifest`` is the scheduler's Welcome config; the owner keeps a copy in its folder so that
    it restarts from its own checkpoint alone. The manifest's ``coordinator_key`` is the
    scheduler's key: the owner accepts the tasks it signed. ``identity`` signs this owner's
    replies and releases (default: ``coordinator/signing.key`` in ``root``, made on first use).
    """
    root = Path(root)
    saved = root / "manifest.json"
    if saved.exists():
        stored = json.loads(saved.read_text())
        if manifest and stored.get("run_id") != manifest.get("run_id"):
            raise ConfigError(
                f"{root} belongs to run {stored.get('run_id')}, not {manifest.get('run_id')}"
            )
        manifest = stored
    else:
        write_json_atomic(saved, manifest)
    c = load_config_dict(manifest["run"], origin=str(saved))
    coordinator = coordinator_for(
        c,
        root / "coordinator",
        run_id=manifest["run_id"],
        peer_config=manifest,
        shard_tokens=manifest["shard_tokens"],
        metrics=metrics,
        clock=clock,
        owner_id=owner_id,
        identity=identity,
        scheduler_key=manifest["coordinator_key"],
        is_scheduler=False,
    )
    coordinator.start(None)
    return coordinator


def run_files(prep: PreparedRun) -> dict[str, Path]:
    """The files a remote peer downloads (``FetchFile``): the tokenizer and each path's shard."""
    files = {"tokenizer.model": prep.root / "tokenizer.model"}
    for p in range(prep.config.build_topology().num_paths):
        for suffix in (".tokens", ".index.npy", ".json"):
            name = f"shards/P{p}/train{suffix}"
            files[name] = prep.shards_dir / f"P{p}" / f"train{suffix}"
    return files


def path_loader(
    prep: PreparedRun,
    modules: Callable[[str], dict[str, torch.Tensor]],
    early: EarlyStopping | None = None,
    device: str = "cpu",
) -> Callable[[int], PathModel]:
    """Path p's model from module tensors, or (``early``) from its early-stopping snapshot."""
    cfg, topology = prep.config.build_model_config(), prep.config.build_topology()

    def load(p: int) -> PathModel:
        if early is not None and early.best(p) is not None:
            model = PathModel(cfg)
            model.load_state_dict(early.state(p))
            return model.to(device)
        mids = topology.path_modules(p)
        return topology.build_path(cfg, p, {mid: modules(mid) for mid in mids}).to(device)

    return load


def heldout_scorer(
    prep: PreparedRun, device: str = "cpu"
) -> Callable[[int, dict[str, dict[str, torch.Tensor]]], float]:
    """The coordinator's held-out check (``validation.heldout_check``): path p's mean loss, with
    the given module tensors, on the first ``validation.heldout_docs`` documents of its held-out
    slice; NaN when the slice is empty (then there is nothing to judge by)."""
    c = prep.config
    cfg, topology = c.build_model_config(), c.build_topology()

    def score(p: int, modules: dict[str, dict[str, torch.Tensor]]) -> float:
        docs = prep.heldout_docs(p)[: c.validation.heldout_docs]
        if not docs:
            return float("nan")
        model = topology.build_path(cfg, p, modules).to(device)
        loss, _ = heldout_loss(
            model, docs, seq_len=c.train.seq_len, prefix_tokens=c.routing.prefix_tokens
        )
        return loss

    return score


def evaluate_modules(
    prep: PreparedRun,
    modules: Callable[[str], dict[str, torch.Tensor]],
    *,
    early: EarlyStopping | None = None,
    window: int | None = None,
    learned: bool = False,
    device: str = "cpu",
) -> dict:
    """Routed validation perplexity of the modular model whose module tensors ``modules`` gives.

    Documents go to the latest routing phase's paths. ``early`` evaluates each path's
    early-stopping snapshot instead; ``window`` re-routes every ``window`` tokens (section 2.4.3),
    with the prefix router applied to the previous chunk, or (``learned``) with the latest
    discriminative phase's chunk router.
    """
    c = prep.config
    docs = prep.val_docs()
    load = path_loader(prep, modules, early, device)
    seq_len, prefix = c.train.seq_len, c.routing.prefix_tokens
    if window is None:
        return routed_perplexity(
            load, docs, prep.val_routes(), seq_len=seq_len, prefix_tokens=prefix
        )
    if prep.router is None:
        raise ConfigError("re-routing needs a feature router; this run's shards are i.i.d.")
    chunk_router = prep.routing.chunk_router
    if learned and chunk_router is None:
        raise ConfigError("no learned chunk router: it comes with a discriminative routing phase")
    routes = chunk_routes(
        prep.initial_model().to(device),
        prep.router.assign,
        docs,
        window=window,
        seq_len=seq_len,
        prefix_tokens=prefix,
        assign_later=chunk_router.assign if learned and chunk_router is not None else None,
        kind=prep.config.routing.features,
    )
    return rerouted_perplexity(
        load, docs, routes, window=window, seq_len=seq_len, prefix_tokens=prefix
    )


def phase_files(prep: PreparedRun, phase: int) -> dict[str, Path]:
    """A routing phase's training shard files, by the names peers fetch them under."""
    prefix = phase_prefix(phase)
    return {
        f"{prefix}/P{p}/train{suffix}": prep.root / prefix / f"P{p}" / f"train{suffix}"
        for p in range(prep.config.build_topology().num_paths)
        for suffix in (".tokens", ".index.npy", ".json")
    }


def track_early_stopping(
    prep: PreparedRun,
    early: EarlyStopping,
    modules: Callable[[str], dict[str, torch.Tensor]],
    rnd: int,
    device: str = "cpu",
) -> dict[int, float]:
    """Measure every path on its held-out slice and keep its best parameters (paper Table 3).

    A snapshot kept under an earlier routing phase is measured again on the current phase's
    slice first, so that a path compares losses on the same documents.
    """
    c = prep.config
    phase = prep.routing.phase
    current, kept_snapshot = (
        path_loader(prep, modules, device=device),
        path_loader(prep, modules, early, device),
    )

    def measure(model: PathModel, docs: list) -> tuple[float, int]:
        return heldout_loss(
            model, docs, seq_len=c.train.seq_len, prefix_tokens=c.routing.prefix_tokens
        )

    losses = {}
    for p in range(c.build_topology().num_paths):
        docs = prep.heldout_docs(p)
        if not docs:
            continue
        kept = early.best(p)
        if kept is not None and kept.get("phase", 0) != phase:
            early.rescore(p, *measure(kept_snapshot(p), docs), phase=phase)
        model = current(p)
        loss, tokens = measure(model, docs)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        early.update(p, rnd, loss, state, tokens, phase=phase)
        losses[p] = loss
    return losses


def heldout_losses(
    prep: PreparedRun, modules: Callable[[str], dict[str, torch.Tensor]], device: str = "cpu"
) -> dict[int, float]:
    """Every path's loss on its held-out slice of the current routing phase's shard."""
    c = prep.config
    current = path_loader(prep, modules, device=device)
    losses = {}
    for p in range(c.build_topology().num_paths):
        docs = prep.heldout_docs(p)
        if docs:
            losses[p] = heldout_loss(
                current(p), docs, seq_len=c.train.seq_len, prefix_tokens=c.routing.prefix_tokens
            )[0]
    return losses


def build_coordinator(
    prep: PreparedRun,
    metrics: MetricsLog,
    *,
    evaluate: bool = True,
    clock: Callable[[], float] = time.monotonic,
    owner_id: str = "local",
    identity: Identity | None = None,
    device: str = "cpu",
) -> Coordinator:
    """The scheduling coordinator of a prepared run; ``device`` runs its evaluation, held-out
    measurements and routing phases."""
    c = prep.config
    coordinator: Coordinator
    early = EarlyStopping(prep.root / "early_stopping") if c.eval.early_stopping else None
    phase_rounds = sorted(c.routing.discriminative_after)
    plateau = c.routing.discriminative_plateau
    last_loss: dict[int, float] = {}  # routing phase -> the paths' mean held-out loss, last round
    running: dict[int, threading.Thread] = {}

    def start_phase(phase: int) -> None:
        """Run a discriminative phase in the background; its tasks open when it is ready."""
        if phase in running or phase in coordinator.phases:
            return

        def work() -> None:
            try:
                t0 = time.monotonic()
                others = [m for m in c.build_topology().module_ids() if not coordinator.owns(m)]
                if others:
                    raise ConfigError(
                        f"a discriminative phase scores every path, but modules {others} belong "
                        f"to other owners; run phases with the scheduler owning every module"
                    )
                routing = discriminative_phase(
                    prep,
                    phase,
                    path_loader(prep, coordinator.store.params, device=device),
                    stage=lambda s: metrics({"event": "stage", "stage": s}),
                    device=device,
                )
                tokens = routing.stats["shards"]["train"]["tokens"]
                coordinator.add_phase(phase, routing.prefix, tokens, phase_files(prep, phase))
                metrics(
                    {
                        "event": "routing_phase",
                        "phase": phase,
                        "seconds": round(time.monotonic() - t0, 2),
                        "label_counts": routing.stats.get("label_counts"),
                        "label_accuracy": routing.stats.get("label_accuracy"),
                        "shard_tokens": tokens,
                    }
                )
            except Exception as exc:  # the run cannot go on without its shards: say why
                log.exception("routing phase %d failed", phase)
                metrics({"event": "routing_phase_failed", "phase": phase, "error": str(exc)})
                coordinator.failure = f"routing phase {phase} failed: {exc}"
                coordinator.finished_event.set()

        running[phase] = threading.Thread(target=work, name=f"routing-phase-{phase}", daemon=True)
        running[phase].start()

    def decide_phase(rnd: int, losses: dict[int, float] | None) -> None:
        """Start a phase once the held-out loss of the current shards stops improving."""
        phase = coordinator.phase_of(rnd)
        if len(coordinator.phase_rounds) >= c.routing.discriminative_phases:
            return
        if phase != prep.routing.phase or phase not in coordinator.phases:
            return  # the current shards' phase is not the one trained on yet
        if losses is None:
            losses = heldout_losses(prep, coordinator.store.params, device)
            metrics(
                {"event": "heldout", "round": rnd, "losses": {str(p): v for p, v in losses.items()}}
            )
        if not losses:
            return
        mean = sum(losses.values()) / len(losses)
        before, last_loss[phase] = last_loss.get(phase), mean
        if before is None or before - mean >= plateau * before:
            return
        decided = coordinator.schedule_phase()
        if decided is not None:
            k, after = decided
            metrics(
                {
                    "event": "plateau",
                    "round": rnd,
                    "heldout_loss": mean,
                    "previous": before,
                    "phase": k,
                    "after_round": after,
                }
            )
            start_phase(k)

    said: set[str] = set()  # notes logged once

    def note(text: str) -> None:
        coordinator.eval_note = text
        if text not in said:
            said.add(text)
            log.warning("%s", text)

    def whole_model() -> Callable[[str], dict[str, torch.Tensor]] | None:
        """Every module's current tensors: this coordinator's own, and (fetched from their
        owners) the others'; None when the others cannot be fetched now."""
        others = [mid for mid in c.build_topology().module_ids() if not coordinator.owns(mid)]
        if not others:
            return coordinator.store.params
        if coordinator.fetch_remote is None:
            note(
                "no per-round validation: other coordinators own modules and this transport "
                "cannot fetch them; `dipaco eval --run-dir` after the run gathers them"
            )
            return None
        try:
            remote = coordinator.fetch_remote(others)
        except DipacoError as exc:
            note(f"per-round validation skipped: cannot fetch other owners' modules ({exc})")
            return None
        coordinator.eval_note = None
        return lambda mid: remote[mid] if mid in remote else coordinator.store.params(mid)

    def on_round(rnd: int) -> None:
        # With other owners the validation fetches their modules; held-out scoring (early
        # stopping, the plateau rule) needs every module here and waits; a scheduled routing
        # phase stops the run with that reason (start_phase).
        whole = all(coordinator.owns(mid) for mid in coordinator.owners)
        losses = None
        if early is not None and whole:
            losses = track_early_stopping(prep, early, coordinator.store.params, rnd, device)
            metrics(
                {"event": "heldout", "round": rnd, "losses": {str(p): v for p, v in losses.items()}}
            )
        if evaluate and c.eval.every_round:
            modules = coordinator.store.params if whole else whole_model()
            if modules is not None:
                evaluate_round(rnd, modules)
        for k, after in enumerate(coordinator.phase_rounds, start=1):
            if rnd >= after:
                start_phase(k)
        if plateau > 0 and whole:
            decide_phase(rnd, losses)

    def evaluate_round(rnd: int, modules: Callable[[str], dict[str, torch.Tensor]]) -> None:
        result = evaluate_modules(prep, modules, device=device)
        metrics(
            {
                "event": "eval",
                "model": "dipaco",
                "round": rnd,
                "steps_per_path": c.train.pretrain_steps + rnd * c.train.inner_steps,
                "ppl": result["ppl"],
                "loss": result["loss"],
                "per_path": {str(p): v["ppl"] for p, v in result["per_path"].items()},
            }
        )

    coordinator = coordinator_for(
        c,
        prep.root / "coordinator",
        run_id=prep.run_id,
        peer_config=peer_config(prep),
        shard_tokens=shard_tokens(prep),
        on_round=on_round
        if (evaluate and c.eval.every_round) or early or phase_rounds or plateau
        else None,
        metrics=metrics,
        clock=clock,
        owner_id=owner_id,
        identity=identity,
        files=run_files(prep),
        heldout_loss=heldout_scorer(prep, device) if c.validation.heldout_check else None,
    )
    if not (evaluate and c.eval.every_round):
        coordinator.eval_note = (
            "no per-round validation: the coordinator was started with --no-eval"
            if not evaluate
            else "no per-round validation: eval.every_round is off in the run config"
        )
    coordinator.start(c.build_topology().init_modules(prep.initial_state()))
    for routing in prep.refresh().routings[1:]:
        coordinator.add_phase(
            routing.phase,
            routing.prefix,
            routing.stats["shards"]["train"]["tokens"],
            phase_files(prep, routing.phase),
        )
    # A restart after a phase's round (or its decision) but before its shards were written runs
    # it now.
    for k, after in enumerate(coordinator.phase_rounds, start=1):
        decided = after not in phase_rounds  # started when decided, a round before its own
        if coordinator.round >= after - decided:
            start_phase(k)
    return coordinator


def run_local_peers(
    coordinator: Coordinator,
    prep: PreparedRun,
    n_peers: int,
    *,
    stop: threading.Event,
    on_progress: Callable[[dict], None] | None = None,
    device: str = "cpu",
    parallel: int = 1,
) -> list[threading.Thread]:
    """Start ``n_peers`` peers in threads over the local transport; they stop when the run ends.

    Local peers share one state folder, so a path's inner optimizer state follows the path,
    whichever local peer trains it: results then do not depend on thread timing.

    ``parallel`` > 1 makes each peer path-parallel (``Peer.run_batch``): it claims up to that
    many tasks of a round and trains them together on its device, step-interleaved (each path on
    its own CUDA stream on a GPU). Meant for ``n_peers=1``: one peer that trains every path of a
    round at once, with module parameters equal, bit for bit on a CPU, to one sequential peer's.
    The coordinator's task quota per key is raised to ``parallel`` if it is lower.
    """
    if parallel > coordinator.security.max_tasks_per_key:
        # The local peer holds a whole batch of leases on its one key: let it.
        coordinator.security = coordinator.security.model_copy(
            update={"max_tasks_per_key": parallel}
        )
    threads = []
    for i in range(n_peers):
        peer = Peer(
            # Each local peer is its own party, with its own key (and its own task quota), kept
            # so that a resumed run knows it again.
            LocalTransport(coordinator.handle).authenticate(
                Identity.load_or_create(prep.root / "peers" / "keys" / f"local-{i}.key")
            ),
            f"local-{i}",
            prep.root / "peers",
            stop=stop,
            on_progress=on_progress,
            device=device,
            parallel=parallel,
        )
        t = threading.Thread(target=peer.run, name=f"peer-{i}", daemon=True)
        t.start()
        threads.append(t)
    return threads


def train_dense_baseline(
    prep: PreparedRun,
    metrics: MetricsLog,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """The dense model of one path's size, trained on all data for as many steps as one path.

    It continues the shared pretraining in chunks of H steps, evaluated and checkpointed after
    each, so it resumes too. Returns the final evaluation.
    """
    c = prep.config
    folder = prep.root / "baseline"
    final = folder / "final.json"
    if final.exists():
        return json.loads(final.read_text())
    model = prep.initial_model()
    settings = inner_settings(c)
    optimizer = make_optimizer(model, settings)
    names = param_names_in_optimizer_order(model)
    chunk = 0
    state_file = folder / "state.dpt"
    if state_file.exists():
        frame = read_tensor_file(state_file)
        model.load_state_dict(
            {k[len("model/") :]: v for k, v in frame.tensors.items() if k.startswith("model/")}
        )
        load_optimizer_state_tensors(
            optimizer,
            names,
            {k[len("optim/") :]: v for k, v in frame.tensors.items() if k.startswith("optim/")},
        )
        chunk = frame.fields["chunk"]
    train = TokenShard(prep.root / "data" / "train")
    docs = prep.val_docs()
    route_all = np.zeros(len(docs), dtype=np.int64)
    result = None

    def evaluate() -> dict:
        return routed_perplexity(
            lambda p: model,
            docs,
            route_all,
            seq_len=c.train.seq_len,
            prefix_tokens=c.routing.prefix_tokens,
        )

    while chunk < c.train.rounds:
        offset = c.train.pretrain_steps + chunk * c.train.inner_steps
        batches = window_batches(
            train, [c.train.seed, 2 << 20, chunk], c.train.batch_size, c.train.seq_len
        )
        losses = train_steps(
            model,
            optimizer,
            batches,
            settings,
            steps=c.train.inner_steps,
            step_offset=offset,
            on_step=on_step,
        )
        chunk += 1
        result = evaluate()
        metrics({"event": "baseline_train", "step_offset": offset, "train_losses": losses})
        metrics(
            {
                "event": "eval",
                "model": "dense",
                "round": chunk,
                "steps_per_path": offset + c.train.inner_steps,
                "ppl": result["ppl"],
                "loss": result["loss"],
            }
        )
        tensors = {f"model/{k}": v.detach() for k, v in model.state_dict().items()}
        tensors.update(
            {f"optim/{k}": v for k, v in optimizer_state_tensors(optimizer, names).items()}
        )
        write_tensor_file(state_file, Frame("BaselineState", {"chunk": chunk}, tensors))
    if result is None:  # resumed after the last chunk was checkpointed
        result = evaluate()
    summary = {"ppl": result["ppl"], "loss": result["loss"]}
    write_json_atomic(final, summary)
    return summary
