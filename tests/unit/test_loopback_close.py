"""Stopping the loopback server: requests in flight get their replies, a stuck one does not
hold Ctrl-C for long."""

import logging
import threading
import time

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
