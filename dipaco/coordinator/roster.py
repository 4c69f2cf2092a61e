"""The peers as this coordinator has seen them, a part that owns them (``core.roster``): when each
was last heard, what its Hello and heartbeats said, the task it was last given, what it trained
and the bytes it moved, for ``status`` and the dashboard. Changed only by these methods, under
the coordinator's lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dipaco.coordinator.records import PeerInfo


class Roster:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.peers: dict[str, PeerInfo] = {}

    def seen(self, peer_id: str) -> PeerInfo:
        """``peer_id`` made a request now."""
        peer = self.peers.setdefault(peer_id, PeerInfo())
        peer.last_seen = self.clock()
        return peer

    def hello(self, peer_id: str, device: str | None, capabilities: dict[str, Any]) -> None:
        peer = self.seen(peer_id)
        peer.device, peer.capabilities = device, capabilities

    def heartbeat(self, peer_id: str, step: int | None) -> None:
        self.seen(peer_id).step = step

    def given(self, peer_id: str, task_id: str) -> None:
        self.peers[peer_id].task = task_id

    def trained(self, peer_id: str, tokens: int) -> None:
        """``peer_id``'s task is done (every owner acknowledged it), ``tokens`` trained."""
        peer = self.peers.setdefault(peer_id, PeerInfo())
        peer.tasks_done += 1
        peer.tokens += tokens
        peer.task = None

    def moved(self, who: str, received: int, sent: int) -> None:
        """A request of ``received`` bytes from ``who`` and its reply of ``sent``."""
        peer = self.peers.get(who)
        if peer is not None:
            peer.bytes_in += received
            peer.bytes_out += sent
