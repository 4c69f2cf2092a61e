"""Many paths trained as one stacked model: one forward, backward and AdamW step for all of them.

A round trains P paths of the same shape, each on its own batches, each with its own AdamW.
Trained one after another (or step-interleaved), each step pays Python's and the framework's
per-operation overhead P times, and on a CPU a small path's matrices are too small to use the
cores well. ``StackedPaths`` keeps the P paths' parameters in one buffer, shape (P, n) with n the
parameters of one path, each named parameter a view (P, *shape) of its columns; the forward pass
runs every linear layer of all paths as one batched matrix product (``torch.bmm``), attention as
one call over P x batch sequences, and the loss per path. ``StackedAdamW`` steps the whole buffer
with a handful of element-wise operations, with each path's own learning rate, step count
(bias correction) and gradient-norm clip.

The paths stay independent: path i's loss depends only on path i's parameters and batch, so
its gradient is exactly its own, and the optimizer is element-wise with per-path scalars. The
results equal the sequential trainer's (``optim.train_step`` on a ``PathModel`` with
``optim.make_optimizer``) up to float rounding: a batched matrix product, the fused q/k/v and
gate/up products and the per-path norm reduce in another order than the sequential kernels, so
parameters agree to about 1e-6 relative after one step, and training, being chaotic, lets such
differences grow slowly (tests/unit/test_stacked.py states the tolerance).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dipaco.model.optim import InnerSettings
from dipaco.model.transformer import ModelConfig, apply_rotary, rotary_tables

# The leaves are views of the (P, n) buffer, not dense tensors, so the autograd engine warns that
# their gradients (views of the gradient buffer, the same layout) break its layout contract; it
# still adds into them in place, which is the point (tests/unit/test_stacked.py checks).
warnings.filterwarnings(
    "ignore",
    message="grad and param do not obey the gradient layout contract",
    category=UserWarning,
)

_EPS = 1e-8  # torch.optim.AdamW's default
_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


# Parameters used together, consecutive in a path's state dict: each group is one leaf tensor
# (P, rows, columns) named by its first element, so that q/k/v and gate/up are one batched
# product each, without a copy.
_LAYER_GROUPS = (
    ("input_layernorm.weight", ("input_layernorm.weight",)),
    (
        "self_attn.qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    ("self_attn.o_proj.weight", ("self_attn.o_proj.weight",)),
    ("post_attention_layernorm.weight", ("post_attention_layernorm.weight",)),
    ("mlp.gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.down_proj.weight", ("mlp.down_proj.weight",)),
)


def _groups(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The leaves of a path (name, members), in state-dict order (``PathModel``'s)."""
    groups = [("embed_tokens.weight", ("embed_tokens.weight",))]
    for layer in range(cfg.n_layers):
        pre = f"layers.{layer}."
        groups += [(pre + leaf, tuple(pre + n for n in group)) for leaf, group in _LAYER_GROUPS]
    return [*groups, ("norm.weight", ("norm.weight",)), ("lm_head.weight", ("lm_head.weight",))]


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, h, v = cfg.dim, cfg.hidden, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, d)}
    per_layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (d, d),
        "self_attn.v_proj.weight": (d, d),
        "self_attn.o_proj.weight": (d, d),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (h, d),
        "mlp.up_proj.weight": (h, d),
        "mlp.down_proj.weight": (d, h),
    }
    for layer in range(cfg.n_layers):
        out.update({f"layers.{layer}.{n}": s for n, s in per_layer.items()})
    return {**out, "norm.weight": (d,), "lm_head.weight": (v, d)}


class StackedPaths:
    """P path models of one ``ModelConfig`` as stacked parameters (see the module docstring).

    ``states``: each path's state dict (``PathModel`` names, as ``Topology.join_modules`` makes
    them, in any order). ``flat`` (P, n) holds every parameter of every path; ``grad`` (P, n)
    their gradients after a backward pass, in the same layout. ``view(name)`` is one named
    parameter of every path, (P, *shape).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        states: Sequence[dict[str, torch.Tensor]],
        device: str | torch.device = "cpu",
        *,
        compile: bool = False,
    ) -> None:
        if not states:
            raise ValueError("StackedPaths needs at least one path")
        self.cfg, self.compile = cfg, compile
        self.shapes = _shapes(cfg)
        self.names = list(self.shapes)
        for i, s in enumerate(states):
            if set(s) != set(self.names):
                raise ValueError(f"path {i}'s parameters are not a {cfg} path's")
            for n in self.names:
                if tuple(s[n].shape) != self.shapes[n]:
                    raise ValueError(f"path {i}'s {n} is {tuple(s[n].shape)}, not {self.shapes[n]}")
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for n in self.names:
            size = math.prod(self.shapes[n])
            self.offsets[n] = (at, at + size)
            at += size
        self.n_paths, self.n_params = len(states), at
        self.flat = torch.empty(self.n_paths, at, device=device, dtype=torch.float32)
        self.grad = torch.zeros_like(self.flat)
        with torch.no_grad():
            for n in self.names:
                a, b = self.offsets[n]
                self.flat[:, a:b] = torch.stack([s[n].reshape(-1) for s in states]).to(self.flat)
        # The leaves: one per group, a view of ``flat`` whose gradient accumulates in place into
        # the same columns of ``grad`` (the engine adds into a defined .grad of matching layout).
        self.leaves: dict[str, torch.Tensor] = {}
        for name, group in _groups(cfg):
            a, b = self.offsets[group[0]][0], self.offsets[group[-1]][1]
            rows = sum(self.shapes[n][0] for n in group)
            shape = (self.n_paths, rows, *self.shapes[group[0]][1:])
            leaf = self.flat[:, a:b].view(shape).detach().requires_grad_()
            leaf.grad = self.grad[:, a:b].view(shape)
            self.leaves[name] = leaf
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # AdamW decays matrices, not norms (optim.make_optimizer): 1 where a column decays.
        self.decays = torch.zeros(at, device=device)
        for n in self.names:
            if len(self.shapes[n]) >= 2:
                a, b = self.offsets[n]
                self.decays[a:b] = 1.0

    def view(self, name: str) -> torch.Tensor:
        """Parameter ``name`` of every path, (P, *shape), sharing ``flat``'s memory."""
        a, b = self.offsets[name]
        return self.flat[:, a:b].view(self.n_paths, *self.shapes[name])

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Path ``i``'s parameters as a state dict (copies, on the buffer's device)."""
        return {n: self.view(n)[i].clone() for n in self.names}

    def zero_grad(self) -> None:
        self.grad.zero_()

    def _rotary(
        self, t: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for ``t`` positions, made once: inside a compiled step they would
        be fused into the rotation and recomputed for every element."""
        key = (t, device, dtype)
        if key not in self._tables:
            self._tables[key] = rotary_tables(
                t, self.cfg.head_dim, self.cfg.rope_theta, device, dtype
            )
        return self._tables[key]

    # ---- the loss ------------------------------------------------------------------------------
    def losses(self, batch: torch.Tensor, autocast: torch.dtype | None = None) -> torch.Tensor:
        """Each path's mean next-token cross-entropy (P,) on its windows (P, B, T+1)."""
        if batch.shape[0] != self.n_paths:
            raise ValueError(f"{batch.shape[0]} batches of windows for {self.n_paths} paths")
        cos, sin = self._rotary(batch.shape[2] - 1, batch.device, self.flat.dtype)
        fn = _compiled_losses() if self.compile else stacked_losses
        return fn(self.cfg, self.leaves, cos, sin, batch, autocast)


def stacked_losses(
    cfg: ModelConfig,
    p: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch: torch.Tensor,
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """Each path's mean next-token cross-entropy (P,) on its windows (P, B, T+1), from the
    stacked leaves ``p`` (``StackedPaths.leaves``): ``PathModel.forward`` and ``optim.lm_loss``
    for P paths at once. A pure function of tensors, so that one compiled form serves every
    ``StackedPaths`` of the same shapes."""
    if autocast is None:
        logits = _forward(cfg, p, cos, sin, batch[:, :, :-1])
    else:
        with torch.autocast(batch.device.type, dtype=autocast):
            logits = _forward(cfg, p, cos, sin, batch[:, :, :-1])
    logits = logits.float()
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch[:, :, 1:].reshape(-1), reduction="none"
    )
    return per_token.view(batch.shape[0], -1).mean(dim=1)


def _forward(
    cfg: ModelConfig,
    p: dict[str, torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """Logits (P, B, T, V) of each path on its own tokens (P, B, T)."""
    n, b, t = tokens.shape
    rows = torch.arange(n, device=tokens.device).view(n, 1, 1)
    x = p["embed_tokens.weight"][rows, tokens].reshape(n, b * t, cfg.dim)
    for layer in range(cfg.n_layers):
        pre = f"layers.{layer}."
        h = _rms(x, p[pre + "input_layernorm.weight"], cfg.norm_eps)
        qkv = _linear(h, p[pre + "self_attn.qkv"]).view(n * b, t, 3 * cfg.n_heads, -1)
        # q and k rotated together: one rotation for 2 x n_heads heads.
        qk = apply_rotary(qkv[:, :, : 2 * cfg.n_heads].transpose(1, 2), cos, sin)
        q, k = qk.split(cfg.n_heads, dim=1)
        v = qkv[:, :, 2 * cfg.n_heads :].transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = att.transpose(1, 2).reshape(n, b * t, cfg.dim)
        x = x + _linear(att, p[pre + "self_attn.o_proj.weight"])
        h = _rms(x, p[pre + "post_attention_layernorm.weight"], cfg.norm_eps)
        gate, up = _linear(h, p[pre + "mlp.gate_up"]).split(cfg.hidden, dim=-1)
        x = x + _linear(F.silu(gate) * up, p[pre + "mlp.down_proj.weight"])
    logits = _linear(_rms(x, p["norm.weight"], cfg.norm_eps), p["lm_head.weight"])
    return logits.view(n, b, t, cfg.vocab_size)


@functools.cache
def _compiled_losses() -> Callable[..., torch.Tensor]:
    """``stacked_losses`` through ``torch.compile`` (made once a process; its kernels are
    compiled on the first call for each shape, a few seconds to a minute on a CPU)."""
    return torch.compile(stacked_losses, dynamic=False)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of (P, N, D) with each path's weight (P, D), as ``transformer.RMSNorm``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.unsqueeze(1) * normed.to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(P, N, in) times each path's ``nn.Linear`` weight (P, out, in): (P, N, out)."""
    return torch.bmm(x, weight.transpose(1, 2))


class StackedAdamW:
    """AdamW (torch's formula, decoupled weight decay) over a ``StackedPaths`` buffer, with each
    path's learning rate, step count and gradient-norm clip (``InnerSettings.grad_clip``, over
    the path's whole gradient, as ``clip_grad_norm_`` on its model).

    ``exp_avg`` / ``exp_avg_sq`` are (P, n) in the buffer's layout; ``steps`` (P,) counts each
    path's optimizer steps (a path whose inner state was loaded continues its own count)."""

    def __init__(self, paths: StackedPaths, settings: InnerSettings) -> None:
        self.paths, self.settings = paths, settings
        self.exp_avg = torch.zeros_like(paths.flat)
        self.exp_avg_sq = torch.zeros_like(paths.flat)
        self.steps = torch.zeros(paths.n_paths, dtype=torch.float64)

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> torch.Tensor:
        """One step of every path at its learning rate; returns each path's gradient norm
        before the clip (P,)."""
        s, flat = self.settings, self.paths.flat
        self.steps += 1
        beta1, beta2 = s.betas
        lr = torch.tensor(lrs, dtype=torch.float64)
        # Per-path scalars as columns (P, 1); the bias corrections in float64, as torch's.
        device = flat.device

        def column(values: torch.Tensor) -> torch.Tensor:
            return values.to(device, torch.float32).unsqueeze(1)

        update = _compiled_update() if self.paths.compile else adamw_update
        return update(
            flat,
            self.paths.grad,
            self.exp_avg,
            self.exp_avg_sq,
            self.paths.decays,
            column(lr),
            column(lr / (1 - beta1**self.steps)),
            column((1 - beta2**self.steps).sqrt()),
            s.grad_clip,
            s.weight_decay,
            beta1,
            beta2,
        )

    # ---- per-path state, in the named form of optim.optimizer_state_tensors --------------------
    def load_path(self, i: int, state: dict[str, torch.Tensor], names: list[str]) -> None:
        """Path ``i``'s moments and step from ``state`` (``{"exp_avg/<name>": t, ...,
        "step/<name>": t}``, as ``optim.optimizer_state_tensors`` writes); missing: a fresh path."""
        steps = {float(state[f"step/{n}"]) for n in names if f"step/{n}" in state}
        if not steps:
            return
        if len(steps) != 1:
            raise ValueError(f"path {i}'s parameters have different step counts {sorted(steps)}")
        self.steps[i] = steps.pop()
        for n in names:
            a, b = self.paths.offsets[n]
            self.exp_avg[i, a:b] = state[f"exp_avg/{n}"].reshape(-1).to(self.exp_avg)
            self.exp_avg_sq[i, a:b] = state[f"exp_avg_sq/{n}"].reshape(-1).to(self.exp_avg_sq)

    def path_state(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Path ``i``'s moments and step as named tensors (``load_path``'s form)."""
        out: dict[str, torch.Tensor] = {}
        for n in names:
            a, b = self.paths.offsets[n]
            shape = self.paths.shapes[n]
            out[f"step/{n}"] = torch.tensor(float(self.steps[i]))
            out[f"exp_avg/{n}"] = self.exp_avg[i, a:b].reshape(shape).clone()
            out[f"exp_avg_sq/{n}"] = self.exp_avg_sq[i, a:b].reshape(shape).clone()
        return out


def adamw_update(
    flat: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    decays: torch.Tensor,
    lr: torch.Tensor,
    step_size: torch.Tensor,
    bias2_sqrt: torch.Tensor,
    grad_clip: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
) -> torch.Tensor:
    """``StackedAdamW.step``'s arithmetic, in place on (P, n) buffers with per-path columns
    (P, 1) ``lr``, ``step_size`` (lr over the first bias correction) and ``bias2_sqrt``; returns
    each path's gradient norm before the clip. A pure function of tensors and numbers, so that
    one compiled form (one fused pass over the buffers) serves every stack of the same shape."""
    norms = torch.linalg.vector_norm(grad, dim=1)
    grad.mul_((grad_clip / (norms + _CLIP_EPS)).clamp(max=1.0).unsqueeze(1))
    flat.mul_(1 - lr * weight_decay * decays)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(_EPS)
    flat.sub_(step_size * exp_avg / denom)
    return norms


@functools.cache
def _compiled_update() -> Callable[..., torch.Tensor]:
    """``adamw_update`` through ``torch.compile``: its seven passes over the (P, n) buffers
    fused into a few (made once a process, compiled on the first call for each shape)."""
    return torch.compile(adamw_update, dynamic=False)


def stacked_step(
    paths: StackedPaths,
    optimizer: StackedAdamW,
    batch: torch.Tensor,
    lrs: Sequence[float],
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """One inner step of every path on its windows (P, B, T+1) at its learning rate; returns
    the paths' losses (P,), detached and not read (no device sync here)."""
    paths.zero_grad()
    losses = paths.losses(batch, autocast)
    losses.sum().backward()
    optimizer.step(lrs)
    return losses.detach()
