"""The wire form of one hivemind transfer: headers, 1 MiB pieces, and a byte-rate cap.

One stream-in, stream-out RPC per request; opaque bytes, nothing is pickled:

* request: ``ExpertRequest`` messages. The first one carries a JSON header in ``uid``
  (``{"v": 2, "size": N}``, and ``"to": PEER_ID`` for a request that a relay passes on to that
  node); every message carries up to 1 MiB of the payload in ``metadata``.
* reply: ``ExpertResponse`` messages. The first one is a JSON header in ``metadata``: either
  ``{"v": 2, "size": N}`` followed by the payload in 1 MiB chunks, or
  ``{"v": 2, "error": REASON, "message": TEXT}`` when the server refused the transfer.

Both sides check the size at the end: a stream whose sender died can end early without any
error, and this is the only way to notice. The bytes themselves are not hashed here: the libp2p
connection's encryption already refuses altered bytes, and every request and reply is a signed
envelope whose BLAKE3 digest the receiver checks (``auth``): one hash of a body, not three.
Version 1 headers also carried a ``sha256`` of the payload; it is still accepted, and ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

from dipaco.protocols.wire import Outgoing, Pieces, received_buffer

CHUNK = 1 << 20
WIRE_VERSION = 2
MAX_HEADER_CHARS = 4096
MAX_PEER_ID_CHARS = 128  # a base58 libp2p peer id is about 46-52


class TokenBucket:
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


def pieces(data: Outgoing) -> Iterator[bytes]:
    """The payload in CHUNK-sized pieces (one copy per piece: protobuf needs bytes), Pieces
    read in turn from their own buffers."""
    if len(data) <= CHUNK and isinstance(data, bytes):
        yield data
        return
    if not isinstance(data, Pieces):
        view = memoryview(data).cast("B")
        for offset in range(0, max(len(view), 1), CHUNK):
            yield bytes(view[offset : offset + CHUNK])
        return
    carry = bytearray()  # the start of a piece that crosses into the next part
    for part in data.parts:
        offset = 0
        if carry:
            offset = min(CHUNK - len(carry), part.nbytes)
            carry += part[:offset]
            if len(carry) < CHUNK:
                continue  # this part is used up
            yield bytes(carry)
            carry = bytearray()
        while part.nbytes - offset >= CHUNK:
            yield bytes(part[offset : offset + CHUNK])
            offset += CHUNK
        carry += part[offset:]
    if carry or not len(data):
        yield bytes(carry)


class Assembly:
    """A payload of ``size`` bytes received in pieces, written into one buffer of that size as
    they come (a list of pieces joined at the end held the payload twice). The buffer's pages
    take memory only once written (wire.received_buffer)."""

    def __init__(self, size: int) -> None:
        self.buffer = received_buffer(size)
        self.got = 0

    @property
    def size(self) -> int:
        return len(self.buffer)

    def add(self, piece: bytes) -> None:
        """Write ``piece`` after what came before; ValueError if it overruns ``size``."""
        end = self.got + len(piece)
        if end > len(self.buffer):
            raise ValueError(f"{end} > {len(self.buffer)} bytes")
        self.buffer[self.got : end] = piece
        self.got = end


def size_header(size: int, to: str | None = None) -> str:
    """The header announcing a payload of ``size`` bytes; ``to`` names the node a relay passes
    the request on to."""
    header: dict = {"v": WIRE_VERSION, "size": size}
    if to is not None:
        header["to"] = to
    return json.dumps(header)


def error_header(reason: str, message: str) -> bytes:
    """The reply header of a refused transfer."""
    return json.dumps({"v": WIRE_VERSION, "error": reason, "message": message}).encode()


def parse_header(raw: str | bytes) -> dict:
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
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise ValueError(f"bad sha256 {digest!r}")  # version 1's, accepted and not checked
    to = header.get("to")
    if to is not None and not (isinstance(to, str) and 0 < len(to) <= MAX_PEER_ID_CHARS):
        raise ValueError(f"bad relay target {str(to)[:80]!r}")
    return header
