"""What the dashboard, ``dipaco status`` and ``/metrics`` show: one JSON snapshot of a run.

The snapshot joins the coordinator's live state (``Coordinator.status``) with series read from
the run's ``metrics.jsonl`` (losses per path, rounds, throughput) and the routing histogram in
``shards/stats.json``. :class:`Series` reads the metrics file incrementally, so a snapshot costs
only the lines written since the last one.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

_LEVEL = re.compile(r"^L(\d+)\.")


class Series:
    """Time series from ``metrics.jsonl``, kept up to date by reading only what was appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._lock = threading.Lock()
        self.train: dict[int, list[dict]] = defaultdict(list)  # path -> [{time, round, loss}]
        self.val: dict[int, list[dict]] = defaultdict(list)  # path -> [{round, ppl}]
        self.routed: list[dict] = []  # [{round, ppl}]: the routed validation of all paths
        self.rounds: list[dict] = []  # [{round, time, seconds}]
        self.peer_rate: dict[str, dict] = {}  # peer -> {tokens, seconds, path, round}
        self.issued: dict[str, float] = {}  # task -> time issued
        self.started: float | None = None
        self.events = 0
        self.malformed = 0

    def update(self) -> None:
        with self._lock:
            if not self.path.exists():
                return
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            self._offset += end
            for line in data[:end].splitlines():
                if not line.strip():
                    continue
                try:
                    self._add(json.loads(line))
                except (ValueError, KeyError, TypeError):
                    self.malformed += 1  # a line cut by a crash: skipped, counted

    def _add(self, e: dict) -> None:
        self.events += 1
        t = e.get("time", time.time())
        if self.started is None:
            self.started = t
        kind = e["event"]
        if kind == "task_issued":
            self.issued[e["task"]] = t
        elif kind == "delta":
            losses = e.get("train_losses") or []
            if losses:
                loss = sum(losses[-5:]) / len(losses[-5:])
                self.train[int(e["path"])].append({"time": t, "round": e["round"], "loss": loss})
            began = self.issued.pop(e["task"], None)
            if began is not None and t > began:
                self.peer_rate[e["peer"]] = {
                    "tokens_per_s": e.get("tokens", 0) / (t - began),
                    "task_seconds": t - began,
                    "path": e["path"],
                    "round": e["round"],
                }
        elif kind == "eval" and e.get("model") == "dipaco":
            self.routed.append({"round": e["round"], "ppl": e["ppl"]})
            for p, ppl in (e.get("per_path") or {}).items():
                self.val[int(p)].append({"round": e["round"], "ppl": ppl})
        elif kind == "round":
            last = self.rounds[-1]["time"] if self.rounds else self.started
            self.rounds.append({"round": e["round"], "time": t, "seconds": t - (last or t)})

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "train_loss": {str(p): list(v) for p, v in sorted(self.train.items())},
                "val_ppl": {str(p): list(v) for p, v in sorted(self.val.items())},
                "routed_ppl": list(self.routed),
                "rounds": list(self.rounds),
                "throughput": dict(self.peer_rate),
                "events": self.events,
                "malformed_lines": self.malformed,
            }


def json_safe(value: Any) -> Any:
    """``value`` with every NaN and infinity as None: browsers' JSON.parse refuses them, and one
    diverged loss would otherwise leave the dashboard unable to read any status at all."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def routing_histogram(run_dir: Path) -> dict[str, list[int]]:
    """Training documents and tokens per path, as the corpus was sharded."""
    stats = run_dir / "shards" / "stats.json"
    try:
        train = json.loads(stats.read_text())["train"]
        return {"docs": list(train["docs"]), "tokens": list(train["tokens"])}
    except (OSError, ValueError, KeyError):
        return {"docs": [], "tokens": []}


def module_grid(modules: dict[str, dict], paths_through: dict[str, int]) -> list[dict]:
    """Rows of modules: shared parts (``S.*``), one row per level (``L<n>.M<m>``), then parts
    private to a path (``P<p>.*``). Each cell: id, version, staleness (rounds behind the newest
    module), deltas pending and paths through it."""
    newest = max((info.get("version", 0) for info in modules.values()), default=0)
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for mid, info in modules.items():
        level = _LEVEL.match(mid)
        key = (1, int(level.group(1))) if level else ((0, 0) if mid.startswith("S.") else (2, 0))
        version = info.get("version", 0)
        rows[key].append(
            {
                "id": mid,
                "version": version,
                "behind": newest - version,
                "pending": len(info.get("pending", [])),
                "paths": paths_through.get(mid, 0),
                "owner": info.get("owner"),
            }
        )
    names = {0: "shared", 2: "private"}
    return [
        {
            "name": f"level {k[1]}" if k[0] == 1 else names[k[0]],
            "modules": sorted(rows[k], key=lambda c: c["id"]),
        }
        for k in sorted(rows)
    ]


BUSY_WAIT = 1.0  # seconds a snapshot waits for a busy coordinator before it shows the last copy


class LastState:
    """The coordinator's last status copied under its lock, and when: while an outer step or a
    state save holds the lock (seconds, under load), a snapshot shows this copy at once."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.at = 0.0
        self._lock = threading.Lock()

    def read(self, coordinator, wait: float = BUSY_WAIT) -> tuple[dict[str, Any], float]:
        """The status state and how old it is (0: fresh)."""
        if coordinator.lock.acquire(timeout=wait if self.state is not None else -1):
            try:
                state = coordinator.status().state
            finally:
                coordinator.lock.release()
            with self._lock:
                self.state, self.at = state, time.monotonic()
            return state, 0.0
        with self._lock:
            return self.state, time.monotonic() - self.at  # type: ignore[return-value]


def snapshot(
    coordinator, run_dir: Path, series: Series, last: LastState | None = None
) -> dict[str, Any]:
    """The whole picture, JSON-ready. Holds the coordinator's lock only to copy its state; with
    ``last``, waits at most ``BUSY_WAIT`` seconds for it (``stale_seconds``: the copy's age)."""
    state, stale = (last or LastState()).read(coordinator)
    series.update()
    topology = coordinator.topology
    paths_through = {mid: len(topology.paths_through(mid)) for mid in state["modules"]}
    rates = series.as_dict()
    peers = {}
    for pid, info in state["peers"].items():
        rate = rates["throughput"].get(pid, {})
        lease = state["leases"].get(info.get("task") or "", {})
        peers[pid] = {
            **info,
            "tokens_per_s": round(rate.get("tokens_per_s", 0.0), 1),
            "current_path": lease.get("path"),
            "current_step": info.get("step") if lease else None,
        }
    return {
        "time": time.time(),
        "run_id": state["run_id"],
        "round": state["round"],
        "rounds": state["rounds"],
        "finished": state["finished"],
        "phase": state["phase"],
        "num_paths": topology.num_paths,
        "inner_steps": coordinator.inner_steps,
        "modules": state["modules"],
        "grid": module_grid(state["modules"], paths_through),
        "leases": state["leases"],
        "peers": peers,
        "machines": state.get("machines", {}),
        "owners": state.get("owners", {}),
        "evaluation": state.get("evaluation"),
        "rejections": state["rejections"],
        "rejections_by_peer": state["rejections_by_peer"],
        "routing": routing_histogram(run_dir),
        "series": {k: v for k, v in rates.items() if k != "throughput"},
        "stale_seconds": round(stale, 1),
    }
