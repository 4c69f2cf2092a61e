"""The hivemind byte transport with real DHT nodes and p2pd daemons on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from dipaco.errors import RejectedError, TransportError
from dipaco.procs import child_pids as _child_pids
from dipaco.protocols.addresses import relayed_address
from dipaco.protocols.hivemind import HivemindNode, HivemindTransport
from dipaco.protocols.hivemind import node as node_module
from dipaco.protocols.hivemind.server import _ByteServicer
from dipaco.protocols.wire import ByteBuffer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
SERVER = Path(__file__).with_name("_hivemind_echo_server.py")
SLEEP = 3.0  # how long the in-process handler sleeps on a b"SLEEP" request


class Handler:
    """Echo, except b"SLEEP..." sleeps first, b"SMALL..." answers b"ok" and b"FAIL..." raises."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, data: ByteBuffer) -> ByteBuffer:
        # A large request comes in a mapping of its own (wire.received_buffer): no bytes methods
        self.calls.append(len(data))
        head = bytes(data[:8])
        if head.startswith(b"FAIL"):
            raise RuntimeError("handler bug")
        if head.startswith(b"SLEEP"):
            time.sleep(SLEEP)
        if head.startswith(b"SMALL"):
            return b"ok"
        return data


@pytest.fixture(scope="module")
def nodes():
    """A listening server node with the Handler, and a client-mode node that only dials out."""
    handler = Handler()
    server = HivemindNode()
    try:
        client = HivemindNode(initial_peers=server.visible_maddrs(), client_mode=True)
    except BaseException:
        server.shutdown()
        raise
    try:
        server.serve(handler)
        yield server, client, handler
    finally:
        client.shutdown()
        server.shutdown()


def payload(n: int, prefix: bytes = b"") -> bytes:
    return prefix + os.urandom(n - len(prefix))


# ---- 1. two nodes in one process ---------------------------------------------------------------


def test_echo_30mb_and_dht(nodes):
    server, client, handler = nodes
    assert client.visible_maddrs() == []  # a client-mode node listens nowhere
    before = dict(server.stats)
    transport = client.transport(server.peer_id, server.visible_maddrs(), timeout=60)
    data = payload(30_000_000)
    start = time.monotonic()
    reply = transport._roundtrip(data)
    elapsed = time.monotonic() - start
    print(f"30 MB echo: {elapsed:.2f} s, {len(data) / elapsed / 1e6:.0f} MB/s each way")
    assert bytes(reply) == data  # a large reply comes in a mapping of its own
    assert transport.bytes_sent == len(data)
    assert transport.bytes_received == len(data)
    assert server.stats["bytes_in"] - before["bytes_in"] == len(data)
    assert server.stats["bytes_out"] - before["bytes_out"] == len(data)
    assert server.stats["handled"] - before["handled"] == 1
    assert transport._roundtrip(b"") == b""

    record = {"peer": server.peer_id, "n": [1, 2.5], "ok": True, "none": None}
    assert client.store("coordinators", record, ttl=30)
    assert server.get("coordinators") == record
    assert server.store("claims:t0", {"t": 1.0}, ttl=30, subkey="peer-a")
    assert client.store("claims:t0", {"t": 2.0}, ttl=30, subkey="peer-b")
    expected = {"peer-a": {"t": 1.0}, "peer-b": {"t": 2.0}}
    assert client.get("claims:t0") == expected
    assert server.get("claims:t0") == expected
    assert client.get("no-such-key") is None


# ---- 3. bad transfers are refused before the handler ----------------------------------------


def raw_call(client: HivemindNode, server: HivemindNode, messages) -> dict:
    """Send request messages straight through the stub; return the first reply's header."""

    async def call():
        stub = _ByteServicer.get_stub(client._p2p, PeerID.from_base58(server.peer_id))
        requests = as_aiter(*messages) if isinstance(messages, list) else messages
        responses = await stub.rpc_call(requests)
        try:
            return await anext(responses)
        finally:
            await responses.aclose()

    return json.loads(client._submit(call(), 30).metadata)


def header(size: int) -> str:
    return json.dumps({"v": 2, "size": size})


def test_truncated_oversized_and_malformed_requests_are_rejected(nodes):
    server, client, handler = nodes
    calls = len(handler.calls)
    rejected = dict(server.stats["rejected"])
    piece = os.urandom(1 << 20)
    full = piece * 3

    # a header claiming 3 MiB, then only 1 MiB and a clean end of stream
    reply = raw_call(
        client, server, [runtime_pb2.ExpertRequest(uid=header(len(full)), metadata=piece)]
    )
    assert reply["error"] == "truncated"
    assert "got 1048576 of 3145728 bytes" in reply["message"]

    # more than the server accepts, refused on the header alone
    huge = [runtime_pb2.ExpertRequest(uid=header(1 << 40), metadata=piece)]
    assert raw_call(client, server, huge)["error"] == "too-large"

    # garbage instead of a header
    assert raw_call(client, server, [runtime_pb2.ExpertRequest(uid="{")])["error"] == "bad-header"

    assert len(handler.calls) == calls  # the handler never saw any of them
    now = server.stats["rejected"]
    for reason in ("truncated", "too-large", "bad-header"):
        assert now.get(reason, 0) - rejected.get(reason, 0) == 1, reason


class DroppingTransport(HivemindTransport):
    """Sends the header for the whole payload but drops its last chunk (or flips a byte)."""

    corrupt = False

    async def _requests(self, data, header):
        if self.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        else:
            data = data[: len(data) - (1 << 20)]
        async for msg in super()._requests(data, header):
            yield msg


def test_client_sees_the_servers_refusal(nodes):
    server, client, handler = nodes
    calls = len(handler.calls)
    transport = DroppingTransport(client, server.peer_id, timeout=30)
    with pytest.raises(TransportError, match="truncated") as info:
        transport._roundtrip(payload(3 << 20))
    assert info.value.reason == "truncated"
    assert len(handler.calls) == calls
    # Bytes of the right size pass: the transport checks sizes only. What they mean is the
    # envelope's to check (its BLAKE3 digest, signed), and the coordinator's handler refuses
    # an altered one (tests/unit/test_attacks_auth.py); this echo handler sends it back as it came.
    transport.corrupt = True
    sent = payload(3 << 20)
    assert bytes(transport._roundtrip(sent)) == bytes([sent[0] ^ 1]) + sent[1:]
    assert len(handler.calls) == calls + 1
    calls += 1

    with pytest.raises(TransportError, match="RuntimeError: handler bug") as info:
        client.transport(server.peer_id)._roundtrip(b"FAIL")
    assert info.value.reason == "handler-error"
    assert len(handler.calls) == calls + 1


def test_too_large_and_stalled_requests():
    with HivemindNode() as server:
        server.serve(lambda data: data, max_request_bytes=3_000_000, read_timeout=1.0)
        with HivemindNode(initial_peers=server.visible_maddrs(), client_mode=True) as client:
            transport = client.transport(server.peer_id, server.visible_maddrs(), timeout=30)
            data = payload(3_000_000)
            assert bytes(transport._roundtrip(data)) == data
            with pytest.raises(RejectedError, match="exceeds the limit") as info:
                transport._roundtrip(data + b"x")
            assert info.value.reason == "too-large"

            async def stalled():  # a header, half the data, then silence
                yield runtime_pb2.ExpertRequest(uid=header(2000), metadata=b"x" * 1000)
                await asyncio.sleep(5)

            start = time.monotonic()
            assert raw_call(client, server, stalled())["error"] == "timeout"
            assert time.monotonic() - start < 4
            assert server.stats["rejected"] == {"too-large": 1, "timeout": 1}


# ---- 4. timeouts ------------------------------------------------------------------------------


def test_timeout(nodes):
    server, client, _ = nodes
    aborted = server.stats["rejected"].get("aborted", 0)
    transport = client.transport(server.peer_id, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(TransportError, match="for 1 s") as info:
        transport._roundtrip(payload(1000, b"SLEEP"))
    elapsed = time.monotonic() - start
    assert info.value.reason == "timeout"
    assert elapsed < SLEEP  # the client did not wait for the handler
    deadline = time.monotonic() + 5  # the server notices that the caller hung up
    while server.stats["rejected"].get("aborted", 0) == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats["rejected"].get("aborted", 0) == aborted + 1
    # the transport still works afterwards
    assert transport._roundtrip(b"hello") == b"hello"


def test_unknown_peer_is_a_transport_error(nodes):
    _, client, _ = nodes
    other = HivemindNode(client_mode=True)
    other_id = other.peer_id
    other.shutdown()
    other.shutdown()  # idempotent
    transport = client.transport(other_id, ["/ip4/127.0.0.1/tcp/1/p2p/" + other_id], timeout=10)
    with pytest.raises(TransportError):
        transport._roundtrip(b"hello")


# ---- 5. rate cap ------------------------------------------------------------------------------


def test_max_mbps(nodes):
    server, client, _ = nodes
    transport = client.transport(server.peer_id, timeout=30, max_mbps=40)
    data = payload(10_000_000, b"SMALL")
    start = time.monotonic()
    assert transport._roundtrip(data) == b"ok"
    elapsed = time.monotonic() - start
    assert elapsed >= 1.8  # 10 MB at 40 Mbit/s = 5 MB/s is 2 s
    assert transport.bytes_sent == len(data)
    assert transport.bytes_received == 2
    # The timeout is for a stalled call (nothing moving), not for a long transfer: 2 s of
    # upload on a link whose timeout is 1 s still arrives.
    patient = client.transport(server.peer_id, timeout=1.0, max_mbps=40)
    assert patient._roundtrip(data) == b"ok"


# ---- 2. a server process, killed mid-transfer -------------------------------------------------


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = _child_pids(todo.pop())
        found += children
        todo += children
    return found


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


@pytest.fixture
def server_process():
    """Starts the echo server script; kills it and every process it started, by pid, at the end."""
    started: list[subprocess.Popen] = []
    helpers: set[int] = set()

    def start() -> tuple[subprocess.Popen, dict]:
        proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        started.append(proc)
        line = proc.stdout.readline()
        assert line, "the echo server exited before printing its address"
        helpers.update(descendants(proc.pid))
        return proc, json.loads(line)

    def track() -> set[int]:
        for proc in started:
            helpers.update(descendants(proc.pid))
        return helpers

    start.track = track
    try:
        yield start
    finally:
        track()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
        for pid in helpers:
            if running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for proc in started:
            proc.wait(10)


@pytest.mark.parametrize("phase", ["upload", "download"])
def test_server_process_killed_mid_transfer(server_process, phase):
    proc, info = server_process()
    with HivemindNode(client_mode=True) as client:
        transport = client.transport(info["peer_id"], info["maddrs"], timeout=20)
        data = payload(3_000_000)
        assert bytes(transport._roundtrip(data)) == data

        helpers = server_process.track()
        assert len(helpers) >= 2, helpers  # at least the DHT process and p2pd

        # 40 MB at 40 Mbit/s (5 MB/s) takes 8 s each way
        slow = client.transport(info["peer_id"], info["maddrs"], timeout=20, max_mbps=40)
        request = payload(40_000_000) if phase == "upload" else b"BIG 40000000"
        outcome: dict = {}

        def send():
            start = time.monotonic()
            try:
                outcome["reply"] = slow._roundtrip(request)
            except Exception as exc:
                outcome["error"] = exc
            outcome["elapsed"] = time.monotonic() - start

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        time.sleep(2.0)
        moved = slow.bytes_sent if phase == "upload" else slow.bytes_received
        assert 0 < moved < 40_000_000, "not mid-transfer"
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # the main process only, as a crash would
        proc.wait(10)
        sender.join(25)
        assert not sender.is_alive(), "the client hung"
        assert "reply" not in outcome, "the client accepted a reply from a dead server"
        assert isinstance(outcome["error"], TransportError), outcome["error"]
        assert outcome["elapsed"] < 20 + 1
        print(
            f"{phase}: client error {time.monotonic() - killed_at:.2f} s after the kill: "
            f"{outcome['error']}"
        )

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(running(pid) for pid in helpers):
            time.sleep(0.1)
        left = [pid for pid in helpers if running(pid)]
        assert not left, f"helper processes outlived their node: {left}"
        print(f"{phase}: helpers gone {time.monotonic() - killed_at:.2f} s after the kill")

        # a new call to the dead server fails quickly and cleanly
        with pytest.raises(TransportError):
            transport._roundtrip(b"hello")


def test_a_node_that_cannot_start_says_why_and_what_to_change():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    # Bound and not listening: connections to it are refused, and no other process can take it.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(TransportError, match=f"127.0.0.1:{port} is taken: stop what listens"):
            HivemindNode(port=port)
        # Nobody listens where the address to join points.
        nobody = (
            f"/ip4/127.0.0.1/tcp/{dead.getsockname()[1]}/p2p/"
            "12D3KooWPvUbQ8Ptm5VrcCFY7GhTqiGiRqvCDngedcEgoq9nt1zT"
        )
        with pytest.raises(TransportError, match="answered: is the coordinator running"):
            HivemindNode(initial_peers=[nobody], client_mode=True)
        with pytest.raises(TransportError, match="must be a whole multiaddr"):
            HivemindNode(initial_peers=["/ip4/127.0.0.1/tcp/1"], client_mode=True)
    finally:
        taken.close()
        dead.close()


def test_a_daemon_slow_to_start_is_waited_for_longer(monkeypatch, caplog):
    # The first waits are far too short for p2pd: the node tries again, waiting longer, and
    # starts within its start_timeout; the log says what happened.
    monkeypatch.setattr(node_module, "P2PD_FIRST_WAIT", 0.01)
    with caplog.at_level("WARNING", logger=node_module.__name__):
        node = HivemindNode(start_timeout=60)
    try:
        assert node.peer_id and node.visible_maddrs()
        assert "the p2p daemon did not start within" in caplog.text
    finally:
        node.shutdown()


# ---- 6. a node that cannot be dialled, reached through a relay ---------------------------------
# ---- 8. a node that cannot be dialled, reached through a relay --------------------------------


def test_a_node_that_cannot_be_dialled_is_served_through_a_relay_for_it_only():
    relayed: set[str] = set()
    with HivemindNode() as relay:
        relay.serve(lambda data: b"relay: " + data, relay_for=relayed.__contains__)
        joined = relay.visible_maddrs()
        with (
            HivemindNode(initial_peers=joined, client_mode=True) as owner,
            HivemindNode(initial_peers=joined, client_mode=True) as client,
        ):
            handler = Handler()
            owner.serve(handler)
            assert owner.visible_maddrs() == []  # listens nowhere: nobody can dial it
            route = [relayed_address(joined[0], owner.peer_id)]
            # Not (yet) one the relay relays for: refused at the relay, counted, never passed on.
            with pytest.raises(TransportError, match="not reachable through this relay") as info:
                client.transport(owner.peer_id, route, timeout=30)._roundtrip(b"hello")
            assert info.value.reason == "not-relayed" and handler.calls == []
            assert relay.stats["rejected"]["not-relayed"] == 1
            relayed.add(owner.peer_id)
            link = client.transport(owner.peer_id, route, timeout=30)
            data = payload(3 << 20)  # several pieces each way
            assert bytes(link._roundtrip(data)) == data and handler.calls == [len(data)]
            assert link.bytes_sent == len(data) == link.bytes_received
            assert relay.stats["relayed"] == 1
            # The owner's refusal reaches the caller through the relay, with its reason.
            with pytest.raises(TransportError, match="handler bug") as info:
                link._roundtrip(b"FAIL")
            assert info.value.reason == "handler-error"
            # The relay itself reaches the owner straight over the owner's connection.
            assert relay.transport(owner.peer_id, route)._roundtrip(b"SMALL") == b"ok"
    # A node that relays for nobody says so.
    with HivemindNode() as plain, HivemindNode(client_mode=True) as client:
        plain.serve(lambda data: data)
        route = [relayed_address(plain.visible_maddrs()[0], relay.peer_id)]
        with pytest.raises(TransportError, match="relays for nobody") as info:
            client.transport(relay.peer_id, route, timeout=30)._roundtrip(b"x")
        assert info.value.reason == "no-relay" and plain.stats["rejected"]["no-relay"] == 1


def test_a_version_1_header_is_still_accepted(nodes):
    """Nodes that still send the old header (with a SHA-256 of the payload) are served; the
    digest is not checked (the envelope is)."""
    server, client, handler = nodes
    calls = len(handler.calls)
    data = b"SMALL" + os.urandom(100)
    old = json.dumps({"v": 1, "size": len(data), "sha256": hashlib.sha256(b"other").hexdigest()})
    reply = raw_call(client, server, [runtime_pb2.ExpertRequest(uid=old, metadata=data)])
    assert reply == {"v": 2, "size": 2} and len(handler.calls) == calls + 1
