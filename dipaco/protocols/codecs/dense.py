"""The dense codecs: every element travels (float32, fp16, bf16, int8 blocks, scaled signs)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from dipaco.errors import WireError
from dipaco.protocols.bitpack import pack_codes, unpack_codes
from dipaco.protocols.codecs.base import BLOCK, SCALE_SUFFIX, Codec, _all_finite, register

_QMAX = 127
_FP16_MAX = float(torch.finfo(torch.float16).max)


class _FloatCodec(Codec):
    """A cast of every element to ``dtype``: one wire tensor per parameter, its own name."""

    dtype: ClassVar[torch.dtype]

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = x.to(self.dtype)
        # The cast may round the largest floats to infinity.
        if not _all_finite(y):
            raise ValueError(f"tensor {name!r} has non-finite values; cannot encode as {self.name}")
        return {name: y}

    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        t = wire[name]
        if t.dtype != self.dtype:
            raise WireError(
                f"tensor {name!r} has dtype {t.dtype}, codec {self.name} sends {self.dtype}"
            )
        if t.shape != shape:
            raise WireError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if not _all_finite(t):
            raise WireError(f"tensor {name!r} has non-finite values")
        return t.to(torch.float32)

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        return wire[name].to(torch.float32)


@register
class Lossless(_FloatCodec):
    """The float32 tensors themselves (no copy when already contiguous cpu float32)."""

    name = "lossless"
    lossless = True
    dtype = torch.float32


@register
class Fp16(_FloatCodec):
    """IEEE half precision; refuses values beyond +-65504, which would overflow."""

    name = "fp16"
    dtype = torch.float16

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.numel():
            lo, hi = (float(v) for v in torch.aminmax(x))  # NaN propagates to both
            if not max(-lo, hi) <= _FP16_MAX:
                raise ValueError(
                    f"tensor {name!r} has values beyond the fp16 range (+-{_FP16_MAX:g}) "
                    "or non-finite values; use bf16 or lossless"
                )
        # Values within the range stay finite: no second check.
        return {name: x.to(self.dtype)}


@register
class Bf16(_FloatCodec):
    """bfloat16: float32's range with 8 bits of mantissa."""

    name = "bf16"
    dtype = torch.bfloat16


def _nblocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (any shape, cpu) -> (q int8 [nblocks, BLOCK], scale float32 [nblocks])."""
    flat = x.reshape(-1)
    nb = _nblocks(flat.numel())
    pad = nb * BLOCK - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(nb, BLOCK)
    lo, hi = torch.aminmax(blocks, dim=1) if nb else (flat.new_zeros(0), flat.new_zeros(0))
    scale = torch.maximum(hi, lo.neg())  # NaN propagates, caught by the caller
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # x / scale lies in [-1, 1] exactly (|x| <= scale), so even tiny scales cannot overflow.
    y = torch.div(blocks, safe.unsqueeze(1))
    y.mul_(_QMAX).round_().clamp_(-_QMAX, _QMAX)
    return y.to(torch.int8), scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    numel = math.prod(shape)
    y = q.to(torch.float32)
    y.mul_((scale / _QMAX).unsqueeze(1))  # q * (scale / 127): never overflows for finite scale
    return y.reshape(-1)[:numel].reshape(shape)


class _Blockwise(Codec):
    """A codec that sends, beside each parameter's codes, one float32 scale per block of
    :data:`BLOCK` elements (``name#scale``)."""

    def wire_names(self, name: str) -> list[str]:
        return [name, name + SCALE_SUFFIX]

    def check_name(self, name: str) -> None:
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"tensor name {name!r} collides with {self.name} scale companions")

    @staticmethod
    def checked_scales(name: str, wire: dict[str, torch.Tensor], nb: int) -> torch.Tensor:
        """``name``'s block scales from untrusted ``wire``: float32 [nb], finite, >= 0."""
        sname = name + SCALE_SUFFIX
        scale = wire[sname]
        if not isinstance(scale, torch.Tensor):
            raise WireError(f"wire entry {sname!r} is not a tensor")
        if scale.dtype != torch.float32:
            raise WireError(f"tensor {sname!r} has dtype {scale.dtype}, expected torch.float32")
        if scale.shape != (nb,):
            raise WireError(f"tensor {sname!r} has shape {list(scale.shape)}, expected [{nb}]")
        if not _all_finite(scale):
            raise WireError(f"tensor {sname!r} has non-finite scales")
        if bool((scale < 0).any()):
            raise WireError(f"tensor {sname!r} has negative scales")
        return scale


@register
class Int8Blockwise(_Blockwise):
    """Block-wise absmax int8: codes ``name`` [nblocks, BLOCK] and scales ``name#scale``."""

    name = "int8"

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _quantise(x)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"tensor {name!r} has non-finite values; cannot encode as int8")
        return {name: q, name + SCALE_SUFFIX: scale}

    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        q = wire[name]
        nb = _nblocks(math.prod(shape))
        if q.dtype != torch.int8:
            raise WireError(f"tensor {name!r} has dtype {q.dtype}, codec int8 sends torch.int8")
        if q.shape != (nb, BLOCK):
            raise WireError(
                f"tensor {name!r} has shape {list(q.shape)}, expected [{nb}, {BLOCK}] "
                f"(int8 blocks for a parameter of shape {list(shape)})"
            )
        scale = self.checked_scales(name, wire, nb)
        if nb and int(q.min()) < -_QMAX:
            raise WireError(f"tensor {name!r} uses the code -128, outside [-127, 127]")
        return _dequantise(q, scale.to(q.device), shape)

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        return _dequantise(wire[name], wire[name + SCALE_SUFFIX], shape)


@register
class Sign1(_Blockwise):
    """Scaled signs: one bit an element (``name``, uint8 [nblocks, BLOCK / 8], bit ``j`` of
    byte ``i`` the sign of element ``8 i + j``, 1 for negative) and each block's mean absolute
    value (``name#scale``, float32 [nblocks]). Every bit pattern decodes; the decoder refuses
    wrong dtypes and shapes and scales that are negative or not finite."""

    name = "sign1"

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _all_finite(x):
            raise ValueError(f"tensor {name!r} has non-finite values; cannot encode as sign1")
        flat = x.reshape(-1)
        nb = _nblocks(flat.numel())
        pad = nb * BLOCK - flat.numel()
        # The padding is left out of the mean: a short last block keeps its own scale.
        counts = torch.full((nb,), float(BLOCK))
        if nb and pad:
            counts[-1] = BLOCK - pad
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks = flat.view(nb, BLOCK)
        scale = blocks.abs().sum(dim=1) / counts
        return {
            name: pack_codes((blocks < 0).to(torch.uint8), 1),
            name + SCALE_SUFFIX: scale,
        }

    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        packed = wire[name]
        nb = _nblocks(math.prod(shape))
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (nb, BLOCK // 8):
            raise WireError(
                f"tensor {name!r} must be uint8 [{nb}, {BLOCK // 8}] (sign bits for a parameter "
                f"of shape {list(shape)}), got {packed.dtype} {list(packed.shape)}"
            )
        scale = self.checked_scales(name, wire, nb)
        return self._rebuild(packed, scale, shape)

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        return self._rebuild(wire[name], wire[name + SCALE_SUFFIX], shape)

    @staticmethod
    def _rebuild(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        negative = unpack_codes(packed, 1, BLOCK).to(torch.float32)
        y = (1.0 - 2.0 * negative).mul_(scale.to(packed.device).unsqueeze(1))
        return y.reshape(-1)[: math.prod(shape)].reshape(shape)
