"""A byte transport over hivemind: a DHT for discovery plus libp2p streams for the frames.

One :class:`HivemindNode` is one hivemind DHT (a forked process that owns a ``p2pd`` daemon) plus a
replica of its P2P handle, driven from a private asyncio loop in a daemon thread. A coordinator
calls :meth:`HivemindNode.serve` with its ``bytes -> bytes`` handler; a peer gets a
:class:`HivemindTransport` from :meth:`HivemindNode.transport` and sends requests through it.

Wire form (one stream-in, stream-out RPC per request; opaque bytes, nothing is pickled):

* request: ``ExpertRequest`` messages. The first one carries a JSON header in ``uid``
  (``{"v": 1, "size": N, "sha256": HEX}``); every message carries up to 1 MiB of the payload in
  ``metadata``.
* reply: ``ExpertResponse`` messages. The first one is a JSON header in ``metadata``: either
  ``{"v": 1, "size": N, "sha256": HEX}`` followed by the payload in 1 MiB chunks, or
  ``{"v": 1, "error": REASON, "message": TEXT}`` when the server refused the transfer.

Both sides check the size and the SHA-256 at the end: a stream whose sender died can end early
without any error, and this is the only way to notice. The server refuses a header size above its
limit before reading any more. The handler runs in a thread pool, never on the event loop.

Crash cleanup: if a node's Python process dies (even by SIGKILL), its forked DHT process notices
that its parent changed, kills its own children (``p2pd``) and exits; ``p2pd`` is also started with
``PR_SET_PDEATHSIG`` so it dies with the DHT process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator hints

from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import use_hivemind_log_handler
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols.transport import Handler, Transport

log = logging.getLogger(__name__)
# hivemind's own log lines go through the root logger, formatted and filtered as ours are
use_hivemind_log_handler("nowhere")

CHUNK = 1 << 20
WIRE_VERSION = 1
MAX_HEADER_CHARS = 4096
# Rejections that mean "this request will never be accepted": the client raises RejectedError.
# Everything else (truncated, hash-mismatch, timeout, handler-error...) is a TransportError.
FINAL_REASONS = frozenset({"too-large", "bad-header"})
DRAIN_SECONDS = 10.0  # how long a refusing server keeps reading, so its refusal arrives


# ---- crash cleanup (runs inside the forked DHT process) ---------------------------------------

PR_SET_PDEATHSIG = 1


def _child_pids(pid: int) -> list[int]:
    """Pids whose parent is ``pid``, read from /proc."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


# In the DHT process: unix socket files of the parent's P2P replica, removed if the parent dies.
_parent_files: list[str] = []


async def _remember_parent_files(_dht: DHT, _node: Any, paths: list[str]) -> None:
    _parent_files.extend(paths)


def _watch_parent(parent_pid: int, interval: float, files: Callable[[], list[str]]) -> None:
    """Exit this process, killing its children and removing the daemon's socket files, as soon
    as ``parent_pid`` is no longer our parent."""
    while True:
        time.sleep(interval)
        if os.getppid() != parent_pid:
            for pid in _child_pids(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for path in files():
                try:
                    os.remove(path)
                except OSError:
                    pass
            os._exit(0)


def _install_pdeathsig_for_subprocesses() -> None:
    """Make every subprocess that asyncio starts in this process die when this process dies.

    hivemind starts ``p2pd`` with ``asyncio.subprocess.create_subprocess_exec``; this wraps it (in
    the forked DHT process only) to add a ``preexec_fn`` calling ``prctl(PR_SET_PDEATHSIG,
    SIGKILL)``. The DHT process's loop runs on its main thread, which lives as long as the process,
    so the signal is not fired early by a thread exit.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    me = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:  # the parent died before prctl took effect
            os._exit(1)

    original = asyncio.subprocess.create_subprocess_exec

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", preexec)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def _remove_stale_sockets(since: float) -> list[str]:
    """Remove hivemind daemon socket files made since ``since`` that nothing listens on: a
    daemon that failed to start (a dead bootstrap address, a bad multiaddr) leaves its file."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("hivemind-p2pd-*.sock"):
        try:
            if path.stat().st_mtime < since - 1.0:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(str(path))
        except ConnectionRefusedError:
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass
        except OSError:  # gone already, or someone listens: not ours to remove
            continue
    return removed


class _WatchedDHT(DHT):
    """A hivemind DHT whose process (and its p2pd) dies when the process that started it dies."""

    watch_interval = 0.5

    def run(self) -> None:
        _install_pdeathsig_for_subprocesses()
        threading.Thread(
            target=_watch_parent,
            args=(self._parent_pid, self.watch_interval, self._socket_files),
            name="dipaco-parent-watch",
            daemon=True,
        ).start()
        super().run()

    def _socket_files(self) -> list[str]:
        paths = list(_parent_files)
        p2p = getattr(getattr(self, "_node", None), "p2p", None)
        for maddr in (
            getattr(p2p, "_daemon_listen_maddr", None),
            getattr(p2p, "_client_listen_maddr", None),
        ):
            try:
                paths.append(maddr["unix"])
            except Exception:  # no such attribute, or not a unix socket
                pass
        return paths


# ---- rate limiting ----------------------------------------------------------------------------


class _TokenBucket:
    """A token bucket in bytes; ``consume`` sleeps while the bucket is in debt."""

    def __init__(self, mbps: float, burst: int = CHUNK) -> None:
        if mbps <= 0:
            raise ValueError(f"max_mbps must be positive, got {mbps}")
        self.rate = mbps * 1e6 / 8  # bytes per second
        self.burst = burst
        self.tokens = 0.0
        self.stamp = time.monotonic()

    async def consume(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


# ---- framing helpers --------------------------------------------------------------------------


def _chunks(data: bytes) -> Iterator[bytes]:
    """The payload in CHUNK-sized pieces (one copy per piece: protobuf needs bytes)."""
    if len(data) <= CHUNK and isinstance(data, bytes):
        yield data
        return
    view = memoryview(data)
    for offset in range(0, max(len(view), 1), CHUNK):
        yield bytes(view[offset : offset + CHUNK])


def _header(size: int, digest: str) -> str:
    return json.dumps({"v": WIRE_VERSION, "size": size, "sha256": digest})


def _error_header(reason: str, message: str) -> bytes:
    return json.dumps({"v": WIRE_VERSION, "error": reason, "message": message}).encode()


def _parse_header(raw: str | bytes) -> dict:
    """A transfer header, or ValueError with what is wrong with it."""
    if len(raw) > MAX_HEADER_CHARS:
        raise ValueError(f"header of {len(raw)} bytes is too long")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    if "error" in header:
        return header
    size, digest = header.get("size"), header.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"bad size {size!r}")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ValueError(f"bad sha256 {digest!r}")
    return header


def _transport_part(maddr: Multiaddr, peer_id: str) -> Multiaddr:
    """``maddr`` without its ``/p2p/<id>`` part, which p2pd's CONNECT wants left out (hivemind
    encodes that part in a form the daemon cannot parse)."""
    if "p2p" in maddr:
        if maddr["p2p"] != peer_id:
            raise ValueError(f"{maddr} belongs to another peer")
        maddr = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
    return maddr


class _Reject(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---- server -----------------------------------------------------------------------------------


class _ByteServicer(ServicerBase):
    """Serves one ``bytes -> bytes`` handler as the ``rpc_call`` stream RPC."""

    def __init__(
        self,
        node: HivemindNode,
        handler: Handler,
        executor: concurrent.futures.ThreadPoolExecutor,
        max_request_bytes: int,
        read_timeout: float,
    ) -> None:
        self._node = node
        self._handler = handler
        self._executor = executor
        self._max = max_request_bytes
        self._read_timeout = read_timeout

    def _job(self, chunks: list[bytes], size: int, digest: str) -> tuple[bytes, str]:
        """Runs in the pool: assemble and check the request, call the handler, hash the reply."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if len(data) != size:  # cannot happen: the reader counts bytes; kept as a guard
            raise _Reject("truncated", f"request truncated: got {len(data)} of {size} bytes")
        if hashlib.sha256(data).hexdigest() != digest:
            raise _Reject("hash-mismatch", f"request of {size} bytes fails its SHA-256 check")
        self._node._record("handler_calls", 1)
        try:
            reply = self._handler(data)
        except Exception as exc:
            log.exception("hivemind transport: handler failed")
            raise _Reject("handler-error", f"handler failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, bytes | bytearray | memoryview):
            raise _Reject("handler-error", f"handler returned {type(reply).__name__}, not bytes")
        reply = bytes(reply) if not isinstance(reply, bytes) else reply
        return reply, hashlib.sha256(reply).hexdigest()

    async def _next(self, stream: AsyncIterator[runtime_pb2.ExpertRequest]):
        try:
            return await asyncio.wait_for(stream.__anext__(), self._read_timeout)
        except TimeoutError:
            raise _Reject(
                "timeout", f"no request data for {self._read_timeout:.0f} s; transfer dropped"
            ) from None

    async def _receive(
        self, stream: AsyncIterator[runtime_pb2.ExpertRequest]
    ) -> tuple[list[bytes], int, str]:
        try:
            first = await self._next(stream)
        except StopAsyncIteration:
            raise _Reject("bad-header", "empty request stream") from None
        try:
            header = _parse_header(first.uid)
            if "error" in header:
                raise ValueError("a request header cannot carry an error")
        except ValueError as exc:
            raise _Reject("bad-header", f"bad request header: {exc}") from None
        size, digest = header["size"], header["sha256"]
        if size > self._max:
            raise _Reject(
                "too-large", f"request of {size} bytes exceeds the limit of {self._max} bytes"
            )
        chunks: list[bytes] = []
        got = 0
        msg = first
        while True:
            piece = msg.metadata
            if piece:
                got += len(piece)
                self._node._record("bytes_in", len(piece))
                if got > size:
                    raise _Reject("overrun", f"request overruns its header: {got} > {size} bytes")
                chunks.append(piece)
            try:
                msg = await self._next(stream)
            except StopAsyncIteration:
                if got < size:
                    raise _Reject(
                        "truncated", f"request truncated: got {got} of {size} bytes"
                    ) from None
                # The sender has finished writing: a reply cannot collide with its writes.
                return chunks, size, digest

    async def _drain(self, stream: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """Read and drop what the caller still sends, until it ends or hangs up (bounded).

        A reply written while the caller is still writing can be lost: when the server closes the
        stream, the caller's next write fails and that error also ends its read side.
        """
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.wait_for(stream.__anext__(), left)
        except (StopAsyncIteration, TimeoutError):
            pass

    async def rpc_call(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        node = self._node
        node._record("requests", 1)
        remote = context.remote_id.to_base58() if context.remote_id is not None else "?"
        stream = requests.__aiter__()
        try:
            chunks, size, digest = await self._receive(stream)
            loop = asyncio.get_running_loop()
            reply, reply_digest = await loop.run_in_executor(
                self._executor, self._job, chunks, size, digest
            )
        except _Reject as rej:
            node._reject(rej.reason)
            log.debug("hivemind transport: rejected a request from %s: %s", remote, rej)
            yield runtime_pb2.ExpertResponse(metadata=_error_header(rej.reason, str(rej)))
            await self._drain(stream)
            return
        except asyncio.CancelledError:
            # The caller went away (killed, or cancelled its call) mid-transfer.
            node._reject("aborted")
            log.debug("hivemind transport: a request from %s was aborted", remote)
            raise
        node._record("handled", 1)
        handed = 0  # reply bytes handed to hivemind to send
        try:
            yield runtime_pb2.ExpertResponse(metadata=_header(len(reply), reply_digest).encode())
            for piece in _chunks(reply):
                if piece:
                    handed += len(piece)
                    node._record("bytes_out", len(piece))
                    yield runtime_pb2.ExpertResponse(metadata=piece)
        finally:
            # hivemind stops pulling from (and then closes) this generator when the caller hangs up
            if handed < len(reply):
                node._reject("reply-aborted")
                log.debug("hivemind transport: %s hung up before the whole reply", remote)


# ---- the node ---------------------------------------------------------------------------------


class HivemindNode:
    """One hivemind DHT node plus a P2P handle (dht.replicate_p2p()) driven from a private asyncio
    loop thread."""

    def __init__(
        self,
        *,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        client_mode: bool = False,
        identity_path: str | Path | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.client_mode = client_mode
        self.stats: dict[str, Any] = {
            "requests": 0,  # streams opened by callers
            "handler_calls": 0,  # requests that passed their checks and reached the handler
            "handled": 0,  # handler calls that returned a reply
            "bytes_in": 0,
            "bytes_out": 0,
            "rejected": {},  # reason -> count
        }
        self._stats_lock = threading.Lock()
        self._closed = False
        self._close_lock = threading.Lock()
        self._servicer: _ByteServicer | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._dht_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._p2p: P2P | None = None
        self._started_at = time.time()

        kwargs: dict[str, Any] = {"client_mode": client_mode}
        if client_mode:
            kwargs["no_listen"] = True  # dial out only: never listen (a peer behind NAT)
        else:
            kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
        if identity_path is not None:
            kwargs["identity_path"] = str(identity_path)
        self._dht = _WatchedDHT(
            initial_peers=list(initial_peers), start=False, shutdown_timeout=5, **kwargs
        )
        try:
            self._dht.run_in_background(await_ready=True, timeout=start_timeout)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="dipaco-hivemind-loop", daemon=True
            )
            self._thread.start()
            self._p2p = self._submit(self._dht.replicate_p2p(), start_timeout)
            replica_socket = self._p2p._client_listen_maddr["unix"]
            self._dht.run_coroutine(partial(_remember_parent_files, paths=[replica_socket]))
        except BaseException as exc:
            self.shutdown()
            if isinstance(exc, Exception):
                # one line, without the daemon's own "2026/11/25 15:43:58" log stamps
                why = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", " ".join(str(exc).split()))
                raise TransportError(f"cannot start a hivemind node: {why}") from exc
            raise
        self.peer_id: str = self._p2p.peer_id.to_base58()
        log.debug("hivemind node %s started (client_mode=%s)", self.peer_id, client_mode)

    # -- plumbing --

    def _submit(self, coro, timeout: float | None):
        """Run a coroutine on the node's loop from another thread and wait for its result."""
        if self._loop is None or self._loop.is_closed():
            coro.close()
            raise TransportError("the hivemind node is shut down")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking call made from the hivemind node's own loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout} s") from None

    def _record(self, key: str, n: int) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def _reject(self, reason: str) -> None:
        with self._stats_lock:
            rejected = self.stats["rejected"]
            rejected[reason] = rejected.get(reason, 0) + 1

    # -- DHT --

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) other nodes can dial; [] for a node that does not listen."""
        try:
            return [str(m) for m in self._submit(self._p2p.get_visible_maddrs(latest=True), 30.0)]
        except ValueError:  # hivemind raises this when the daemon listens nowhere
            return []

    def store(self, key: str, value: Any, ttl: float, subkey: str | None = None) -> bool:
        """Store a JSON-like value for ``ttl`` seconds (under ``subkey`` for a dictionary value).

        Returns False when the DHT refused it (e.g. a record with a later expiration exists).
        """
        with self._dht_lock:
            fut = self._dht.store(
                key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True
            )
        return bool(fut.result())

    def get(self, key: str) -> Any:
        """The latest value under ``key``: the plain value, ``{subkey: value}`` for a dictionary
        value, or None when absent or expired."""
        with self._dht_lock:
            fut = self._dht.get(key, latest=True, return_future=True)
        found = fut.result()
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict) and all(
            isinstance(item, ValueWithExpiration) for item in value.values()
        ):  # a dictionary value: {subkey: ValueWithExpiration}
            return {sub: item.value for sub, item in value.items()}
        return value

    # -- server --

    def serve(
        self,
        handler: Callable[[bytes], bytes],
        *,
        max_request_bytes: int = 1 << 31,
        workers: int = 8,
        read_timeout: float = 120.0,
    ) -> None:
        """Answer requests from other nodes with ``handler`` (run in a pool of ``workers`` threads).

        ``read_timeout`` drops a transfer whose sender sends nothing for that many seconds.
        """
        if self._servicer is not None:
            raise RuntimeError("this hivemind node already serves a handler")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="dipaco-hivemind-handler"
        )
        servicer = _ByteServicer(self, handler, self._executor, max_request_bytes, read_timeout)
        self._submit(servicer.add_p2p_handlers(self._p2p), 30.0)
        self._servicer = servicer

    # -- client --

    def transport(
        self,
        target_peer_id: str,
        target_maddrs: Sequence[str] = (),
        *,
        timeout: float = 120.0,
        max_mbps: float | None = None,
    ) -> HivemindTransport:
        return HivemindTransport(
            self, target_peer_id, target_maddrs, timeout=timeout, max_mbps=max_mbps
        )

    # -- shutdown --

    async def _aclose(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        if self._p2p is not None and self._servicer is not None:
            try:
                await asyncio.wait_for(self._servicer.remove_p2p_handlers(self._p2p), 5)
            except Exception:  # the daemon may already be gone
                log.debug("hivemind node: removing handlers failed", exc_info=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._p2p is not None:
            await self._p2p.shutdown()

    def shutdown(self) -> None:
        """Stop the loop thread, the P2P replica and the DHT process (and its p2pd). Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            try:
                self._submit(self._aclose(), 15.0)
            except Exception:
                log.debug("hivemind node: closing the loop failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10.0)
        if loop is not None and not loop.is_running():
            loop.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            self._dht.shutdown()
        except Exception:
            log.debug("hivemind node: DHT shutdown failed", exc_info=True)
        if self._dht.is_alive():
            self._dht.kill()
            self._dht.join(5.0)
        _remove_stale_sockets(self._started_at)

    def __enter__(self) -> HivemindNode:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# ---- the client transport ---------------------------------------------------------------------


class HivemindTransport(Transport):
    """A peer's transport to one coordinator's node; requests may run concurrently.

    ``bytes_sent``/``bytes_received`` count payload bytes this client put on / took off the wire.
    ``max_mbps`` caps both directions (a token bucket each), in megabits per second.
    """

    def __init__(
        self,
        node: HivemindNode,
        target_peer_id: str,
        target_maddrs: Sequence[str] = (),
        *,
        timeout: float = 120.0,
        max_mbps: float | None = None,
        max_reply_bytes: int = 1 << 31,
    ) -> None:
        self.node = node
        self.target = target_peer_id
        try:
            self._peer = PeerID.from_base58(target_peer_id)
            self._maddrs = [_transport_part(Multiaddr(m), target_peer_id) for m in target_maddrs]
        except Exception as exc:
            raise TransportError(f"bad hivemind address for {target_peer_id}: {exc}") from None
        self.timeout = timeout
        self.max_mbps = max_mbps
        self._moved_at = 0.0  # loop time of the last chunk sent or received
        self.max_reply_bytes = max_reply_bytes
        self._up = _TokenBucket(max_mbps) if max_mbps else None
        self._down = _TokenBucket(max_mbps) if max_mbps else None
        self._dialed = not self._maddrs
        self.bytes_sent = 0
        self.bytes_received = 0

    async def _dial(self) -> None:
        """Tell our p2pd where the target listens (adds the addresses to its peerstore, connects)."""
        try:
            await self.node._p2p._client.connect(self._peer, self._maddrs)
            self._dialed = True
        except Exception as exc:  # the call below reports the failure if it matters
            log.debug("hivemind transport: dialing %s failed: %s", self.target, exc)

    async def _requests(self, data: bytes, header: str) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        first = True
        for piece in _chunks(data):
            if self._up is not None:  # wait before a piece, so the stream ends right after the last
                await self._up.consume(len(piece))
            if first:
                yield runtime_pb2.ExpertRequest(uid=header, metadata=piece)
                first = False
            else:
                yield runtime_pb2.ExpertRequest(metadata=piece)
            self.bytes_sent += len(piece)
            self._moved_at = asyncio.get_running_loop().time()

    async def _call(self, data: bytes, header: str) -> tuple[list[bytes], int, str]:
        if not self._dialed:
            await self._dial()
        stub = _ByteServicer.get_stub(self.node._p2p, self._peer)
        responses = await stub.rpc_call(self._requests(data, header))
        try:
            reply_header = None
            chunks: list[bytes] = []
            got = 0
            async for msg in responses:
                if reply_header is None:
                    try:
                        reply_header = _parse_header(msg.metadata)
                    except ValueError as exc:
                        raise TransportError(
                            f"bad reply header from {self.target}: {exc}"
                        ) from None
                    if "error" in reply_header:
                        reason = str(reply_header["error"])
                        text = f"{self.target} refused the transfer: {reply_header.get('message')}"
                        if reason in FINAL_REASONS:
                            raise RejectedError(text, reason=reason)
                        raise TransportError(text, reason=reason)
                    size = reply_header["size"]
                    if size > self.max_reply_bytes:
                        raise TransportError(
                            f"reply of {size} bytes exceeds the limit of "
                            f"{self.max_reply_bytes} bytes",
                            reason="too-large",
                        )
                    if size == 0:
                        break
                    continue
                piece = msg.metadata
                self._moved_at = asyncio.get_running_loop().time()
                got += len(piece)
                self.bytes_received += len(piece)
                if got > size:
                    raise TransportError(
                        f"reply overruns its header: {got} > {size} bytes", reason="overrun"
                    )
                chunks.append(piece)
                if self._down is not None:
                    await self._down.consume(len(piece))
                if got == size:
                    break
        finally:
            await responses.aclose()
        if reply_header is None:
            raise TransportError(f"{self.target} closed the stream without a reply")
        if got != size:
            raise TransportError(f"reply truncated: got {got} of {size} bytes", reason="truncated")
        return chunks, size, reply_header["sha256"]

    async def _within_budget(self, data: bytes, header: str):
        """``_call``, given up when no byte has moved either way for ``timeout`` seconds: a
        stalled or hung call fails, a long transfer (a big module, a rate-capped link) does not."""
        loop = asyncio.get_running_loop()
        self._moved_at = loop.time()
        task = asyncio.ensure_future(self._call(data, header))
        while True:
            remaining = self._moved_at + self.timeout - loop.time()
            if remaining <= 0:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise TimeoutError
            done, _ = await asyncio.wait({task}, timeout=min(remaining, 1.0))
            if done:
                return task.result()

    async def _call_with_timeout(self, data: bytes, header: str):
        try:
            return await self._within_budget(data, header)
        except (TransportError, RejectedError):
            self._dialed = not self._maddrs
            raise
        except TimeoutError:
            self._dialed = not self._maddrs
            raise TransportError(
                f"nothing moved to or from {self.target} for {self.timeout:g} s",
                reason="timeout",
            ) from None
        except Exception as exc:
            self._dialed = not self._maddrs
            what = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ControlFailure):
                problem = f"cannot reach {self.target}: {what}"
            elif isinstance(exc, ConnectionError | asyncio.IncompleteReadError):
                problem = f"connection to {self.target} lost mid-transfer: {what}"
            else:
                problem = f"call to {self.target} failed: {what}"
            raise TransportError(problem) from None

    def _roundtrip(self, data: bytes) -> bytes:
        header = _header(len(data), hashlib.sha256(data).hexdigest())
        try:
            chunks, size, digest = self.node._submit(
                self._call_with_timeout(data, header), None
            )  # the call keeps its own time budget
        except (TransportError, RejectedError):
            raise
        except (TimeoutError, concurrent.futures.CancelledError, asyncio.CancelledError):
            raise TransportError(
                f"call to {self.target} did not finish (node loop stuck or shut down)"
            ) from None
        reply = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if hashlib.sha256(reply).hexdigest() != digest:
            raise TransportError(
                f"reply of {size} bytes from {self.target} fails its SHA-256 check",
                reason="hash-mismatch",
            )
        return reply
