"""Preparing a run (DESIGN.md "One round", step 1), done once by the coordinator's operator.

tokenizer -> token files -> dense pretraining -> prefix features -> router -> per-path shards.
Every step writes its outputs atomically and is skipped when they already exist, so preparing
again after an interruption continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dipaco.config import RunConfig
from dipaco.data.corpus import split_train_val
from dipaco.data.shards import ShardWriter, TokenShard, window_batches
from dipaco.data.sources import open_source
from dipaco.data.tokenizer import Tokenizer
from dipaco.errors import ConfigError, DataError
from dipaco.fileio import write_json_atomic
from dipaco.model.optim import InnerSettings, make_optimizer, train_steps
from dipaco.model.transformer import PathModel, new_dense_model
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file
from dipaco.routing.features import prefix_features
from dipaco.routing.kmeans import KMeansRouter, fit_router, routing_stats
from dipaco.routing.sharding import write_path_shards

log = logging.getLogger(__name__)

Stage = Callable[[str], None]
# Sections that may change when a run resumes: they do not change what is trained.
OPERATIONAL = {"name", "scheduler", "eval", "baseline"}


@dataclass
class PreparedRun:
    root: Path
    config: RunConfig
    tokenizer: Tokenizer
    router: KMeansRouter
    val_paths: np.ndarray

    @property
    def shards_dir(self) -> Path:
        return self.root / "shards"

    def val_docs(self) -> list[np.ndarray]:
        shard = TokenShard(self.root / "data" / "val")
        n = (
            len(shard)
            if self.config.eval.max_docs is None
            else min(len(shard), self.config.eval.max_docs)
        )
        return [shard[i] for i in range(n)]

    def initial_state(self) -> dict[str, torch.Tensor]:
        return read_tensor_file(self.root / "initial.dpt").tensors

    def initial_model(self) -> PathModel:
        model = PathModel(self.config.build_model_config())
        model.load_state_dict(self.initial_state())
        return model

    @property
    def run_id(self) -> str:
        parts = [self.config.content_hash(), self.tokenizer.sha256, self.router.sha256]
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
) -> PreparedRun:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    seed = config.train.seed
    data_dir = root / "data"
    config_file = root / "config.json"
    if config_file.exists():
        saved = json.loads(config_file.read_text())
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
    write_json_atomic(config_file, config.to_dict())

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
        stage(f"tokenizing {len(train_docs)} + {len(val_docs)} documents")
        for name, part in (
            ("val", val_docs),
            ("train", train_docs),
        ):  # train last: it marks completion
            kept = 0
            with ShardWriter(data_dir / name, tokenizer.vocab_size) as writer:
                for doc, ids in zip(
                    part, tokenizer.encode_batch([d.text for d in part]), strict=True
                ):
                    if len(ids) + 1 >= config.data.min_doc_tokens:
                        writer.add(ids + [tokenizer.eos_id], doc.doc_id)
                        kept += 1
            if kept == 0:
                raise DataError(
                    f"no {name} document has {config.data.min_doc_tokens} tokens or more"
                )
    tokenizer = Tokenizer.load(tok_path)
    train = TokenShard(data_dir / "train")

    if not (root / "initial.dpt").exists():
        steps = config.train.pretrain_steps
        stage(f"dense pretraining ({steps} steps)")
        model = new_dense_model(config.build_model_config(), seed)
        settings = inner_settings(config)
        losses = (
            train_steps(
                model,
                make_optimizer(model, settings),
                window_batches(
                    train, [seed, 1 << 20], config.train.batch_size, config.train.seq_len
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
                {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            ),
        )

    router_path = root / "router.json"
    routing_path = root / "routing.json"
    if not routing_path.exists():
        model = PathModel(config.build_model_config())
        model.load_state_dict(read_tensor_file(root / "initial.dpt").tensors)
        val = TokenShard(data_dir / "val")
        p = config.routing.prefix_tokens
        stage("prefix features and router")
        train_docs = [train[i] for i in range(len(train))]
        feats = prefix_features(model, train_docs, p)
        topology = config.build_topology()
        router = fit_router(
            feats,
            list(topology.levels),
            method=config.routing.method,
            balance=config.routing.balance,
            seed=seed,
        )
        router.save(router_path)
        stage(f"writing shards for {topology.num_paths} paths")
        train_paths = router.assign(feats)
        stats = write_path_shards(
            root / "shards",
            train_docs,
            train.doc_ids,
            train_paths,
            topology.num_paths,
            tokenizer.vocab_size,
            heldout_fraction=config.data.heldout_fraction,
            seed=seed,
            min_train_tokens=config.train.seq_len + 1,
        )
        val_paths = router.assign(prefix_features(model, [val[i] for i in range(len(val))], p))
        write_json_atomic(
            routing_path,
            {
                "train": routing_stats(train_paths, train.doc_lengths, topology.num_paths),
                "shards": stats,
                "val": routing_stats(val_paths, val.doc_lengths, topology.num_paths),
                "val_paths": [int(x) for x in val_paths],
            },
        )
    routing = json.loads(routing_path.read_text())
    return PreparedRun(
        root, config, tokenizer, KMeansRouter.load(router_path), np.array(routing["val_paths"])
    )
