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

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from dipaco.config import FlowerSection
from dipaco.coordinator.core import Coordinator
from dipaco.data.shards import shard_name
from dipaco.errors import DipacoError, RejectedError, WireError
from dipaco.flower import records as rec
from dipaco.flower import server
from dipaco.flower.nodes import Node, NodeTable, Sent
from dipaco.protocols import auth
from dipaco.protocols import messages as m

log = logging.getLogger(__name__)


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
        self.on_round = on_round or (lambda info: None)
        self.table = NodeTable(state_file)
        self.nodes = self.table.nodes
        self.sent: dict[str, Sent] = {}  # Flower message id -> what it asked
        self.round_stats: dict[str, Any] = {}

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
        for nid, prefer in self.table.preferences(ready, self.core.free_paths()):
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
        self.table.save()
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
        """Rounds until every module has made the run's outer steps (or ``num_rounds``):
        server.py's loop."""
        return server.run_rounds(self, grid, num_rounds, timeout, stop=stop)

    # ---- sending ------------------------------------------------------------------------------

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
        # A routing phase's offer names its shard files; phase 0's are in the manifest.
        shard = offer.shard or shard_name(offer.path)
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
        return {n: data for n in missing if (data := self.core.run_file(n)) is not None}

    # ---- receiving ----------------------------------------------------------------------------

    def keep_leases(self, waiting: set[str]) -> None:
        self._keep_alive([self.sent[mid] for mid in waiting if mid in self.sent])

    def _keep_alive(self, sents: list[Sent]) -> None:
        held = [
            (sent.task.task_id, self.nodes[sent.node_id].peer_id)
            for sent in sents
            if sent.task is not None and sent.node_id in self.nodes
        ]
        self.core.keep_alive(held)

    def release(self, node: Node, sent: Sent, why: str) -> None:
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
            self.release(node, sent, f"Flower error: {reply.error.reason}")
            node.missed += 1
            return "failed"
        try:
            meta = rec.meta_of(reply.content)
            state = rec.state_report(meta)
            error = rec.text(meta, "error")
        except WireError as exc:
            self.core.refuse(who, exc.reason, str(exc))
            self.release(node, sent, f"malformed reply: {exc}")
            return "refused"
        node.modules, node.paths, node.files = state["modules"], state["paths"], state["files"]
        if error:
            self.release(node, sent, f"{rec.text(meta, 'reason')}: {error}")
            node.missed = 0
            return "failed"
        try:
            envelope = rec.blob(reply.content, "envelope")
        except WireError as exc:
            self.core.refuse(who, exc.reason, str(exc))
            self.release(node, sent, f"malformed reply: {exc}")
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
        self.release(node, sent, node.last)
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
