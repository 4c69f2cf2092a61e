"""A run on the hivemind DHT. For coordinators: the records they publish (the run's entry, its
manifest, its progress, each owner's modules and addresses), the node key that keeps a
coordinator's address across restarts, and an owner's first contact with the scheduler it joins.
For peers: joining a run (``join_run``), with everything a ``Peer`` needs to reach its owners.
For both: ``SchedulerLink``, the transport to the run's scheduler that follows a standby's
takeover, and ``supersedes``, the order of two schedulers' claims on a run (epoch, then id).

docs/protocol.md section 5 has the records' keys and fields; ``discovery.Publisher`` keeps them
fresh in the DHT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.owner import HAND_OVER_PATIENCE, resending
from dipaco.errors import TransportError
from dipaco.peer.download import RunFiles
from dipaco.peer.identity import FollowingLink
from dipaco.peer.modules import check_manifest
from dipaco.peer.seeds import SEED_REQUEST_BYTES, SeedFetcher, SeedServer
from dipaco.protocols import discovery
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.linkwatch import LinkWatch
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import ByteBuffer, Outgoing

log = logging.getLogger(__name__)


def node_identity(run_dir: Path) -> Path:
    """The node's libp2p key file, made on first use, so that its address (PeerID) survives
    restarts."""
    from hivemind.p2p import P2P

    path = run_dir / "coordinator" / "identity.key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return path


def scheduler_records(
    coordinator: Coordinator, peer_id: str, addresses: list[str], run_id: str
) -> list[tuple]:
    """What the scheduler publishes: the run's entry in ``dipaco.runs``, the manifest, the
    progress, and every owner's modules and addresses (``(key, value[, subkey])`` each)."""
    manifest = coordinator.peer_config
    with coordinator.lock:
        owners: dict[str, list[str]] = {}
        for mid, owner in coordinator.owners.items():
            owners.setdefault(owner, []).append(mid)
        versions = {mid: coordinator.version(mid) for mid in coordinator.owners}
        entry = {
            "scheduler": peer_id,
            "addresses": addresses,
            "manifest": discovery.manifest_sha256(manifest),
            "epoch": coordinator.epoch,
        }
        progress = {
            "round": coordinator.round,
            "rounds": coordinator.rounds,
            "modules": versions,
            "finished": coordinator.finished,
        }
        out: list[tuple] = [
            (discovery.RUNS, entry, run_id),
            (discovery.key(run_id, "manifest"), manifest),
            (discovery.key(run_id, "progress"), progress),
        ]
        for owner, mids in owners.items():
            info = {
                "modules": sorted(mids),
                "addresses": coordinator.addresses.get(owner, []),
                "scheduler": owner == peer_id,
            }
            out.append((discovery.key(run_id, "owners"), info, owner))
    return out


def owner_records(
    coordinator: Coordinator, peer_id: str, addresses: list[str], run_id: str
) -> list[tuple]:
    """What a module owner that is not the scheduler publishes: its modules and addresses."""
    info = {"modules": coordinator.owned_modules(), "addresses": addresses, "scheduler": False}
    return [(discovery.key(run_id, "owners"), info, peer_id)]


def supersedes(entry: Any, scheduler: str, epoch: int) -> bool:
    """Whether the DHT run entry ``entry`` names a scheduler other than ``scheduler`` whose
    claim on the run is newer: a higher epoch, or the same epoch and a greater node id (two
    schedulers that restarted into the same epoch: the order is total, so exactly one of them
    gives way)."""
    if not isinstance(entry, dict):
        return False
    other, their = entry.get("scheduler"), entry.get("epoch", 0)
    if not isinstance(other, str) or other == scheduler:
        return False
    if not isinstance(their, int) or isinstance(their, bool):
        return False
    return (their, other) > (epoch, scheduler)


def run_entry(node: Any, run_id: str) -> Any:
    """The run's entry in ``dipaco.runs`` now, or None (the DHT is best effort)."""
    try:
        found = node.get(discovery.RUNS)
    except Exception:  # noqa: BLE001 - a DHT that does not answer is no entry
        return None
    return found.get(run_id) if isinstance(found, dict) else None


class SchedulerLink(Transport):
    """The transport to a run's scheduler, following it across a takeover.

    Requests go to the scheduler the DHT announced. When it does not answer, the run's entry is
    read again; if it now names another scheduler with a newer claim (``supersedes``: a standby
    that took over, with a higher epoch), the request is sent there instead, and so is every
    later one. The new scheduler signs with the same key (a standby holds a copy of it), so the
    caller's pinned key still checks every reply: a stranger that wrote a DHT entry gets
    requests, but its replies are refused (``bad-signature``).
    """

    def __init__(
        self,
        node: Any,
        run_id: str,
        entry: dict[str, Any],
        connect: Callable[[str, list[str]], Transport],
    ) -> None:
        self.node, self.run_id, self.connect = node, run_id, connect
        self.scheduler = str(entry["scheduler"])
        epoch = entry.get("epoch", 0)
        self.epoch = epoch if isinstance(epoch, int) else 0
        self.addresses = [a for a in entry.get("addresses", []) if isinstance(a, str)]
        self.current = connect(self.scheduler, self.addresses)
        self._moving = threading.Lock()
        # Called with the new scheduler's addresses once this link follows it (an owner behind
        # the scheduler's relay is reached through the new one from then on).
        self.on_follow: Callable[[list[str]], None] | None = None

    def _roundtrip(self, data: Outgoing) -> ByteBuffer:
        current = self.current
        try:
            return current._roundtrip(data)
        except TransportError:
            if not self._follow(current):
                raise
            return self.current._roundtrip(data)

    def _follow(self, failed: Transport) -> bool:
        """Move to the scheduler the DHT names now, if it supersedes the one that failed."""
        with self._moving:
            if self.current is not failed:  # another request moved already
                return True
            entry = run_entry(self.node, self.run_id)
            if not supersedes(entry, self.scheduler, self.epoch):
                return False
            addresses = [a for a in entry.get("addresses", []) if isinstance(a, str)]
            self.current = self.connect(entry["scheduler"], addresses)
            self.scheduler, self.epoch, self.addresses = (
                entry["scheduler"],
                entry["epoch"],
                addresses,
            )
            log.warning(
                "the run's scheduler is now %s (epoch %d, a standby took over): following it",
                self.scheduler,
                self.epoch,
            )
        if self.on_follow is not None:
            self.on_follow(addresses)
        return True

    def close(self) -> None:
        self.current.close()


def contact_scheduler(
    node: Any, me: Identity, run: str | None, scheduler_key: str | None
) -> tuple[str, dict[str, Any], Any]:
    """Find the run in the DHT and say Hello to its scheduler as a coordinator; returns the run
    id, the manifest and an authenticated transport to the scheduler (one that follows a
    standby's takeover). The manifest must be the one the DHT announces and be signed by the
    scheduler's key (ConfigError otherwise)."""
    run_id, entry, manifest = discovery.find_run(node, run)
    scheduler = SchedulerLink(node, run_id, entry, node.transport)
    scheduler.authenticate(me, scheduler_key)
    hello = m.Hello(peer_id=node.peer_id, device="coordinator")
    # A first stream can end without a reply (a CI run saw it through a relay a second after
    # joining): sent again, as every later request of the owner's is (owner.resending).
    welcome = resending(lambda: scheduler.request(hello), HAND_OVER_PATIENCE)
    check_manifest(welcome, scheduler.server_key, entry["manifest"])  # as every peer checks it
    return run_id, manifest, scheduler


@dataclass
class HivemindJoin:
    """A peer's place in a run found through the DHT: its client node, the scheduler's
    transport, every link it opened (for the traffic counts), its DHT record and publisher, and
    an event the DHT sets when the run has finished."""

    node: Any
    run_id: str
    scheduler: Any
    manifest_sha256: str
    files: Any  # peer.download.RunFiles: the run's files, fetched and checked on demand
    announce: dict[str, Any]  # what the DHT shows of this peer (its task and progress too)
    publisher: Any
    run_over: threading.Event
    links: list[Any] = field(default_factory=list)
    max_mbps: float | None = None
    seeds: SeedFetcher | None = None  # modules peer to peer: fetched from, served to (if dialled)
    seed_server: SeedServer | None = None

    def connect(self, owner: str, addresses: list[str]) -> Any:
        """A transport to a module owner (counted in ``links``)."""
        link = self.node.transport(owner, addresses, max_mbps=self.max_mbps)
        self.links.append(link)
        return link

    def peer_options(self) -> dict[str, Any]:
        """The ``Peer`` keywords for a peer joined this way."""
        return {
            "connect": self.connect,
            "shard_source": self.files.shard,
            "manifest_sha256": self.manifest_sha256,
            "run_over": self.run_over,
            "seeds": self.seeds,
        }

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received so far: the messages over every link, to other peers serving
        modules, and what this peer served (requests in, replies out). Not counted: the DHT, and
        libp2p's and TCP's framing (what the kernel counts on the interface on top)."""
        sent = sum(t.bytes_sent for t in self.links)
        received = sum(t.bytes_received for t in self.links)
        if self.seeds is not None:
            up, down = self.seeds.traffic()
            sent, received = sent + up, received + down
        if self.seed_server is not None:
            sent, received = sent + self.seed_server.wire[0], received + self.seed_server.wire[1]
        return sent, received

    def close(self) -> None:
        self.run_over.set()
        if self.seeds is not None:
            self.seeds.close()
        self.publisher.close()
        self.node.shutdown()


def start_node(
    address: str, patience: float, on_wait: Callable[[str], None], listen: str | None = None
) -> Any:
    """A hivemind node bootstrapped from ``address`` (a client node, unless it ``listen``s on
    that host for other peers), retried for ``patience`` seconds (the coordinator may be
    restarting), saying so through ``on_wait`` in a few lines (``LinkWatch``); then a
    TransportError that says what was tried and points to ``dipaco-peer doctor``."""
    from dipaco.protocols.hivemind import HivemindNode

    watch = join_watch(address, patience, on_wait, every=2.0)
    began = time.monotonic()
    while True:
        try:
            if listen is not None:
                return HivemindNode(initial_peers=[address], host=listen)
            return HivemindNode(initial_peers=[address], client_mode=True)
        except TransportError as exc:
            watch.failed(exc)
            left = patience - (time.monotonic() - began)
            if left <= 0:
                raise watch.gave_up(exc) from None
            time.sleep(min(2.0, max(left, 0.1)))


def join_watch(
    address: str, patience: float, on_wait: Callable[[str], None], every: float
) -> LinkWatch:
    """The watch on a join's first contact with ``address``: its lines go to ``on_wait``."""
    return LinkWatch(
        f"the run at {address}",
        f"retrying every {every:g} s for up to {patience:.0f} s",
        check=f"Check the address with: dipaco-peer doctor {address}",
        lost="cannot reach {what} yet",
        logger=log,
        tell=lambda level, line: on_wait(line),
    )


def join_run(
    address: str,
    *,
    run: str | None,
    peer_id: str,
    state_dir: Path,
    me: Identity,
    trust: tuple[str | None, Callable[[str], None]],
    device: str,
    memory_gb: float | None,
    max_mbps: float | None,
    patience: float,
    on_wait: Callable[[str], None],
    serve_modules: str | None = None,
    trust_dir: Path | None = None,
) -> HivemindJoin:
    """Join a run's DHT: find the run, authenticate its scheduler (``trust``: the pinned or
    given coordinator key, and what to do on first use), fetch the tokenizer, publish this
    peer's record, and watch the DHT for the run's end. In client mode, unless
    ``serve_modules`` names a host to listen on: then the peer serves the module versions it
    holds to other peers (``peer.seeds``). Either way it fetches from peers that serve.
    ``trust_dir``: where the coordinator key is pinned (``state_dir`` unless a machine's)."""
    node = start_node(address, patience, on_wait, serve_modules)
    try:
        run_id, entry, manifest = discovery.find_run(node, run)
        info = {
            "peer": peer_id,
            "device": device,
            "memory_gb": memory_gb,
            "max_mbps": max_mbps,
            "client_mode": serve_modules is None,
        }
        publisher = discovery.Publisher(
            node, lambda: [(discovery.key(run_id, "peers"), info, peer_id)], interval=10.0
        )
        join = HivemindJoin(
            node, run_id, None, entry["manifest"], None, info, publisher, threading.Event(),
            max_mbps=max_mbps,
        )  # fmt: skip
        join.seeds = SeedFetcher(node, run_id, me, peer_id, serving=serve_modules is not None)
        if serve_modules is not None:
            join.seed_server = SeedServer(me, join.seeds.held)
            # FetchSeed requests are small; two uploads at a time at most
            node.serve(join.seed_server.handle, workers=2, max_request_bytes=SEED_REQUEST_BYTES)
        # Follows a standby's takeover (SchedulerLink) and a rotation of the scheduler's key.
        link = SchedulerLink(node, run_id, entry, join.connect)
        join.scheduler = FollowingLink(link, trust_dir or state_dir, address, peer_id, run_id)
        join.scheduler.authenticate(me, *trust)
        join.files = RunFiles(
            join.scheduler, peer_id, manifest["files"], state_dir / "runs" / run_id
        )
        join.files.get("tokenizer.model")
        publisher.start()
        threading.Thread(
            target=_watch_progress, args=(node, run_id, join.run_over), name="dipaco-progress",
            daemon=True,
        ).start()  # fmt: skip
    except BaseException:
        node.shutdown()
        raise
    return join


def _watch_progress(node: Any, run_id: str, run_over: threading.Event) -> None:
    """Set ``run_over`` when the DHT says the run has finished, even if no one answers."""
    while not run_over.wait(2.0):
        try:
            progress = node.get(discovery.key(run_id, "progress"))
        except Exception:  # the DHT is best effort
            continue
        if isinstance(progress, dict) and progress.get("finished"):
            run_over.set()
