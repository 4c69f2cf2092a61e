"""The loopback transport under slow and silent parties, done for real over 127.0.0.1: a client
that connects and says nothing, or stalls in the middle of a request, costs only its own
connection; a client whose server never answers the handshake, or stops mid-reply, gets a clear
error naming the address within its time limit."""

import os
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import pytest

from dipaco.errors import TransportError
from dipaco.protocols.transport import LoopbackServer, LoopbackTransport

KEY = b"k" * 32


def _served_within(address: str, seconds: float) -> float:
    """How long a real client took to connect and get its reply; fails past ``seconds``."""
    t0 = time.monotonic()
    transport = LoopbackTransport(address, KEY, timeout=seconds, connect_timeout=seconds)
    try:
        assert transport._roundtrip(b"ping") == b"pong:ping"
    finally:
        transport.close()
    took = time.monotonic() - t0
    assert took < seconds
    return took


def _raw_handshaken(address: str) -> socket.socket:
    """A raw socket that has done the HMAC handshake as a client, and can then misbehave."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(None)  # a Connection reads its descriptor as a blocking one
    with Connection(os.dup(sock.fileno())) as conn:
        answer_challenge(conn, KEY)
        deliver_challenge(conn, KEY)
    return sock


def _wait_eof(sock: socket.socket, seconds: float) -> float:
    """Seconds until the other end closed ``sock`` (what was sent meanwhile is read away)."""
    sock.settimeout(seconds)
    t0 = time.monotonic()
    while sock.recv(4096):
        pass
    return time.monotonic() - t0


def test_a_silent_client_does_not_delay_others_while_its_handshake_waits():
    server = LoopbackServer(lambda data: b"pong:" + data, KEY)  # the 10 s handshake limit
    host, port = server.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(5)]
    try:
        time.sleep(0.2)  # they are accepted, and waiting in their handshakes
        for _ in range(3):
            assert _served_within(server.address, 2.0) < 2.0
        assert server.refused == 0  # the silent ones are still within their limit
    finally:
        for sock in silent:
            sock.close()
        server.close()


def test_a_request_stalled_midway_drops_only_that_connection():
    server = LoopbackServer(lambda data: b"pong:" + data, KEY)
    server.request_seconds = 1.0
    stalled = _raw_handshaken(server.address)
    try:
        # A frame that announces 1000 bytes and sends 10 of them, then nothing.
        stalled.sendall(struct.pack("!i", 1000) + b"x" * 10)
        _served_within(server.address, 2.0)  # meanwhile an honest peer is served at once
        assert _wait_eof(stalled, 10.0) < 5.0  # the stalled one is dropped after ~1 s
        assert server.dropped == 1
        _served_within(server.address, 2.0)
    finally:
        stalled.close()
        server.close()


def test_a_quiet_connection_between_requests_is_kept():
    """Only a stall inside a message counts: a peer may think for long between requests."""
    server = LoopbackServer(lambda data: b"pong:" + data, KEY)
    server.request_seconds = 0.5
    transport = LoopbackTransport(server.address, KEY)
    try:
        assert transport._roundtrip(b"a") == b"pong:a"
        time.sleep(1.5)  # three times the mid-request limit
        assert transport._roundtrip(b"b") == b"pong:b"
        assert server.dropped == 0
    finally:
        transport.close()
        server.close()


def test_close_ends_idle_connections_and_stops_accepting():
    server = LoopbackServer(lambda data: b"pong:" + data, KEY)
    idle = _raw_handshaken(server.address)
    address = server.address
    try:
        t0 = time.monotonic()
        server.close(timeout=1.0)
        assert _wait_eof(idle, 5.0) < 2.0  # its serving thread noticed and closed it
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(TransportError, match=address):
            LoopbackTransport(address, KEY, connect_timeout=2.0)  # nobody listens any more
    finally:
        idle.close()


@pytest.fixture
def mute_server():
    """A TCP server that accepts connections and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    host, port = listener.getsockname()
    yield f"{host}:{port}"
    stop.set()
    thread.join(5)
    for sock in accepted:
        sock.close()
    listener.close()


def test_a_server_that_never_answers_the_handshake_is_a_clear_timeout(mute_server):
    t0 = time.monotonic()
    with pytest.raises(TransportError) as caught:
        LoopbackTransport(mute_server, KEY, connect_timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    message = str(caught.value)
    assert mute_server in message and "did not answer the handshake within 0.5 s" in message


def test_a_reply_stalled_midway_is_a_clear_timeout():
    """A server that does the handshake, then sends a reply's first bytes and stops."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()
    kept: list[socket.socket] = []

    def serve() -> None:
        sock, _ = listener.accept()
        with Connection(os.dup(sock.fileno())) as conn:
            deliver_challenge(conn, KEY)
            answer_challenge(conn, KEY)
            conn.recv_bytes()
        sock.sendall(struct.pack("!i", 100) + b"partial")
        kept.append(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    transport = LoopbackTransport(f"{host}:{port}", KEY, timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="stalled") as caught:
            transport._roundtrip(b"ping")
        assert time.monotonic() - t0 < 3.0
        assert f"{host}:{port}" in str(caught.value)
    finally:
        transport.close()
        thread.join(5)
        for raw in kept:
            raw.close()
        listener.close()
