"""Error feedback (EF-SGD): the residual a lossy codec left out of a peer's delta joins its next
one, so compression error does not accumulate (docs/protocol.md §7, "Error feedback")."""

from __future__ import annotations

import threading

import torch

from dipaco.protocols.codecs import as_float32, encode, get


class ErrorFeedback:
    """Per-stream residuals kept by a peer (error feedback, as in EF-SGD).

    ``compress(codec, key, delta)`` sends ``encode(codec, delta + residual)`` and keeps
    ``residual = (delta + residual) - decode(sent)``, per ``(key, tensor name)``. So the sum of
    all decoded deltas of a stream equals the sum of the true deltas minus the current residual:
    compression error does not accumulate. A lossless codec sends ``delta + residual`` exactly
    and stores nothing (any residual left from an earlier lossy round is flushed into it).
    Residuals are float32 cpu tensors; they are replaced, never modified in place.

    With ``decay`` = beta < 1 (SparseLoCo's error feedback) the residual joins the next delta as
    ``delta + beta * residual``: what a sparse codec left out fades by beta a round instead of
    waiting in full, so the identity above holds for the decayed residuals. ``density`` is the
    share of each chunk a sparse codec sends (the run's ``network`` section sets both).
    """

    SEP = "|"
    decay: float = 1.0  # the residual's weight when it joins the next delta (SparseLoCo's beta)
    density: float | None = None  # a sparse codec's share of each chunk (None: its default)

    def __init__(self, decay: float | None = None, density: float | None = None) -> None:
        self._residuals: dict[str, dict[str, torch.Tensor]] = {}
        # A peer that sends a task's deltas while it sets up the next (push behind) touches
        # two streams from two threads: each method is atomic.
        self._lock = threading.RLock()
        if decay is not None:
            self.decay = decay
        if density is not None:
            self.density = density

    def compress(
        self, codec: str, key: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        with self._lock:
            return self._compress(codec, key, tensors)

    def _compress(
        self, codec: str, key: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        c = get(codec)
        if self.SEP in key:
            raise ValueError(f"stream key {key!r} must not contain {self.SEP!r}")
        res = self._residuals.get(key, {})
        target: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            x = as_float32(name, tensor)
            r = res.get(name)
            if r is not None:
                if r.shape != x.shape:
                    raise ValueError(
                        f"tensor {name!r} of stream {key!r} has shape {list(x.shape)}, but its "
                        f"residual has shape {list(r.shape)}; reset({key!r}) first"
                    )
                x = x + r if self.decay == 1.0 else x + self.decay * r
            target[name] = x
        wire = encode(codec, target, self.density)
        if c.lossless:
            for name in target:
                res.pop(name, None)
        else:
            for name, x in target.items():
                res[name] = x - c.decode_own(name, wire, x.shape)
        if res:
            self._residuals[key] = res
        else:
            self._residuals.pop(key, None)
        return wire

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Residuals as flat ``f"{key}|{name}"`` tensors, e.g. for a tensor file on disk."""
        with self._lock:
            return {
                f"{key}{self.SEP}{name}": r
                for key, res in self._residuals.items()
                for name, r in res.items()
            }

    def stream(self, key: str) -> dict[str, torch.Tensor]:
        """One stream's residuals by tensor name (the tensors themselves: never modified)."""
        with self._lock:
            return dict(self._residuals.get(key, {}))

    def set_stream(self, key: str, residuals: dict[str, torch.Tensor]) -> None:
        """Replace one stream's residuals (by tensor name), checked as
        :meth:`load_state_tensors` checks them; the other streams are left as they are."""
        flat = {f"{key}{self.SEP}{name}": t for name, t in residuals.items()}
        loaded = self._checked(flat).get(key, {})
        with self._lock:
            if loaded:
                self._residuals[key] = loaded
            else:
                self._residuals.pop(key, None)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with ones saved by :meth:`state_tensors`."""
        loaded = self._checked(tensors)
        with self._lock:
            self._residuals = loaded

    def _checked(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for flat, t in tensors.items():
            key, sep, name = flat.partition(self.SEP)
            if not sep:
                raise ValueError(f"residual name {flat!r} is not of the form 'key|name'")
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ValueError(f"residual {flat!r} must be a float32 tensor")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"residual {flat!r} has non-finite values")
            loaded.setdefault(key, {})[name] = t.detach().to("cpu").clone()
        return loaded

    def reset(self, key: str) -> None:
        """Forget the residuals of one stream (e.g. after its module was re-synchronised)."""
        with self._lock:
            self._residuals.pop(key, None)
