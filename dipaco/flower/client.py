"""The node's side: dipaco's peer, run on what one Flower message carried.

Every message starts a fresh ``flwr-clientapp`` process, so nothing is kept in memory between
rounds: the node's key, its peer id, each path's inner optimizer state and error-feedback
residuals (``Peer``'s per-path files), the cached module versions and the run files it was sent
all live in its state folder (``--node-config state-dir=...``) and survive restarts.

``hello`` answers with the node's signed ``Hello``; ``train`` runs one task with the ordinary
:class:`~dipaco.peer.peer.Peer`, through :class:`RelayTransport`, which answers the peer's requests
from the message (the manifest, the task, its modules, the shard files) and seals the peer's
``SubmitDelta`` with the node's key instead of sending it. The ServerApp hands that envelope to
the coordinator core, which checks it like any other request.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import RecordDict

from dipaco.data.shards import shard_name
from dipaco.errors import ConfigError, CorruptFileError, DipacoError, TransportError, WireError
from dipaco.faults import fault_point
from dipaco.fileio import write_json_atomic, write_private
from dipaco.flower import forward
from dipaco.flower import records as rec
from dipaco.peer.download import RunFiles
from dipaco.peer.identity import coordinator_trust, stable_peer_id
from dipaco.peer.modules import TaskAborted
from dipaco.peer.peer import Peer
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LoopbackServer, Transport
from dipaco.protocols.wire import (
    ByteBuffer,
    Frame,
    Outgoing,
    read_tensor_file,
    tensors_sha256,
    write_tensor_file,
)

log = logging.getLogger(__name__)


class RelayTransport(Transport):
    """The coordinator as one Flower message presents it: replies come from the message, and
    the one request that must reach the core, ``SubmitDelta``, is sealed and kept for the reply.

    Everything the peer trusts is signed by the coordinator's key whatever carried it: the
    manifest (``Welcome.signature``) and each module release (``Modules.signatures``), which
    :class:`Peer` checks against ``server_key`` as on every transport.
    """

    def __init__(
        self,
        welcome: m.Welcome,
        offer: m.TaskOffer,
        modules: m.Modules,
        files: dict[str, bytes],
    ) -> None:
        self.welcome, self.offer, self.modules, self.files = welcome, offer, modules, files
        self.submitted: bytes | None = None
        self.released = False

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        raise TransportError("a Flower node cannot call its coordinator; it only answers")

    def request(self, msg: m.Message) -> m.Message:
        if isinstance(msg, m.Hello):
            return self.welcome
        if isinstance(msg, m.FetchModules):
            if msg.task_id != self.offer.task_id:
                raise TransportError(f"this message carries task {self.offer.task_id} only")
            return self.modules
        if isinstance(msg, m.Heartbeat):  # the ServerApp keeps the lease while it waits
            return m.HeartbeatAck(lease_ok=True, deadline_in=self.offer.lease_seconds)
        if isinstance(msg, m.FetchFile):
            return self._chunk(msg)
        if isinstance(msg, m.SubmitDelta):
            if self.identity is None:
                raise TransportError("the relay has no key to sign the delta with")
            self.submitted, _ = auth.seal_request(self.identity, m.encode_message(msg))
            mids = sorted({key.partition("/")[0] for key in msg.tensors})
            # Handed to the ServerApp, which submits it; the node hears the outcome next round.
            return m.DeltaAck(accepted=mids, closed=[], task_done=True)
        if isinstance(msg, m.ReleaseTask):
            self.released = True
            return m.Ok()
        raise TransportError(f"{type(msg).__name__} cannot be relayed over Flower")

    def _chunk(self, req: m.FetchFile) -> m.FileChunk:
        data = self.files.get(req.name)
        if data is None:
            raise TransportError(
                f"the ServerApp did not send {req.name}, and this node has no valid copy",
                reason="missing-file",
            )
        piece = data[req.offset : req.offset + req.length]
        tensor = torch.frombuffer(bytearray(piece), dtype=torch.uint8) if piece else None
        return m.FileChunk(
            name=req.name,
            size=len(data),
            sha256="",
            offset=req.offset,
            tensors={"data": tensor if tensor is not None else torch.zeros(0, dtype=torch.uint8)},
        )


class NodeState:
    """What a node keeps between messages, all of it in ``state_dir``."""

    def __init__(self, state_dir: str | Path, node_config: dict[str, Any]) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = node_config
        self.identity = auth.Identity.load_or_create(self.dir / "signing.key")
        # the same rule as every dipaco-peer
        self.peer_id = stable_peer_id(self.dir, str(node_config.get("peer-id", "") or "") or None)
        self.cache_dir = self.dir / "flower" / "modules"

    # ---- trust --------------------------------------------------------------------------------
    def coordinator_key(self, offered: str) -> str:
        """The key this node insists on: ``coordinator-key`` from its node config, else the one
        it pinned on first use (kept per SuperLink address in known_coordinators.json)."""
        given = str(self.config.get("coordinator-key", "") or "")
        if given:
            return auth.check_public_key(given)
        where = str(self.config.get("superlink", "flower") or "flower")
        key, pin = coordinator_trust(self.dir, where, None)
        if key is None:
            pin(offered)  # logs that it is trusted on first use
            return offered
        return key

    # ---- what the node holds ------------------------------------------------------------------
    def report(self) -> str:
        modules = {}
        for file in sorted(self.cache_dir.glob("*.dpt")):
            try:
                frame = read_tensor_file(file)
                modules[str(frame.fields["module"])] = int(frame.fields["version"])
            except (CorruptFileError, KeyError, ValueError, TypeError):
                file.unlink(missing_ok=True)
        inner = sorted(
            (self.dir / "inner").glob("P*.dpt"), key=lambda f: f.stat().st_mtime, reverse=True
        )
        paths = [int(f.stem[1:]) for f in inner if f.stem[1:].isdigit()]
        files_index = self.dir / "flower" / "files.json"
        files = json.loads(files_index.read_text()) if files_index.exists() else {}
        return json.dumps({"modules": modules, "paths": paths, "files": files})

    def load_cache(self, mids: list[str]) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
        cache = {}
        for mid in mids:
            file = self.cache_dir / f"{mid}.dpt"
            try:
                frame = read_tensor_file(file)
            except (OSError, CorruptFileError, ValueError):
                continue
            if tensors_sha256(frame.tensors) == frame.fields.get("hash"):
                cache[mid] = (int(frame.fields["version"]), frame.tensors)
        return cache

    def save_cache(self, cache: dict[str, tuple[int, dict[str, torch.Tensor]]]) -> None:
        for mid, (version, tensors) in cache.items():
            fields = {"module": mid, "version": version, "hash": tensors_sha256(tensors)}
            write_tensor_file(self.cache_dir / f"{mid}.dpt", Frame("CachedModule", fields, tensors))

    def remember_files(self, infos: dict[str, dict[str, Any]]) -> None:
        index = self.dir / "flower" / "files.json"
        known = json.loads(index.read_text()) if index.exists() else {}
        known.update({name: info["sha256"] for name, info in infos.items()})
        write_json_atomic(index, known)

    # ---- the two operations -------------------------------------------------------------------
    def hello(self) -> bytes:
        device = str(self.config.get("device", "auto") or "auto")
        hello = m.Hello(
            peer_id=self.peer_id,
            device=device,
            capabilities={"transport": "flower", "pid": os.getpid()},
        )
        sealed, _ = auth.seal_request(self.identity, m.encode_message(hello))
        return sealed

    def train(
        self, meta: dict[str, Any], blobs: dict[str, bytes], files: dict[str, bytes]
    ) -> tuple[str, bytes]:
        welcome = m.decode_message(rec.raw(meta, "welcome"))
        offer = m.decode_message(rec.raw(meta, "offer"))
        if "modules" not in blobs:
            raise WireError("a train message must carry the modules frame")
        modules = m.decode_message(blobs["modules"])
        if not (
            isinstance(welcome, m.Welcome)
            and isinstance(offer, m.TaskOffer)
            and isinstance(modules, m.Modules)
        ):
            raise ConfigError("a train message must carry a Welcome, a TaskOffer and Modules")
        last = rec.text(meta, "last")
        if last:
            log.info("node %s: the coordinator's answer to the last delta: %s", self.peer_id, last)
        relay = RelayTransport(welcome, offer, modules, files)
        offered = str(welcome.config.get("coordinator_key", ""))
        relay.authenticate(self.identity, self.coordinator_key(offered))
        run_id = str(welcome.config.get("run_id", "run"))
        if not run_id or not all(c.isalnum() or c in "._-" for c in run_id) or run_id[0] == ".":
            raise ConfigError(f"refusing run id {run_id!r}: not a plain folder name")
        files = RunFiles(
            relay, self.peer_id, welcome.config.get("files", {}), self.dir / "runs" / run_id
        )
        memory_gb = self.config.get("memory-gb")
        peer = Peer(
            relay,
            self.peer_id,
            self.dir,
            device=str(self.config.get("device", "auto") or "auto"),
            identity=self.identity,
            shard_source=files.shard,
            memory_bytes=int(float(memory_gb) * 2**30) if memory_gb else None,
            max_tasks=1,
        )
        peer.setup()
        path_mids = peer.topology.path_modules(offer.path)
        peer.cache = self.load_cache(path_mids)
        began = time.monotonic()
        peer.run_task(offer)
        if relay.submitted is None:
            raise TransportError("the task ended without a delta")
        self.save_cache({mid: peer.cache[mid] for mid in path_mids if mid in peer.cache})
        shard = offer.shard or shard_name(offer.path)
        infos = offer.shard_files or {
            name: info
            for name, info in welcome.config.get("files", {}).items()
            if name.startswith(shard + ".")
        }
        self.remember_files(infos)
        log.info(
            "node %s: %s trained in %.1f s", self.peer_id, offer.task_id, time.monotonic() - began
        )
        return offer.task_id, relay.submitted


def answer(op: str, content: Any, node_config: dict[str, Any]) -> RecordDict:
    """The reply content for one Flower message, computed in this process."""
    try:
        meta, blobs, files = rec.meta_of(content), rec.blobs_of(content), rec.files_of(content)
    except WireError as exc:
        return rec.pack({"op": op, "error": str(exc), "reason": exc.reason})
    reply, reply_blobs = respond(op, meta, blobs, files, node_config)
    return rec.pack(reply, reply_blobs)


def respond(
    op: str,
    meta: dict[str, Any],
    blobs: dict[str, bytes],
    files: dict[str, bytes],
    node_config: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The reply (fields and frames) for one operation (``hello`` or ``train``); failures
    become an error field with a reason, so the ServerApp frees the task at once instead of
    waiting for the round to time out."""
    state_dir = node_config.get("state-dir")
    if not state_dir:
        return {"op": op, "error": "the node config has no state-dir", "reason": "config"}, {}
    node = NodeState(str(state_dir), node_config)
    try:
        if op == "hello":
            return {"op": op, "state": node.report()}, {"envelope": node.hello()}
        if op == "finished":
            # `dipaco-peer join --flower` watches for this file, says so and exits
            write_json_atomic(
                Path(str(state_dir)) / "flower" / "finished.json",
                {"run": str(meta.get("run", "")), "round": meta.get("round")},
            )
            return {"op": op}, {}
        if op == "train":
            fault_point("flower.train")  # sleep:S makes a node whose call hangs
            task_id, envelope = node.train(meta, blobs, files)
            if fault_point("flower.reply"):  # corrupt: the body no longer matches its signature
                envelope = envelope[:-1] + bytes([envelope[-1] ^ 0xFF])
            return {"op": op, "task": task_id, "state": node.report()}, {"envelope": envelope}
        raise ConfigError(f"unknown dipaco operation {op!r}")
    except (DipacoError, TaskAborted) as exc:
        reason = getattr(exc, "reason", "aborted")
        log.warning("node %s: %s failed: %s (%s)", node.peer_id, op, exc, reason)
        return {"op": op, "error": str(exc), "reason": reason, "state": node.report()}, {}
    except Exception as exc:  # a bug or a broken device: say so rather than time out
        log.error("node %s: %s failed:\n%s", node.peer_id, op, traceback.format_exc())
        return {"op": op, "error": f"{type(exc).__name__}: {exc}", "reason": "node-error"}, {}


class NodeTrainer:
    """The warm half of a node: runs :func:`respond` in the long-lived ``dipaco-peer join
    --flower`` process, for the ClientApps the SuperNode starts (``forward.ask``), so that a
    round does not pay for importing torch and dipaco in a fresh process. One task at a time.

    It listens on 127.0.0.1 behind multiprocessing's HMAC challenge, keyed with
    ``<state-dir>/flower/trainer.key`` (mode 0600): only processes that can read the node's
    state folder get in.
    """

    def __init__(
        self,
        node_config: dict[str, Any],
        on_task: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.config = dict(node_config)
        self.on_task = on_task or (lambda info: None)
        self.key_file = Path(str(node_config["state-dir"])) / "flower" / "trainer.key"
        key = secrets.token_bytes(32)
        write_private(self.key_file, key.hex())
        self.lock = threading.Lock()
        self.served = 0  # messages answered
        self.server = LoopbackServer(self._handle, key, host="127.0.0.1", port=0)

    @property
    def node_config(self) -> dict[str, Any]:
        """What the SuperNode's ClientApps need to find this trainer."""
        return {"trainer": self.server.address, "trainer-key": str(self.key_file)}

    def _handle(self, data: bytes) -> bytes:
        began = time.monotonic()
        try:
            op, meta, parts = forward.decode(data)
        except WireError as exc:
            return forward.encode("error", {"error": str(exc), "reason": exc.reason}, {})
        blobs = {k[5:]: v for k, v in parts.items() if k.startswith("blob:")}
        files = {k[5:]: v for k, v in parts.items() if k.startswith("file:")}
        with self.lock:
            reply, reply_blobs = respond(op, meta, blobs, files, self.config)
            self.served += 1
        self.on_task({"op": op, "seconds": time.monotonic() - began, **reply})
        return forward.encode(op, reply, {f"blob:{k}": v for k, v in reply_blobs.items()})

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving; a task being trained gets up to ``timeout`` seconds to finish."""
        self.server.close(timeout)
