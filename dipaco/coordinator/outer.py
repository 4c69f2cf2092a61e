"""The outer step of one module: DiPaCo Algorithm 1, lines 12-14, with section 2.7's two tweaks.

For module (l, e) with paths i through it, each reporting delta_i = theta_{t-1} - theta_i^t:

    g = s * sum_i alpha_i * delta_i          (the outer gradient)
    alpha_i = |D_i| / sum_j |D_j|            (loss reweighing by shard size in tokens, eq. 2-3;
                                              1/n when ``weight_by_tokens`` is off)
    s = rescale(n)                           (outer-gradient rescale by the n paths reporting:
                                              ``rescale`` none: 1; sqrt: sqrt(n), the paper's
                                              section 2.7; linear: n; norm: the mean of the
                                              deltas' norms over the norm of their average, at
                                              most sqrt(n): 1 when the paths agree, sqrt(n) when
                                              their deltas are orthogonal)

then Nesterov momentum SGD (DiLoCo: lr 0.7, momentum 0.9), with PyTorch's convention:

    b <- mu * b + g ;   theta <- theta - lr * (g + mu * b)     (b starts at zero)

With ``warmup_rounds`` w > 0 the outer learning rate of a module's k-th step (k = 1, 2, ...) is
lr * min(1, k / w): the first outer steps, taken from deltas of paths that have just forked, are
the ones that overshoot (docs/results.md, the rescale sweep).

Robust aggregation (``aggregation``, from the run config's ``validation`` section) replaces the
weighted sum by a coordinate-wise combiner once at least ``min_paths_for_robust`` deltas arrive:

    trimmed_mean: per coordinate, drop the k lowest and k highest of the n values (k counted in
                  paths), then the alpha-weighted mean of the rest, alphas renormalised
    median:       per coordinate, the unweighted median (a weighted one lets a path holding half
                  the weight decide alone)

and with fewer votes (below) clips each key's deltas by its vote's norm against ``norm_ratio``
times the votes' median norm, then takes the weighted mean of all the deltas. The rescale
applies to every combiner with n the deltas received: a robust centre is still an estimate of
the mean delta, whose size shrinks with n the same way.

One vote per key: given each delta's *voter* (the key that sent it), a robust combiner first
merges each voter's deltas into their weighted mean, weighted as one path (their mean weight),
and combines the voters, not the paths: a key holding 3 of a module's 8 paths is one value of
6, so it cannot outvote the trim or the median by taking many tasks. The plain mean is unchanged by the merge
(a weighted mean of weighted means), so it skips it and gives the same bits as ever. The "norm"
rescale under a robust combiner takes its typical delta size as the median over keys of each
key's mean delta norm: oversized deltas from a minority of keys do not inflate the step.

Pure functions over named tensors: the golden tests in tests/unit/test_outer.py check them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

import torch

from dipaco.config import OUTER_LR, OUTER_MOMENTUM, OuterSection, ValidationSection
from dipaco.coordinator import validation

Tensors = dict[str, torch.Tensor]


_OUTER, _VALIDATION = OuterSection.model_fields, ValidationSection.model_fields


@dataclass(frozen=True)
class OuterSettings:
    """One module's outer step. Every default is the run config's (``config.OuterSection``,
    ``ValidationSection``; lr and momentum the dense codecs'), so that a step made without a
    config (the simulator, a bench) is the one a default run makes."""

    lr: float = OUTER_LR
    momentum: float = OUTER_MOMENTUM
    nesterov: bool = _OUTER["nesterov"].default
    rescale: str = _OUTER["rescale"].default  # "none", "sqrt", "linear" or "norm" (above)
    weight_by_tokens: bool = _OUTER["weight_by_tokens"].default
    warmup_rounds: int = _OUTER["warmup_rounds"].default
    # "mean", "trimmed_mean" or "median": the config's "auto" picks one by the run's join
    # policy (run/factory.py); a step without a config takes the paper's mean.
    aggregation: str = "mean"
    trim_fraction: float = _VALIDATION["trim_fraction"].default
    min_paths_for_robust: int = _VALIDATION["min_paths_for_robust"].default
    # the clip, in median norms, when too few paths for a robust combiner
    norm_ratio: float = _VALIDATION["norm_ratio"].default
    # (paths through a module, its lr): that lr for such modules (``for_sharing``), else ``lr``
    lr_by_sharing: tuple[tuple[int, float], ...] = ()


RESCALES = ("none", "sqrt", "linear", "norm")


def for_sharing(s: OuterSettings, paths: int) -> OuterSettings:
    """The settings of a module that ``paths`` paths go through (``lr_by_sharing``)."""
    lr = dict(s.lr_by_sharing).get(paths)
    return s if lr is None or lr == s.lr else replace(s, lr=lr)


def at_step(s: OuterSettings, version: int) -> OuterSettings:
    """The settings of the outer step that makes version ``version + 1`` (the lr warm-up)."""
    if s.warmup_rounds <= 0 or version + 1 >= s.warmup_rounds:
        return s
    return replace(s, lr=s.lr * (version + 1) / s.warmup_rounds)


def _weights(deltas: list[tuple[Tensors, float]], s: OuterSettings) -> list[float]:
    """alpha_i: shard size in tokens, or 1/n."""
    n = len(deltas)
    total = sum(tokens for _, tokens in deltas)
    return [tokens / total if s.weight_by_tokens and total > 0 else 1.0 / n for _, tokens in deltas]


def _scale(
    s: OuterSettings,
    deltas: list[list[torch.Tensor]],
    average_norm: float,
    group: list[int] | None = None,
    delta_norms: list[float] | None = None,
) -> float:
    """The rescale factor of the outer gradient for these n deltas and their average's norm.

    With ``group`` (a robust combiner's voter of each delta), the "norm" rescale's typical
    delta size is the median over voters of each voter's mean delta norm, so that a minority of
    keys sending oversized deltas cannot inflate the step; with one voter it is the plain mean.
    ``delta_norms``: the deltas' norms, when the caller measured them already.
    """
    n = len(deltas)
    if s.rescale == "none" or n == 1:
        return 1.0
    if s.rescale == "sqrt":
        return math.sqrt(n)
    if s.rescale == "linear":
        return float(n)
    if s.rescale == "norm":
        norms = delta_norms if delta_norms is not None else [_norm(d) for d in deltas]
        mean_norm = sum(norms) / n
        if group is not None:
            per_voter: dict[int, list[float]] = {}
            for g, norm in zip(group, norms, strict=True):
                per_voter.setdefault(g, []).append(norm)
            mean_norm = statistics.median(sum(v) / len(v) for v in per_voter.values())
        if average_norm <= 0.0:
            return 1.0
        return min(math.sqrt(n), max(1.0, mean_norm / average_norm))
    raise ValueError(f"unknown outer rescale {s.rescale!r}; expected one of {RESCALES}")


def one_vote_per_voter(
    tensors: list[Tensors], weights: list[float], voters: list[str] | None
) -> tuple[list[Tensors], list[float], list[int]]:
    """Each voter's deltas merged into their weighted mean, weighted as one of them (their mean
    weight): a key counts as one path, whatever number of paths it holds.

    Returns the merged deltas and weights (in order of each voter's first delta) and, for each
    input delta, the index of its voter's merged value. Without voters: the inputs as they are.
    """
    if voters is None or len(set(voters)) == len(voters):
        return tensors, weights, list(range(len(tensors)))
    order: dict[str, list[int]] = {}
    for i, v in enumerate(voters):
        order.setdefault(v, []).append(i)
    merged, merged_w, group = [], [], [0] * len(tensors)
    for g, members in enumerate(order.values()):
        total = sum(weights[i] for i in members)
        if len(members) == 1:
            merged.append(tensors[members[0]])
        else:
            share = [weights[i] / total if total > 0 else 1.0 / len(members) for i in members]
            merged.append(validation.weighted_mean([tensors[i] for i in members], share))
        merged_w.append(total / len(members))
        for i in members:
            group[i] = g
    return merged, merged_w, group


def outer_gradient(
    deltas: list[tuple[Tensors, float]],
    s: OuterSettings,
    info: dict | None = None,
    voters: list[str] | None = None,
) -> Tensors:
    """Weighted average of the paths' deltas (each with its shard size), times the rescale.

    ``info``, when given, receives the combiner used ("aggregation"), the number of values it
    combined ("voters") and, for the clipped mean, the factor each delta was scaled by
    ("clip_factors"). ``voters`` (one per delta) gives a robust combiner one vote per voter.
    """
    if not deltas:
        raise ValueError("an outer step needs at least one delta")
    weights = _weights(deltas, s)
    info = info if info is not None else {}
    names = list(deltas[0][0])
    lists = [[_float32(d[k]) for k in names] for d, _ in deltas]
    if s.aggregation != "mean":
        if s.aggregation not in ("trimmed_mean", "median"):
            raise ValueError(f"unknown aggregation {s.aggregation!r}")
        originals = [d for d, _ in deltas]
        tensors, vote_weights, group = one_vote_per_voter(originals, weights, voters)
        votes = info["voters"] = len(tensors)
        if votes >= s.min_paths_for_robust and s.aggregation == "trimmed_mean":
            center = validation.trimmed_mean(tensors, vote_weights, s.trim_fraction)
        elif votes >= s.min_paths_for_robust and s.aggregation == "median":
            center = validation.coordinate_median(tensors)
        else:
            # Too few keys to trim: each key's deltas are scaled by its vote's clip factor, then
            # every delta counts with its own weight. Unclipped, this is the weighted mean of
            # the deltas whichever key sent which: the result does not depend on the grouping.
            _, factors = validation.clip_to_median_norm(tensors, s.norm_ratio)
            per_delta = info["clip_factors"] = [factors[g] for g in group]
            scaled = [
                d if f == 1.0 else {k: (v.double() * f).to(v.dtype) for k, v in d.items()}
                for d, f in zip(originals, per_delta, strict=True)
            ]
            center = validation.weighted_mean(scaled, weights)
            info["aggregation"] = "clipped_mean"
        info.setdefault("aggregation", s.aggregation)
        center_norm = _norm([center[k] for k in names]) if s.rescale == "norm" else 0.0
        # The clipped mean (too few keys) rescales as the mean does: its clip bounds the sizes.
        robust = votes >= s.min_paths_for_robust
        scale = _scale(s, lists, center_norm, group if robust else None)
        info["rescale"] = scale
        return {name: (scale * c).float() for name, c in center.items()}
    info["aggregation"] = "mean"
    average = weighted_average(lists, weights)
    scale = _scale(s, lists, _norm(average) if s.rescale == "norm" else 0.0)
    info["rescale"] = scale
    return dict(zip(names, torch._foreach_mul(average, scale), strict=True))


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def weighted_average(lists: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """sum_i weights[i] * lists[i] (weights summing to 1), tensor by tensor, one pass per input.

    A chain of lerps, a running mean: m_1 = x_1, m_k = lerp(m_{k-1}, x_k, w_k / W_k) with W_k
    the weight so far (``_average_piece``, into new tensors). Float32, in path order, so the
    same deltas give the same bits on every transport. With one input, that input itself (not a
    copy): callers must not write to it.
    """
    if len(lists) == 1:
        return lists[0]
    new = [torch.empty_like(t) for t in lists[0]]
    _average_piece(_whole(new), lists, weights, new)
    return new


def nesterov_step(
    params: Tensors, momentum: Tensors | None, grad: Tensors, s: OuterSettings
) -> tuple[Tensors, Tensors]:
    """New parameters and momentum buffers; inputs are left untouched."""
    names = list(params)
    return _nesterov(names, params, momentum, [grad[n] for n in names], 1.0, s)


def _nesterov(
    names: list[str],
    params: Tensors,
    momentum: Tensors | None,
    g: list[torch.Tensor],
    k: float,
    s: OuterSettings,
) -> tuple[Tensors, Tensors]:
    """Nesterov with the gradient given as k * g, into new tensors (``_nesterov_piece``):

    b = mu * b + k g ;  theta <- theta - lr k g - lr mu b    (theta - lr b without Nesterov)
    """
    theta = [params[n] for n in names]
    g = [t.to(th.dtype) for t, th in zip(g, theta, strict=True)]
    mom = None if momentum is None else [momentum[n] for n in names]
    new, b = [torch.empty_like(t) for t in theta], [torch.empty_like(t) for t in theta]
    whole = _whole(theta)
    _nesterov_piece(whole, _cut(whole, g), theta, mom, new, b, k, s)
    return dict(zip(names, new, strict=True)), dict(zip(names, b, strict=True))


def apply_round(
    deltas: list[tuple[Tensors, float]],
    params: Tensors,
    momentum: Tensors | None,
    s: OuterSettings,
    info: dict | None = None,
    out: tuple[Tensors, Tensors] | None = None,
    voters: list[str] | None = None,
) -> tuple[Tensors, Tensors, float]:
    """One module's whole outer step: new parameters, new momentum, and the outer gradient's norm.

    The plain mean never materialises the gradient: the weighted average is formed in the new
    parameters' buffers and its rescale factor folded into the Nesterov update, piece by piece
    (``PIECE``), each piece averaged and stepped while it is in cache. A round therefore moves
    the floor through memory, P + 4 module sizes with P paths (P deltas, parameters and momentum
    read; parameters and momentum written), plus one read for the norm-dependent "norm" rescale,
    which steps in a second pass. Robust combiners go through ``outer_gradient``. Inputs are
    left untouched.

    ``out`` (new parameters, new momentum: float32 contiguous tensors named and shaped like
    ``params``, aliasing none of the inputs) receives the results in place and is returned:
    fresh results cost a page fault per 4 KiB on first touch, several times the arithmetic.
    Without ``out`` the same operations run into new float32 buffers: the same bits either
    way, so a restarted coordinator redoes a step exactly.
    ``voters`` (the key of each delta) gives a robust combiner one vote per key.
    """
    info = info if info is not None else {}
    if not deltas:
        # Every path of the module was skipped this round (their deltas refused for what they
        # held: rounds.due): the module carries its parameters and momentum to the next version.
        info["aggregation"] = "none"
        new_p, new_b = out or ({k: torch.empty(v.shape) for k, v in params.items()}, {})
        for k, v in params.items():
            new_p[k].copy_(v)
            kept = new_b.setdefault(k, torch.empty(v.shape))
            kept.zero_() if momentum is None else kept.copy_(momentum[k])
        return new_p, new_b, 0.0
    if s.aggregation != "mean":
        grad = outer_gradient(deltas, s, info, voters)
        new_params, new_momentum = nesterov_step(params, momentum, grad, s)
        return new_params, new_momentum, grad_norm(grad)
    info["aggregation"] = "mean"
    names = list(params)
    weights = _weights(deltas, s)
    lists = [[_float32(d[k]) for k in names] for d, _ in deltas]
    if out is None:  # fresh results: the same operations, into new buffers
        fresh = [{n: torch.empty(params[n].shape) for n in names} for _ in range(2)]
        out = (fresh[0], fresh[1])
    new = [out[0][n] for n in names]
    b = [out[1][n] for n in names]
    theta = [params[n] for n in names]
    mom = None if momentum is None else [momentum[n] for n in names]
    pieces = _pieces([t.numel() for t in theta])
    # With a rescale that does not depend on the average's norm, each piece is averaged and
    # stepped while it is in cache: one pass over memory, P + 4 module sizes with P paths.
    scale = _scale(s, lists, 0.0) if s.rescale != "norm" or len(lists) == 1 else None
    squares: list[torch.Tensor] = []
    delta_squares: list[list[torch.Tensor]] = [[] for _ in lists]  # "norm": each delta's norm
    for piece in pieces:
        if scale is None:  # read while the piece comes into cache for the average
            for acc, x in zip(delta_squares, lists, strict=True):
                acc.append(_square_sum(_cut(piece, x)))
        average = _average_piece(piece, lists, weights, new)
        squares.append(_square_sum(average))
        if scale is not None:
            _nesterov_piece(piece, average, theta, mom, new, b, scale, s)
    norm = _root(squares)
    if scale is None:  # the "norm" rescale needs the whole average's norm: a second pass
        scale = _scale(s, lists, norm, delta_norms=[_root(acc) for acc in delta_squares])
        for piece in pieces:
            average = _cut(piece, lists[0]) if len(lists) == 1 else _cut(piece, new)
            _nesterov_piece(piece, average, theta, mom, new, b, scale, s)
    info["rescale"] = scale
    return out[0], out[1], norm * scale


# Tensors above this many elements are stepped in pieces of it (1 MiB of float32 each), so
# that a piece's P deltas, parameters and momentum stay in cache between the operations.
PIECE = 1 << 18

Piece = list[tuple[int, int, int]]  # (tensor index, start, stop) in the flattened tensors


def _pieces(sizes: list[int]) -> list[Piece]:
    """The small tensors together (one foreach call each operation), then each large one in
    pieces of PIECE elements."""
    small = [(i, 0, n) for i, n in enumerate(sizes) if n <= PIECE]
    out = [small] if small else []
    for i, n in enumerate(sizes):
        if n > PIECE:
            out += [[(i, a, min(a + PIECE, n))] for a in range(0, n, PIECE)]
    return out


def _square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of these tensors together, in float64."""
    return torch.stack(torch._foreach_norm(tensors)).double().square().sum()


def _root(square_sums: list[torch.Tensor]) -> float:
    return float(torch.stack(square_sums).sum().sqrt()) if square_sums else 0.0


def _whole(tensors: list[torch.Tensor]) -> Piece:
    """All of these tensors as one piece."""
    return [(i, 0, t.numel()) for i, t in enumerate(tensors)]


def _cut(piece: Piece, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[i].reshape(-1)[a:z] for i, a, z in piece]


def _average_piece(
    piece: Piece, lists: list[list[torch.Tensor]], weights: list[float], new: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The weighted running mean (weighted_average's lerps) of one piece, built in the new
    parameters' buffers; with one delta, that delta's piece itself."""
    if len(lists) == 1:
        return _cut(piece, lists[0])
    o = _cut(piece, new)
    so_far = weights[0] + weights[1]
    for x, y, into in zip(_cut(piece, lists[0]), _cut(piece, lists[1]), o, strict=True):
        torch.lerp(x, y, weights[1] / so_far if so_far else 0.5, out=into)
    for tensors, w in zip(lists[2:], weights[2:], strict=True):
        so_far += w
        torch._foreach_lerp_(o, _cut(piece, tensors), w / so_far if so_far else 0.0)
    if abs(so_far - 1.0) > 1e-12 and so_far > 0:
        torch._foreach_mul_(o, so_far)
    return o


def _nesterov_piece(
    piece: Piece,
    g: list[torch.Tensor],
    theta: list[torch.Tensor],
    mom: list[torch.Tensor] | None,
    new: list[torch.Tensor],
    b: list[torch.Tensor],
    k: float,
    s: OuterSettings,
) -> None:
    """b = mu b + k g; theta - lr k g - lr mu b (theta - lr b without Nesterov), for one piece,
    into the new buffers (over g itself when g lives in them: element by element, exact)."""
    bb, nn, th = _cut(piece, b), _cut(piece, new), _cut(piece, theta)
    if mom is None:  # b = k g
        for x, o in zip(g, bb, strict=True):
            torch.mul(x, k, out=o)
    else:
        for m, o in zip(_cut(piece, mom), bb, strict=True):
            torch.mul(m, s.momentum, out=o)
        torch._foreach_add_(bb, g, alpha=k)
    if s.nesterov:
        for t, x, o in zip(th, g, nn, strict=True):
            torch.add(t, x, alpha=-s.lr * k, out=o)
        torch._foreach_add_(nn, bb, alpha=-s.lr * s.momentum)
    else:
        for t, x, o in zip(th, bb, nn, strict=True):
            torch.add(t, x, alpha=-s.lr, out=o)


def _norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    norms = torch._foreach_norm([_float32(t) for t in tensors])
    return float(torch.linalg.vector_norm(torch.stack(norms).double()))


def grad_norm(grad: Tensors) -> float:
    """The L2 norm of all of a module's outer gradient, with foreach kernels."""
    return _norm(list(grad.values()))
