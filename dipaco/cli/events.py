"""One line per event of a coordinator's run, as a person reads it in a terminal or a log file."""

from __future__ import annotations

from dipaco.cli.common import console
from dipaco.run.metrics_log import MetricsLog

EVENT_TEXT = {
    "task_issued": "task {task} issued to {peer}: path P{path}, round {round_1}, {steps} steps",
    "delta": "task {task} done by {peer}: path P{path}, round {round_1}, loss {loss:.3f}",
    "outer_step": "module {module} -> v{version} ({n_paths} paths, closed by {closed_by})",
    "round": "round {round} complete",
    "task_released": "task {task} released by {peer}",
    "task_hedged": "task {task} issued to {peer}: a copy of the straggling task {copies}",
    "lease_expired": "task {task}: lease expired ({peer} went silent)",
    "eval": "round {round}: routed validation perplexity {ppl:.2f}",
    "owner_changed": "module {module} is now owned by {owner}",
    "banned": "key {key} banned: {reason}",
}


def print_event(e: dict) -> None:
    """One coordinator event as one line (``console.event``: plain, JSON or dimmed); events
    without a line of their own are not printed."""
    template = EVENT_TEXT.get(e.get("event", ""))
    if template is None or (e["event"] == "eval" and e.get("model", "dipaco") != "dipaco"):
        return
    values = dict(e)
    values["round_1"] = e.get("round", 0) + 1 if isinstance(e.get("round"), int) else "?"
    values["loss"] = (e.get("train_losses") or [float("nan")])[-1]
    values["n_paths"] = len(e.get("paths", []))
    try:
        text = template.format(**values)
    except (KeyError, ValueError, TypeError):
        text = f"{e['event']}: {e}"
    fields = {k: v for k, v in e.items() if isinstance(v, (str, int, float, bool))}
    console.event(e["event"], text, **{k: v for k, v in fields.items() if k != "event"})


def print_events(metrics: MetricsLog) -> None:
    """One line per task event of the coordinator, as it is logged in this process."""
    metrics.listeners.append(print_event)
