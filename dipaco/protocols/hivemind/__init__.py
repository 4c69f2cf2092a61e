"""A byte transport over hivemind: a DHT for discovery plus libp2p streams for the frames.

One :class:`HivemindNode` is one hivemind DHT (a forked process that owns a ``p2pd`` daemon) plus a
replica of its P2P handle, driven from a private asyncio loop in a daemon thread. A coordinator
calls :meth:`HivemindNode.serve` with its ``bytes -> bytes`` handler; a peer gets a
:class:`HivemindTransport` from :meth:`HivemindNode.transport` and sends requests through it.

The parts: ``framing`` (the wire form of a transfer: headers, 1 MiB pieces, a byte-rate cap),
``server`` (the handler as a stream RPC), ``client`` (the transport), ``node`` (the DHT, the loop
thread, start and shutdown) and ``cleanup`` (a node's DHT process and ``p2pd`` die with it, even
after a SIGKILL).
"""

from dipaco.protocols.hivemind.client import HivemindTransport
from dipaco.protocols.hivemind.node import HivemindNode

__all__ = ["HivemindNode", "HivemindTransport"]
