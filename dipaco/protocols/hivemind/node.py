"""One hivemind node: a DHT (a forked process that owns a ``p2pd`` daemon) plus a P2P replica.

The replica is driven from a private asyncio loop in a daemon thread. A coordinator calls
:meth:`HivemindNode.serve` with its ``bytes -> bytes`` handler; a peer gets a
:class:`~dipaco.protocols.hivemind.client.HivemindTransport` from :meth:`HivemindNode.transport`
and sends requests through it. The DHT also stores and reads the JSON-like records that
discovery publishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P
from hivemind.utils.logging import use_hivemind_log_handler
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from dipaco.errors import TransportError
from dipaco.protocols.hivemind.cleanup import (
    WatchedDHT,
    remember_parent_files,
    remove_stale_sockets,
)
from dipaco.protocols.hivemind.client import HivemindTransport
from dipaco.protocols.hivemind.framing import size_header
from dipaco.protocols.hivemind.server import _ByteServicer
from dipaco.protocols.transport import Handler
from dipaco.protocols.wire import ByteBuffer

log = logging.getLogger(__name__)
# hivemind's own log lines go through the root logger, formatted and filtered as ours are
use_hivemind_log_handler("nowhere")


P2PD_FIRST_WAIT = 15.0  # seconds p2pd gets to start at first (hivemind's default)
P2PD_WAIT_GROWTH = 4.0  # each later try waits this many times longer, within start_timeout
DHT_SECONDS = 60.0  # the longest a DHT read or store may take (hivemind's own RPCs time out sooner)
RELAY_TIMEOUT = 120.0  # a relayed request fails when nothing moved to or from its target so long


def start_dht(initial_peers: list[str], kwargs: dict[str, Any], start_timeout: float) -> WatchedDHT:
    """A started DHT (and its p2pd). A daemon too slow to start (a loaded or slow machine) is
    tried again, waiting longer each time, until ``start_timeout`` is spent; the wait is logged."""
    deadline = time.monotonic() + start_timeout
    wait = min(P2PD_FIRST_WAIT, start_timeout)
    while True:
        dht = WatchedDHT(
            initial_peers=initial_peers,
            start=False,
            shutdown_timeout=5,
            startup_timeout=wait,
            **kwargs,
        )
        try:
            dht.run_in_background(await_ready=True, timeout=max(1.0, deadline - time.monotonic()))
            return dht
        except Exception as exc:
            dht.shutdown()
            if dht.is_alive():
                dht.kill()
                dht.join(5.0)
            left = deadline - time.monotonic()
            if "failed to start in" not in str(exc) or left < 1.0:
                raise
            log.warning(
                "the p2p daemon did not start within %.3g s (a loaded machine?): "
                "waiting up to %.3g s",
                wait,
                min(wait * P2PD_WAIT_GROWTH, left),
            )
            wait = min(wait * P2PD_WAIT_GROWTH, left)


def start_advice(why: str, initial_peers: Sequence[str], host: str, port: int) -> str:
    """What to change, for the daemon's start-up failures people meet (empty if none fits)."""
    if "address already in use" in why:
        return f"{host}:{port} is taken: stop what listens there, or listen on another port"
    if "bootstrap peers" in why:
        return (
            f"none of {', '.join(initial_peers)} answered: is the coordinator running, and is "
            "this the address it printed? `dipaco-peer doctor ADDRESS` checks the route"
        )
    if "multiaddr" in why:
        return (
            "an address to join must be a whole multiaddr (/ip4/HOST/tcp/PORT/p2p/PEER_ID): "
            "copy the one the coordinator printed"
        )
    if "failed to start in" in why:
        return "the p2p daemon was too slow to start, even waiting longer; is the machine loaded?"
    return ""


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
            "relayed": 0,  # requests passed on to a node this one relays for, and answered
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
        self._dht: WatchedDHT | None = None  # shutdown() below copes with a DHT never started
        try:
            self._dht = start_dht(list(initial_peers), kwargs, start_timeout)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="dipaco-hivemind-loop", daemon=True
            )
            self._thread.start()
            self._p2p = self._submit(self._dht.replicate_p2p(), start_timeout)
            replica_socket = self._p2p._client_listen_maddr["unix"]
            self._dht.run_coroutine(partial(remember_parent_files, paths=[replica_socket]))
        except BaseException as exc:
            self.shutdown()
            if isinstance(exc, Exception):
                # one line, without the daemon's own "2026/11/25 15:43:58" log stamps
                why = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", " ".join(str(exc).split()))
                advice = start_advice(why, initial_peers, host, port)
                raise TransportError(
                    f"cannot start a hivemind node: {why}" + (f": {advice}" if advice else "")
                ) from exc
            raise
        self.peer_id: str = self._p2p.peer_id.to_base58()
        log.debug("hivemind node %s started (client_mode=%s)", self.peer_id, client_mode)

    # -- plumbing --

    def _live_p2p(self) -> P2P:
        """The node's P2P handle; a TransportError when it has none (it never started)."""
        if self._p2p is None:
            raise TransportError("the hivemind node has no P2P handle (it never started)")
        return self._p2p

    def _live_dht(self) -> WatchedDHT:
        """The node's DHT; a TransportError when it has none (it never started)."""
        if self._dht is None:
            raise TransportError("the hivemind node has no DHT (it never started)")
        return self._dht

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
            return [
                str(m) for m in self._submit(self._live_p2p().get_visible_maddrs(latest=True), 30.0)
            ]
        except ValueError:  # hivemind raises this when the daemon listens nowhere
            return []

    def store(self, key: str, value: Any, ttl: float, subkey: str | None = None) -> bool:
        """Store a JSON-like value for ``ttl`` seconds (under ``subkey`` for a dictionary value).

        Returns False when the DHT refused it (e.g. a record with a later expiration exists).
        """
        with self._dht_lock:
            fut = self._live_dht().store(
                key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True
            )
        return bool(self._dht_result(fut, f"storing {key}"))

    def get(self, key: str) -> Any:
        """The latest value under ``key``: the plain value, ``{subkey: value}`` for a dictionary
        value, or None when absent or expired."""
        with self._dht_lock:
            fut = self._live_dht().get(key, latest=True, return_future=True)
        found = self._dht_result(fut, f"reading {key}")
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict) and all(
            isinstance(item, ValueWithExpiration) for item in value.values()
        ):  # a dictionary value: {subkey: ValueWithExpiration}
            return {sub: item.value for sub, item in value.items()}
        return value

    @staticmethod
    def _dht_result(fut: Any, what: str) -> Any:
        """A DHT call's result; a TransportError (``timeout``) rather than a wait without end
        when the DHT process does not answer within DHT_SECONDS."""
        try:
            return fut.result(DHT_SECONDS)
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise TransportError(
                f"the DHT did not answer within {DHT_SECONDS:g} s ({what})", reason="timeout"
            ) from None

    # -- server --

    def serve(
        self,
        handler: Handler,
        *,
        max_request_bytes: int = 1 << 31,
        workers: int = 8,
        read_timeout: float = 120.0,
        relay_for: Callable[[str], bool] | None = None,
    ) -> None:
        """Answer requests from other nodes with ``handler`` (run in a pool of ``workers`` threads).

        ``read_timeout`` drops a transfer whose sender sends nothing for that many seconds.
        ``relay_for(peer_id)`` makes this node a relay for the nodes it accepts: a request for
        one of them is passed on over the connection that node keeps to this one (server.py).
        """
        if self._servicer is not None:
            raise RuntimeError("this hivemind node already serves a handler")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="dipaco-hivemind-handler"
        )
        servicer = _ByteServicer(
            self._record,
            self._reject,
            handler,
            self._executor,
            max_request_bytes,
            read_timeout,
            relay_for=relay_for,
            forward=self._forward,
            own_id=self.peer_id,
        )
        self._submit(servicer.add_p2p_handlers(self._p2p), 30.0)
        self._servicer = servicer

    async def _forward(self, target: str, data: ByteBuffer) -> ByteBuffer:
        """A relayed request, sent on to ``target`` (on this node's loop); its reply."""
        link = HivemindTransport(self, target, (), timeout=RELAY_TIMEOUT)
        return await link._call_with_timeout(data, size_header(len(data)))

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

    def shutdown(self, quick: bool = False) -> None:
        """Stop the loop thread, the P2P replica and the DHT process (and its p2pd). Idempotent.
        ``quick`` (Ctrl-C) keeps every wait short: about 2.5 s in all, then the DHT process is
        killed (its p2pd dies with it)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            try:
                self._submit(self._aclose(), 1.0 if quick else 15.0)
            except Exception:
                log.debug("hivemind node: closing the loop failed", exc_info=True)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(0.5 if quick else 10.0)
        if loop is not None and not loop.is_running():
            loop.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._dht is not None:
            if quick:
                self._dht.shutdown_timeout = 1.0
            try:
                self._dht.shutdown()
            except Exception:
                log.debug("hivemind node: DHT shutdown failed", exc_info=True)
            if self._dht.is_alive():
                self._dht.kill()
                self._dht.join(5.0)
        remove_stale_sockets(self._started_at)

    def __enter__(self) -> HivemindNode:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
