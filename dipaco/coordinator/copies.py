"""Copies of earlier deltas refused: a part of the coordinator that owns a sketch of every delta
it admitted, per module.

In an open run a key costs nothing, and a key that sends back a delta it (or another of its
keys) sent before, as it was or scaled, gets the credit of a task it never trained: the norm
check passes it (its norm is a normal one) and so would a held-out score of a delta that
helped once. Each module's admitted deltas leave here a sketch: the delta's values at
``SKETCH_SIZE`` coordinates drawn at random from the module's, by a secret this process draws
at its start (a sender cannot know which coordinates to change to pass). A delta whose sketch
has a cosine of at least ``validation.copy_cosine`` with one of the module's last ``KEPT``
sketches of stored deltas from another task is refused (``copied``, a hostile reason: counted towards a ban).
A delta and a scaled copy of it have a cosine of exactly 1 (the sketches are centred: their
cosine is the samples' correlation); two honest deltas of a module, even
of one path in consecutive rounds, are far from it (docs/security.md has the measurement). A
retry of the same task is not a copy of itself, and two tasks of one path and round (a hedged
copy) never both reach here: the module keeps the first and drops the second before its
content is judged (admission.plan).

The sketches live in memory: after a restart a copy of a delta stored before it passes. On by
default where the held-out check is (``copy_cosine`` "auto": an open run), at ``AUTO_COSINE``:
a diverging run's honest deltas are copies of each other, and the held-out check tells such a
run (its paths score worse than where they started), where a copy is let through
(heldout.let_through; docs/security.md).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass

import torch

SKETCH_SIZE = 512  # coordinates sampled per module
AUTO_COSINE = 0.9999  # validation.copy_cosine "auto", where it is on (docs/security.md)
KEPT = 64  # sketches kept per module, the newest

Sketches = dict[str, torch.Tensor | None]  # module -> its unit sketch (None: not judged)


@dataclass(frozen=True)
class Copied:
    """``module``'s delta copies the one of ``task`` (sent by ``peer``), at ``cosine``."""

    module: str
    cosine: float
    task: str
    peer: str


class DeltaCopies:
    """The sketches of admitted deltas, per module (see the module docstring). ``cosine``:
    ``validation.copy_cosine``, None to judge nothing. Thread-safe: admission judges content
    outside the coordinator's lock."""

    def __init__(self, cosine: float | None, secret: bytes | None = None) -> None:
        self.cosine = cosine
        self._secret = secret if secret is not None else secrets.token_bytes(16)
        self._lock = threading.Lock()
        # module -> [(parameter name, indices into its flattened values, slots in the sketch)]
        self._where: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        self._kept: dict[str, list[tuple[torch.Tensor, str, str]]] = {}  # (unit sketch, task, peer)
        self.nearest: dict[str, float] = {}  # per module, the highest cosine of an admitted delta

    def judge(
        self, task: str, deltas: dict[str, dict[str, torch.Tensor]]
    ) -> tuple[Copied | None, Sketches]:
        """The first module whose delta copies another task's kept one (or None), and every
        module's sketch, for :meth:`keep` once the delta is stored."""
        if self.cosine is None:
            return None, {}
        sketches = {mid: self._sketch(mid, delta) for mid, delta in deltas.items()}
        with self._lock:
            for mid, unit in sketches.items():
                best, seen = self._nearest(mid, unit, task)
                if best >= self.cosine:
                    return Copied(mid, best, *seen), sketches
        return None, sketches

    def keep(self, task: str, peer: str, sketches: Sketches) -> None:
        """Keep the sketches of a delta now stored (admission.write, after its commit): only a
        stored delta is one a later delta can copy, so a delta refused or lost after it was
        judged (the held-out check, a full disk) leaves nothing that would make the same
        path's retraining a copy."""
        with self._lock:
            for mid, unit in sketches.items():
                if unit is None:
                    continue
                best, _ = self._nearest(mid, unit, task)
                self.nearest[mid] = max(self.nearest.get(mid, -1.0), best)
                kept = self._kept.setdefault(mid, [])
                kept.append((unit, task, peer))
                del kept[:-KEPT]

    def _nearest(
        self, mid: str, unit: torch.Tensor | None, task: str
    ) -> tuple[float, tuple[str, str]]:
        """The highest cosine of ``unit`` with the module's kept sketches of other tasks (and
        their task and peer); -1 when there is none (under the lock)."""
        if unit is None:
            return -1.0, ("", "")
        return max(
            ((float(unit @ s), (t, p)) for s, t, p in self._kept.get(mid, ()) if t != task),
            default=(-1.0, ("", "")),
        )

    def _sketch(self, mid: str, delta: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The delta's values at the module's secret coordinates, less their mean, as a unit
        vector: the cosine of two sketches is the correlation of the two deltas' samples, 1
        for a copy however scaled or shifted. None for a delta that is constant there (zero, or
        a test's constant step), which says nothing of where it came from."""
        where = self._coordinates(mid, delta)
        out = torch.zeros(sum(len(i) for _, i, _ in where), dtype=torch.float64)
        for name, index, slots in where:
            out[slots] = delta[name].detach().reshape(-1)[index].to(torch.float64)
        scale = float(out.abs().max()) * len(out) ** 0.5
        out -= out.mean()
        norm = float(out.norm())
        return out / norm if norm > 1e-9 * scale else None

    def _coordinates(
        self, mid: str, delta: dict[str, torch.Tensor]
    ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Where the module's sketch reads, drawn once a process from the secret: SKETCH_SIZE
        coordinates over the module's values in name order (all of them if fewer)."""
        where = self._where.get(mid)
        if where is not None and [n for n, _, _ in where] == sorted(delta):
            return where
        names = sorted(delta)
        sizes = torch.tensor([delta[n].numel() for n in names])
        total = int(sizes.sum())
        seed = hashlib.sha256(self._secret + mid.encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little") >> 1)
        if total <= SKETCH_SIZE:
            picked = torch.arange(total)
        else:
            picked = torch.randint(0, total, (SKETCH_SIZE,), generator=g).sort().values
        starts = torch.cumsum(sizes, 0) - sizes
        owner = torch.bucketize(picked, torch.cumsum(sizes, 0), right=True)
        where = []
        for i, name in enumerate(names):
            slots = (owner == i).nonzero().flatten()
            if len(slots):
                where.append((name, picked[slots] - starts[i], slots))
        self._where[mid] = where
        return where
