"""Preparing a run (docs/design.md, "One round, end to end", step 1), done once by the
coordinator's operator.

tokenizer -> token files -> dense pretraining -> prefix features -> router -> per-path shards.
Every step writes its outputs atomically and is skipped when they already exist, so preparing
again after an interruption continues where it stopped.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dipaco.config import RunConfig, read_run_config
from dipaco.data.corpus import split_train_val
from dipaco.data.shards import ShardWriter, TokenShard, window_batches
from dipaco.data.sources import open_source
from dipaco.data.tokenizer import Tokenizer
from dipaco.errors import ConfigError, DataError
from dipaco.fileio import write_atomic, write_json_atomic
from dipaco.model.optim import InnerSettings, make_optimizer, train_steps
from dipaco.model.transformer import new_dense_model
from dipaco.prepare.folder import (
    PreparedRun,
    cached_features,
    load_routings,
    router_file,
    routing_file,
)
from dipaco.prepare.phases import Stage, choose_paths, write_phase
from dipaco.protocols.wire import Frame, write_tensor_file
from dipaco.routing.kmeans import fit_router
from dipaco.routing.routers import Router

# Sections that may change when a run resumes: they do not change what is trained (validation:
# how a coordinator judges the deltas it is sent, which it may tighten or loosen on a restart,
# as it may who may join).
OPERATIONAL = {"name", "scheduler", "eval", "security", "flower", "baseline", "validation"}


def inner_settings(config: RunConfig) -> InnerSettings:
    return InnerSettings.of_train(config.train.model_dump(), config.total_steps)


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
        saved = read_run_config(root).to_dict()
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
                byte_fallback=config.data.byte_fallback,
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

    if not (root / routing_file(0)).exists():
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
            feats = cached_features(root, config, "train", device)
            router = fit_router(
                feats,
                topology.routing_levels,
                method=config.routing.method,
                balance=config.routing.balance,
                seed=seed,
            )
            router.save(root / router_file(0))
            # The balanced assignment the router was fitted with: it spreads documents that
            # share their features (a common opening) where the router alone cannot.
            train_choice = (
                router.fit_choice
                if n == 1 and router.fit_choice is not None
                else choose_paths(router, feats, n)
            )
            val_paths = router.assign(cached_features(root, config, "val", device))
        stage(f"writing shards for {topology.num_paths} paths")
        write_phase(root, config, 0, train, train_choice, val, val_paths, {})
    return PreparedRun(root, config, tokenizer, load_routings(root))


def is_router_doc(doc_id: str, fraction: float, seed: int) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{seed}:router:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


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


def _routing_key(c: RunConfig) -> dict[str, Any]:
    return {
        **_pretrain_key(c),
        "topology": c.topology.model_dump(),
        "routing": c.routing.model_dump(),
    }


def _reuse(base: Path, root: Path, config: RunConfig) -> None:
    """Link another prepared run's tokenizer, token files, pretrained model, features, and
    its first routing phase (router and shards) when it routes alike."""
    if base.resolve() == root.resolve() or not (base / "config.json").exists():
        return
    other = read_run_config(base)
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
        if (other.routing.features, other.routing.skip_openings) == (
            config.routing.features,
            config.routing.skip_openings,
        ):
            names += [f"features/{part}.npy" for part in ("train", "val", "router")]
            names += ["openings.json"]
        # The same topology and routing too (runs that differ in their outer step alone): the
        # router and the shards, the routing file last (it marks the phase ready).
        if _routing_key(other) == _routing_key(config) and (base / routing_file(0)).exists():
            topology = config.build_topology()
            names += [router_file(0), "shards/stats.json"]
            names += [
                f"shards/P{p}/{part}{suffix}"
                for p in range(topology.num_paths)
                for part in ("train", "heldout")
                for suffix in (".tokens", ".index.npy", ".json")
            ]
            names += [routing_file(0)]
    for name in names:
        src, dest = base / name, root / name
        if src.exists() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dest)
            except OSError:
                shutil.copyfile(src, dest)
