"""Evaluating a prepared run's modules: routed perplexity, held-out losses, early stopping.

Paths are built from module tensors (or from their early-stopping snapshots) one at a time;
validation documents go to the latest routing phase's paths, or are re-routed every few tokens
(DiPaCo section 2.4.3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.errors import ConfigError
from dipaco.model.transformer import PathModel
from dipaco.prepare.folder import PreparedRun
from dipaco.routing.evaluate import (
    chunk_routes,
    heldout_loss,
    rerouted_perplexity,
    routed_perplexity,
)


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


Scorer = Callable[[int, dict[str, dict[str, torch.Tensor]]], float]


def _scorer(prep: PreparedRun, docs_for: Callable[[int], list], device: str) -> Scorer:
    """Path p's mean loss, with the given module tensors, on ``docs_for(p)``; NaN when there
    are none (then there is nothing to judge by)."""
    c = prep.config
    cfg, topology = c.build_model_config(), c.build_topology()

    def score(p: int, modules: dict[str, dict[str, torch.Tensor]]) -> float:
        docs = docs_for(p)
        if not docs:
            return float("nan")
        model = topology.build_path(cfg, p, modules).to(device)
        loss, _ = heldout_loss(
            model, docs, seq_len=c.train.seq_len, prefix_tokens=c.routing.prefix_tokens
        )
        return loss

    return score


def heldout_scorer(prep: PreparedRun, device: str = "cpu") -> Scorer:
    """The coordinator's held-out check (``validation.heldout_check``): path p's mean loss, with
    the given module tensors, on the first ``validation.heldout_docs`` documents of its held-out
    slice."""
    count = prep.config.validation.heldout_docs
    return _scorer(prep, lambda p: prep.heldout_docs(p)[:count], device)


def foreign_scorer(prep: PreparedRun, device: str = "cpu") -> Scorer:
    """Path p's mean loss, with the given module tensors, on other paths' held-out documents:
    the first document of each of ``validation.heldout_docs`` other paths, spread evenly over
    them (``validation.offshard_check``). Against its own documents' loss it tells a delta
    trained on the path's own shard (which should help its own documents more) from one
    trained on other data (docs/security.md, "Trained on another path's shard")."""
    n, k = prep.config.build_topology().num_paths, prep.config.validation.heldout_docs
    pools: dict[int, list] = {}

    def pool(p: int) -> list:
        if p not in pools:
            others = [q for q in range(n) if q != p]
            picks = others[:: max(1, len(others) // k)][:k]
            pools[p] = [docs[0] for q in picks if (docs := prep.heldout_docs(q))]
        return pools[p]

    return _scorer(prep, pool, device)


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
        openings=prep.openings,
    )
    return rerouted_perplexity(
        load, docs, routes, window=window, seq_len=seq_len, prefix_tokens=prefix
    )


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
