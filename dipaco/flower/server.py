"""The ServerApp's round loop: Flower rounds until every module has made the run's outer steps.

Each round sends one message per node (``DipacoStrategy.configure_train``), collects replies
until all are in, or a quorum is in and stragglers had ``straggler_seconds`` more, or the round
timed out (keeping the round's leases alive meanwhile), hands them to ``aggregate_train``, and
releases the tasks of nodes that did not answer. At the end every node is told the run has
finished.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from dipaco.config import FlowerSection
from dipaco.coordinator.core import Coordinator
from dipaco.errors import DipacoError
from dipaco.flower import records as rec
from dipaco.flower.nodes import Node, NodeTable, Sent


class RoundDriver(Protocol):
    """What the loop needs of the strategy (DipacoStrategy is one)."""

    core: Coordinator
    settings: FlowerSection
    table: NodeTable
    sent: dict[str, Sent]
    on_round: Callable[[dict[str, Any]], None]
    _pending_sent: list[Sent]

    def summary(self) -> None: ...

    def configure_train(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, Any]: ...

    def release(self, node: Node, sent: Sent, why: str) -> None: ...

    def keep_leases(self, waiting: set[str]) -> None: ...


log = logging.getLogger(__name__)


def run_rounds(
    strategy: RoundDriver,
    grid: Grid,
    num_rounds: int | None = None,
    timeout: float | None = None,
    *,
    stop: Callable[[], bool] = lambda: False,
) -> Result:
    """Rounds until every module has made the run's outer steps (or ``num_rounds``)."""
    strategy.summary()
    result = Result()
    server_round = 0
    idle_since = time.monotonic()
    while not strategy.core.finished and not stop():
        if strategy.core.failure:
            raise DipacoError(strategy.core.failure)
        if num_rounds is not None and server_round >= num_rounds:
            break
        strategy.core.tick()
        messages = list(strategy.configure_train(server_round + 1, None, ConfigRecord(), grid))
        if not messages:
            if time.monotonic() - idle_since > 10:
                log.info("waiting for nodes (%d known, no task to send)", len(strategy.table.nodes))
                idle_since = time.monotonic()
            time.sleep(max(strategy.settings.poll_seconds, 0.5))
            continue
        server_round += 1
        began = time.monotonic()
        ids = list(grid.push_messages(messages))
        for mid, sent in zip(ids, strategy._pending_sent, strict=True):
            strategy.sent[mid] = sent
        replies = collect(strategy, grid, ids, timeout)
        _, metrics = strategy.aggregate_train(server_round, replies)
        missed(strategy, ids, replies)
        seconds = time.monotonic() - began
        info = {
            "event": "flower_round",
            "round": server_round,
            "messages": len(ids),
            "replies": len(replies),
            "seconds": round(seconds, 2),
            "outer_round": strategy.core.round,
            **({k: int(v) for k, v in metrics.items()} if metrics else {}),
        }
        strategy.core.metrics(info)
        strategy.on_round(info)
        if metrics is not None:
            result.train_metrics_clientapp[server_round] = metrics
        log.info(
            "flower round %d: %d/%d replies in %.1f s; outer round %d of %d",
            server_round,
            len(replies),
            len(ids),
            seconds,
            strategy.core.round,
            strategy.core.rounds,
        )
    if strategy.core.finished:
        within(ANNOUNCE_LIMIT_SECONDS, lambda: announce_finished(strategy, grid))
    return result


# The most the ServerApp waits to tell the nodes the run has finished. One fresh-clone run saw
# that take 3 minutes (a Flower grid call blocked, cause unknown) where it takes seconds; a node
# that is not told stops when the SuperLink says the run is over.
ANNOUNCE_LIMIT_SECONDS = 30.0


def within(limit: float, work: Callable[[], Any]) -> bool:
    """Run ``work`` on a daemon thread and wait at most ``limit`` seconds; False (and logged) if
    it had not returned by then (it is left to finish or die with the process)."""
    thread = threading.Thread(target=work, name="announce-finished", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        log.warning("telling the nodes the run has finished took over %.0f s: not waiting", limit)
        return False
    return True


def announce_finished(strategy: RoundDriver, grid: Grid, wait: float = 15.0) -> int:
    """Tell every node the run has finished (a ``finished`` query), so that each says so and
    exits instead of waiting for tasks; waits up to ``wait`` s for them to hear it."""
    node_ids = sorted(int(n) for n in grid.get_node_ids())
    if not node_ids:
        return 0
    messages = [
        Message(
            rec.pack({"op": "finished", "run": strategy.core.run_id, "round": strategy.core.round}),
            dst_node_id=nid,
            message_type="query",
            group_id="finished",
            ttl=wait,
        )
        for nid in node_ids
    ]
    ids = list(grid.push_messages(messages))
    waiting, heard, began = set(ids), 0, time.monotonic()
    while waiting and time.monotonic() - began < wait:
        for reply in grid.pull_messages(list(waiting)):
            waiting.discard(reply.metadata.reply_to_message_id)
            heard += 1
        time.sleep(strategy.settings.poll_seconds)
    log.info("told %d of %d nodes that the run has finished", heard, len(ids))
    return heard


def collect(
    strategy: RoundDriver, grid: Grid, ids: list[str], timeout: float | None
) -> list[Message]:
    """Replies until all are in, or the quorum is in and stragglers had their grace, or the
    round timed out; the leases of the round's tasks are kept alive meanwhile."""
    s = strategy.settings
    limit = timeout or s.round_timeout
    began = time.monotonic()
    quorum_at: float | None = None
    waiting, replies = set(ids), []
    beat = began
    while waiting:
        for reply in grid.pull_messages(list(waiting)):
            waiting.discard(reply.metadata.reply_to_message_id)
            replies.append(reply)
        now = time.monotonic()
        if not waiting or now - began > limit:
            break
        if quorum_at is None and len(replies) >= s.quorum * len(ids):
            quorum_at = now
        if quorum_at is not None and now - quorum_at > s.straggler_seconds:
            log.warning(
                "round closes with %d of %d replies (stragglers had %.0f s more)",
                len(replies),
                len(ids),
                s.straggler_seconds,
            )
            break
        if now - beat > 1.0:
            # Every task of the round, answered or not: a reply already in is taken only
            # when the round's collection ends, and an expired lease voids its ticket.
            strategy.keep_leases(set(ids))
            beat = now
        time.sleep(s.poll_seconds)
    return replies


def missed(strategy: RoundDriver, ids: list[str], replies: list[Message]) -> None:
    answered = {r.metadata.reply_to_message_id for r in replies}
    for mid in ids:
        if mid in answered:
            continue
        sent = strategy.sent.pop(mid, None)
        if sent is None:
            continue
        node = strategy.table.nodes[sent.node_id]
        node.missed += 1
        strategy.release(node, sent, "no reply in time")
    strategy.table.save()
