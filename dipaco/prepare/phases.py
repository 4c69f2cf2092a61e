"""Re-sharding a prepared run for a routing phase: shards and routing files per phase.

``write_phase`` writes a phase's per-path shards and its routing file (last: it marks the phase
ready); ``discriminative_phase`` is one EM-like phase of discriminative routing (DiPaCo section
2.4.2), run by the coordinator's operator while training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dipaco.config import RunConfig
from dipaco.data.shards import TokenShard
from dipaco.errors import ConfigError, DataError
from dipaco.fileio import write_json_atomic
from dipaco.model.transformer import PathModel
from dipaco.prepare.folder import PreparedRun, Routing, phase_prefix, router_file, routing_file
from dipaco.routing.discriminative import best_paths, fit_logistic_router, score_documents
from dipaco.routing.evaluate import window_features
from dipaco.routing.kmeans import routing_stats
from dipaco.routing.routers import Router
from dipaco.routing.sharding import write_path_shards

log = logging.getLogger(__name__)

# Progress: called with a short description of each step as it starts.
Stage = Callable[[str], None]


def discriminative_phase(
    prep: PreparedRun,
    phase: int,
    load_path: Callable[[int], PathModel],
    stage: Stage = lambda s: None,
    device: str = "cpu",
) -> Routing:
    """One EM-like phase of discriminative routing (DiPaCo section 2.4.2, 7.2.1).

    Score every router document under every path (summed log-likelihood; only each document's
    top ``routing.candidates`` paths of the current router when set), label it with its best
    path, fit a K-class logistic-regression router on the prefix features with a bias that keeps
    every path's share in the balance band, and re-shard train and validation data with it.
    ``load_path(p)`` gives path p's current model; paths are loaded one at a time.
    """
    root, config = prep.root, prep.config
    if (root / routing_file(phase)).exists():
        return prep.refresh().routings[phase]
    if phase != len(prep.refresh().routings):
        raise ConfigError(f"routing phase {phase} needs phase {phase - 1} first")
    router_shard = root / "data" / "router"
    if not TokenShard.exists(router_shard) or len(TokenShard(router_shard)) == 0:
        raise DataError(
            "discriminative routing needs router documents: raise routing.router_fraction "
            "or use more data"
        )
    topology = config.build_topology()
    shard = TokenShard(router_shard)
    router_docs = shard.docs()
    router_feats = prep.features("router")
    candidates = None
    current = prep.router
    if config.routing.candidates is not None and current is not None:
        c = min(config.routing.candidates, topology.num_paths)
        candidates = current.top_paths(router_feats, c)
    stage(f"phase {phase}: scoring {len(router_docs)} router documents under each path")
    scores = score_documents(
        load_path,
        router_docs,
        topology.num_paths,
        seq_len=config.train.seq_len,
        prefix_tokens=config.routing.prefix_tokens,
        candidates=candidates,
        device=device,
    )
    labels = best_paths(scores)
    train = TokenShard(root / "data" / "train")
    train_feats = prep.features("train")
    stage(f"phase {phase}: fitting the discriminative router")
    router = fit_logistic_router(
        router_feats,
        labels,
        topology.routing_levels,
        balance=config.routing.balance,
        assign_features=train_feats,
        seed=config.train.seed,
    )
    router.save(root / router_file(phase))
    _fit_chunk_router(prep, phase, router_docs, labels, device)
    train_choice = choose_paths(router, train_feats, config.routing.overlap)
    val = TokenShard(root / "data" / "val")
    val_paths = router.assign(prep.features("val"))
    extra = {
        "router_docs": len(router_docs),
        "label_counts": np.bincount(labels, minlength=topology.num_paths).tolist(),
        "label_accuracy": float(np.mean(router.assign(router_feats) == labels)),
        "candidates": None if candidates is None else int(candidates.shape[1]),
    }
    stage(f"phase {phase}: writing shards for {topology.num_paths} paths")
    write_phase(
        root,
        config,
        phase,
        train,
        train_choice,
        val,
        val_paths,
        extra,
    )
    return prep.refresh().routings[phase]


def _fit_chunk_router(
    prep: PreparedRun,
    phase: int,
    router_docs: list[np.ndarray],
    labels: np.ndarray,
    device: str,
) -> None:
    """A learned chunk router for test-time re-routing (section 2.4.3, simplified).

    The paper fine-tunes a transformer to predict, from the chunk it reads, the path that scores
    the document best (its target over the whole sequence). Here the reader is the frozen initial
    model: every 32-token window of each router document, every 16 tokens, is a training example
    labelled with the document's best path, and a logistic regression with the same bias
    correction learns it. One router serves every re-routing interval, as in the paper.
    """
    c = prep.config
    span = c.routing.prefix_tokens
    feats, index = window_features(
        prep.initial_model().to(device),
        router_docs,
        seq_len=c.train.seq_len,
        span=span,
        stride=max(span // 2, 1),
        kind=c.routing.features,
    )
    try:
        chunk = fit_logistic_router(
            feats,
            labels[index],
            c.build_topology().routing_levels,
            balance=c.routing.balance,
            seed=c.train.seed,
        )
    except DataError as exc:  # too few windows for every path: re-routing uses the prefix router
        log.warning("phase %d: no chunk router (%s)", phase, exc)
        return
    chunk.save(prep.root / f"chunk-router-phase{phase}.json")


def choose_paths(router: Router, feats: np.ndarray, overlap: int) -> np.ndarray:
    """Training documents' paths: (N,) best, or (N, overlap) best first (overlapping shards)."""
    return router.top_paths(feats, overlap) if overlap > 1 else router.assign(feats)


def write_phase(
    root: Path,
    config: RunConfig,
    phase: int,
    train: TokenShard,
    train_choice: np.ndarray,
    val: TokenShard,
    val_paths: np.ndarray,
    extra: dict[str, Any],
) -> None:
    topology = config.build_topology()
    stats = write_path_shards(
        root / phase_prefix(phase),
        train.docs(),
        train.doc_ids,
        train_choice,
        topology.num_paths,
        train.vocab_size,
        heldout_fraction=config.data.heldout_fraction,
        seed=config.train.seed,
        min_train_tokens=config.train.seq_len + 1,
    )
    first = train_choice if train_choice.ndim == 1 else train_choice[:, 0]
    write_json_atomic(
        root / routing_file(phase),
        {
            "phase": phase,
            "method": config.routing.method if phase == 0 else "discriminative",
            "train": routing_stats(first, train.doc_lengths, topology.num_paths),
            "shards": stats,
            "val": routing_stats(val_paths, val.doc_lengths, topology.num_paths),
            "val_paths": [int(x) for x in val_paths],
            **extra,
        },
    )
