"""Preparing a run (DESIGN.md "One round", step 1), done once by the coordinator's operator.

tokenizer -> token files -> dense pretraining -> prefix features -> router -> per-path shards.
Every step writes its outputs atomically and is skipped when they already exist, so preparing
again after an interruption continues where it stopped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.config import RunConfig, load_config_dict
from dipaco.data.corpus import split_train_val
from dipaco.data.shards import ShardWriter, TokenShard, window_batches
from dipaco.data.sources import open_source
from dipaco.data.tokenizer import Tokenizer
from dipaco.errors import ConfigError, CorruptFileError, DataError
from dipaco.fileio import write_atomic, write_json_atomic
from dipaco.model.optim import InnerSettings, make_optimizer, train_steps
from dipaco.model.transformer import PathModel, new_dense_model
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file
from dipaco.routing.discriminative import best_paths, fit_logistic_router, score_documents
from dipaco.routing.evaluate import window_features
from dipaco.routing.features import prefix_features
from dipaco.routing.kmeans import fit_router, routing_stats
from dipaco.routing.routers import Router, load_router
from dipaco.routing.sharding import write_path_shards

log = logging.getLogger(__name__)

Stage = Callable[[str], None]
# Sections that may change when a run resumes: they do not change what is trained.
OPERATIONAL = {"name", "scheduler", "eval", "security", "flower", "baseline"}


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
        shard = TokenShard(self.root / routing.prefix / f"P{path}" / "heldout")
        return shard.docs()

    def initial_state(self) -> dict[str, torch.Tensor]:
        return read_tensor_file(self.root / "initial.dpt").tensors

    def initial_model(self) -> PathModel:
        model = PathModel(self.config.build_model_config())
        model.load_state_dict(self.initial_state())
        return model

    def features(self, part: str) -> np.ndarray:
        """Prefix features of ``data/<part>`` under the initial model, computed once and kept."""
        return _features(self.root, self.config, part)

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


def inner_settings(config: RunConfig) -> InnerSettings:
    t = config.train
    return InnerSettings(
        lr=t.lr,
        warmup_steps=t.warmup_steps,
        total_steps=config.total_steps,
        min_lr_ratio=t.min_lr_ratio,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
    )


def prepare(
    root: str | Path,
    config: RunConfig,
    stage: Stage = lambda s: None,
    on_step: Callable[[int, float], None] | None = None,
    reuse: str | Path | None = None,
    device: str = "cpu",
) -> PreparedRun:
    """Prepare (or finish preparing) the run folder ``root``.

    ``reuse`` names another prepared run folder: its tokenizer and token files are linked in when
    both runs read the same data, and its pretrained model too when they also pretrain alike
    (benchmarks compare many models that start from one pretraining). ``device`` runs the
    dense pretraining and the prefix features.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    seed = config.train.seed
    data_dir = root / "data"
    config_file = root / "config.json"
    if config_file.exists():
        # Read through today's schema: a setting added since the run began has its default.
        saved = load_config_dict(
            json.loads(config_file.read_text()), origin=str(config_file)
        ).to_dict()
        changed = sorted(
            k
            for k in set(saved) | set(config.to_dict())
            if k not in OPERATIONAL and saved.get(k) != config.to_dict().get(k)
        )
        if changed:
            raise ConfigError(
                f"{root} holds a run whose {', '.join(changed)} settings differ from this config; "
                f"resume it with the same settings, or start a new run folder (or pass --fresh)"
            )
    else:
        # A new run: its id differs from any other folder's prepared from the same config (two
        # runs announced under one id would collide in the DHT); copies of the folder keep it.
        write_atomic(root / "run_nonce", (secrets.token_hex(8) + "\n").encode())
    write_json_atomic(config_file, config.to_dict())
    if reuse is not None:
        _reuse(Path(reuse), root, config)

    tok_path = root / "tokenizer.model"
    if not (TokenShard.exists(data_dir / "train") and TokenShard.exists(data_dir / "val")):
        stage("reading documents")
        docs = list(open_source(config.data.source, field=config.data.text_field))
        if config.data.max_docs is not None and len(docs) > config.data.max_docs:
            step = len(docs) / config.data.max_docs
            docs = [docs[int(i * step)] for i in range(config.data.max_docs)]
        train_docs, val_docs = split_train_val(docs, config.data.val_fraction, seed)
        if not train_docs or not val_docs:
            raise DataError(
                f"data.source {config.data.source!r} gave {len(docs)} documents: too few to split"
            )
        if not tok_path.exists():
            stage(f"training the tokenizer (vocab {config.model.vocab_size})")
            Tokenizer.train(
                (d.text for d in train_docs),
                tok_path,
                config.model.vocab_size,
                sample_chars=config.data.tokenizer_sample_chars,
                seed=seed,
            )
        tokenizer = Tokenizer.load(tok_path)
        # The router documents (section 7.2.1's "router data") are held out of training.
        router_docs = [
            d for d in train_docs if is_router_doc(d.doc_id, config.routing.router_fraction, seed)
        ]
        train_docs = [
            d
            for d in train_docs
            if not is_router_doc(d.doc_id, config.routing.router_fraction, seed)
        ]
        stage(f"tokenizing {len(train_docs)} + {len(val_docs)} + {len(router_docs)} documents")
        parts = [("val", val_docs), ("router", router_docs), ("train", train_docs)]
        for name, part in parts:  # train last: it marks completion
            kept = 0
            with ShardWriter(data_dir / name, tokenizer.vocab_size) as writer:
                for doc, ids in zip(
                    part, tokenizer.encode_batch([d.text for d in part]), strict=True
                ):
                    if len(ids) + 1 >= config.data.min_doc_tokens:
                        writer.add(ids + [tokenizer.eos_id], doc.doc_id)
                        kept += 1
            if kept == 0 and name != "router":
                raise DataError(
                    f"no {name} document has {config.data.min_doc_tokens} tokens or more"
                )
    tokenizer = Tokenizer.load(tok_path)
    train = TokenShard(data_dir / "train")

    if not (root / "initial.dpt").exists():
        steps = config.train.pretrain_steps
        stage(f"dense pretraining ({steps} steps)")
        model = new_dense_model(config.build_model_config(), seed).to(device)
        settings = inner_settings(config)
        losses = (
            train_steps(
                model,
                make_optimizer(model, settings),
                window_batches(
                    train, [seed, 1 << 20], config.train.batch_size, config.train.seq_len, device
                ),
                settings,
                steps=steps,
                step_offset=0,
                on_step=on_step,
            )
            if steps
            else []
        )
        write_tensor_file(
            root / "initial.dpt",
            Frame(
                "DenseModel",
                {"steps": steps, "losses": losses},
                {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
            ),
        )

    if not (root / _routing_file(0)).exists():
        topology = config.build_topology()
        val = TokenShard(data_dir / "val")
        n = config.routing.overlap
        router: Router | None = None
        if config.routing.method == "iid":
            stage(f"spreading documents over {topology.num_paths} i.i.d. shards")
            train_choice = _hash_paths(train.doc_ids, topology.num_paths, n, seed)
            val_paths = _hash_paths(val.doc_ids, topology.num_paths, 1, seed)[:, 0]
        else:
            stage("prefix features and router")
            feats = _features(root, config, "train", device)
            router = fit_router(
                feats,
                topology.routing_levels,
                method=config.routing.method,
                balance=config.routing.balance,
                seed=seed,
            )
            router.save(root / _router_file(0))
            train_choice = _train_choice(router, feats, n)
            val_paths = router.assign(_features(root, config, "val", device))
        stage(f"writing shards for {topology.num_paths} paths")
        _write_phase(root, config, 0, train, train_choice, val, val_paths, {})
    return PreparedRun(root, config, tokenizer, load_routings(root))


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
    if (root / _routing_file(phase)).exists():
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
    router.save(root / _router_file(phase))
    _fit_chunk_router(prep, phase, router_docs, labels, device)
    train_choice = _train_choice(router, train_feats, config.routing.overlap)
    val = TokenShard(root / "data" / "val")
    val_paths = router.assign(prep.features("val"))
    extra = {
        "router_docs": len(router_docs),
        "label_counts": np.bincount(labels, minlength=topology.num_paths).tolist(),
        "label_accuracy": float(np.mean(router.assign(router_feats) == labels)),
        "candidates": None if candidates is None else int(candidates.shape[1]),
    }
    stage(f"phase {phase}: writing shards for {topology.num_paths} paths")
    _write_phase(
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


def _train_choice(router: Router, feats: np.ndarray, overlap: int) -> np.ndarray:
    """Training documents' paths: (N,) best, or (N, overlap) best first (overlapping shards)."""
    return router.top_paths(feats, overlap) if overlap > 1 else router.assign(feats)


def is_router_doc(doc_id: str, fraction: float, seed: int) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{seed}:router:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def phase_prefix(phase: int) -> str:
    return "shards" if phase == 0 else f"shards/phase{phase}"


def _routing_file(phase: int) -> str:
    return "routing.json" if phase == 0 else f"routing-phase{phase}.json"


def _router_file(phase: int) -> str:
    return "router.json" if phase == 0 else f"router-phase{phase}.json"


def load_routings(root: Path) -> list[Routing]:
    """Every routing phase that is ready in ``root`` (its routing file, written last, marks it)."""
    out = []
    phase = 0
    while (root / _routing_file(phase)).exists():
        info = json.loads((root / _routing_file(phase)).read_text())
        router_path = root / _router_file(phase)
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


def _write_phase(
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
        root / _routing_file(phase),
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


def _hash_paths(doc_ids: list[str], num_paths: int, n: int, seed: int) -> np.ndarray:
    """I.i.d. shards: each document's paths from a hash of its id, (N, n)."""
    first = np.array(
        [
            int.from_bytes(hashlib.sha256(f"{seed}:iid:{d}".encode()).digest()[:8], "little")
            % num_paths
            for d in doc_ids
        ],
        dtype=np.int64,
    )
    return (first[:, None] + np.arange(n)[None, :]) % num_paths


def _features(root: Path, config: RunConfig, part: str, device: str = "cpu") -> np.ndarray:
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
        model, shard.docs(), config.routing.prefix_tokens, kind=config.routing.features
    )
    buffer = io.BytesIO()
    np.save(buffer, feats, allow_pickle=False)
    write_atomic(path, buffer.getvalue())
    return feats


def _data_key(c: RunConfig) -> dict[str, Any]:
    return {
        "data": c.data.model_dump(),
        "vocab": c.model.vocab_size,
        "seed": c.train.seed,
        "router_fraction": c.routing.router_fraction,
    }


def _pretrain_key(c: RunConfig) -> dict[str, Any]:
    return {
        **_data_key(c),
        "model": c.model.model_dump(),
        "train": c.train.model_dump(),
        "total_steps": c.total_steps,
        "prefix": c.routing.prefix_tokens,
    }


def _reuse(base: Path, root: Path, config: RunConfig) -> None:
    """Link another prepared run's tokenizer, token files, pretrained model and features."""
    if base.resolve() == root.resolve() or not (base / "config.json").exists():
        return
    other = load_config_dict(json.loads((base / "config.json").read_text()), str(base))
    names: list[str] = []
    if _data_key(other) == _data_key(config):
        names += ["tokenizer.model"]
        names += [
            f"data/{part}{suffix}"
            for part in ("train", "val", "router")
            for suffix in (".tokens", ".index.npy", ".json")
        ]
    if _pretrain_key(other) == _pretrain_key(config):
        names += ["initial.dpt"]
        if other.routing.features == config.routing.features:
            names += [f"features/{part}.npy" for part in ("train", "val", "router")]
    for name in names:
        src, dest = base / name, root / name
        if src.exists() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copyfile(src, dest)
