"""What a run publishes in the hivemind DHT, and how peers and owners find it.

Keys (values are JSON-like; every record has a TTL and is refreshed while its writer lives):

    dipaco.runs                    subkey <run id>: {"scheduler", "addresses", "manifest"}
    dipaco.<run id>.manifest       the run manifest (the scheduler's Welcome config); its SHA-256
                                   is the "manifest" field above, and its run_id the subkey
    dipaco.<run id>.owners         subkey <owner id>: {"modules", "addresses", "scheduler"}
    dipaco.<run id>.progress       {"round", "rounds", "modules": {mid: version}, "finished"}
    dipaco.<run id>.peers          subkey <peer id>: {"peer", "device", "memory_gb", "max_mbps",
                                   "client_mode", "task", "step", "steps", "loss"}

The DHT has no compare-and-swap, so it never decides anything: the scheduler stays the authority
for task claims and module ownership; the DHT only helps find it, and shows progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dipaco.errors import ConfigError, TransportError
from dipaco.fileio import plain_name_error

log = logging.getLogger(__name__)

RUNS = "dipaco.runs"
TTL = 60.0


def manifest_sha256(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def key(run_id: str, what: str) -> str:
    return f"dipaco.{run_id}.{what}"


def find_run(node, run_id: str | None = None, wait: float = 30.0) -> tuple[str, dict, dict]:
    """(run id, its entry in dipaco.runs, its verified manifest), waiting up to ``wait`` s."""
    why = None if run_id is None else plain_name_error(run_id, depth=1)
    if why is not None:
        raise ConfigError(f"--run {str(run_id)[:40]!r} is not a run id: {why}")
    deadline, warned = time.monotonic() + wait, False
    while True:
        try:
            found = node.get(RUNS)
        except TransportError as exc:  # a DHT that does not answer now: look again, in time
            log.warning("cannot read the DHT's runs yet: %s", exc)
            found = None
        # Anyone can write to the DHT: a run id becomes a folder name (the peer keeps a run's
        # files under runs/<id>), so one that is not a plain name is not a run.
        runs = {
            rid: entry
            for rid, entry in (found.items() if isinstance(found, dict) else [])
            if plain_name_error(rid, depth=1) is None
        }
        if isinstance(found, dict) and len(runs) < len(found) and not warned:
            log.warning("ignored %d DHT run record(s) with a malformed id", len(found) - len(runs))
            warned = True
        if run_id is not None and run_id in runs:
            chosen = run_id
        elif run_id is None and len(runs) == 1:
            (chosen,) = runs
        elif run_id is None and len(runs) > 1:
            raise ConfigError(
                f"this DHT announces several runs {sorted(runs)}: choose one with --run"
            )
        else:
            chosen = None
        if chosen is not None:
            entry = runs[chosen]
            manifest = node.get(key(chosen, "manifest"))
            if isinstance(manifest, dict) and isinstance(entry, dict):
                if manifest_sha256(manifest) != entry.get("manifest"):
                    raise TransportError(
                        f"the manifest of run {chosen} in the DHT does not match its hash",
                        reason="bad-manifest",
                    )
                if manifest.get("run_id") != chosen:
                    raise TransportError(
                        f"the manifest announced as run {chosen} is for run "
                        f"{manifest.get('run_id')}",
                        reason="bad-manifest",
                    )
                return chosen, entry, manifest
        if time.monotonic() > deadline:
            what = f"run {run_id}" if run_id else "run"
            raise TransportError(f"found no {what} in the DHT within {wait:.0f} s")
        time.sleep(0.5)


class Publisher(threading.Thread):
    """Re-stores a node's records every ``interval`` seconds (and once at start)."""

    def __init__(self, node, records: Callable[[], list[tuple]], interval: float = 10.0):
        super().__init__(name="dipaco-dht-publisher", daemon=True)
        self.node, self.records, self.interval = node, records, interval
        self.stop = threading.Event()
        self.publish()

    def publish(self) -> None:
        for record in self.records():
            k, value, *sub = record
            try:
                self.node.store(k, value, TTL, subkey=sub[0] if sub else None)
            except Exception as exc:  # the DHT is best effort: log and try again next time
                log.warning("DHT store of %s failed: %s", k, exc)

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.publish()

    def close(self) -> None:
        self.stop.set()
