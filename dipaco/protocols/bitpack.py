"""Packing small integers into bytes for the wire: ``bits``-bit codes four or two to a byte, and
indices below 65536 as little-endian byte pairs (the wire allows uint8, not 16-bit integers).
Used by the sparse top-k codecs (:mod:`dipaco.protocols.codecs`)."""

from __future__ import annotations

import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``bits`` bits [n, k] -> packed bytes [n, ceil(k * bits / 8)]."""
    per = 8 // bits
    n, k = codes.shape
    pad = (-k) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(n, pad)], dim=1)
    groups = codes.view(n, codes.shape[1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (groups << shifts).sum(dim=2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The first ``k`` codes of each row of :func:`pack_codes`'s bytes (int32 [n, k])."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0], packed.shape[1] * per)[:, :k]


def index_bytes(idx: torch.Tensor) -> torch.Tensor:
    """int64 indices below 65536 [n, k] -> little-endian byte pairs, uint8 [n, 2k]."""
    pairs = torch.stack([idx & 0xFF, idx >> 8], dim=2)
    return pairs.reshape(idx.shape[0], 2 * idx.shape[1]).to(torch.uint8)


def index_values(index: torch.Tensor) -> torch.Tensor:
    """:func:`index_bytes`'s pairs back to int64 indices [n, k] (any byte pair: 0..65535)."""
    pairs = index.to(torch.int64).view(index.shape[0], index.shape[1] // 2, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 8)
