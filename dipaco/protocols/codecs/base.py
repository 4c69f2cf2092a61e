"""The codec interface and its registry (:mod:`dipaco.protocols.codecs` has the whole story)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, TypeVar

import torch

BLOCK = 256  # elements per int8 block
SCALE_SUFFIX = "#scale"


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
