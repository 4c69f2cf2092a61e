"""Refusals counted once: a part of the coordinator that owns the counts.

Every refusal of a request (a ``RejectedError`` with its reason) is counted once: by reason, by
the peer (or key) refused, and against the caller's ban budget (``AccessPolicy.offence``). The
counts are saved in coordinator.json (``state_dict``/``load_state_dict``) and shown by status.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, NoReturn

from dipaco.coordinator.access import AccessPolicy
from dipaco.errors import RejectedError


class Refusals:
    """``by_reason`` and ``by_peer`` counts; ``lock`` is the coordinator's (the counts change
    with the state they are saved with), ``caller`` the key of the request being handled."""

    def __init__(
        self, lock: threading.RLock, access: AccessPolicy, caller: Callable[[], str | None]
    ) -> None:
        self._lock, self._access, self._caller = lock, access, caller
        self.by_reason: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = defaultdict(Counter)

    def count(self, who: str, reason: str, blame: bool = True) -> None:
        """Count one refusal of ``who`` (the caller holds the coordinator's lock); against the
        caller's ban budget too unless ``blame`` is False (a judgement an honest peer can
        earn: a late delta judged against modules that moved on since its base)."""
        self.by_reason[reason] += 1
        self.by_peer[who][reason] += 1
        if blame:
            self._access.offence(self._caller(), reason)

    def refuse(self, who: str, reason: str, message: str, blame: bool = True) -> NoReturn:
        """Count the refusal and raise it, marked counted (the service must not count it
        again). Takes the lock itself: admission refuses outside it too."""
        with self._lock:
            self.count(who, reason, blame)
        exc = RejectedError(message, reason=reason)
        exc.counted = True
        raise exc

    def state_dict(self) -> dict[str, Any]:
        return {
            "rejections": dict(self.by_reason),
            "rejections_by_peer": {p: dict(c) for p, c in self.by_peer.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Add the counts of a saved coordinator.json (checked before: state.py)."""
        self.by_reason.update(saved.get("rejections", {}))
        for who, counts in saved.get("rejections_by_peer", {}).items():
            self.by_peer[who].update(counts)
