"""DiLoCo at equal compute: the baseline a DiPaCo run must beat, trained beside it.

DiPaCo with P paths trains P workers' worth of tokens. DiLoCo-P trains one dense model of a
path's size on the same P workers (i.i.d. shards of the same training documents, the same inner
steps, Nesterov outer step lr 0.7 / momentum 0.9, no rescale): the same compute and the same
communication, without the modularity. ``dipaco demo`` trains it after DiPaCo so that its table
shows the honest comparison (docs/results.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from dipaco.config import RunConfig, load_config_dict
from dipaco.coordinator.prepare import PreparedRun, prepare
from dipaco.coordinator.run import MetricsLog, build_coordinator, evaluate_modules, run_local_peers
from dipaco.errors import DipacoError

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
        stop = threading.Event()
        threads = run_local_peers(coordinator, sub, n_peers, stop=stop, device=device)
        try:
            while not coordinator.finished_event.wait(0.5):
                if not any(t.is_alive() for t in threads):
                    raise DipacoError(f"DiLoCo-{replicas}: every local peer stopped early")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
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
