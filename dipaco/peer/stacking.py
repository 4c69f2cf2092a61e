"""A path-parallel batch trained as one stacked model (``dipaco.model.stacked``).

``training.train_together`` hands a batch of set-up tasks here when the peer batches by stacking
(``Peer(batching="stacked")``, the default): their models' parameters and their optimizers'
moments are copied into one ``StackedPaths`` / ``StackedAdamW``, every inner step of every task
is one forward, backward and AdamW step, each task drawing its windows from its own data slice
at its own point of the learning-rate schedule; at the end (or when a task leaves the batch)
the parameters and moments are copied back into each task's model and optimizer, so that
``PathTrainer.finish`` takes the deltas and saves the inner state exactly as after
``training.train_interleaved``. The loop is ``training.train_stacked``. Same parameters as the sequential trainer up to float rounding
(``dipaco.model.stacked`` says why; ``tests/unit/test_stacked.py`` measures it).

Stacking needs every task's whole batch in one step (no micro-batches) and the same optimizer
settings; ``stackable`` says why a batch is not, and the trainer then interleaves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from dipaco.errors import ConfigError
from dipaco.model.optim import (
    InnerSettings,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
)
from dipaco.model.stacked import StackedAdamW, StackedPaths, stacked_step
from dipaco.model.transformer import ModelConfig

BATCHINGS = ("stacked", "streams")


def batching_of(value: str) -> str:
    """``value`` if it names a way to train a path-parallel batch, else a ``ConfigError``."""
    if value not in BATCHINGS:
        raise ConfigError(f"batching must be one of {', '.join(BATCHINGS)}, not {value!r}")
    return value


class Stackable(Protocol):
    """What a stack needs of a task (``training.TaskRun`` has it)."""

    task: Any  # its ``step_offset`` places the task's steps on the lr schedule
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    names: list[str]
    settings: InnerSettings
    batches: Iterator[torch.Tensor]
    step: int


def stackable(runs: Sequence[Stackable], micro_batch: int, batch_size: int) -> str | None:
    """Why ``runs`` cannot train as one stacked model, or None if they can."""
    if micro_batch < batch_size:
        return f"micro-batches of {micro_batch} (the device's memory)"
    first = runs[0].settings
    for run in runs[1:]:
        s = run.settings
        if (s.weight_decay, s.grad_clip, s.betas) != (
            first.weight_decay,
            first.grad_clip,
            first.betas,
        ):
            return "tasks with different optimizer settings"
    return None


class Stack:
    """The tasks ``runs`` copied into one stacked model and optimizer on ``device``, with the
    peer's training ``features`` (``compile``, ``autocast``)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        device: str,
        features: dict[str, Any],
        runs: Sequence[Stackable],
    ) -> None:
        self.runs, self.autocast = runs, features.get("autocast")
        self.paths = StackedPaths(
            model_cfg,
            [{k: v.detach() for k, v in run.model.state_dict().items()} for run in runs],
            device,
            compile=bool(features.get("compile")),
        )
        self.optimizer = StackedAdamW(self.paths, runs[0].settings)
        for i, run in enumerate(runs):
            state = optimizer_state_tensors(run.optimizer, run.names)
            self.optimizer.load_path(i, state, run.names)

    def step(self) -> torch.Tensor:
        """One inner step of every task; their losses (P,), not read."""
        batch = torch.stack([next(run.batches) for run in self.runs])
        lrs = [run.settings.lr_at(run.task.step_offset + run.step) for run in self.runs]
        return stacked_step(self.paths, self.optimizer, batch, lrs, self.autocast)

    @torch.no_grad()
    def write_back(self) -> None:
        """Each task's parameters and moments into its own model and optimizer."""
        for i, run in enumerate(self.runs):
            params = dict(run.model.named_parameters())
            for name, p in params.items():
                p.copy_(self.paths.view(name)[i])
            load_optimizer_state_tensors(
                run.optimizer, run.names, self.optimizer.path_state(i, run.names)
            )
