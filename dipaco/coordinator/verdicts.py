"""Verdicts on whole-path deltas, a part of the coordinator that owns its state (issue 53).

Where a path's modules belong to more than one coordinator, no owner can score the path's delta
on held-out documents by itself. The scheduler does it for them (scoring.py): the peer sends it
the whole encoded delta first (``ScoreDelta``), it scores the path with every module (its own,
and the others' current releases, fetched from their owners and kept per version here), and
signs a verdict: the task, the path, the key, the weight factor (the key's trust and the delta's
usefulness), whether the run is diverging, and a digest of each module's encoded tensors. Each
owner applies its modules' deltas only with that verdict, and only if the tensors it got are the
ones scored (``check``). A peer cannot strip the requirement: the task's signed ticket says that
its deltas are scored first (``Task.scored``).

``Verdicts`` keeps the verdicts given lately (a retried ``ScoreDelta`` of the same delta gets the
same verdict, not a second judgement of its key) and the other owners' modules as last fetched.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]

KEEP_VERDICTS = 4096  # verdicts remembered for retries (a task's is asked for once or twice)


def path_bytes(model: dict[str, Any] | None) -> int:
    """A whole path's parameters in float32 (a ScoreDelta's largest lossless delta), from the
    run's model config (the manifest's ``model``); 0 without one."""
    from dipaco.model.transformer import ModelConfig, PathModel

    if not model:
        return 0
    try:
        with torch.device("meta"):  # shapes only: no memory
            path = PathModel(ModelConfig(**model))
    except (TypeError, ValueError):  # a model config of another version: the owned size rules
        return 0
    return 4 * sum(p.numel() for p in path.parameters())


def digest(tensors: dict[str, torch.Tensor], mid: str) -> str:
    """A digest of module ``mid``'s encoded tensors (``mid/name`` keys) as they travel: names,
    dtypes, shapes and bytes. The scorer and each owner compute it over what each received."""
    h = hashlib.blake2b(digest_size=16)
    prefix = mid + "/"
    for key in sorted(k for k in tensors if k.startswith(prefix)):
        t = tensors[key].detach().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # its bytes, not a copy
    return h.hexdigest()


@dataclass(frozen=True)
class ScoredVerdict:
    """A verdict as an owner reads it, once checked (``check``)."""

    trust: float  # the delta's weight factor (0 < trust <= 1)
    diverging: bool  # the run diverged when it was scored: copies are let through


def payload(
    run_id: str,
    task: str,
    path: int,
    key: str,
    trust: float,
    diverging: bool,
    digests: dict[str, str],
) -> dict[str, Any]:
    """What the scorer signs (tickets.VERDICT)."""
    return {
        "run": run_id,
        "task": task,
        "path": path,
        "key": key,
        "trust": trust,
        "diverging": diverging,
        "digests": digests,
    }


def check(
    signed: dict[str, Any] | None,
    run_id: str,
    task: str,
    path: int,
    key: str,
    tensors: dict[str, torch.Tensor],
    mids: list[str],
) -> ScoredVerdict | str:
    """The verdict, if ``signed`` (a verified verdict's payload, None if it did not verify) is
    for this run, task, path and key, and scored these modules' tensors; else why not."""
    if signed is None:
        return "no verdict signed by the scheduler came with it"
    want = {"run": run_id, "task": task, "path": path, "key": key}
    for name, value in want.items():
        if signed.get(name) != value:
            return f"its verdict is for another {name} ({str(signed.get(name))[:40]!r})"
    trust, digests = signed.get("trust"), signed.get("digests")
    if not (isinstance(trust, int | float) and math.isfinite(trust) and 0 < trust <= 1):
        return f"its verdict's weight factor {trust!r:.20} is not in (0, 1]"
    if not isinstance(digests, dict):
        return "its verdict names no module digests"
    for mid in mids:
        if digests.get(mid) != digest(tensors, mid):
            return f"the delta for {mid} is not the one the scheduler scored"
    return ScoredVerdict(float(trust), signed.get("diverging") is True)


class Verdicts:
    """The scorer's memory: verdicts given (task -> (its digests, the signed verdict)), and the
    other owners' modules as last fetched (module -> (version, tensors))."""

    def __init__(self) -> None:
        self.given: OrderedDict[str, tuple[dict[str, str], str]] = OrderedDict()
        self.modules: dict[str, tuple[int, Tensors]] = {}

    def again(self, task: str, digests: dict[str, str]) -> str | None:
        """The verdict already given for this task's delta (a retry), if these are its digests."""
        kept = self.given.get(task)
        return kept[1] if kept is not None and kept[0] == digests else None

    def keep(self, task: str, digests: dict[str, str], verdict: str) -> None:
        self.given[task] = (digests, verdict)
        self.given.move_to_end(task)
        while len(self.given) > KEEP_VERDICTS:
            self.given.popitem(last=False)

    def fetched(self, mid: str, version: int | None) -> Tensors | None:
        """Module ``mid`` as last fetched, if at ``version``."""
        kept = self.modules.get(mid)
        return kept[1] if kept is not None and version is not None and kept[0] == version else None

    def fetch_kept(self, mid: str, version: int, tensors: Tensors) -> None:
        self.modules[mid] = (version, tensors)
