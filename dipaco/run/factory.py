"""Building the coordinator of a prepared run: the scheduler, or an owner of some modules.

``build_coordinator`` is the scheduling coordinator of a prepared folder, with what happens
after each round on this box (``round_work.RoundWork``: validation, early stopping, and the
discriminative routing phases). ``build_owner`` is a coordinator that owns modules for a run
another coordinator schedules.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dipaco.config import RunConfig, load_config_dict, outer_lr_momentum
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import ConfigError
from dipaco.fileio import write_json_atomic
from dipaco.prepare.folder import PreparedRun
from dipaco.protocols.auth import Identity
from dipaco.run.evaluate import (
    foreign_scorer,
    heldout_scorer,
)
from dipaco.run.manifest import peer_config, phase_files, run_files, shard_tokens
from dipaco.run.metrics_log import MetricsLog
from dipaco.run.round_work import RoundWork

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


def aggregation(c: RunConfig) -> str:
    """The combiner of the run: ``validation.aggregation``, with "auto" resolved by who may
    join (a robust trimmed mean when anyone may, the paper's mean on an allow-list)."""
    a = c.validation.aggregation
    if a != "auto":
        return a
    return "trimmed_mean" if c.security.join == "open" else "mean"


def heldout_check(c: RunConfig) -> bool:
    """Whether the run's coordinator scores every delta on held-out documents:
    ``validation.heldout_check``, with "auto" resolved by who may join (on when anyone may)."""
    v = c.validation.heldout_check
    return c.security.join == "open" if v == "auto" else bool(v)


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
    """The scheduling coordinator of a prepared run, with its after-round work
    (``round_work.RoundWork``); ``device`` runs its evaluation, held-out measurements and
    routing phases."""
    c = prep.config
    work = RoundWork(prep, metrics, evaluate=evaluate, device=device)
    coordinator = coordinator_for(
        c,
        prep.root / "coordinator",
        run_id=prep.run_id,
        peer_config=peer_config(prep),
        shard_tokens=shard_tokens(prep),
        on_round=work.on_round if work.needed else None,
        metrics=metrics,
        clock=clock,
        owner_id=owner_id,
        identity=identity,
        files=run_files(prep),
        heldout_loss=heldout_scorer(prep, device) if heldout_check(c) else None,
        foreign_loss=(
            foreign_scorer(prep, device)
            if heldout_check(c) and c.validation.offshard_check
            else None
        ),
        eval_note=lambda: work.eval_note,
    )
    work.attach(coordinator)
    coordinator.start(c.build_topology().init_modules(prep.initial_state()))
    for routing in prep.refresh().routings[1:]:
        coordinator.add_phase(
            routing.phase,
            routing.prefix,
            routing.stats["shards"]["train"]["tokens"],
            phase_files(prep, routing.phase),
        )
    work.resume()  # a round's work or a routing phase a stop cut off
    return coordinator
