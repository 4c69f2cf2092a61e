"""The run's metrics: append-only JSON lines in ``<run>/metrics.jsonl``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path


class MetricsLog:
    """Append-only metrics as JSON lines in the run folder (thread-safe)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[dict], None]] = []

    def __call__(self, event: dict) -> None:
        event = {"time": round(time.time(), 3), **event}
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        for listener in self.listeners:
            listener(event)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
