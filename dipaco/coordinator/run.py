"""Running a prepared run on one machine: the coordinator, local peers, evaluation, the baseline.

This is what ``dipaco demo`` and ``dipaco-coordinator start`` drive. Everything it keeps lives in
the run folder, so stopping at any point and starting again continues the run.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.config import RunConfig, load_config_dict
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.prepare import PreparedRun, inner_settings
from dipaco.data.shards import TokenShard, window_batches
from dipaco.errors import ConfigError
from dipaco.fileio import write_json_atomic
from dipaco.model.optim import (
    load_optimizer_state_tensors,
    make_optimizer,
    optimizer_state_tensors,
    param_names_in_optimizer_order,
    train_steps,
)
from dipaco.model.transformer import PathModel
from dipaco.peer.peer import Peer
from dipaco.protocols.transport import LocalTransport
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file
from dipaco.routing.evaluate import routed_perplexity


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
    return json.loads((prep.shards_dir / "stats.json").read_text())["train"]["tokens"]


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
        outer=OuterSettings(**c.outer.model_dump()),
        lease_seconds=c.scheduler.lease_seconds,
        policy=c.scheduler,
        codec=c.network.codec,
        **kwargs,
    )


def build_owner(
    root: str | Path,
    manifest: dict[str, Any],
    metrics: MetricsLog,
    *,
    owner_id: str,
    secret: bytes,
    clock: Callable[[], float] = time.monotonic,
) -> Coordinator:
    """A coordinator that owns modules for a run another coordinator schedules.

    ``manifest`` is the scheduler's Welcome config; the owner keeps a copy in its folder so that
    it restarts from its own checkpoint alone.
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
        secret=secret,
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


def file_info(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def evaluate_modules(prep: PreparedRun, modules: Callable[[str], dict[str, torch.Tensor]]) -> dict:
    """Routed validation perplexity of the modular model whose module tensors ``modules`` gives."""
    cfg, topology = prep.config.build_model_config(), prep.config.build_topology()
    docs = prep.val_docs()

    def load(p: int) -> PathModel:
        return topology.build_path(cfg, p, {mid: modules(mid) for mid in topology.path_modules(p)})

    return routed_perplexity(
        load,
        docs,
        prep.val_paths[: len(docs)],
        seq_len=prep.config.train.seq_len,
        prefix_tokens=prep.config.routing.prefix_tokens,
    )


def build_coordinator(
    prep: PreparedRun,
    metrics: MetricsLog,
    *,
    evaluate: bool = True,
    clock: Callable[[], float] = time.monotonic,
    owner_id: str = "local",
    secret: bytes | None = None,
) -> Coordinator:
    c = prep.config
    coordinator: Coordinator

    def on_round(rnd: int) -> None:
        result = evaluate_modules(prep, coordinator.store.params)
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
        on_round=on_round if evaluate and c.eval.every_round else None,
        metrics=metrics,
        clock=clock,
        owner_id=owner_id,
        secret=secret,
        files=run_files(prep),
    )
    coordinator.start(c.build_topology().init_modules(prep.initial_state()))
    return coordinator


def run_local_peers(
    coordinator: Coordinator,
    prep: PreparedRun,
    n_peers: int,
    *,
    stop: threading.Event,
    on_progress: Callable[[dict], None] | None = None,
) -> list[threading.Thread]:
    """Start ``n_peers`` peers in threads over the local transport; they stop when the run ends.

    Local peers share one state folder, so a path's inner optimizer state follows the path,
    whichever local peer trains it: results then do not depend on thread timing.
    """
    threads = []
    for i in range(n_peers):
        peer = Peer(
            LocalTransport(coordinator.handle),
            f"local-{i}",
            prep.root / "peers",
            stop=stop,
            on_progress=on_progress,
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
