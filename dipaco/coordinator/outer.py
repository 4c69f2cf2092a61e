"""The outer step of one module: DiPaCo Algorithm 1, lines 12-14, with section 2.7's two tweaks.

For module (l, e) with paths i through it, each reporting delta_i = theta_{t-1} - theta_i^t:

    g = s * sum_i alpha_i * delta_i          (the outer gradient)
    alpha_i = |D_i| / sum_j |D_j|            (loss reweighing by shard size in tokens, eq. 2-3;
                                              1/n when ``weight_by_tokens`` is off)
    s = sqrt(n)                              (outer-gradient rescale by the paths through the module)

then Nesterov momentum SGD (DiLoCo: lr 0.7, momentum 0.9), with PyTorch's convention:

    b <- mu * b + g ;   theta <- theta - lr * (g + mu * b)     (b starts at zero)

Robust aggregation (``aggregation``, from the run config's ``validation`` section) replaces the
weighted sum by a coordinate-wise combiner once at least ``min_paths_for_robust`` deltas arrive:

    trimmed_mean: per coordinate, drop the k lowest and k highest of the n values (k counted in
                  paths), then the alpha-weighted mean of the rest, alphas renormalised
    median:       per coordinate, the unweighted median (a weighted one lets a path holding half
                  the weight decide alone)

and with fewer deltas clips each to ``norm_ratio`` times their median norm before the weighted
mean. The sqrt(n) rescale applies to every combiner with n the deltas received: a robust centre
is still an estimate of the mean delta, whose size shrinks with n the same way.

Pure functions over named tensors: the golden tests in tests/unit/test_outer.py check them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dipaco.coordinator import validation

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class OuterSettings:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    sqrt_rescale: bool = True
    weight_by_tokens: bool = True
    aggregation: str = "mean"  # "mean", "trimmed_mean" or "median"
    trim_fraction: float = 0.2
    min_paths_for_robust: int = 3
    norm_ratio: float = 3.0  # the clip, in median norms, when too few paths for a robust combiner


def outer_gradient(
    deltas: list[tuple[Tensors, float]], s: OuterSettings, info: dict | None = None
) -> Tensors:
    """Weighted average of the paths' deltas (each with its shard size), times sqrt(paths).

    ``info``, when given, receives the combiner used ("aggregation") and, for the clipped mean,
    the factor each delta was scaled by ("clip_factors").
    """
    if not deltas:
        raise ValueError("an outer step needs at least one delta")
    n = len(deltas)
    total = sum(tokens for _, tokens in deltas)
    weights = [
        tokens / total if s.weight_by_tokens and total > 0 else 1.0 / n for _, tokens in deltas
    ]
    scale = math.sqrt(n) if s.sqrt_rescale else 1.0
    info = info if info is not None else {}
    if s.aggregation != "mean":
        tensors = [d for d, _ in deltas]
        if n >= s.min_paths_for_robust and s.aggregation == "trimmed_mean":
            center = validation.trimmed_mean(tensors, weights, s.trim_fraction)
        elif n >= s.min_paths_for_robust and s.aggregation == "median":
            center = validation.coordinate_median(tensors)
        elif s.aggregation in ("trimmed_mean", "median"):
            tensors, info["clip_factors"] = validation.clip_to_median_norm(tensors, s.norm_ratio)
            center = validation.weighted_mean(tensors, weights)
            info["aggregation"] = "clipped_mean"
        else:
            raise ValueError(f"unknown aggregation {s.aggregation!r}")
        info.setdefault("aggregation", s.aggregation)
        return {name: (scale * c).float() for name, c in center.items()}
    info["aggregation"] = "mean"
    names = deltas[0][0].keys()
    return {
        name: scale
        * sum(w * d[name].double() for w, (d, _) in zip(weights, deltas, strict=True)).float()
        for name in names
    }


def nesterov_step(
    params: Tensors, momentum: Tensors | None, grad: Tensors, s: OuterSettings
) -> tuple[Tensors, Tensors]:
    """New parameters and momentum buffers; inputs are left untouched."""
    new_params, new_momentum = {}, {}
    for name, theta in params.items():
        g = grad[name].to(theta.dtype)
        b = s.momentum * momentum[name] + g if momentum is not None else g.clone()
        update = g + s.momentum * b if s.nesterov else b
        new_params[name] = theta - s.lr * update
        new_momentum[name] = b
    return new_params, new_momentum
