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
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols import auth
from dipaco.protocols.messages import Error, Message, decode_message, encode_message_gathered
from dipaco.protocols.wire import (
    ByteBuffer,
    Outgoing,
    Pieces,
    Received,
    is_received,
    joined,
    received_buffer,
)

log = logging.getLogger(__name__)

# A sealed request -> a sealed reply, maybe a view. A request handed in as wire.Received is the
# handler's own (a transport received it into a buffer of its own, or joined Pieces into one):
# its tensors may stay views of it. Any other buffer is the caller's.
Handler = Callable[[ByteBuffer], ByteBuffer]
BACKLOG = 1024  # connections waiting to be accepted (the kernel caps it at somaxconn)
HANDSHAKE_SECONDS = 10.0  # a connection silent this long in its handshake is dropped
CONNECT_SECONDS = 10.0  # a client's connect and handshake, each read of it, at most
# A request (or a reply) stalled this long in the middle of its bytes drops the connection; a
# peer may stay quiet as long as it likes *between* requests.
REQUEST_SECONDS = 30.0
POLL_SECONDS = 0.5  # how often waiting threads look whether the server is closing


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


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def _recv_timeout(conn: Connection, seconds: float) -> None:
    """Bound every read on ``conn`` to ``seconds`` (0: no bound) without making it non-blocking
    (``settimeout`` would, for every descriptor of the socket). A read that times out raises
    ``BlockingIOError``."""
    _setsockopt(conn, socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _send_timeout(conn: Connection, seconds: float) -> None:
    """Bound every write on ``conn`` to ``seconds`` (0: no bound), as ``_recv_timeout``."""
    _setsockopt(conn, socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


_SMALL = 16 << 10  # a message this short goes out with its length in one write


def _send_message(conn: Connection, data: Outgoing) -> None:
    """``conn.send_bytes(data)``'s framing (multiprocessing's length prefix: the other side may
    be any Connection), but Pieces are written one after another from their own memory and
    nothing is copied whole. A write that stalls raises (SO_SNDTIMEO), as send_bytes does."""
    n = len(data)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    if isinstance(data, Pieces):
        parts = [memoryview(head), *data.parts]
    elif n <= _SMALL:
        parts = [memoryview(head + bytes(data))]
    else:
        parts = [memoryview(head), memoryview(data).cast("B")]
    fd = conn.fileno()
    for part in parts:
        while part.nbytes:
            part = part[os.write(fd, part) :]


def _recv_message(conn: Connection, maxsize: int | None = None) -> Received:
    """The next message sent with ``send_bytes``' framing, read straight into one new buffer
    of its size (``recv_bytes`` reads it in pieces and gathers them: twice the memory while it
    reads). EOFError if the other side left before it; OSError for a length over ``maxsize``,
    a message cut short, or a read that stalled (SO_RCVTIMEO)."""
    fd = conn.fileno()
    (size,) = struct.unpack("!i", _read_exact(fd, bytearray(4), eof_ok=True))
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exact(fd, bytearray(8)))
    if size < 0 or (maxsize is not None and size > maxsize):
        raise OSError("bad message length")
    return _read_exact(fd, received_buffer(size))


def _read_exact(fd: int, buf: Received, eof_ok: bool = False) -> Received:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            if eof_ok and got == 0:
                raise EOFError
            raise OSError("got end of file during message")
        got += n
    return buf


def _stalled(exc: BaseException) -> bool:
    """A read or write that ran into its time limit (SO_RCVTIMEO, SO_SNDTIMEO)."""
    return isinstance(exc, (BlockingIOError, TimeoutError))


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
    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        """Send a sealed request (one buffer, or Pieces sent in turn), return the sealed reply:
        wire.Received only when it is this caller's own (received into a buffer of its own),
        so that its tensors need no copy."""

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
        room = auth.ENVELOPE_ROOM  # the envelope is written in front of the frame: no copy
        # A large request (a delta) goes out from its tensors' own memory (Pieces).
        body = encode_message_gathered(msg, room=room)
        sealed, nonce = auth.seal_request(self.identity, body, room=room)
        del body
        raw = self._roundtrip(sealed)
        del sealed
        # A reply received into a buffer of our own is ours: its tensors (modules) stay views
        # of it, with no second copy.
        opened = auth.open_reply(raw, nonce, self.server_key)
        if self.server_key is None:
            self.server_key = opened.key
            if self.on_pin is not None:
                self.on_pin(opened.key)
        reply = decode_message(opened.body, copy=not is_received(raw))
        if isinstance(reply, Error):
            raise RejectedError(reply.message, reason=reply.reason)
        return reply

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to close
        """Release the connection, if the transport holds one."""


class LocalTransport(Transport):
    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        return self._handler(joined(data))  # Pieces joined: the handler's own copy


class LoopbackTransport(Transport):
    """Client side of the loopback form; one connection, requests serialized.

    A failed request drops the connection (a late reply must never answer the next request);
    the next request dials again, so a peer outlives a coordinator restart on the same address.
    Connecting and the handshake take at most ``connect_timeout`` seconds each; a reply must
    begin within ``timeout`` seconds, and no read or write of a request or reply may stall for
    longer than that.
    """

    def __init__(
        self,
        address: str,
        authkey: bytes,
        timeout: float = 30.0,
        connect_timeout: float = CONNECT_SECONDS,
    ) -> None:
        self.address = address
        self._authkey = authkey
        self._lock = threading.Lock()
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._conn: Connection | None = None
        self._connect()

    def _connect(self) -> Connection:
        """Dial and shake hands; the connection, also kept as ``self._conn``."""
        host, _, port = self.address.rpartition(":")
        wait = self._connect_timeout
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=wait)
        except TimeoutError:
            raise TransportError(
                f"cannot connect to coordinator at {self.address}: no answer within {wait:g} s"
            ) from None
        except (OSError, ValueError) as exc:
            raise TransportError(
                f"cannot connect to coordinator at {self.address}: {exc}"
            ) from None
        sock.settimeout(None)  # blocking; the limits below are the socket's own
        conn = Connection(sock.detach())
        try:
            _no_delay(conn)
            _recv_timeout(conn, wait)
            _send_timeout(conn, wait)
            answer_challenge(conn, self._authkey)  # what multiprocessing's Client does
            deliver_challenge(conn, self._authkey)
            _recv_timeout(conn, self._timeout)
            _send_timeout(conn, self._timeout)
        except AuthenticationError:
            conn.close()
            raise TransportError(
                f"coordinator at {self.address} refused our key (wrong --authkey-file?)",
                reason="auth",
            ) from None
        except (OSError, EOFError) as exc:
            conn.close()
            if _stalled(exc):
                raise TransportError(
                    f"coordinator at {self.address} did not answer the handshake within "
                    f"{wait:g} s (is it a dipaco loopback coordinator?)"
                ) from None
            raise TransportError(
                f"cannot connect to coordinator at {self.address}: "
                f"{exc or type(exc).__name__} (in the handshake)"
            ) from None
        self._conn = conn
        return conn

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        with self._lock:
            conn = self._conn if self._conn is not None else self._connect()
            try:
                _send_message(conn, data)
                if conn.poll(self._timeout):
                    return _recv_message(conn)
                problem = f"no reply within {self._timeout:.0f} s"
            except (OSError, EOFError) as exc:
                if _stalled(exc):
                    problem = f"the connection stalled for {self._timeout:.0f} s mid-message"
                else:
                    problem = f"connection to coordinator lost: {exc or type(exc).__name__}"
            self.close()
            raise TransportError(f"{problem} ({self.address})")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class LoopbackServer:
    """Serves a handler to many peer processes, one thread per connection.

    The accept loop only accepts: the HMAC handshake runs in each connection's own thread, each
    read of it limited to ``handshake_seconds``, so a client that connects and says nothing
    locks nobody out. Between requests a connection may be quiet for as long as it likes; a
    request or reply stalled for ``request_seconds`` in the middle of its bytes drops that
    connection only. Every waiting thread looks at least every ``POLL_SECONDS`` whether the
    server is closing, so :meth:`close` leaves no thread serving.
    """

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
        # multiprocessing's Listener listens with a backlog of 1 (with many peers dialling at
        # once, connections beyond it were dropped mid-handshake and their clients waited for
        # the challenge forever), and runs the handshake inline in accept() (one silent
        # connection locked everyone out): a plain socket, and the handshake per connection.
        self._authkey = authkey
        try:
            self._sock = socket.create_server((host, port), backlog=BACKLOG)
        except OSError as exc:
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from None
        self._sock.settimeout(POLL_SECONDS)
        self.handshake_seconds = HANDSHAKE_SECONDS
        self.request_seconds = REQUEST_SECONDS
        self.refused = 0  # connections that failed or stalled in the handshake
        self.dropped = 0  # connections dropped for a request or reply stalled mid-way
        self._closed = threading.Event()
        self._idle = threading.Condition()
        self._inflight = 0
        self._thread = threading.Thread(target=self._accept_loop, name="dipaco-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # closing the listener lands here
                if not self._closed.is_set():
                    log.warning("could not accept a connection: %s", exc)
                    self._closed.wait(0.05)  # out of descriptors, say: no hot loop
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _handshake(self, conn: Connection) -> bool:
        """The HMAC challenge both ways, each read limited to ``handshake_seconds``."""
        try:
            _recv_timeout(conn, self.handshake_seconds)
            _send_timeout(conn, self.handshake_seconds)
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            # From now on, only a stall in the middle of a message is limited (waits between
            # requests use poll, which these limits do not touch).
            _recv_timeout(conn, self.request_seconds)
            _send_timeout(conn, self.request_seconds)
            return True
        except Exception as exc:  # noqa: BLE001 - a wrong key, garbage, a stall: all refused
            if not self._closed.is_set():
                self.refused += 1
                reason = "stalled" if _stalled(exc) else exc
                log.warning("refused a connection in its handshake: %s", reason)
            return False

    def _next_request(self, conn: Connection) -> Received | None:
        """The next request, or None when the peer left, stalled or the server is closing."""
        try:
            while not conn.poll(POLL_SECONDS):
                if self._closed.is_set():
                    return None
            if self._closed.is_set():
                return None
            return _recv_message(conn, self._max)
        except EOFError:
            return None
        except OSError as exc:  # a stall mid-request, or an oversized frame: drop the peer
            why = str(exc)
            if _stalled(exc):
                self.dropped += 1
                why = f"a request stalled for {self.request_seconds:g} s mid-way"
            log.warning("dropped a connection: %s", why)
            return None

    def _serve(self, conn: Connection) -> None:
        _no_delay(conn)
        with conn:
            if not self._handshake(conn):
                return
            while (data := self._next_request(conn)) is not None:
                with self._idle:
                    self._inflight += 1
                try:
                    reply = self._handler(data)
                finally:
                    with self._idle:
                        self._inflight -= 1
                        self._idle.notify_all()
                try:
                    _send_message(conn, reply)
                except OSError as exc:
                    if _stalled(exc):
                        self.dropped += 1
                        log.warning("dropped a connection: its peer read no reply for %g s",
                                    self.request_seconds)  # fmt: skip
                    return

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, and wait up to ``timeout`` seconds for requests being handled to
        finish. One that does not is left behind (said in the log): what it made durable stays,
        and its peer, unanswered, retries against the next coordinator on this folder. Idle
        connections are closed within ``POLL_SECONDS``."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop at once
        except OSError:
            pass
        self._sock.close()
        with self._idle:
            if not self._idle.wait_for(lambda: self._inflight == 0, timeout):
                log.warning(
                    "stopping with %d request(s) still being handled after %.0f s",
                    self._inflight,
                    timeout,
                )
