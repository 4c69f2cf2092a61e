"""Request rates per key: token buckets, bounded in number.

A coordinator (``coordinator/access.py``) and a peer that serves modules (``peer/seeds.py``)
each give a key ``rate`` requests a second with bursts of ``burst``. Only the ``keys`` keys seen
last keep a bucket: in an open run anyone can make keys, and a bucket per key ever seen would
grow without end. A forgotten key starts with a full bucket, as a new key would.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Bucket:
    """One key's tokens as of ``at``, and what its holder keeps about the key (``state``)."""

    tokens: float
    at: float
    state: Any = None


class KeyBuckets:
    """Token buckets per key, the ``keys`` most recently used kept (thread-safe)."""

    def __init__(
        self,
        rate: float,
        burst: float,
        keys: int,
        state: Callable[[], Any] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.burst, self.keys = rate, float(burst), keys
        self.state, self.clock = state, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()  # least recently used first

    def take(self, key: str) -> Bucket | None:
        """Take one of ``key``'s tokens: its bucket, or None when it has none left."""
        now = self.clock()
        with self._lock:
            bucket = self._buckets.pop(key, None) or Bucket(self.burst, now, self.state())
            self._buckets[key] = bucket
            while len(self._buckets) > self.keys:
                self._buckets.popitem(last=False)
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            if bucket.tokens < 1.0:
                return None
            bucket.tokens -= 1.0
            return bucket

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, key: object) -> bool:
        return key in self._buckets
