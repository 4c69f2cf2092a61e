"""The inner optimizer: AdamW with linear warmup and cosine decay, gradient clipping.

DiLoCo / DiPaCo inner loop (DiPaCo Algorithm 1, lines 5-9): each path trains alone for H steps.
The learning-rate schedule is global over a path's whole run (``step_offset`` places a task's H
steps on it), so a task's steps are a pure function of its inputs: the same task trained twice
gives the same parameters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class InnerSettings:
    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)

    @classmethod
    def of_train(cls, train: Mapping[str, Any], total_steps: int) -> InnerSettings:
        """The settings of a run config's ``train`` section (a dict, as run manifests carry it)."""
        keys = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip")
        return cls(total_steps=total_steps, **{k: train[k] for k in keys})

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@functools.cache
def fused_adamw_available(device: str) -> bool:
    """Whether this torch has the fused AdamW kernel (one pass per parameter) for ``device``."""
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        torch.optim.AdamW([probe], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def make_optimizer(model: nn.Module, s: InnerSettings) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-D tensors), as usual for Llama-style models.

    The fused kernel where this torch has it for the parameters' device (CPU and CUDA;
    ``bench/peer_throughput.py`` prints its step time against the foreach kernels'), else the
    foreach kernels.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": s.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    device = str(next(model.parameters()).device)
    if fused_adamw_available(device):
        return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=True)
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, foreach=True)


def lm_loss(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of windows (B, T+1).

    ``autocast`` (e.g. ``torch.bfloat16`` on a GPU) runs the forward pass in that precision;
    the loss itself is taken in float32.
    """
    if autocast is None:
        logits = model(tokens[:, :-1])
    else:
        with torch.autocast(tokens.device.type, dtype=autocast):
            logits = model(tokens[:, :-1])
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    settings: InnerSettings,
    *,
    step: int,
    micro_batch: int | None = None,
    autocast: torch.dtype | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One optimizer step on ``batch`` at global step ``step`` of the lr schedule.

    Sets the step's learning rate, zeroes the gradients, runs the forward and backward passes
    (or accumulates ``micro_batch``-sized chunks, see :func:`train_steps`), clips and steps.
    Returns the batch's mean loss as a detached 0-dim float32 tensor, *not read*: nothing here
    waits for the device, so steps of several models issued on their own CUDA streams can run
    at once (``loss.item()`` when the value is wanted). ``model`` must be in training mode.
    """
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    lr = settings.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # Not ``forward or model``: a compiled module (torch.compile's OptimizedModule) has no truth
    # value; its ``__len__`` raises.
    fwd = model if forward is None else forward
    if micro_batch is None or micro_batch >= batch.shape[0]:
        loss = lm_loss(fwd, batch, autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
    else:
        optimizer.zero_grad(set_to_none=True)
        loss = _accumulate_gradients(fwd, batch, micro_batch, autocast)
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    optimizer.step()
    # The gradients go now, not at the next step: a path-size buffer that the next forward,
    # and between tasks the deltas and the push, would hold for nothing.
    optimizer.zero_grad(set_to_none=True)
    return loss


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[torch.Tensor],
    settings: InnerSettings,
    *,
    steps: int,
    step_offset: int,
    on_step: Callable[[int, float], None] | None = None,
    micro_batch: int | None = None,
    autocast: torch.dtype | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """Run ``steps`` optimizer steps (:func:`train_step` each); returns the training loss of each.

    ``autocast`` is the forward pass's precision (None: the parameters' own), ``forward`` a
    compiled form of ``model`` (``torch.compile``) to call instead of it; the parameters, the
    clip and the optimizer are ``model``'s either way.

    With ``micro_batch`` smaller than a batch, the batch is split into chunks of at most
    ``micro_batch`` windows whose gradients accumulate before the single clip and step (gradient
    accumulation): the update equals the full-batch one up to float rounding, and the loss
    returned is still the full-batch mean.
    """
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    model.train()
    losses = []
    for i in range(steps):
        loss = train_step(
            model,
            optimizer,
            next(batches),
            settings,
            step=step_offset + i,
            micro_batch=micro_batch,
            autocast=autocast,
            forward=forward,
        )
        losses.append(loss.item())
        if on_step is not None:
            on_step(step_offset + i, losses[-1])
    return losses


def _accumulate_gradients(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    micro_batch: int,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """Backpropagate ``batch`` in chunks of at most ``micro_batch`` rows; returns the mean loss
    (a 0-dim float32 tensor, not read).

    Each chunk's mean loss is weighted by its share of the rows, so the accumulated gradient is
    the gradient of the full-batch mean (every window has the same length).
    """
    rows = batch.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=batch.device)
    for chunk in batch.split(micro_batch, dim=0):
        scaled = lm_loss(model, chunk, autocast) * (chunk.shape[0] / rows)
        scaled.backward()
        total += scaled.detach().float()
    return total


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> dict[str, torch.Tensor]:
    """AdamW state as named tensors (``exp_avg/<param>``, ...), for a pickle-free file."""
    out: dict[str, torch.Tensor] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for name, p in zip(names, params, strict=True):
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{key}/{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_state_tensors(
    optimizer: torch.optim.Optimizer,
    names: list[str],
    tensors: dict[str, torch.Tensor],
    own: bool = False,
) -> None:
    """AdamW state from named tensors (:func:`optimizer_state_tensors`). ``own``: the tensors
    are the caller's to give (a file's, read or mapped private), and are used as they are
    where they are on the parameter's device, not copied: a path's AdamW state is twice its
    weights."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_name: dict[str, dict[str, torch.Tensor]] = {}  # one pass: a state file holds every name
    for key, t in tensors.items():
        kind, name = key.split("/", 1)
        by_name.setdefault(name, {})[kind] = t
    for name, p in zip(names, params, strict=True):
        state = by_name.get(name, {})
        if state:
            # Moments live with the parameter. The step counter: on the CPU for the foreach
            # kernels, on the parameter's device in float32 for the fused (and capturable) ones.
            on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
            optimizer.state[p] = {
                k: (v if own and v.device == p.device else v.clone().to(p.device))
                if v.dim()
                else (v.to(p.device, torch.float32) if on_device else v.clone())
                for k, v in state.items()
            }


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str], copy: bool = False
) -> dict[str, torch.Tensor]:
    """A model's weights (``model/<name>``) and its optimizer's state (``optim/<kind>/<name>``)
    as named tensors, for a pickle-free file; ``copy``: CPU copies (training goes on meanwhile)."""
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"optim/{k}": v for k, v in optimizer_state_tensors(optimizer, names).items()})
    return {k: v.detach().to("cpu", copy=True) if copy else v.detach() for k, v in tensors.items()}


def load_training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    tensors: dict[str, torch.Tensor],
    own: bool = False,
) -> None:
    """Weights and optimizer state from :func:`training_state`'s tensors (``own``: see above)."""
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
    optim = {k[6:]: v for k, v in tensors.items() if k.startswith("optim/")}
    load_optimizer_state_tensors(optimizer, names, optim, own=own)


def param_names_in_optimizer_order(model: nn.Module) -> list[str]:
    named = dict(model.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    decay = [by_id[id(p)] for p in model.parameters() if p.dim() >= 2]
    no_decay = [by_id[id(p)] for p in model.parameters() if p.dim() < 2]
    return decay + no_decay
