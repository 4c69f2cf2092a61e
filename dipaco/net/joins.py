"""How a peer joins a run, by the kind of address it was given: a registry of joiners.

``dipaco-peer join ADDRESS`` asks each registered transport, newest first, whether the address
is its own (``claims``), then falls back to the built-in classification (a multiaddr is hivemind,
HOST:PORT with ``--authkey-file`` is loopback: ``protocols.addresses.join_address``). The
joiner returns a :class:`Joined`: the scheduler's transport (a ``protocols.transport.Transport``)
and whatever the ``Peer`` needs beside it. A new transport is one file: its ``Transport``
subclass (``_roundtrip(bytes) -> bytes``), a joiner, and ``register("name", joiner, claims)``;
docs/architecture.md shows it, and ``tests/integration/test_join_registry.py`` adds one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dipaco.errors import ConfigError, TransportError
from dipaco.net import hivemind
from dipaco.peer.identity import FollowingLink
from dipaco.protocols.addresses import join_address
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LoopbackTransport, Transport


@dataclass
class JoinRequest:
    """What the user asked for: the address and the peer's own settings."""

    address: str
    peer_id: str
    state_dir: Path
    me: Identity  # the peer's signing key
    trust: tuple[str | None, Callable[[str], None]]  # the coordinator key, and on first use
    run: str | None = None
    authkey_file: str | None = None
    device: str = "cpu"
    memory_gb: float | None = None
    max_mbps: float | None = None
    patience: float = 60.0  # seconds to keep retrying an address that does not answer yet
    serve_modules: str | None = None  # hivemind: the host to listen on and serve modules from
    on_wait: Callable[[str], None] = lambda line: None  # says why it is still retrying
    trust_dir: Path | None = None  # where ``trust``'s key is pinned, if not in state_dir


@dataclass
class Joined:
    """A joined run: the scheduler's transport, the ``Peer`` keywords beside it, and more."""

    scheduler: Transport
    peer_options: dict[str, Any] = field(default_factory=dict)
    announce: dict[str, Any] | None = None  # what the network shows of this peer, if anything
    note: str | None = None  # one line for the user (what was checked)
    traffic: Callable[[], tuple[int, int]] | None = None  # bytes up and down, where counted
    close: Callable[[], None] = lambda: None
    seed_server: Any = None  # what this peer serves to other peers (peer.seeds.SeedServer)


Joiner = Callable[[JoinRequest], Joined]
_JOINERS: dict[str, tuple[Joiner, Callable[[str], bool] | None]] = {}


def register(kind: str, joiner: Joiner, claims: Callable[[str], bool] | None = None) -> None:
    """Make ``kind`` a way to join; ``claims(address)`` says whether an address is its own (a
    built-in kind is chosen by ``join_address`` instead)."""
    if kind in _JOINERS:
        raise ValueError(f"a transport named {kind!r} is registered already")
    _JOINERS[kind] = (joiner, claims)


def unregister(kind: str) -> None:
    _JOINERS.pop(kind, None)


def kind_of(address: str, authkey_file: str | None) -> str:
    """The registered transport whose address this is (a ConfigError says what was expected)."""
    for kind, (_, claims) in reversed(_JOINERS.items()):
        if claims is not None and claims(address):
            return kind
    return join_address(address, authkey_file)


def join(request: JoinRequest) -> Joined:
    """Join the run at ``request.address`` by the transport its address names."""
    kind = kind_of(request.address, request.authkey_file)
    return _JOINERS[kind][0](request)


def _join_hivemind(r: JoinRequest) -> Joined:
    j = hivemind.join_run(
        r.address, run=r.run, peer_id=r.peer_id, state_dir=r.state_dir, me=r.me, trust=r.trust,
        device=r.device, memory_gb=r.memory_gb, max_mbps=r.max_mbps, patience=r.patience,
        on_wait=r.on_wait, serve_modules=r.serve_modules, trust_dir=r.trust_dir,
    )  # fmt: skip
    return Joined(
        j.scheduler,
        j.peer_options(),
        announce=j.announce,
        note=f"run {j.run_id}: manifest verified (sha256 {j.manifest_sha256[:12]}...)",
        traffic=j.traffic,
        close=j.close,
        seed_server=j.seed_server,
    )


def _join_loopback(r: JoinRequest) -> Joined:
    try:
        key = bytes.fromhex(Path(str(r.authkey_file)).read_text().strip())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--authkey-file {r.authkey_file}: not a readable key file ({exc})"
        ) from None
    if r.serve_modules is not None:
        raise ConfigError("--serve-modules needs a hivemind run (a multiaddr address)")
    link = dial_loopback(r.address, key, r.patience, r.on_wait)
    # follows a rotation of the scheduler's key, from the run id its first Welcome names
    transport = FollowingLink(link, r.trust_dir or r.state_dir, r.address, r.peer_id)
    transport.authenticate(r.me, *r.trust)
    return Joined(transport, close=transport.close)


def dial_loopback(
    address: str, key: bytes, patience: float, on_wait: Callable[[str], None]
) -> LoopbackTransport:
    """Connect to a loopback coordinator, retrying for ``patience`` seconds: a coordinator
    that is restarting, or a connection cut mid-handshake, must not end the peer before it
    starts (later requests redial by themselves). A refused key fails at once."""
    watch = hivemind.join_watch(address, patience, on_wait, every=1.0)
    began = time.monotonic()
    while True:
        try:
            return LoopbackTransport(address, key)
        except TransportError as exc:
            if exc.reason == "auth":
                raise
            watch.failed(exc)
            if time.monotonic() - began > patience:
                raise watch.gave_up(exc) from None
            time.sleep(1.0)


register("hivemind", _join_hivemind)
register("loopback", _join_loopback)
