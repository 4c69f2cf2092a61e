"""Building the coordinator of a prepared run: the scheduler, or an owner of some modules.

``build_coordinator`` is the scheduling coordinator of a prepared folder, with what happens
after each round on this box: validation, early stopping, and the discriminative routing phases
(started at their rounds, or when the held-out loss stops improving). ``build_owner`` is a
coordinator that owns modules for a run another coordinator schedules.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.config import RunConfig, load_config_dict, outer_lr_momentum
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import ConfigError, DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.prepare.folder import PreparedRun
from dipaco.prepare.phases import discriminative_phase
from dipaco.protocols.auth import Identity
from dipaco.run.evaluate import (
    evaluate_modules,
    heldout_losses,
    heldout_scorer,
    path_loader,
    track_early_stopping,
)
from dipaco.run.manifest import peer_config, phase_files, run_files, shard_tokens
from dipaco.run.metrics_log import MetricsLog

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]

# In the coordinator's folder: the last round whose after-round work (validation, held-out
# scoring) finished, so that a restart runs the work a stop cut off (resume_round_work).
AFTER_ROUND_FILE = "after_round.json"
# The per-round validation's tries at fetching other owners' modules before it skips a round.
FETCH_TRIES = 3


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
    lr, momentum = outer_lr_momentum(c)
    return OuterSettings(
        **{
            **c.outer.model_dump(),
            "lr": lr,
            "momentum": momentum,
            "lr_by_sharing": tuple(sorted(c.outer.lr_by_sharing.items())),
        },
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


def resume_round_work(coordinator: Coordinator, done_file: Path) -> None:
    """At a restart, the round work (validation, held-out scoring) of the round the modules
    are at, if it never finished: the process stopped after the round closed and before its
    work ran, which runs on a thread of its own (serial.py) that a stop does not wait for.
    Only the last round's versions are still there to score: an earlier round whose work was
    lost with it stays unscored. ``done_file`` holds the last round whose work finished."""
    try:
        done = json.loads(done_file.read_text()).get("round", 0)
    except (OSError, ValueError, AttributeError):  # none yet (a new run, or one from before)
        done = 0
    on_round = coordinator.on_round
    with coordinator.lock:
        rnd = coordinator.round
        if on_round is not None and 0 < rnd and (not isinstance(done, int) or done < rnd):
            log.info("round %d's validation and scoring did not finish: running them now", rnd)
            on_round(rnd)  # as when it closed: queued, outside the lock
            if coordinator.finished:  # the run's end is said after its last round's work
                coordinator.finished_event.clear()
                coordinator.after_round.then(coordinator.finished_event.set)


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
    done_file = prep.root / "coordinator" / AFTER_ROUND_FILE  # the last round whose work ran
    phase_rounds = sorted(c.routing.discriminative_after)
    plateau = c.routing.discriminative_plateau
    last_loss: dict[int, float] = {}  # routing phase -> the paths' mean held-out loss, last round
    running: dict[int, threading.Thread] = {}

    def start_phase(phase: int) -> None:
        """Run a discriminative phase in the background; its tasks open when it is ready.
        Called as a round closes and from the plateau rule's scoring: the lock keeps the two
        from starting one phase twice."""
        with coordinator.lock:
            if phase in running or phase in coordinator.phases:
                return
            running[phase] = threading.Thread(
                target=phase_work, args=(phase,), name=f"routing-phase-{phase}", daemon=True
            )
        running[phase].start()

    def phase_work(phase: int) -> None:
        """A discriminative phase: score, label, fit the router, re-shard; then open it."""
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

    def decide_phase(
        rnd: int, losses: dict[int, float] | None, modules: Callable[[str], Tensors]
    ) -> None:
        """Start a phase once the held-out loss of the current shards stops improving."""
        phase = coordinator.phase_of(rnd)
        if len(coordinator.phase_rounds) >= c.routing.discriminative_phases:
            return
        if phase != prep.routing.phase or phase not in coordinator.phases:
            return  # the current shards' phase is not the one trained on yet
        if losses is None:
            losses = heldout_losses(prep, modules, device)
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

    def whole_model(own: dict[str, Tensors]) -> Callable[[str], Tensors] | None:
        """Every module's tensors: ``own``, this coordinator's, and (fetched from their owners
        now) the others'; None when the others cannot be fetched now."""
        others = [mid for mid in c.build_topology().module_ids() if mid not in own]
        if not others:
            return own.__getitem__
        if coordinator.fetch_remote is None:
            note(
                "no per-round validation: other coordinators own modules and this transport "
                "cannot fetch them; `dipaco eval --run-dir` after the run gathers them"
            )
            return None
        for attempt in range(FETCH_TRIES):  # a busy owner or a dropped stream: try again
            try:
                remote = coordinator.fetch_remote(others)
                break
            except DipacoError as exc:
                if attempt + 1 == FETCH_TRIES:
                    note(
                        f"per-round validation skipped: cannot fetch other owners' modules ({exc})"
                    )
                    return None
                log.info("per-round validation: fetching other owners' modules again (%s)", exc)
                time.sleep(1.0)
        coordinator.eval_note = None
        return lambda mid: remote[mid] if mid in remote else own[mid]

    def on_round(rnd: int) -> None:
        # Called under the coordinator's lock as the round closes. What takes long runs after
        # it, in order, outside the lock (serial.py), on this round's versions of our modules:
        # the dict of each holds them (a later step writes new tensors while another reference
        # to these exists). With other owners the validation fetches their modules; held-out
        # scoring (early stopping, the plateau rule) needs every module here; a scheduled
        # routing phase stops the run with that reason (start_phase).
        whole = all(coordinator.owns(mid) for mid in coordinator.owners)
        scored = (early is not None or plateau > 0) and whole
        if (evaluate and c.eval.every_round) or scored:
            own = {mid: coordinator.store.params(mid) for mid in coordinator.owned_modules()}
            coordinator.after_round.submit(
                lambda: after_round(rnd, own, scored), on_skip=lambda: skipped(rnd)
            )
        for k, after in enumerate(coordinator.phase_rounds, start=1):
            if rnd >= after:
                start_phase(k)

    def skipped(rnd: int) -> None:
        """A round whose validation and held-out scoring never started: later rounds came in
        while earlier ones were still being evaluated (serial.py's backlog)."""
        log.warning(
            "round %d is not validated or scored: the evaluation of earlier rounds is slower "
            "than the rounds (set eval.max_docs lower, or eval.every_round off)",
            rnd,
        )
        metrics({"event": "round_work_skipped", "round": rnd})

    def after_round(rnd: int, own: dict[str, Tensors], scored: bool) -> None:
        round_work(rnd, own, scored)
        try:  # done: a restart does not run it again (resume_round_work)
            write_json_atomic(done_file, {"round": rnd})
        except OSError as exc:
            log.error("cannot save %s: %s", done_file, exc)

    def round_work(rnd: int, own: dict[str, Tensors], scored: bool) -> None:
        losses = None
        if early is not None and scored:
            losses = track_early_stopping(prep, early, own.__getitem__, rnd, device)
            metrics(
                {"event": "heldout", "round": rnd, "losses": {str(p): v for p, v in losses.items()}}
            )
        if plateau > 0 and scored:
            # The decision's first round is one no task has been issued for yet
            # (phases.schedule_phase): the rounds trained meanwhile keep their shards.
            decide_phase(rnd, losses, own.__getitem__)
        if evaluate and c.eval.every_round:
            validate_round(rnd, own)

    def validate_round(rnd: int, own: dict[str, Tensors]) -> None:
        modules = whole_model(own)  # with other owners: their modules fetched now
        if modules is not None:
            evaluate_round(rnd, modules)

    def evaluate_round(rnd: int, modules: Callable[[str], Tensors]) -> None:
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
    resume_round_work(coordinator, done_file)
    # A restart after a phase's round (or its decision) but before its shards were written runs
    # it now.
    for k, after in enumerate(coordinator.phase_rounds, start=1):
        decided = after not in phase_rounds  # started when decided, a round before its own
        if coordinator.round >= after - decided:
            start_phase(k)
    return coordinator
