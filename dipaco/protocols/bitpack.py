"""Packing small integers into bytes for the wire: ``bits``-bit codes four or two to a byte;
indices below 65536 as little-endian byte pairs (the wire allows uint8, not 16-bit integers), or,
when that is smaller, a chunk's chosen positions as a bitmap, one bit per element. Used by the
sparse top-k codecs (:mod:`dipaco.protocols.codecs`)."""

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


def mask_width(chunk: int) -> int:
    """Bytes of a bitmap over ``chunk`` elements."""
    return -(-chunk // 8)


def mask_bytes(idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """int64 positions [n, k] below ``chunk`` -> bitmaps uint8 [n, ceil(chunk / 8)]: bit ``j``
    of byte ``b`` is position ``8 b + j``."""
    n = idx.shape[0]
    bits = torch.zeros(n, mask_width(chunk) * 8, dtype=torch.int32)
    bits.scatter_(1, idx, 1)
    shifts = torch.arange(8, dtype=torch.int32)
    return (bits.view(n, mask_width(chunk), 8) << shifts).sum(dim=2).to(torch.uint8)


def mask_positions(mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`mask_bytes`'s bitmaps back to ascending positions, int64 [n, k].

    Raises ``ValueError`` when a bit past ``chunk`` is set, or the rows do not all set the
    same number k >= 1 of bits. No rows (an empty tensor): k is 1."""
    n = mask.shape[0]
    if n == 0:  # an empty tensor: no chunks, and k = 1 as for any one-element chunk
        return torch.zeros(0, 1, dtype=torch.int64, device=mask.device)
    shifts = torch.arange(8, dtype=torch.int32, device=mask.device)
    bits = ((mask.to(torch.int32).unsqueeze(2) >> shifts) & 1).reshape(n, -1)
    if bool(bits[:, chunk:].any()):
        raise ValueError(f"a bitmap sets a position past its chunk of {chunk}")
    counts = bits.sum(dim=1)
    k = int(counts[0])
    if k < 1 or bool((counts != k).any()):
        raise ValueError("bitmaps must set the same number (at least 1) of positions per chunk")
    return bits.nonzero()[:, 1].view(n, k)
