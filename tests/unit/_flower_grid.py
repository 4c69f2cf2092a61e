"""An in-process Flower ``Grid``: the real ServerApp strategy and ClientApp, without a SuperLink.

Messages are handed to the ClientApp in worker threads (one per node, like SuperNodes working in
parallel), with each node's own ``Context`` and node config. For the unit suite (it lives with
its tests, not in the package); a node can be made silent (``silence``) to test what a dead
SuperNode does to a round.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

RUN_ID = 1
SERVER_NODE = 0


class LocalGrid(Grid):
    def __init__(
        self,
        app: ClientApp,
        node_configs: dict[int, dict[str, Any]],
        run_config: dict[str, Any] | None = None,
    ) -> None:
        # Flower stamps new messages with the running task's identity; set it as its own
        # in-memory grid does.
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN_ID, 1, SERVER_NODE
        self.app = app
        self.node_configs = dict(node_configs)
        self.contexts = {
            nid: Context(RUN_ID, nid, dict(cfg), RecordDict(), dict(run_config or {}))
            for nid, cfg in node_configs.items()
        }
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(node_configs)))
        self.locks = {nid: threading.Lock() for nid in node_configs}  # one message at a time
        self.futures: dict[str, Future] = {}
        self.silent: set[int] = set()
        self._run: Run | None = None

    # ---- test controls ------------------------------------------------------------------------
    def silence(self, node_id: int) -> None:
        """The node stops answering (as if killed): its messages get no reply."""
        self.silent.add(node_id)

    def remove(self, node_id: int) -> None:
        """The node leaves the grid's node list."""
        self.node_configs.pop(node_id, None)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    # ---- Grid ---------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run  # type: ignore[return-value]

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.node_configs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            nid = msg.metadata.dst_node_id
            if nid in self.contexts and nid not in self.silent:
                self.futures[mid] = self.pool.submit(self._deliver, nid, msg)
            ids.append(mid)
        return ids

    def _deliver(self, nid: int, msg: Message) -> Message:
        with self.locks[nid]:
            return self.app(msg, self.contexts[nid])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for mid in message_ids:
            future = self.futures.get(mid)
            if future is None or not future.done():
                continue
            del self.futures[mid]
            reply = future.result()
            if reply.metadata.src_node_id in self.silent:
                continue  # silenced while it worked: its reply never arrives
            out.append(reply)
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        for mid in ids:
            future = self.futures.get(mid)
            if future is not None:
                future.exception(timeout)
        return self.pull_messages(ids)
