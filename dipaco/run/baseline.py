"""The baselines a DiPaCo run is compared with: the dense model, and DiLoCo at equal compute.

The dense baseline is one model of a path's size trained on all data for as many steps as one
path. DiPaCo with P paths trains P workers' worth of tokens: DiLoCo-P trains one dense model of a
path's size on the same P workers (i.i.d. shards of the same training documents, the same inner
steps, Nesterov outer step lr 0.7 / momentum 0.9, no rescale): the same compute and the same
communication, without the modularity. ``dipaco demo`` trains both after DiPaCo so that its
table shows the honest comparison (docs/results.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dipaco.config import RunConfig, load_config_dict
from dipaco.data.shards import TokenShard, window_batches
from dipaco.errors import DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.model.optim import (
    load_training_state,
    make_optimizer,
    param_names_in_optimizer_order,
    train_steps,
    training_state,
)
from dipaco.prepare.folder import PreparedRun
from dipaco.prepare.pipeline import inner_settings, prepare
from dipaco.protocols.wire import Frame, read_tensor_file, write_tensor_file
from dipaco.routing.evaluate import routed_perplexity
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.local import LocalRun
from dipaco.run.metrics_log import MetricsLog


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
        load_training_state(model, optimizer, names, frame.tensors)
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
        tensors = training_state(model, optimizer, names)
        write_tensor_file(state_file, Frame("BaselineState", {"chunk": chunk}, tensors))
    if result is None:  # resumed after the last chunk was checkpointed
        result = evaluate()
    summary = {"ppl": result["ppl"], "loss": result["loss"]}
    write_json_atomic(final, summary)
    return summary


# DiLoCo's outer step (its paper's Table 5): Nesterov, lr 0.7, momentum 0.9, no rescale.
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True, "rescale": "none"}


def diloco_config(c: RunConfig, replicas: int) -> RunConfig:
    """DiLoCo-``replicas`` with everything else of ``c``: model, data, schedule, evaluation."""
    data = c.to_dict()
    data["name"] = f"{c.name}-diloco{replicas}"
    data["baseline"] = False
    data["topology"] = {**data["topology"], "levels": "1", "replicas": replicas}
    data["routing"] = {
        **data["routing"],
        "method": "iid",
        "discriminative_after": [],
        "discriminative_plateau": 0.0,
    }
    data["outer"] = {**data["outer"], **DILOCO_OUTER, "warmup_rounds": 0}
    data["eval"] = {**data["eval"], "early_stopping": False, "reroute_windows": []}
    return load_config_dict(data, origin=f"DiLoCo-{replicas} of {c.name}")


def train_diloco(
    prep: PreparedRun,
    replicas: int,
    *,
    n_peers: int = 1,
    on_event: Callable[[dict], None] | None = None,
    device: str = "cpu",
) -> dict:
    """Train DiLoCo-``replicas`` in ``<run>/diloco<replicas>`` (resumable) and evaluate it.

    The folder shares the run's tokenizer, token files and dense pretraining (hard links), so
    both start from the same model. Returns ``{"ppl", "loss", "tokens", "config"}``.
    """
    root = Path(prep.root) / f"diloco{replicas}"
    config = diloco_config(prep.config, replicas)
    sub = prepare(root, config, reuse=prep.root, device=device)
    metrics = MetricsLog(root / "metrics.jsonl")
    if on_event is not None:
        metrics.listeners.append(on_event)
    coordinator = build_coordinator(sub, metrics, device=device)
    if not coordinator.finished_event.is_set():
        with LocalRun(coordinator, sub, n_peers, device=device) as local:
            local.wait(f"DiLoCo-{replicas}: every local peer stopped early")
    if coordinator.failure:
        raise DipacoError(coordinator.failure)
    result = evaluate_modules(sub, coordinator.store.params, device=device)
    c = config
    tokens = (
        c.train.batch_size
        * c.train.seq_len
        * (c.train.pretrain_steps + replicas * c.train.rounds * c.train.inner_steps)
    )
    return {"ppl": result["ppl"], "loss": result["loss"], "tokens": tokens, "config": config}
