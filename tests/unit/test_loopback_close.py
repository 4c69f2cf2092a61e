"""The loopback server: requests in flight get their replies when it stops, a stuck one does not
hold Ctrl-C for long, and a connection silent in its handshake locks nobody out."""

import logging
import socket
import threading
import time

from dipaco.errors import TransportError
from dipaco.protocols.transport import LoopbackServer, LoopbackTransport

KEY = b"k" * 32


def _ask(address: str, replies: list) -> None:
    transport = LoopbackTransport(address, KEY, timeout=30.0)
    try:
        replies.append(transport._roundtrip(b"ping"))
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        replies.append(exc)
    finally:
        transport.close()


def test_close_waits_for_a_request_being_handled_and_it_gets_its_reply():
    started = threading.Event()

    def handler(data: bytes) -> bytes:
        started.set()
        time.sleep(0.5)  # an outer step being written
        return b"done:" + data

    server = LoopbackServer(handler, KEY)
    replies: list = []
    client = threading.Thread(target=_ask, args=(server.address, replies))
    client.start()
    assert started.wait(10)
    server.close(timeout=10)
    client.join(10)
    assert replies == [b"done:ping"]


def test_close_gives_up_on_a_stuck_request_and_says_so(caplog):
    release, started = threading.Event(), threading.Event()

    def handler(data: bytes) -> bytes:
        started.set()
        release.wait(60)
        return data

    server = LoopbackServer(handler, KEY)
    client = threading.Thread(target=_ask, args=(server.address, []), daemon=True)
    client.start()
    assert started.wait(10)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        server.close(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert "1 request(s) still being handled" in caplog.text
    release.set()


def test_a_silent_connection_does_not_lock_peers_out_and_is_dropped():
    """Issue 17, break 3: the handshake ran inline in the accept loop with no time limit."""
    server = LoopbackServer(lambda data: b"pong:" + data, KEY)
    server.handshake_seconds = 1.0
    host, port = server.address.rsplit(":", 1)
    idle = socket.create_connection((host, int(port)))  # no key needed to open one
    try:
        replies: list = []
        client = threading.Thread(target=_ask, args=(server.address, replies), daemon=True)
        client.start()
        client.join(10)
        assert replies == [b"pong:ping"]  # an honest peer got through at once
        idle.settimeout(10)
        t0 = time.monotonic()
        while idle.recv(4096):  # the challenge, then the end of the stream: dropped
            pass
        assert time.monotonic() - t0 < 5
        assert server.refused == 1
    finally:
        idle.close()
        server.close()


def test_a_wrong_key_is_refused_and_counted():
    server = LoopbackServer(lambda data: data, KEY)
    try:
        try:
            LoopbackTransport(server.address, b"x" * 32)
        except TransportError as exc:
            assert exc.reason == "auth"
        else:
            raise AssertionError("a wrong key was let in")
        wait = time.monotonic() + 5
        while server.refused == 0 and time.monotonic() < wait:
            time.sleep(0.05)
        assert server.refused == 1
    finally:
        server.close()
