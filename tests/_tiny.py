"""A tiny coordinator and the deltas its tests send: one builder for every test that needs one.

Importable from every test folder (pytest puts ``tests/``, the folder of the root conftest, on
``sys.path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.protocols import messages as m

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
TOPO = Topology.parse("2x2", 2)


def initial_modules(topology: Topology = TOPO) -> dict[str, dict[str, torch.Tensor]]:
    return topology.init_modules(new_dense_model(CFG, 0).state_dict())


def tiny_coordinator(
    root: str | Path, topology: Topology = TOPO, *, start: bool = True, **overrides: Any
) -> Coordinator:
    """A scheduler over ``topology`` (2 rounds of 5 inner steps unless ``overrides`` say
    otherwise), started from the tiny model's modules unless ``start`` is False."""
    settings: dict[str, Any] = {
        "rounds": 2,
        "inner_steps": 5,
        "step_offset": 0,
        "total_steps": 100,
        "seed": 0,
        "outer": OuterSettings(),
        "lease_seconds": 30.0,
        "run_id": "test",
        "peer_config": {},
    }
    co = Coordinator(root, topology, **{**settings, **overrides})
    if start:
        co.start(initial_modules(topology))
    return co


def delta_message(
    task: m.TaskOffer, peer_id: str, delta: dict[str, torch.Tensor], **override: Any
) -> m.SubmitDelta:
    """The SubmitDelta a peer sends for ``task`` (100 tokens, the task's ticket); ``override``
    sets any field afterwards."""
    msg = m.SubmitDelta(
        peer_id=peer_id,
        task_id=task.task_id,
        path=task.path,
        base_versions=task.module_versions,
        tokens=100,
        losses=[1.0],
        tensors=delta,
        ticket=task.ticket,
    )
    for k, v in override.items():
        setattr(msg, k, v)
    return msg


def constant_delta(
    co: Coordinator, task: m.TaskOffer, scale: float = 0.01, topology: Topology = TOPO
) -> dict[str, torch.Tensor]:
    """A delta of ``scale`` everywhere, for every module of the task's path."""
    return {
        f"{mid}/{k}": torch.full_like(v, scale)
        for mid in topology.path_modules(task.path)
        for k, v in co.store.params(mid).items()
    }
