"""The calling side of the hivemind transport: a peer's :class:`HivemindTransport` to one node.

A request's pieces go out as one stream; the reply's header and pieces come back on it. A call
fails when nothing has moved either way for ``timeout`` seconds, so a long transfer does not; a
refusal with a final reason (``too-large``, ``bad-header``) is a :class:`RejectedError`, anything
else a :class:`TransportError`. ``max_mbps`` caps both directions with a token bucket each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Protocol

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from dipaco.errors import RejectedError, TransportError
from dipaco.protocols.addresses import RELAYED, split_relayed
from dipaco.protocols.hivemind.framing import (
    Assembly,
    TokenBucket,
    parse_header,
    pieces,
    size_header,
)
from dipaco.protocols.hivemind.server import _ByteServicer
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import ByteBuffer, Outgoing

log = logging.getLogger(__name__)

# Rejections that mean "this request will never be accepted": the client raises RejectedError.
# Everything else (truncated, overrun, timeout, handler-error...) is a TransportError.
FINAL_REASONS = frozenset({"too-large", "bad-header"})


class _Node(Protocol):
    """What a transport uses of its :class:`~dipaco.protocols.hivemind.node.HivemindNode`."""

    def _live_p2p(self) -> P2P: ...

    def _submit(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any: ...


def _transport_part(maddr: Multiaddr, peer_id: str) -> Multiaddr:
    """``maddr`` without its ``/p2p/<id>`` part, which p2pd's CONNECT wants left out (hivemind
    encodes that part in a form the daemon cannot parse)."""
    if "p2p" in maddr:
        if maddr["p2p"] != peer_id:
            raise ValueError(f"{maddr} belongs to another peer")
        maddr = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
    return maddr


class HivemindTransport(Transport):
    """A peer's transport to one coordinator's node; requests may run concurrently.

    ``bytes_sent``/``bytes_received`` count payload bytes this client put on / took off the wire.
    ``max_mbps`` caps both directions (a token bucket each), in megabits per second. A target
    whose addresses are all relayed (:func:`relayed_address`) is reached through its relay: the
    streams go to the relay, their header naming the target (or straight to the target, over
    the connection it keeps, when this node is the relay).
    """

    def __init__(
        self,
        node: _Node,
        target_peer_id: str,
        target_maddrs: Sequence[str] = (),
        *,
        timeout: float = 120.0,
        max_mbps: float | None = None,
        max_reply_bytes: int = 1 << 31,
    ) -> None:
        self.node = node
        self.target = target_peer_id
        self._to: str | None = None  # the target, named in each header, when through a relay
        try:
            direct = [m for m in target_maddrs if RELAYED not in m]
            # split_relayed: None for exactly the addresses that name no relay
            via = [v for v in map(split_relayed, target_maddrs) if v is not None]
            if any(target != target_peer_id for _, _, target in via):
                raise ValueError("a relayed address names another node")
            stream_to = target_peer_id
            if via and not direct and via[0][1] != getattr(node, "peer_id", None):
                relay, stream_to, _ = via[0]
                direct, self._to = [relay], target_peer_id
            self._peer = PeerID.from_base58(stream_to)
            self._maddrs = [_transport_part(Multiaddr(m), stream_to) for m in direct]
        except Exception as exc:
            raise TransportError(f"bad hivemind address for {target_peer_id}: {exc}") from None
        self.timeout = timeout
        self.max_mbps = max_mbps
        self._moved_at = 0.0  # loop time of the last chunk sent or received
        self.max_reply_bytes = max_reply_bytes
        self._up = TokenBucket(max_mbps) if max_mbps else None
        self._down = TokenBucket(max_mbps) if max_mbps else None
        self._dialed = not self._maddrs
        self.bytes_sent = 0
        self.bytes_received = 0

    async def _dial(self) -> None:
        """Tell our p2pd where the target listens (adds the addresses to its peerstore, connects)."""
        try:
            await self.node._live_p2p()._client.connect(self._peer, self._maddrs)
            self._dialed = True
        except Exception as exc:  # the call below reports the failure if it matters
            log.debug("hivemind transport: dialing %s failed: %s", self.target, exc)

    async def _requests(
        self, data: Outgoing, header: str
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        first = True
        for piece in pieces(data):
            if self._up is not None:  # wait before a piece, so the stream ends right after the last
                await self._up.consume(len(piece))
            if first:
                yield runtime_pb2.ExpertRequest(uid=header, metadata=piece)
                first = False
            else:
                yield runtime_pb2.ExpertRequest(metadata=piece)
            self.bytes_sent += len(piece)
            self._moved_at = asyncio.get_running_loop().time()

    async def _call(self, data: Outgoing, header: str) -> ByteBuffer:
        if not self._dialed:
            await self._dial()
        stub = _ByteServicer.get_stub(self.node._live_p2p(), self._peer)
        responses = await stub.rpc_call(self._requests(data, header))
        try:
            reply_header = None
            reply = Assembly(0)
            async for msg in responses:
                if reply_header is None:
                    try:
                        reply_header = parse_header(msg.metadata)
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
                    reply = Assembly(size)  # the reply's one buffer, filled as pieces come
                    continue
                piece = msg.metadata
                self._moved_at = asyncio.get_running_loop().time()
                self.bytes_received += len(piece)
                try:
                    reply.add(piece)
                except ValueError as exc:
                    raise TransportError(
                        f"reply overruns its header: {exc}", reason="overrun"
                    ) from None
                if self._down is not None:
                    await self._down.consume(len(piece))
                if reply.got == size:
                    break
        finally:
            await responses.aclose()
        if reply_header is None:
            raise TransportError(f"{self.target} closed the stream without a reply")
        if reply.got != reply.size:
            raise TransportError(
                f"reply truncated: got {reply.got} of {reply.size} bytes",
                reason="truncated",
            )
        return reply.buffer

    async def _within_budget(self, data: Outgoing, header: str):
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

    async def _call_with_timeout(self, data: Outgoing, header: str):
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

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        header = size_header(len(data), to=self._to)
        try:
            reply = self.node._submit(
                self._call_with_timeout(data, header), None
            )  # the call keeps its own time budget
        except (TransportError, RejectedError):
            raise
        except (TimeoutError, concurrent.futures.CancelledError, asyncio.CancelledError):
            raise TransportError(
                f"call to {self.target} did not finish (node loop stuck or shut down)"
            ) from None
        return reply  # a buffer of its own: the reply's tensors are views of it
