"""Modules served peer to peer: a peer that holds a released module version serves it to others.

A peer keeps the module versions it trained from (``Held``: the newest checked version of each
module, with the owner's signed release). On a network where it can be dialled (hivemind, not in
client mode) it answers other peers' ``FetchSeed`` with them (``SeedServer``) and announces each
in the DHT under ``<run>.seeds.<module>.v<version>``. A peer that needs a version asks its owner
for the signed release only (the hash and signature, no tensors) and fetches the tensors from
the holders that moved bytes fastest to it before (``SeedFetcher``), checking them against the
owner's signed hash; a holder that sends anything else is refused, counted and not asked again,
and the module comes from the next holder or from its owner. No tensor a peer trains on is
trusted for who sent it: only for matching the release its owner signed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from dipaco.errors import DipacoError, RejectedError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.addresses import announceable, reachable
from dipaco.protocols.discovery import key as dht_key
from dipaco.protocols.limits import KeyBuckets
from dipaco.protocols.reasons import Reason
from dipaco.protocols.wire import ByteBuffer, tensors_sha256

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
SEED_TTL = 600.0  # seconds a holder's DHT record lives (announced again with each version)
SPEED_MEMORY = 0.5  # weight of a holder's newest transfer rate in its running estimate
SEED_REQUEST_BYTES = 1 << 16  # the largest FetchSeed a serving peer reads (signed, tiny)
SEED_WAIT = 2.0  # seconds at most a peer waits for a holder of a new version (SeedFetcher.find)
# What one key may ask of a serving peer (its upload is a volunteer's home link): requests per
# second (a token bucket of SEED_BURST), and how often one module version (a key that fetched it
# and checked it has no need of it again; a retry after a lost reply is one more). The counts
# of the SEED_KEYS keys seen last are kept; an older key starts afresh.
SEED_REQUESTS_PER_SECOND = 1.0
SEED_BURST = 8
SEED_REPEATS = 2
SEED_KEYS = 4096


@dataclass
class Release:
    """A module version as its owner released it: the signed hash, and tensors that match it."""

    version: int
    digest: str
    signature: str  # the owner's signature of (run, module, version, digest)
    tensors: Tensors


class Held:
    """The module versions this peer can serve: the newest checked version of each module."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._releases: dict[str, Release] = {}

    def put(self, mid: str, release: Release) -> bool:
        """Keep ``release`` unless a newer version of ``mid`` is held; True if kept."""
        with self._lock:
            old = self._releases.get(mid)
            if old is not None and old.version >= release.version:
                return False
            self._releases[mid] = release
            return True

    def get(self, mid: str, version: int) -> Release | None:
        with self._lock:
            release = self._releases.get(mid)
        return release if release is not None and release.version == version else None


class SeedServer:
    """Answers other peers' signed ``FetchSeed`` requests from ``held``, sealed with this peer's
    key. Anything else, a replay, a version not held, or a key over its share (``SEED_*``) is
    an Error reply, counted."""

    def __init__(
        self,
        identity: auth.Identity,
        held: Held,
        clock_skew: float = 300.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.identity, self.held = identity, held
        self.guard = auth.ReplayGuard(clock_skew)
        self.clock = clock
        self._lock = threading.Lock()
        # Per key: its request tokens, and per module the newest version it fetched and how
        # many times ({module: (version, times)}).
        self._uses = KeyBuckets(
            SEED_REQUESTS_PER_SECOND, SEED_BURST, SEED_KEYS, state=dict, clock=clock
        )
        self.served = 0  # module versions sent
        self.bytes_out = 0  # their tensor bytes
        self.wire = [0, 0]  # bytes of the replies sent and of the requests read, all of them
        self.refused: Counter[str] = Counter()  # reason -> requests answered with an Error

    def handle(self, data: ByteBuffer) -> ByteBuffer:
        nonce = ""
        try:
            nonce = auth.peek_nonce(data)
            signed = auth.open_request(data)
            with self._lock:
                self.guard.check(signed)  # a replay costs its signer nothing
                fetched = self._admit(signed.key)
            req = m.decode_message(signed.body)
            if not isinstance(req, m.FetchSeed):
                raise RejectedError(
                    f"a peer serves FetchSeed only, not {type(req).__name__}",
                    reason=Reason.BAD_MESSAGE,
                )
            reply: Any = self._serve(req, fetched, auth.fingerprint(signed.key))
        except DipacoError as exc:
            with self._lock:
                self.refused[exc.reason] += 1
            reply = m.Error(reason=exc.reason, message=str(exc))
        sealed = auth.seal_reply(self.identity, nonce, m.encode_message(reply))
        with self._lock:
            self.wire[0] += len(sealed)
            self.wire[1] += len(data)
        return sealed

    def _admit(self, key: str) -> dict[str, tuple[int, int]]:
        """What ``key`` fetched, with one of its request tokens taken; RejectedError
        (rate-limited) when it has none left."""
        bucket = self._uses.take(key)
        if bucket is None:
            raise RejectedError(
                f"key {auth.fingerprint(key)} asks this peer more than "
                f"{SEED_REQUESTS_PER_SECOND:g} times a second; fetch from the module's owner",
                reason=Reason.RATE_LIMITED,
            )
        return bucket.state

    def _serve(self, req: m.FetchSeed, fetched: dict[str, tuple[int, int]], who: str) -> m.Modules:
        release = self.held.get(req.module, req.version)
        if release is None:
            raise RejectedError(
                f"this peer does not hold {req.module} v{req.version}", reason=Reason.NOT_HELD
            )
        size = sum(t.numel() * t.element_size() for t in release.tensors.values())
        with self._lock:
            version, times = fetched.get(req.module, (release.version, 0))
            times = times if version == release.version else 0
            if times >= SEED_REPEATS:
                raise RejectedError(
                    f"key {who} fetched {req.module} v{release.version} from this peer "
                    f"{times} times already; fetch it from the module's owner",
                    reason=Reason.RATE_LIMITED,
                )
            fetched[req.module] = (release.version, times + 1)
            self.served += 1
            self.bytes_out += size
        return m.Modules(
            versions={req.module: release.version},
            hashes={req.module: release.digest},
            tensors={f"{req.module}/{k}": v for k, v in release.tensors.items()},
            signatures={req.module: release.signature},
        )


def seed_key(run_id: str, mid: str, version: int) -> str:
    """The DHT key under which the holders of a module version announce themselves."""
    return dht_key(run_id, f"seeds.{mid}.v{version}")


class SeedFetcher:
    """A peer's side of peer-to-peer modules: finds holders in the DHT, fetches from the fastest,
    checks every byte against the owner's signed hash, and announces what this peer holds.

    ``node`` is the peer's hivemind node (``get``, ``store``, ``transport``, ``peer_id``,
    ``visible_maddrs``); ``serving`` says whether it can be dialled (not in client mode), so
    whether it announces; ``wait`` bounds the wait for a holder of a new version (``find``). Counters: ``from_seeds`` and ``from_owner`` (module versions),
    ``seed_bytes``, and ``refused`` (holder id -> times its module failed the check).
    """

    def __init__(
        self,
        node: Any,
        run_id: str,
        identity: auth.Identity,
        peer_id: str,
        *,
        serving: bool,
        timeout: float = 60.0,
        tries: int = 3,
        wait: float = SEED_WAIT,
    ) -> None:
        self.node, self.run_id, self.identity, self.peer_id = node, run_id, identity, peer_id
        self.serving, self.timeout, self.tries, self.wait = serving, timeout, tries, wait
        self.held = Held()
        self._lock = threading.Lock()
        self._links: dict[str, Any] = {}
        self.speed: dict[str, float] = {}  # holder id -> bytes per second, running estimate
        self.bad: set[str] = set()  # holders that sent a module failing its check: never again
        self.unreachable: set[str] = set()  # holders with no address this machine can dial
        self.refused: Counter[str] = Counter()
        self.from_seeds = self.from_owner = self.seed_bytes = 0
        self._gone = [0, 0]  # bytes sent and received over links since closed
        self._addresses: list[str] | None = None
        self._announced: dict[str, float] = {}  # DHT key -> when this peer last announced it
        self._found: dict[tuple[str, int], list] = {}  # (module, version) -> holders find read

    # -- holders ---------------------------------------------------------------------------

    def holders(self, mid: str, version: int) -> list[tuple[str, dict]]:
        """The other peers that announced ``mid`` v``version``, fastest known first (unknown
        ones after them, in the DHT's order), with the addresses this machine can dial; never
        this peer, a refused one, or one with no such address (a peer behind another NAT:
        ``addresses.reachable``; counted in ``unreachable``)."""
        try:
            found = self.node.get(seed_key(self.run_id, mid, version))
        except Exception:  # noqa: BLE001 - the DHT is best effort: no holders, ask the owner
            return []
        if not isinstance(found, dict):
            return []
        out = []
        for holder, info in found.items():
            if not (
                isinstance(holder, str)
                and holder != self.node.peer_id
                and holder not in self.bad
                and isinstance(info, dict)
                and isinstance(info.get("key"), str)
                and isinstance(info.get("addresses"), list)
            ):
                continue
            usable = [a for a in info["addresses"] if isinstance(a, str) and reachable(a)]
            if not usable:  # behind another router's NAT: dialling it would only time out
                with self._lock:
                    self.unreachable.add(holder)
                continue
            out.append((holder, {**info, "addresses": usable}))
        out.sort(key=lambda item: -self.speed.get(item[0], 0.0))
        return out[: self.tries]

    def find(self, needed: dict[str, int]) -> dict[str, int]:
        """The module versions of ``needed`` that some other peer holds. For those no one holds
        yet (a version just released: every peer of the round wants it at once), wait a random
        part of ``wait`` seconds, looking again every 0.1 s: the peer whose wait ends first
        fetches from the owner and announces, and the others find it. Only for the run's first
        versions (version 0: every peer that starts with the run wants them at once) and for
        modules whose previous version someone else held: a peer alone (or among peers that
        cannot be dialled) waits only on its first tasks."""
        self._found = {(mid, v): self.holders(mid, v) for mid, v in needed.items()}
        found = {mid: v for mid, v in needed.items() if self._found[mid, v]}
        rest = {
            mid: v
            for mid, v in needed.items()
            if mid not in found and (v == 0 or self.holders(mid, v - 1))
        }
        if rest and self.wait > 0:
            end = time.monotonic() + random.uniform(0, self.wait)
            while rest and time.monotonic() < end:
                time.sleep(0.1)
                for mid, v in list(rest.items()):
                    if holders := self.holders(mid, v):
                        self._found[mid, v] = holders
                        found[mid] = rest.pop(mid)
        return found

    # -- fetching --------------------------------------------------------------------------

    def fetch(self, mid: str, version: int, digest: str) -> Tensors | None:
        """``mid`` v``version`` from a holder, its tensors matching ``digest`` (the hash the
        owner signed), or None when no holder delivered it. The holders ``find`` just read are
        asked; the DHT is read again only for a version ``find`` did not look up."""
        holders = self._found.pop((mid, version), None)
        if holders is None:
            holders = self.holders(mid, version)
        for holder, info in holders:
            if holder in self.bad:  # refused while fetching another module meanwhile
                continue
            began = time.monotonic()
            try:
                reply = self._link(holder, info).request(
                    m.FetchSeed(peer_id=self.peer_id, module=mid, version=version)
                )
            except DipacoError as exc:  # unreachable, gone, or does not hold it: the next one
                log.info("peer %s: holder %s did not serve %s v%d: %s", self.peer_id,
                         holder[:12], mid, version, exc)  # fmt: skip
                self._forget(holder)
                continue
            except Exception as exc:  # noqa: BLE001 - its DHT record (anyone's) is unusable
                log.info("peer %s: holder %s cannot be dialled (%s): skipped for good",
                         self.peer_id, holder[:12], exc)  # fmt: skip
                with self._lock:
                    self.bad.add(holder)
                continue
            tensors = self._checked(holder, reply, mid, version, digest)
            if tensors is None:
                continue
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            rate = size / max(time.monotonic() - began, 1e-6)
            with self._lock:
                old = self.speed.get(holder)
                self.speed[holder] = rate if old is None else (
                    SPEED_MEMORY * rate + (1 - SPEED_MEMORY) * old
                )  # fmt: skip
                self.from_seeds += 1
                self.seed_bytes += size
            log.info("peer %s: %s v%d from peer %s (%s), %.1f MB/s", self.peer_id, mid, version,
                     info.get("peer"), holder[:12], rate / 1e6)  # fmt: skip
            return tensors
        return None

    def _checked(
        self, holder: str, reply: Any, mid: str, version: int, digest: str
    ) -> Tensors | None:
        """The reply's tensors of ``mid`` if they are exactly the signed release; otherwise the
        holder is refused (counted, never asked again) and None."""
        why = None
        if not isinstance(reply, m.Modules):
            why = f"answered {type(reply).__name__}"
        elif reply.versions.get(mid) != version or reply.hashes.get(mid) != digest:
            why = "named another version or hash"
        if why is None:
            prefix = f"{mid}/"
            tensors = {
                k[len(prefix) :]: v for k, v in reply.tensors.items() if k.startswith(prefix)
            }
            if len(tensors) != len(reply.tensors) or tensors_sha256(tensors) != digest:
                why = "sent tensors that do not match the owner's signed hash"
            else:
                return tensors
        with self._lock:
            self.refused[holder] += 1
            self.bad.add(holder)
        log.warning(
            "peer %s: refused %s v%d from peer %s: it %s (counted; fetching it elsewhere)",
            self.peer_id, mid, version, holder[:12], why,
        )  # fmt: skip
        self._forget(holder)
        return None

    def _link(self, holder: str, info: dict) -> Any:
        with self._lock:
            link = self._links.get(holder)
        if link is None:
            link = self.node.transport(holder, info["addresses"], timeout=self.timeout)
            link.authenticate(self.identity, info["key"])
            with self._lock:
                self._links[holder] = link
        return link

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received over links to holders, closed ones included."""
        with self._lock:
            links = list(self._links.values())
            sent, received = self._gone
        return (sent + sum(link.bytes_sent for link in links),
                received + sum(link.bytes_received for link in links))  # fmt: skip

    def _forget(self, holder: str) -> None:
        with self._lock:
            link = self._links.pop(holder, None)
            if link is not None:
                self._gone[0] += link.bytes_sent
                self._gone[1] += link.bytes_received
        if link is not None:
            try:
                link.close()
            except Exception:  # noqa: BLE001 - a link that will not close is gone anyway
                pass

    # -- holding ---------------------------------------------------------------------------

    def hold(self, mid: str, release: Release) -> None:
        """Keep a checked module version to serve, and announce it (when this peer serves);
        a version still held is announced again once half its record's life has passed."""
        newer = self.held.put(mid, release)
        if not self.serving:
            return
        key = seed_key(self.run_id, mid, release.version)
        now = time.monotonic()
        if not newer and now - self._announced.get(key, -SEED_TTL) < SEED_TTL / 2:
            return
        if not newer and self.held.get(mid, release.version) is None:
            return  # an older version than the one held: nothing to say
        self._announced = {k: t for k, t in self._announced.items() if now - t < SEED_TTL}
        self._announced[key] = now
        if self._addresses is None:
            self._addresses = announceable(self.node.visible_maddrs())
        record = {"peer": self.peer_id, "key": self.identity.public_key,
                  "addresses": self._addresses}  # fmt: skip
        try:
            self.node.store(key, record, SEED_TTL, subkey=self.node.peer_id)
        except Exception as exc:  # noqa: BLE001 - best effort: others fetch from the owner
            log.info("peer %s: could not announce %s v%d: %s", self.peer_id, mid,
                     release.version, exc)  # fmt: skip

    def close(self) -> None:
        with self._lock:
            holders = list(self._links)
        for holder in holders:
            self._forget(holder)

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {
                "from_seeds": self.from_seeds,
                "from_owner": self.from_owner,
                "seed_bytes": self.seed_bytes,
                "refused": sum(self.refused.values()),
                "unreachable": len(self.unreachable),
            }
