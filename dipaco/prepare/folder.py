"""A prepared run folder read back: its config, tokenizer, routing phases and cached features.

``prepare`` (``dipaco.prepare.pipeline``) writes the folder; ``PreparedRun`` is how everything
else reads it: the routing phases that are ready (each marked by its routing file, written last),
the validation and held-out documents, the pretrained initial model and the prefix features.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.config import RunConfig
from dipaco.data.shards import TokenShard, shard_name
from dipaco.data.tokenizer import Tokenizer
from dipaco.errors import ConfigError, CorruptFileError
from dipaco.fileio import write_atomic, write_json_atomic
from dipaco.model.transformer import PathModel
from dipaco.protocols.wire import read_tensor_file
from dipaco.routing.features import Openings, prefix_features, shared_openings, skip_opening
from dipaco.routing.routers import Router, load_router


@dataclass
class Routing:
    """One routing phase: its router, where its shards live, and the validation routes."""

    phase: int
    method: str
    router: Router | None  # None for i.i.d. shards
    val_paths: np.ndarray
    prefix: str  # shard folder relative to the run folder: "shards", "shards/phase1", ...
    stats: dict[str, Any]
    chunk_router: Router | None = None  # a discriminative phase's learned chunk router


@dataclass
class PreparedRun:
    root: Path
    config: RunConfig
    tokenizer: Tokenizer
    routings: list[Routing]

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    @property
    def routing(self) -> Routing:
        """The latest routing phase that is ready."""
        return self.routings[-1]

    @property
    def router(self) -> Router | None:
        return self.routing.router

    @property
    def val_paths(self) -> np.ndarray:
        return self.routing.val_paths

    @property
    def openings(self) -> Openings | None:
        """The shared openings a route skips (``routing.skip_openings``), or None."""
        return openings_of(self.root, self.config)

    def refresh(self) -> PreparedRun:
        """Pick up routing phases written since this object was made."""
        self.routings = load_routings(self.root)
        return self

    def val_index(self) -> np.ndarray:
        """Which validation documents are evaluated: all, or ``eval.max_docs`` of them spread
        evenly over the set (its first ones would be one source of a corpus sorted by source)."""
        total = len(TokenShard(self.root / "data" / "val"))
        n = total if self.config.eval.max_docs is None else min(total, self.config.eval.max_docs)
        return np.arange(n, dtype=np.int64) * total // max(n, 1)

    def val_docs(self) -> list[np.ndarray]:
        shard = TokenShard(self.root / "data" / "val")
        return [shard[int(i)] for i in self.val_index()]

    def val_routes(self) -> np.ndarray:
        """The path each of :meth:`val_docs` is routed to (the latest routing phase)."""
        return np.asarray(self.val_paths)[self.val_index()]

    def heldout_docs(self, path: int, phase: int | None = None) -> list[np.ndarray]:
        """Path ``path``'s held-out slice in a routing phase (the latest by default)."""
        routing = self.routing if phase is None else self.routings[phase]
        shard = TokenShard(self.root / shard_name(path, "heldout", routing.prefix))
        return shard.docs()

    def initial_state(self) -> dict[str, torch.Tensor]:
        return read_tensor_file(self.root / "initial.dpt").tensors

    def initial_model(self) -> PathModel:
        model = PathModel(self.config.build_model_config())
        model.load_state_dict(self.initial_state())
        return model

    def features(self, part: str) -> np.ndarray:
        """Prefix features of ``data/<part>`` under the initial model, computed once and kept."""
        return cached_features(self.root, self.config, part)

    @property
    def run_id(self) -> str:
        first = self.routings[0].router
        parts = [
            self.config.content_hash(),
            self.tokenizer.sha256,
            first.sha256 if first is not None else "iid",
        ]
        nonce = self.root / "run_nonce"
        if nonce.exists():  # folders prepared before the nonce existed keep their id
            parts.append(nonce.read_text().strip())
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def phase_prefix(phase: int) -> str:
    return "shards" if phase == 0 else f"shards/phase{phase}"


def routing_file(phase: int) -> str:
    return "routing.json" if phase == 0 else f"routing-phase{phase}.json"


def router_file(phase: int) -> str:
    return "router.json" if phase == 0 else f"router-phase{phase}.json"


def load_routings(root: Path) -> list[Routing]:
    """Every routing phase that is ready in ``root`` (its routing file, written last, marks it)."""
    out = []
    phase = 0
    while (root / routing_file(phase)).exists():
        info = json.loads((root / routing_file(phase)).read_text())
        router_path = root / router_file(phase)
        router = load_router(router_path) if info.get("method") != "iid" else None
        chunk_path = root / f"chunk-router-phase{phase}.json"
        out.append(
            Routing(
                phase,
                info.get("method", "kmeans"),
                router,
                np.array(info["val_paths"], dtype=np.int64),
                phase_prefix(phase),
                info,
                load_router(chunk_path) if chunk_path.exists() else None,
            )
        )
        phase += 1
    if not out:
        raise ConfigError(f"{root} is not a prepared run (no routing.json)")
    return out


def cached_features(root: Path, config: RunConfig, part: str, device: str = "cpu") -> np.ndarray:
    path = root / "features" / f"{part}.npy"
    if path.exists():
        try:
            return np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise CorruptFileError(f"{path}: unreadable features: {exc}") from None
    model = PathModel(config.build_model_config())
    model.load_state_dict(read_tensor_file(root / "initial.dpt").tensors)
    model.to(device)
    shard = TokenShard(root / "data" / part)
    feats = prefix_features(
        model,
        shard.docs(),
        config.routing.prefix_tokens,
        kind=config.routing.features,
        openings=openings_of(root, config),
    )
    buffer = io.BytesIO()
    np.save(buffer, feats, allow_pickle=False)
    write_atomic(path, buffer.getvalue())
    return feats


def openings_of(root: Path, config: RunConfig) -> Openings | None:
    """The shared openings a run's routes skip (``routing.skip_openings``): found in the training
    documents on first use and kept in ``openings.json``; None when the setting is off."""
    share = config.routing.skip_openings
    if share <= 0:
        return None
    path = root / "openings.json"
    if path.exists():
        try:
            saved = json.loads(path.read_text())
            return [set(level) for level in saved["blocks"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFileError(f"{path}: unreadable openings: {exc}") from None
    train = TokenShard(root / "data" / "train")
    docs = train.docs()
    min_docs = max(2, math.ceil(share * len(docs)))
    levels = shared_openings(docs, config.routing.prefix_tokens, min_docs)
    skipped = sum(
        1 for d in docs if len(skip_opening(d, config.routing.prefix_tokens, levels)) < len(d)
    )
    write_json_atomic(
        path,
        {
            "prefix_tokens": config.routing.prefix_tokens,
            "min_docs": min_docs,
            "documents_skipping": skipped,
            "documents": len(docs),
            "blocks": [sorted(level) for level in levels],
        },
    )
    return levels
