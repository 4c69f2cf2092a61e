"""Compression codecs for module deltas sent from peers to coordinators.

A delta is a ``dict[str, torch.Tensor]`` of float32 tensors (one per parameter of a module).
:func:`encode` turns it into *wire tensors* (every dtype is on the wire allowlist of
:mod:`dipaco.protocols.wire`); :func:`decode` turns wire tensors back into float32 tensors shaped
like a reference dict, validating everything, because the wire is never trusted.

Each codec is one subclass of :class:`Codec`, found by its name in a registry: :func:`get` gives
the registered instance, :func:`register` adds a class (also usable as a class decorator),
:func:`unregister` removes one, and :func:`names` (also ``CODECS``) lists the registered names.
:func:`encode`, :func:`decode` and :class:`ErrorFeedback` take the codec's name and look it up
there, so a new codec is one class and one ``register`` call.

Built-in codecs and their per-element error bounds (``x`` the sent value, ``y`` the decoded one):

``lossless`` (:class:`Lossless`)
    The float32 tensors themselves. Exact: ``y == x`` bit for bit. 4 bytes per element.
``fp16`` (:class:`Fp16`)
    IEEE half precision, round to nearest. For ``|x|`` in the normal fp16 range
    ``[2**-14, 65504]``: ``|y - x| <= 2**-11 * |x|``; below it (subnormals) ``|y - x| <= 2**-25``.
    Values beyond 65504 would overflow, so :func:`encode` refuses them. 2 bytes per element.
``bf16`` (:class:`Bf16`)
    bfloat16, round to nearest: ``|y - x| <= 2**-8 * |x|`` over the whole float32 normal
    range. 2 bytes per element.
``int8`` (:class:`Int8Blockwise`)
    Block-wise absmax quantisation. The tensor is flattened and zero-padded to a multiple of
    :data:`BLOCK` elements; each block gets ``scale = max |x|`` over the block (float32, wire name
    ``f"{name}#scale"``, shape ``[nblocks]``) and ``q = round(x / scale * 127)`` (int8, shape
    ``[nblocks, BLOCK]``); decoding is ``y = q * scale / 127``. Hence
    ``|y - x| <= scale / 254`` (plus float32 rounding, a few ulps of ``scale``). An all-zero block
    has ``scale == 0`` and decodes to exact zeros. About 1 + 4/BLOCK bytes per element (~0.254x
    of float32 for large tensors).

``sign1`` (:class:`Sign1`)
    Scaled signs (EF-signSGD): each block of :data:`BLOCK` elements sends the sign of every
    element as one bit (uint8 ``[nblocks, BLOCK / 8]``) and ``scale = mean |x|`` over the block
    (float32 ``name#scale``); decoding is ``y = scale * sign(x)`` (a zero decodes as ``+scale``).
    No per-element bound: a block's decoded L1 norm equals its sent one, and the rest is left to
    error feedback. About 1/8 + 4/BLOCK bytes per element (0.14 of int8).

Lossy codecs are meant to be used through :class:`ErrorFeedback`, which keeps on the peer what
compression dropped and adds it to the next delta of the same stream, so errors do not accumulate
over rounds (EF-SGD): the sum of everything decoded differs from the sum of the true deltas by
exactly the current residual, which stays bounded by one step's quantisation error.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, TypeVar

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

BLOCK = 256  # elements per int8 block
SCALE_SUFFIX = "#scale"
_QMAX = 127
_FP16_MAX = float(torch.finfo(torch.float16).max)


class Codec(ABC):
    """One way to carry float32 delta tensors on the wire.

    A subclass sets ``name`` (what peers and coordinators call it) and ``lossless`` (True when
    decoding gives back the input bit for bit, so :class:`ErrorFeedback` keeps no residual), and
    implements :meth:`encode_tensor`, :meth:`decode_tensor` and, when a parameter travels as more
    than one wire tensor, :meth:`wire_names`. The module-level :func:`encode` and :func:`decode`
    do what every codec shares: looking the codec up, turning inputs into cpu float32, and
    checking the set of wire names.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool] = False

    def wire_names(self, name: str) -> list[str]:
        """The names of the wire tensors that carry parameter ``name``."""
        return [name]

    def check_name(self, name: str) -> None:
        """Raise ValueError if a parameter called ``name`` cannot be sent with this codec."""
        return None

    @abstractmethod
    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A contiguous cpu float32 tensor -> its wire tensors, named by :meth:`wire_names`.

        Raises ValueError for values the codec cannot carry.
        """

    @abstractmethod
    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        """Parameter ``name`` of ``shape``, float32, from untrusted ``wire`` tensors.

        ``wire`` holds exactly the names :meth:`wire_names` gives for every parameter, and
        ``wire[name]`` is a tensor; anything else wrong raises WireError naming the tensor.
        """

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        """Decode wire tensors this process just encoded (no validation needed)."""
        return self.decode_tensor(name, wire, shape)


_REGISTRY: dict[str, Codec] = {}
_C = TypeVar("_C", bound=type[Codec])


def register(codec_cls: _C) -> _C:
    """Make ``codec_cls`` available by its ``name``; returns the class, so it can decorate it."""
    if not (isinstance(codec_cls, type) and issubclass(codec_cls, Codec)):
        raise TypeError(f"{codec_cls!r} is not a subclass of Codec")
    name = getattr(codec_cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec class {codec_cls.__name__} needs a non-empty string name")
    if name in _REGISTRY:
        raise ValueError(f"a codec named {name!r} is already registered")
    _REGISTRY[name] = codec_cls()
    return codec_cls


def unregister(name: str) -> None:
    """Forget the codec registered as ``name`` (KeyError if there is none)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered codec names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def get(name: str) -> Codec:
    """The codec registered as ``name``; ValueError naming the registered ones otherwise."""
    codec = _REGISTRY.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; expected one of {names()}")
    return codec


def __getattr__(attr: str) -> tuple[str, ...]:
    # ``CODECS`` is computed on each access, so it always lists what is registered now.
    if attr == "CODECS":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def as_float32(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"tensor {name!r} must be a floating-point tensor, got {kind}")
    return t.detach().to("cpu", torch.float32).contiguous()


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN and no infinity, in one read-only pass (min and max propagate both).

    ``torch.isfinite(t).all()`` writes a boolean per element first (``bench/codecs.py`` times
    both against memcpy).
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


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


@register
class Int8Blockwise(Codec):
    """Block-wise absmax int8: codes ``name`` [nblocks, BLOCK] and scales ``name#scale``."""

    name = "int8"

    def wire_names(self, name: str) -> list[str]:
        return [name, name + SCALE_SUFFIX]

    def check_name(self, name: str) -> None:
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"tensor name {name!r} collides with int8 scale companions")

    def encode_tensor(self, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _quantise(x)
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"tensor {name!r} has non-finite values; cannot encode as int8")
        return {name: q, name + SCALE_SUFFIX: scale}

    def decode_tensor(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        q, sname = wire[name], name + SCALE_SUFFIX
        scale = wire[sname]
        nb = _nblocks(math.prod(shape))
        if q.dtype != torch.int8:
            raise WireError(f"tensor {name!r} has dtype {q.dtype}, codec int8 sends torch.int8")
        if q.shape != (nb, BLOCK):
            raise WireError(
                f"tensor {name!r} has shape {list(q.shape)}, expected [{nb}, {BLOCK}] "
                f"(int8 blocks for a parameter of shape {list(shape)})"
            )
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
        if nb and int(q.min()) < -_QMAX:
            raise WireError(f"tensor {name!r} uses the code -128, outside [-127, 127]")
        return _dequantise(q, scale.to(q.device), shape)

    def decode_own(
        self, name: str, wire: dict[str, torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        return _dequantise(wire[name], wire[name + SCALE_SUFFIX], shape)


@register
class Sign1(Codec):
    """Scaled signs: one bit an element (``name``, uint8 [nblocks, BLOCK / 8], bit ``j`` of
    byte ``i`` the sign of element ``8 i + j``, 1 for negative) and each block's mean absolute
    value (``name#scale``, float32 [nblocks]). Every bit pattern decodes; the decoder refuses
    wrong dtypes and shapes and scales that are negative or not finite."""

    name = "sign1"

    def wire_names(self, name: str) -> list[str]:
        return [name, name + SCALE_SUFFIX]

    def check_name(self, name: str) -> None:
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"tensor name {name!r} collides with sign1 scale companions")

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
        packed, sname = wire[name], name + SCALE_SUFFIX
        scale = wire[sname]
        nb = _nblocks(math.prod(shape))
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (nb, BLOCK // 8):
            raise WireError(
                f"tensor {name!r} must be uint8 [{nb}, {BLOCK // 8}] (sign bits for a parameter "
                f"of shape {list(shape)}), got {packed.dtype} {list(packed.shape)}"
            )
        if not isinstance(scale, torch.Tensor):
            raise WireError(f"wire entry {sname!r} is not a tensor")
        if scale.dtype != torch.float32 or tuple(scale.shape) != (nb,):
            raise WireError(
                f"tensor {sname!r} must be float32 [{nb}], got {scale.dtype} {list(scale.shape)}"
            )
        if not _all_finite(scale):
            raise WireError(f"tensor {sname!r} has non-finite scales")
        if bool((scale < 0).any()):
            raise WireError(f"tensor {sname!r} has negative scales")
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
    density: ClassVar[float] = SPARSE_DENSITY

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

    def _rebuild(self, packed, idx, scale, k, chunk, nchunks, shape) -> torch.Tensor:  # type: ignore[no-untyped-def]
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


def encode(
    codec: str, tensors: dict[str, torch.Tensor], density: float | None = None
) -> dict[str, torch.Tensor]:
    """float32 tensors -> wire tensors (cpu, contiguous).

    ``density`` is the share of each chunk a sparse codec sends (the run's
    ``network.topk_density``; its class default otherwise); the dense codecs ignore it.

    Wire names are the original names, plus ``f"{name}#scale"`` companions for ``int8``.
    ``lossless`` returns the float32 tensors themselves (no copy when already contiguous cpu
    float32). Raises :class:`ValueError` for an unknown codec, a non-float tensor, a name that
    collides with a scale companion, or values the codec cannot carry (non-finite values, or
    ``|x| > 65504`` for ``fp16``).
    """
    c = get(codec)
    if density is not None and isinstance(c, TopK) and density != c.density:
        if not 0 < density <= 1:
            raise ValueError(f"a top-k density must be in (0, 1], got {density}")
        c = type(c)()
        c.density = density
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        c.check_name(name)
        wire.update(c.encode_tensor(name, as_float32(name, tensor)))
    return wire


def decode(
    codec: str, wire: dict[str, torch.Tensor], like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Wire tensors -> float32 tensors with the names and shapes of ``like``.

    Only ``like``'s names and shapes are used. Every problem with the wire (unknown codec,
    missing or unexpected names, wrong dtype, wrong shape, wrong number of int8 blocks, bad
    scale shape, non-finite or negative scales, the out-of-range int8 code -128, non-finite
    float values) raises :class:`~dipaco.errors.WireError` naming the tensor. Outputs live on
    the wire tensors' device (cpu for frames read by :mod:`dipaco.protocols.wire`).
    """
    try:
        c = get(codec)
    except ValueError as e:
        raise WireError(str(e), reason="bad-codec") from None
    if not isinstance(wire, dict):
        raise WireError(f"wire tensors must be a dict, got {type(wire).__name__}")
    expected = [wire_name for name in like for wire_name in c.wire_names(name)]
    got = set(wire)
    missing = [n for n in expected if n not in got]
    unexpected = sorted(got.difference(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}" + (" ..." if len(unexpected) > 5 else ""))
        raise WireError(f"{codec} delta has wrong tensor names: {'; '.join(parts)}")
    out: dict[str, torch.Tensor] = {}
    for name, ref in like.items():
        if not isinstance(wire[name], torch.Tensor):
            raise WireError(f"wire entry {name!r} is not a tensor")
        out[name] = c.decode_tensor(name, wire, torch.Size(ref.shape))
    return out


def wire_bytes(wire: dict[str, torch.Tensor]) -> int:
    """Total payload bytes of the wire tensors (headers not included)."""
    return sum(t.numel() * t.element_size() for t in wire.values())
