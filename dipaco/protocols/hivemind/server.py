"""The serving side of the hivemind transport: one ``bytes -> bytes`` handler as a stream RPC.

The server refuses a header size above its limit before reading any more, checks the size and
the SHA-256 of what arrived, and runs the handler in a thread pool, never on the event loop. A
refusal is a reply header with a reason (see :mod:`.framing`); the server then keeps reading what
the caller still sends (bounded), so that the refusal arrives.

A node that relays (``relay_for``) passes a request whose header names another node (``"to"``)
on to that node, over the connection that node keeps to it (a module owner behind NAT, which
cannot be dialled, dials the relay), and the reply back: only to the nodes ``relay_for``
accepts, otherwise the request is refused (``no-relay``, ``not-relayed``) and counted. The relay
sees only signed envelopes, which it cannot alter unnoticed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from typing import AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator hints

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from dipaco.protocols.hivemind.framing import (
    Assembly,
    error_header,
    parse_header,
    pieces,
    size_header,
)
from dipaco.protocols.transport import Handler
from dipaco.protocols.wire import ByteBuffer, Received

log = logging.getLogger(__name__)

DRAIN_SECONDS = 10.0  # how long a refusing server keeps reading, so its refusal arrives


# (target node, request) -> its reply: what a relay does with a request for another node
Forward = Callable[[str, ByteBuffer], Awaitable[ByteBuffer]]


class _Reject(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _ByteServicer(ServicerBase):
    """Serves one ``bytes -> bytes`` handler as the ``rpc_call`` stream RPC.

    The class name is part of the wire: hivemind names the handler ``_ByteServicer.rpc_call``.
    ``record(key, n)`` and ``reject(reason)`` count into the node's stats.
    """

    def __init__(
        self,
        record: Callable[[str, int], None],
        reject: Callable[[str], None],
        handler: Handler,
        executor: concurrent.futures.ThreadPoolExecutor,
        max_request_bytes: int,
        read_timeout: float,
        relay_for: Callable[[str], bool] | None = None,
        forward: Forward | None = None,
        own_id: str = "",
    ) -> None:
        self._record = record
        self._reject = reject
        self._handler = handler
        self._executor = executor
        self._max = max_request_bytes
        self._read_timeout = read_timeout
        self._relay_for = relay_for
        self._forward = forward
        self.own_id = own_id  # a request for this node itself is served, not relayed

    def _job(self, data: Received) -> ByteBuffer:
        """Runs in the pool: call the handler on the request (a buffer of its own, see
        transport.Handler)."""
        self._record("handler_calls", 1)
        try:
            reply = self._handler(data)
        except Exception as exc:
            log.exception("hivemind transport: handler failed")
            raise _Reject("handler-error", f"handler failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, ByteBuffer):
            raise _Reject("handler-error", f"handler returned {type(reply).__name__}, not bytes")
        return reply  # sent in 1 MiB pieces, each its own copy: no copy of the whole

    async def _next(self, stream: AsyncIterator[runtime_pb2.ExpertRequest]):
        try:
            return await asyncio.wait_for(stream.__anext__(), self._read_timeout)
        except TimeoutError:
            raise _Reject(
                "timeout", f"no request data for {self._read_timeout:.0f} s; transfer dropped"
            ) from None

    def _check_relay(self, to: str) -> None:
        """Refuse a request for ``to`` (another node) unless this node relays for it: from its
        header, before the rest of it is read."""
        if self._relay_for is None or self._forward is None:
            raise _Reject("no-relay", f"this node relays for nobody (the request is for {to})")
        if not self._relay_for(to):
            raise _Reject("not-relayed", f"{to} is not reachable through this relay")

    async def _relay(self, to: str, data: Received) -> ByteBuffer:
        """Pass a request on to ``to`` (a node this one relays for); its reply."""
        forward = self._forward
        if forward is None:  # cannot happen: _check_relay refused it from its header
            raise _Reject("no-relay", f"this node relays for nobody (the request is for {to})")
        try:
            reply = await forward(to, data)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, timed out: the caller's
            reason = getattr(exc, "reason", "transport")
            raise _Reject("unreachable" if reason == "transport" else reason, str(exc)) from None
        self._record("relayed", 1)
        return reply

    async def _receive(
        self, stream: AsyncIterator[runtime_pb2.ExpertRequest]
    ) -> tuple[Received, str | None]:
        """The request, read into one buffer of its announced size as its pieces come, and the
        node it is for (None: this one)."""
        try:
            first = await self._next(stream)
        except StopAsyncIteration:
            raise _Reject("bad-header", "empty request stream") from None
        try:
            header = parse_header(first.uid)
            if "error" in header:
                raise ValueError("a request header cannot carry an error")
        except ValueError as exc:
            raise _Reject("bad-header", f"bad request header: {exc}") from None
        size = header["size"]
        if size > self._max:
            raise _Reject(
                "too-large", f"request of {size} bytes exceeds the limit of {self._max} bytes"
            )
        if header.get("to") not in (None, self.own_id):
            self._check_relay(header["to"])
        request = Assembly(size)
        msg = first
        while True:
            piece = msg.metadata
            if piece:
                self._record("bytes_in", len(piece))
                try:
                    request.add(piece)
                except ValueError as exc:
                    raise _Reject("overrun", f"request overruns its header: {exc}") from None
            try:
                msg = await self._next(stream)
            except StopAsyncIteration:
                if request.got < size:
                    raise _Reject(
                        "truncated", f"request truncated: got {request.got} of {size} bytes"
                    ) from None
                # The sender has finished writing: a reply cannot collide with its writes.
                return request.buffer, header.get("to")

    async def _drain(self, stream: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """Read and drop what the caller still sends, until it ends or hangs up (bounded).

        A reply written while the caller is still writing can be lost: when the server closes the
        stream, the caller's next write fails and that error also ends its read side.
        """
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.wait_for(stream.__anext__(), left)
        except (StopAsyncIteration, TimeoutError):
            pass

    async def rpc_call(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        self._record("requests", 1)
        remote = context.remote_id.to_base58() if context.remote_id is not None else "?"
        stream = requests.__aiter__()
        try:
            data, to = await self._receive(stream)
            reply: ByteBuffer
            if to is not None and to != self.own_id:
                reply = await self._relay(to, data)
            else:
                loop = asyncio.get_running_loop()
                reply = await loop.run_in_executor(self._executor, self._job, data)
            del data
        except _Reject as rej:
            self._reject(rej.reason)
            log.debug("hivemind transport: rejected a request from %s: %s", remote, rej)
            yield runtime_pb2.ExpertResponse(metadata=error_header(rej.reason, str(rej)))
            await self._drain(stream)
            return
        except asyncio.CancelledError:
            # The caller went away (killed, or cancelled its call) mid-transfer.
            self._reject("aborted")
            log.debug("hivemind transport: a request from %s was aborted", remote)
            raise
        self._record("handled", 1)
        handed = 0  # reply bytes handed to hivemind to send
        try:
            yield runtime_pb2.ExpertResponse(metadata=size_header(len(reply)).encode())
            for piece in pieces(reply):
                if piece:
                    handed += len(piece)
                    self._record("bytes_out", len(piece))
                    yield runtime_pb2.ExpertResponse(metadata=piece)
        finally:
            # hivemind stops pulling from (and then closes) this generator when the caller hangs up
            if handed < len(reply):
                self._reject("reply-aborted")
                log.debug("hivemind transport: %s hung up before the whole reply", remote)
