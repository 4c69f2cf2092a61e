"""A run on the hivemind DHT, for coordinators: the records they publish (the run's entry, its
manifest, its progress, each owner's modules and addresses), the node key that keeps a
coordinator's address across restarts, and an owner's first contact with the scheduler it joins.

docs/protocol.md section 5 has the records' keys and fields; ``discovery.Publisher`` keeps them
fresh in the DHT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dipaco.coordinator.core import Coordinator
from dipaco.errors import ConfigError
from dipaco.protocols import discovery
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity, check_payload


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


def contact_scheduler(
    node: Any, me: Identity, run: str | None, scheduler_key: str | None
) -> tuple[str, dict[str, Any], Any]:
    """Find the run in the DHT and say Hello to its scheduler as a coordinator; returns the run
    id, the manifest and an authenticated transport to the scheduler. The manifest must be the
    one the DHT announces and be signed by the scheduler's key (ConfigError otherwise)."""
    run_id, entry, manifest = discovery.find_run(node, run)
    scheduler = node.transport(entry["scheduler"], entry.get("addresses", []))
    scheduler.authenticate(me, scheduler_key)
    welcome = scheduler.request(m.Hello(peer_id=node.peer_id, device="coordinator"))
    if discovery.manifest_sha256(welcome.config) != entry["manifest"]:
        raise ConfigError("the scheduler's manifest differs from the one in the DHT")
    if welcome.config.get("coordinator_key") != scheduler.server_key or not check_payload(
        scheduler.server_key, welcome.signature, "manifest", welcome.config
    ):
        raise ConfigError("the scheduler's manifest is not signed by the scheduler's key")
    return run_id, manifest, scheduler
