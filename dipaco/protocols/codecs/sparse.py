"""The sparse codecs: chunked top-k with 2- or 4-bit values (``topk2``, ``topk4``)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from dipaco.errors import WireError
from dipaco.protocols.bitpack import (
    index_bytes,
    index_values,
    mask_bytes,
    mask_positions,
    mask_width,
    pack_codes,
    unpack_codes,
)
from dipaco.protocols.codecs.base import SCALE_SUFFIX, Codec, _all_finite, register

SPARSE_CHUNK = 4096  # elements per top-k chunk (a smaller tensor is one chunk)
SPARSE_DENSITY = 1 / 8  # the share of each chunk's elements sent (config.TOPK_DENSITY)
INDEX_SUFFIX = "#idx"


def _masked(k: int, chunk: int) -> bool:
    """Whether a chunk's k positions go as a bitmap (smaller than k byte pairs, or as small)."""
    return 2 * k >= mask_width(chunk)


def _chunking(numel: int) -> tuple[int, int]:
    """(chunk length, number of chunks) for a tensor of ``numel`` elements."""
    chunk = max(1, min(SPARSE_CHUNK, numel))
    return chunk, -(-numel // chunk)


class TopK(Codec):
    """Chunked top-k with ``bits``-bit values (SparseLoCo-style; meant for error feedback).

    The tensor is flattened, zero-padded and cut into chunks of :data:`SPARSE_CHUNK` elements (a
    smaller tensor is one chunk); each chunk sends its ``k = ceil(density * chunk)`` largest
    elements by magnitude: their positions in the chunk (``name#idx``: uint8 [nchunks, 2k], each
    index as two little-endian bytes), and their values as a sign bit and ``bits - 1`` bits of
    magnitude between the chunk's smallest and largest selected magnitudes ``lo, hi``
    (``name#scale``: float32 [nchunks, 2]), packed (``name``: uint8 [nchunks, ceil(k*bits/8)]).
    A level ``j`` of ``L = 2**(bits-1)`` decodes to ``lo + (hi - lo) * (j + 0.5) / L``, so a sent
    element is off by at most ``(hi - lo) / (2L)``; the elements not sent decode to 0 and stay
    in the peer's residual (:class:`ErrorFeedback`). At the default density 1/64 a 2-bit delta
    is 2.25 bytes per sent element, 0.035 bytes per element (0.9% of float32, 3.5% of int8).

    The decoder takes ``k`` from the wire (any 1 <= k <= chunk: the density is the sender's
    choice) and refuses indices past the chunk, repeated indices, scales that are not finite or
    not ``0 <= lo <= hi``, and wrong dtypes or shapes.
    """

    bits: ClassVar[int]
    # The class's default; an instance made with another density keeps its own (codecs.encode,
    # for the run's network.topk_density).
    density: float = SPARSE_DENSITY

    def __init__(self, density: float | None = None) -> None:
        if density is not None:
            self.density = density

    def wire_names(self, name: str) -> list[str]:
        return [name, name + INDEX_SUFFIX, name + SCALE_SUFFIX]

    def check_name(self, name: str) -> None:
        if name.endswith((SCALE_SUFFIX, INDEX_SUFFIX)):
            raise ValueError(f"tensor name {name!r} collides with {self.name} companions")

    def _k(self, chunk: int) -> int:
        return max(1, min(chunk, math.ceil(self.density * chunk)))

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _all_finite(x):
            raise ValueError(f"tensor {name!r} has non-finite values; cannot encode as {self.name}")
        flat = x.reshape(-1)
        chunk, nchunks = _chunking(flat.numel())
        pad = chunk * nchunks - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(nchunks, chunk)
        k = self._k(chunk)
        idx = blocks.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # in order
        values = blocks.gather(1, idx)
        mags = values.abs()
        lo, hi = mags.min(dim=1).values, mags.max(dim=1).values
        levels = 1 << (self.bits - 1)
        span = torch.where(hi > lo, hi - lo, torch.ones_like(hi)).unsqueeze(1)
        level = ((mags - lo.unsqueeze(1)) / span * levels).floor().clamp_(0, levels - 1)
        codes = level.to(torch.uint8) | ((values < 0).to(torch.uint8) << (self.bits - 1))
        return {
            name: pack_codes(codes, self.bits),
            name + INDEX_SUFFIX: mask_bytes(idx, chunk) if _masked(k, chunk) else index_bytes(idx),
            name + SCALE_SUFFIX: torch.stack([lo, hi], dim=1),
        }

    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        numel = math.prod(shape)
        chunk, nchunks = _chunking(numel)
        packed, iname, sname = wire[name], name + INDEX_SUFFIX, name + SCALE_SUFFIX
        index, scale = wire[iname], wire[sname]
        for wname, t in ((iname, index), (sname, scale)):
            if not isinstance(t, torch.Tensor):
                raise WireError(f"wire entry {wname!r} is not a tensor")
        if index.dtype != torch.uint8 or index.dim() != 2 or index.shape[0] != nchunks:
            raise WireError(
                f"tensor {iname!r} must be uint8 [{nchunks}, 2k] or [{nchunks}, "
                f"{mask_width(chunk)}], got {index.dtype} {list(index.shape)}"
            )
        masked = index.shape[1] == mask_width(chunk)
        if masked:
            try:
                idx = mask_positions(index, chunk)
            except ValueError as exc:
                raise WireError(f"tensor {iname!r}: {exc}") from None
            k = idx.shape[1]
        else:
            k = index.shape[1] // 2
            if index.shape[1] % 2 or not 1 <= k <= chunk:
                raise WireError(
                    f"tensor {iname!r} holds {index.shape[1]} bytes a chunk: not 2k for "
                    f"1 <= k <= {chunk}, nor a bitmap of {mask_width(chunk)}"
                )
        width = -(-k * self.bits // 8)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (nchunks, width):
            raise WireError(
                f"tensor {name!r} must be uint8 [{nchunks}, {width}], got {packed.dtype} "
                f"{list(packed.shape)}"
            )
        if scale.dtype != torch.float32 or tuple(scale.shape) != (nchunks, 2):
            raise WireError(f"tensor {sname!r} must be float32 [{nchunks}, 2]")
        if not _all_finite(scale):
            raise WireError(f"tensor {sname!r} has non-finite scales")
        lo, hi = scale[:, 0], scale[:, 1]
        if bool((lo < 0).any()) or bool((hi < lo).any()):
            raise WireError(f"tensor {sname!r} has scales outside 0 <= lo <= hi")
        if not masked:  # a bitmap's positions are in range and distinct by construction
            idx = index_values(index)
            if bool((idx >= chunk).any()):
                raise WireError(f"tensor {iname!r} has an index past its chunk of {chunk}")
            if k > 1 and bool((idx.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise WireError(f"tensor {iname!r} repeats an index within a chunk")
        return self._rebuild(packed, idx, scale, k, chunk, nchunks, shape)

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        chunk, nchunks = _chunking(math.prod(shape))
        index = wire[name + INDEX_SUFFIX]
        if index.shape[1] == mask_width(chunk):
            idx = mask_positions(index, chunk)
        else:
            idx = index_values(index)
        return self._rebuild(
            wire[name], idx, wire[name + SCALE_SUFFIX], idx.shape[1], chunk, nchunks, shape
        )

    def _rebuild(self, packed, idx, scale, k, chunk, nchunks, shape) -> torch.Tensor:
        codes = unpack_codes(packed, self.bits, k)
        levels = 1 << (self.bits - 1)
        level = (codes & (levels - 1)).to(torch.float32)
        sign = 1.0 - 2.0 * (codes >> (self.bits - 1)).to(torch.float32)
        lo, hi = scale[:, :1], scale[:, 1:]
        values = sign * (lo + (hi - lo) * (level + 0.5) / levels)
        out = torch.zeros(nchunks, chunk, dtype=torch.float32, device=packed.device)
        out.scatter_(1, idx, values)
        return out.reshape(-1)[: math.prod(shape)].reshape(shape)


@register
class TopK2(TopK):
    """Top-k with 2-bit values: a sign bit and one bit of magnitude."""

    name = "topk2"
    bits = 2


@register
class TopK4(TopK):
    """Top-k with 4-bit values: a sign bit and three bits of magnitude."""

    name = "topk4"
    bits = 4
