"""The ServerApp's side: a Flower ``Strategy`` that drives the coordinator core, round by round.

Each Flower round:

1. ``configure_train`` asks the core for one task per node (``ClaimTask`` on the node's behalf,
   preferring a path whose inner optimizer state the node keeps), fetches the path's modules
   (only those the node has not cached) and sends them, with the signed manifest and the shard
   files the node lacks, as dipaco wire frames. A node whose key is not known yet (new, or
   silent last round) is sent ``hello`` instead.
2. The replies are collected until every node has answered, or a quorum has and stragglers had
   ``straggler_seconds`` more, or ``round_timeout`` passed; leases are kept alive meanwhile.
3. ``aggregate_train`` hands each reply's envelope, the node's own signed ``SubmitDelta``, to
   :meth:`Coordinator.handle`: the same checks (signature, replay, access, ticket bound to the
   node's key, shape, norms, staleness) and the same per-module outer steps as every transport.
   A node that failed or did not answer loses only its task: the lease is released and the path
   is trained in a later round.

The core checkpoints module versions and outer-optimizer state as always; the node table
(keys, affinity, caches) is kept in ``flower_nodes.json`` so a restarted ServerApp resumes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dipaco.config import FlowerSection
from dipaco.coordinator.core import Coordinator
from dipaco.errors import DipacoError, RejectedError, WireError
from dipaco.fileio import write_json_atomic
from dipaco.flower import records as rec
from dipaco.protocols import auth
from dipaco.protocols import messages as m

log = logging.getLogger(__name__)


@dataclass
class Node:
    """What the ServerApp knows of one SuperNode."""

    key: str = ""  # its dipaco key, from its signed Hello
    peer_id: str = ""
    paths: list[int] = field(default_factory=list)  # inner state it keeps, most recent first
    modules: dict[str, int] = field(default_factory=dict)  # module versions it has cached
    files: dict[str, str] = field(default_factory=dict)  # run files it holds: name -> SHA-256
    missed: int = 0  # rounds in a row it did not answer
    last: str = ""  # the core's answer to its last delta, told to it with its next task
    tasks: int = 0  # deltas the core accepted from it
    gave_up: int | None = None  # the path of its last failed or lost task: offered to others first


@dataclass
class Sent:
    node_id: int
    op: str
    task: m.TaskOffer | None = None


class DipacoStrategy(Strategy):
    def __init__(
        self,
        core: Coordinator,
        settings: FlowerSection | None = None,
        *,
        state_file: Path | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        others = [mid for mid, owner in core.owners.items() if owner != core.owner_id]
        if others:
            raise DipacoError(
                f"under Flower the ServerApp's coordinator owns every module; {others} belong "
                "to other owners"
            )
        self.core = core
        self.settings = settings or FlowerSection()
        self.state_file = state_file
        self.on_round = on_round or (lambda info: None)
        self.nodes: dict[int, Node] = {}
        self.sent: dict[str, Sent] = {}  # Flower message id -> what it asked
        self.round_stats: dict[str, Any] = {}
        if state_file is not None and state_file.exists():
            try:
                saved = json.loads(state_file.read_text())
                self.nodes = {int(k): Node(**v) for k, v in saved.items()}
            except (ValueError, TypeError) as exc:
                log.warning("ignoring unreadable %s: %s", state_file, exc)

    # ---- Strategy -----------------------------------------------------------------------------
    def summary(self) -> None:
        c = self.core
        log.info(
            "dipaco over Flower: run %s, %d paths, %d rounds; round timeout %.0f s, quorum %.2f",
            c.run_id,
            c.topology.num_paths,
            c.rounds,
            self.settings.round_timeout,
            self.settings.quorum,
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord | None, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per node: its task, or ``hello`` while its key is unknown."""
        out: list[tuple[Message, Sent]] = []
        node_ids = sorted(int(n) for n in grid.get_node_ids())
        for nid in node_ids:
            self.nodes.setdefault(nid, Node())
        ready = [nid for nid in node_ids if self.nodes[nid].key and not self.nodes[nid].missed]
        for nid in node_ids:
            if nid not in ready:
                msg = Message(
                    rec.pack({"op": "hello", "run": self.core.run_id}),
                    dst_node_id=nid,
                    message_type="query",
                    group_id=str(server_round),
                    ttl=self.settings.round_timeout,
                )
                out.append((msg, Sent(nid, "hello")))
        for nid, prefer in self._preferences(ready):
            msg = self._task_message(server_round, nid, prefer)
            if msg is not None:
                out.append(msg)
        self._pending_sent = [sent for _, sent in out]
        return [msg for msg, _ in out]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accepted = refused = failed = 0
        taken = []
        for reply in replies:
            sent = self.sent.pop(reply.metadata.reply_to_message_id, None)
            if sent is not None:  # else a reply to a message of a round already closed
                taken.append((sent, reply))
        for i, (sent, reply) in enumerate(taken):
            # The replies came in time: their leases live until each is taken (taking one may
            # run an outer step), since an expired lease voids its ticket.
            self._keep_alive([s for s, _ in taken[i:]])
            outcome = self._take_reply(sent, reply)
            accepted += outcome == "accepted"
            refused += outcome == "refused"
            failed += outcome == "failed"
        self._save()
        return None, MetricRecord({"accepted": accepted, "refused": refused, "failed": failed})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # the coordinator evaluates after each outer step itself ([eval])

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        *,
        stop: Callable[[], bool] = lambda: False,
        **_: Any,
    ) -> Result:
        """Rounds until every module has made the run's outer steps (or ``num_rounds``)."""
        self.summary()
        result = Result()
        server_round = 0
        idle_since = time.monotonic()
        while not self.core.finished and not stop():
            if self.core.failure:
                raise DipacoError(self.core.failure)
            if num_rounds is not None and server_round >= num_rounds:
                break
            self.core.tick()
            messages = list(self.configure_train(server_round + 1, None, ConfigRecord(), grid))
            if not messages:
                if time.monotonic() - idle_since > 10:
                    log.info("waiting for nodes (%d known, no task to send)", len(self.nodes))
                    idle_since = time.monotonic()
                time.sleep(max(self.settings.poll_seconds, 0.5))
                continue
            server_round += 1
            began = time.monotonic()
            ids = list(grid.push_messages(messages))
            for mid, sent in zip(ids, self._pending_sent, strict=True):
                self.sent[mid] = sent
            replies = self._collect(grid, ids, timeout)
            _, metrics = self.aggregate_train(server_round, replies)
            self._missed(ids, replies)
            seconds = time.monotonic() - began
            info = {
                "event": "flower_round",
                "round": server_round,
                "messages": len(ids),
                "replies": len(replies),
                "seconds": round(seconds, 2),
                "outer_round": self.core.round,
                **({k: int(v) for k, v in metrics.items()} if metrics else {}),
            }
            self.core.metrics(info)
            self.on_round(info)
            if metrics is not None:
                result.train_metrics_clientapp[server_round] = metrics
            log.info(
                "flower round %d: %d/%d replies in %.1f s; outer round %d of %d",
                server_round,
                len(replies),
                len(ids),
                seconds,
                self.core.round,
                self.core.rounds,
            )
        if self.core.finished:
            self.announce_finished(grid)
        return result

    def announce_finished(self, grid: Grid, wait: float = 15.0) -> int:
        """Tell every node the run has finished (a ``finished`` query), so that each says so and
        exits instead of waiting for tasks; waits up to ``wait`` s for them to hear it."""
        node_ids = sorted(int(n) for n in grid.get_node_ids())
        if not node_ids:
            return 0
        messages = [
            Message(
                rec.pack({"op": "finished", "run": self.core.run_id, "round": self.core.round}),
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
            time.sleep(self.settings.poll_seconds)
        log.info("told %d of %d nodes that the run has finished", heard, len(ids))
        return heard

    # ---- sending ------------------------------------------------------------------------------
    def _preferences(self, ready: list[int]) -> list[tuple[int, int | None]]:
        """Each ready node with the path it should train: one whose inner state it holds if
        such a path is open, else one no other node holds state for. Nodes with their own
        path claim first, so that paths stay where their optimizer state is."""
        with self.core.lock:
            free = set(self.core.open_paths()) - self.core.scheduler.leased_paths()
        held = {p: nid for nid, node in self.nodes.items() for p in node.paths}
        own, rest = [], []
        for nid in ready:
            node = self.nodes[nid]
            mine = next((p for p in node.paths if p in free and p != node.gave_up), None)
            if mine is not None:
                free.discard(mine)
                own.append((nid, mine))
            else:
                rest.append(nid)
        out = list(own)
        # A node whose last task failed picks last, and not that path while another is free:
        # a node that keeps failing on a path must not hold it by affinity.
        for nid in sorted(rest, key=lambda n: self.nodes[n].gave_up is not None):
            gave_up = self.nodes[nid].gave_up
            pick = next((p for p in sorted(free) if held.get(p, nid) == nid and p != gave_up), None)
            if pick is not None:
                free.discard(pick)
            out.append((nid, pick))
        return out

    def _task_message(
        self, server_round: int, nid: int, prefer: int | None
    ) -> tuple[Message, Sent] | None:
        node, core = self.nodes[nid], self.core
        try:
            offer = core.act_for(node.key, m.ClaimTask(peer_id=node.peer_id, prefer_path=prefer))
            if not isinstance(offer, m.TaskOffer):
                return None  # nothing open for it now (or the run is over)
            path_mids = core.topology.path_modules(offer.path)
            have = {mid: node.modules[mid] for mid in path_mids if mid in node.modules}
            modules = core.act_for(
                node.key,
                m.FetchModules(
                    peer_id=node.peer_id, task_id=offer.task_id, have=have, ticket=offer.ticket
                ),
            )
            welcome = core.act_for(node.key, m.Hello(peer_id=node.peer_id, device="flower"))
        except RejectedError as exc:
            log.warning("node %d (%s): no task: %s (%s)", nid, node.peer_id, exc, exc.reason)
            return None
        files = self._bundle(node, offer)
        meta = {
            "op": "train",
            "welcome": bytes(m.encode_message(welcome)),
            "offer": bytes(m.encode_message(offer)),
            "last": node.last,
        }
        msg = Message(
            rec.pack(meta, {"modules": m.encode_message(modules)}, files),
            dst_node_id=nid,
            message_type="train",
            group_id=str(server_round),
            ttl=self.settings.round_timeout + 60,
        )
        return msg, Sent(nid, "train", offer)

    def _bundle(self, node: Node, offer: m.TaskOffer) -> dict[str, bytes]:
        """The task's shard files the node does not hold (by SHA-256), read from the run."""
        shard = offer.shard or f"shards/P{offer.path}/train"
        infos = offer.shard_files or {
            name: info
            for name, info in self.core.peer_config.get("files", {}).items()
            if name.startswith(shard + ".")
        }
        missing = [n for n, info in infos.items() if node.files.get(n) != info["sha256"]]
        total = sum(infos[n]["size"] for n in missing)
        if total > self.settings.max_bundle_mb * 2**20:
            log.warning(
                "node %s lacks %.0f MB of shard files (over flower.max_bundle_mb); it must be "
                "given the run's shards beforehand",
                node.peer_id,
                total / 2**20,
            )
            return {}
        return {n: self.core.files[n].read_bytes() for n in missing if n in self.core.files}

    # ---- receiving ----------------------------------------------------------------------------
    def _collect(self, grid: Grid, ids: list[str], timeout: float | None) -> list[Message]:
        """Replies until all are in, or the quorum is in and stragglers had their grace, or the
        round timed out; the leases of the round's tasks are kept alive meanwhile."""
        s = self.settings
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
                self._keep_leases(set(ids))
                beat = now
            time.sleep(s.poll_seconds)
        return replies

    def _keep_leases(self, waiting: set[str]) -> None:
        self._keep_alive([self.sent[mid] for mid in waiting if mid in self.sent])

    def _keep_alive(self, sents: list[Sent]) -> None:
        with self.core.lock:
            for sent in sents:
                node = self.nodes.get(sent.node_id)
                if sent.task is not None and node is not None:
                    self.core.scheduler.heartbeat(sent.task.task_id, node.peer_id)

    def _missed(self, ids: list[str], replies: list[Message]) -> None:
        answered = {r.metadata.reply_to_message_id for r in replies}
        for mid in ids:
            if mid in answered:
                continue
            sent = self.sent.pop(mid, None)
            if sent is None:
                continue
            node = self.nodes[sent.node_id]
            node.missed += 1
            self._release(node, sent, "no reply in time")
        self._save()

    def _release(self, node: Node, sent: Sent, why: str) -> None:
        if sent.task is None:
            return
        node.gave_up = sent.task.path
        try:
            self.core.act_for(
                node.key, m.ReleaseTask(peer_id=node.peer_id, task_id=sent.task.task_id)
            )
        except DipacoError as exc:
            log.warning("cannot release %s: %s", sent.task.task_id, exc)
        self.core.metrics(
            {
                "event": "flower_task_lost",
                "task": sent.task.task_id,
                "peer": node.peer_id,
                "path": sent.task.path,
                "why": why,
            }
        )
        log.warning("node %s lost task %s: %s", node.peer_id, sent.task.task_id, why)

    def _take_reply(self, sent: Sent, reply: Message) -> str:
        node = self.nodes.setdefault(sent.node_id, Node())
        who = node.peer_id or f"flower-node-{sent.node_id}"
        if reply.has_error():
            self._release(node, sent, f"Flower error: {reply.error.reason}")
            node.missed += 1
            return "failed"
        try:
            meta = rec.meta_of(reply.content)
            state = rec.state_report(meta)
            error = rec.text(meta, "error")
        except WireError as exc:
            self.core.refuse(who, exc.reason, str(exc))
            self._release(node, sent, f"malformed reply: {exc}")
            return "refused"
        node.modules, node.paths, node.files = state["modules"], state["paths"], state["files"]
        if error:
            self._release(node, sent, f"{rec.text(meta, 'reason')}: {error}")
            node.missed = 0
            return "failed"
        try:
            envelope = rec.blob(reply.content, "envelope")
        except WireError as exc:
            self.core.refuse(who, exc.reason, str(exc))
            self._release(node, sent, f"malformed reply: {exc}")
            return "refused"
        answer = self._handle(envelope)  # every check of the core; refusals counted there
        if sent.op == "hello":
            if isinstance(answer, m.Welcome):
                signed = auth.open_request(envelope)  # it passed the core's checks
                hello = m.decode_message(signed.body)
                node.key, node.peer_id, node.missed = signed.key, hello.peer_id, 0
                log.info("node %d is %s (%s)", sent.node_id, hello.peer_id, signed.key)
                return "hello"
            log.warning("node %d refused: %s", sent.node_id, getattr(answer, "message", answer))
            node.key = ""
            return "refused"
        node.missed = 0
        if isinstance(answer, m.DeltaAck):
            node.tasks += 1
            node.gave_up = None
            node.last = f"accepted {', '.join(answer.accepted)}"
            return "accepted"
        node.last = f"refused: {getattr(answer, 'reason', '?')}: {getattr(answer, 'message', '')}"
        self._release(node, sent, node.last)
        return "refused"

    def _handle(self, envelope: bytes) -> m.Message:
        """The core's answer to a node's envelope, opened with the core's own key."""
        try:
            nonce = auth.peek_nonce(envelope)
        except DipacoError:
            nonce = ""  # the core refuses it and says why, under no nonce
        sealed = self.core.handle(envelope)
        opened = auth.open_reply(sealed, nonce, self.core.identity.public_key)
        return m.decode_message(opened.body)

    def _save(self) -> None:
        if self.state_file is not None:
            write_json_atomic(
                self.state_file, {str(k): asdict(v) for k, v in sorted(self.nodes.items())}
            )
