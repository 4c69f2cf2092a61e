"""The hivemind node of a coordinator process beyond the scheduler's own: an owner's or a
standby's, joined to a run, and the relay a scheduler runs for owners behind NAT (``--relay``,
``--via-relay``; ``dipaco.protocols.hivemind.server``)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dipaco.coordinator.core import Coordinator
from dipaco.errors import ConfigError, DipacoError
from dipaco.net import hivemind
from dipaco.protocols import messages as m
from dipaco.protocols.addresses import relayed_address, split_hostport
from dipaco.protocols.auth import Identity

log = logging.getLogger(__name__)


def add_join_options(start: argparse.ArgumentParser) -> None:
    """``start``'s options for a coordinator that joins a run (another owner, a standby), and
    the relay's."""
    start.add_argument(
        "--join", help="another owner or a standby: the address the run's coordinator printed"
    )
    start.add_argument("--owns", help="another owner: comma-separated module ids to take over")
    start.add_argument(
        "--scheduler-key",
        help="another owner: the scheduler's public key (else trusted on first contact)",
    )
    start.add_argument("--run", help="the run id, when the DHT announces several")
    start.add_argument(
        "--standby",
        action="store_true",
        help="stand by for the run's scheduler (with --join): copy its state and take over "
        "when it stops answering",
    )
    start.add_argument(
        "--takeover-seconds",
        type=float,
        default=15.0,
        help="a standby takes over after the scheduler has not answered for this long",
    )
    start.add_argument("--sync-seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    start.add_argument(
        "--relay",
        action="store_true",
        help="the scheduler also relays for its module owners that cannot be dialled "
        "(behind NAT, started with --via-relay)",
    )
    start.add_argument(
        "--via-relay",
        action="store_true",
        help="another owner behind NAT: listen nowhere, and be reached through the scheduler "
        "it joins (which runs with --relay)",
    )


def check_relay_flags(args: argparse.Namespace) -> None:
    """``--relay`` belongs to a hivemind scheduler (or a standby, once it schedules),
    ``--via-relay`` to another module owner: a clear error for any other mix."""
    if args.relay and (args.transport != "hivemind" or (args.join and not args.standby)):
        raise ConfigError(
            "--relay is for a hivemind scheduler (or a standby): an owner behind NAT uses "
            "--via-relay"
        )
    if args.via_relay and (args.standby or not (args.join and args.owns)):
        raise ConfigError(
            "--via-relay is for another module owner (with --join and --owns): a scheduler or "
            "a standby must be reachable itself"
        )


def relays_for_owners(coordinator: Coordinator):
    """Whom the scheduler's node relays for (``--relay``): the run's module owners, and only
    them (keys the operator allowed, which took modules over), never a peer or a stranger."""

    def accepts(peer_id: str) -> bool:
        for _ in range(3):  # read from the node's loop, while a request may change the table
            try:
                return peer_id != coordinator.owner_id and peer_id in set(
                    coordinator.owners.values()
                )
            except RuntimeError:
                continue
        return False

    return accepts


def relayed_route(coordinator: Coordinator, node, scheduler, join: str) -> list[str]:
    """An owner behind NAT's address: through the relay of the scheduler it reports to, and
    through the new one once a standby takes over (reported to it at once), so that peers find
    the owner again where its link to the run now is."""

    def route(addresses: list[str]) -> list[str]:
        return [relayed_address(addresses[0], node.peer_id)] if addresses else []

    def follow(addresses: list[str]) -> None:
        new = route(addresses)
        if new:
            coordinator.reachable_at(new)  # the reporter tells the new scheduler now
            log.warning("reachable through the new scheduler's relay at %s", new[0])

    scheduler.on_follow = follow
    return route(scheduler.addresses) or [relayed_address(join, node.peer_id)]


def check_relayed(node, me: Identity, coordinator: Coordinator, address: str) -> None:
    """Ask this owner for its status through the relay, as a peer would reach it; a clear
    error if the scheduler does not relay (``--relay``) or cannot reach us."""
    link = node.transport(node.peer_id, [address], timeout=30.0).authenticate(
        me, coordinator.identity.public_key
    )
    try:
        link.request(m.GetStatus())
    except DipacoError as exc:
        raise ConfigError(
            f"peers cannot reach this owner through the scheduler ({exc}): start the "
            "scheduler with --relay, or run this owner where it can listen (without --via-relay)"
        ) from None


def joined_node(args: argparse.Namespace, run_dir: Path):
    """A DHT node listening on ``--listen`` (or nowhere, behind NAT: ``--via-relay``),
    bootstrapped from ``--join``, with the folder's node key (an owner's, a standby's)."""
    from dipaco.protocols.hivemind import HivemindNode

    host, port = split_hostport(args.listen)
    return HivemindNode(
        initial_peers=[args.join],
        host=host,
        port=port,
        client_mode=bool(getattr(args, "via_relay", False)),
        identity_path=hivemind.node_identity(run_dir),
    )
