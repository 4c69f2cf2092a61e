"""Transports move encoded messages between a peer and a coordinator; they know nothing else.

A coordinator exposes one handler, ``bytes -> bytes``. The ``local`` transport calls it in the
same process, but always through the wire encoding so that the encoding is exercised on every
run. The ``loopback`` form of the local transport carries the same frames between processes on
one machine over a socket (length-prefixed byte strings, HMAC challenge on connect; no pickling).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols.messages import Error, Message, decode_message, encode_message

log = logging.getLogger(__name__)

Handler = Callable[[bytes], bytes]


class Transport(ABC):
    """A peer's view of one coordinator: send a request message, get the reply message."""

    @abstractmethod
    def _roundtrip(self, data: bytes) -> bytes: ...

    def request(self, msg: Message) -> Message:
        reply = decode_message(self._roundtrip(encode_message(msg)))
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
        self._listener = Listener((host, port), authkey=authkey)
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
            except Exception as exc:  # auth failures and closing the listener both land here
                if not self._closed.is_set():
                    log.warning("refused a connection: %s", exc)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
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

    def close(self, timeout: float = 30.0) -> None:
        """Stop accepting, and wait for requests being handled to finish."""
        self._closed.set()
        self._listener.close()
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout)
