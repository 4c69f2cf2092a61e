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

import torch

from dipaco.errors import WireError

# The built-ins register on import, in this order (``names()``: dense first, then sparse).
from dipaco.protocols.codecs.base import (
    BLOCK,
    SCALE_SUFFIX,
    Codec,
    _all_finite,
    as_float32,
    get,
    names,
    register,
    unregister,
)
from dipaco.protocols.codecs.dense import Bf16, Fp16, Int8Blockwise, Lossless, Sign1
from dipaco.protocols.codecs.sparse import (
    INDEX_SUFFIX,
    SPARSE_CHUNK,
    SPARSE_DENSITY,
    TopK,
    TopK2,
    TopK4,
)

__all__ = [
    "BLOCK",
    "INDEX_SUFFIX",
    "SCALE_SUFFIX",
    "SPARSE_CHUNK",
    "SPARSE_DENSITY",
    "Bf16",
    "Codec",
    "Fp16",
    "Int8Blockwise",
    "Lossless",
    "Sign1",
    "TopK",
    "TopK2",
    "TopK4",
    "_all_finite",
    "as_float32",
    "decode",
    "encode",
    "get",
    "names",
    "register",
    "unregister",
    "wire_bytes",
]


def __getattr__(attr: str) -> tuple[str, ...]:
    # ``CODECS`` is computed on each access, so it always lists what is registered now.
    if attr == "CODECS":
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


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
        c = type(c)(density)
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
