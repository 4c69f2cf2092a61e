"""Transports move encoded messages between a peer and a coordinator; they know nothing else.

A coordinator exposes one handler, ``bytes -> bytes``. The ``local`` transport calls it in the
same process, but always through the wire encoding so that the encoding is exercised on every
run. The ``loopback`` form of the local transport carries the same frames between processes on
one machine over a socket (length-prefixed byte strings, HMAC challenge on connect; no pickling).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols import auth
from dipaco.protocols.messages import Error, Message, decode_message, encode_message

log = logging.getLogger(__name__)

Handler = Callable[[bytes], bytes]
BACKLOG = 1024  # connections waiting to be accepted (the kernel caps it at somaxconn)
HANDSHAKE_SECONDS = 10.0  # a connection silent this long in its handshake is dropped


def _setsockopt(conn: Connection, level: int, option: int, value: int | bytes) -> None:
    """Set a socket option on ``conn`` through a duplicate of its descriptor (the option is the
    socket's, shared by both); a connection that is no TCP socket is left as it is."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.setsockopt(level, option, value)
    except OSError:
        pass  # not a TCP socket (tests may serve over other families): nothing to tune
    finally:
        sock.close()


def _no_delay(conn: Connection) -> None:
    """Turn Nagle's algorithm off on a loopback connection.

    ``send_bytes`` writes a message above 16 KiB as two writes (length, then payload); with Nagle
    on, the second waits for the peer's delayed ACK, and every round trip of such a message took
    about 80 ms more on Linux (bench/soak.py). Requests are whole messages: nothing to coalesce.
    """
    _setsockopt(conn, socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_timeout(conn: Connection, seconds: float) -> None:
    """Bound every read on ``conn`` to ``seconds`` (0: no bound) without making it non-blocking
    (``settimeout`` would, for every descriptor of the socket)."""
    sec = int(seconds)
    timeval = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    _setsockopt(conn, socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


class Transport(ABC):
    """A peer's view of one coordinator: send a request message, get the reply message.

    Every request goes out in an envelope signed by ``identity`` (when none is given, a key made
    for this process, which then speaks as one party), and every reply must come back signed for that request by
    ``server_key``. Without a known ``server_key`` the first reply's key is pinned (trust on
    first use) and ``on_pin`` is told, so a caller can remember it.
    """

    identity: auth.Identity | None = None
    server_key: str | None = None
    on_pin: Callable[[str], None] | None = None

    @abstractmethod
    def _roundtrip(self, data: bytes) -> bytes: ...

    def authenticate(
        self,
        identity: auth.Identity | None,
        server_key: str | None = None,
        on_pin: Callable[[str], None] | None = None,
    ) -> Transport:
        """Sign with ``identity`` and accept replies only from ``server_key``; returns self."""
        self.identity, self.server_key, self.on_pin = identity, server_key, on_pin
        return self

    def request(self, msg: Message) -> Message:
        if self.identity is None:
            self.identity = auth.process_identity()
        sealed, nonce = auth.seal_request(self.identity, encode_message(msg))
        opened = auth.open_reply(self._roundtrip(sealed), nonce, self.server_key)
        if self.server_key is None:
            self.server_key = opened.key
            if self.on_pin is not None:
                self.on_pin(opened.key)
        reply = decode_message(opened.body)
        if isinstance(reply, Error):
            raise RejectedError(reply.message, reason=reply.reason)
        return reply

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to close
        """Release the connection, if the transport holds one."""


class LocalTransport(Transport):
    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    def _roundtrip(self, data: bytes) -> bytes:
        return self._handler(data)


class LoopbackTransport(Transport):
    """Client side of the loopback form; one connection, requests serialized.

    A failed request drops the connection (a late reply must never answer the next request);
    the next request dials again, so a peer outlives a coordinator restart on the same address.
    """

    def __init__(self, address: str, authkey: bytes, timeout: float = 30.0) -> None:
        self.address = address
        self._authkey = authkey
        self._lock = threading.Lock()
        self._timeout = timeout
        self._conn: Connection | None = None
        self._connect()

    def _connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            self._conn = Client((host, int(port)), authkey=self._authkey)
            _no_delay(self._conn)
        except AuthenticationError:
            raise TransportError(
                f"coordinator at {self.address} refused our key (wrong --authkey-file?)",
                reason="auth",
            ) from None
        except (OSError, ValueError, EOFError) as exc:
            raise TransportError(
                f"cannot connect to coordinator at {self.address}: {exc}"
            ) from None

    def _roundtrip(self, data: bytes) -> bytes:
        with self._lock:
            if self._conn is None:
                self._connect()
            try:
                self._conn.send_bytes(data)
                if self._conn.poll(self._timeout):
                    return self._conn.recv_bytes()
                problem = f"no reply within {self._timeout:.0f} s"
            except (OSError, EOFError) as exc:
                problem = f"connection to coordinator lost: {exc or type(exc).__name__}"
            self.close()
            raise TransportError(problem)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class LoopbackServer:
    """Serves a handler to many peer processes, one thread per connection."""

    def __init__(
        self,
        handler: Handler,
        authkey: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 1 << 31,
    ) -> None:
        self._handler = handler
        self._max = max_message_bytes
        # multiprocessing's default backlog is 1: with many peers dialling at once, connections
        # beyond it were dropped mid-handshake and their clients waited for the challenge forever.
        # The HMAC handshake runs in each connection's own thread with a time limit (the
        # Listener's own runs inline in accept(): one silent connection locked everyone out).
        self._authkey = authkey
        self._listener = Listener((host, port), backlog=BACKLOG)
        self.handshake_seconds = HANDSHAKE_SECONDS
        self.refused = 0  # connections that failed or stalled in the handshake
        self._closed = threading.Event()
        self._idle = threading.Condition()
        self._inflight = 0
        self._thread = threading.Thread(target=self._accept_loop, name="dipaco-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.address
        return f"{host}:{port}"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except OSError as exc:  # closing the listener lands here
                if not self._closed.is_set():
                    log.warning("could not accept a connection: %s", exc)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _handshake(self, conn: Connection) -> bool:
        """The HMAC challenge both ways, each read limited to ``handshake_seconds``."""
        try:
            _recv_timeout(conn, self.handshake_seconds)
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            _recv_timeout(conn, 0.0)  # a peer may be quiet for long between requests
            return True
        except Exception as exc:  # noqa: BLE001 - a wrong key, garbage, a stall: all refused
            if not self._closed.is_set():
                self.refused += 1
                reason = "stalled" if isinstance(exc, (BlockingIOError, TimeoutError)) else exc
                log.warning("refused a connection in its handshake: %s", reason)
            return False

    def _serve(self, conn: Connection) -> None:
        _no_delay(conn)
        with conn:
            if not self._handshake(conn):
                return
            while not self._closed.is_set():
                try:
                    data = conn.recv_bytes(self._max)
                except EOFError:
                    return
                except OSError as exc:  # an oversized frame lands here too: drop the peer
                    log.warning("dropped a connection: %s", exc)
                    return
                with self._idle:
                    self._inflight += 1
                try:
                    reply = self._handler(data)
                finally:
                    with self._idle:
                        self._inflight -= 1
                        self._idle.notify_all()
                try:
                    conn.send_bytes(reply)
                except OSError:
                    return

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, and wait up to ``timeout`` seconds for requests being handled to
        finish. One that does not is left behind (said in the log): what it made durable stays,
        and its peer, unanswered, retries against the next coordinator on this folder."""
        self._closed.set()
        self._listener.close()
        with self._idle:
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout):
                log.warning(
                    "stopping with %d request(s) still being handled after %.0f s",
                    self._inflight,
                    timeout,
                )
