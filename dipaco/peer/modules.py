"""Fetching a task's modules from their owners, and the checks before the peer trains.

The run manifest must be the one announced, name the key of the scheduler that sent it, and be
signed by it (``check_manifest``). For a task's modules, the peer asks each owner only for the
modules its cache lacks at the task's versions. Every module version it trains on must be the
one the task names, must be signed (its release) by the owner that served it, under the key the
scheduler vouched for, and must match the hash in that release; otherwise the task is aborted
(``TaskAborted``) and handed back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dipaco.errors import ConfigError
from dipaco.faults import fault_point
from dipaco.peer.links import OwnerLinks
from dipaco.peer.seeds import Release, SeedFetcher
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.discovery import manifest_sha256
from dipaco.protocols.wire import tensors_sha256

# module id -> (version, its tensors by name)
Cache = dict[str, tuple[int, dict[str, torch.Tensor]]]
# Overlap: per path, its last task's (round, per-module delta) on this peer
Ends = dict[int, tuple[int, dict[str, dict[str, torch.Tensor]]]]
KEEP_ENDS = 8  # the paths whose last delta a peer keeps, to start their next round from


class TaskAborted(Exception):
    """The task cannot go on (its lease was lost, its modules failed a check, the peer is
    stopping): drop the work."""


def check_manifest(welcome: m.Welcome, server_key: str | None, announced: str | None) -> None:
    """The manifest is the one ``announced`` (its digest, when the DHT announced one) and names
    the scheduler's key (``server_key``), which signed it and the reply that carried it."""
    if announced and manifest_sha256(welcome.config) != announced:
        raise ConfigError("the scheduler's run manifest differs from the one announced in the DHT")
    key = welcome.config.get("coordinator_key")
    if not isinstance(key, str) or key != server_key:
        raise ConfigError(
            "the run manifest does not name the key of the coordinator that sent it: "
            "refusing to train for it"
        )
    if not auth.check_payload(key, welcome.signature, "manifest", welcome.config):
        raise ConfigError("the run manifest's signature does not verify: refusing it")


def fetch_modules(
    links: OwnerLinks,
    task: m.TaskOffer,
    peer_id: str,
    run_id: str | None,
    cache: Cache,
    seeds: SeedFetcher | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """The path's modules at the task's versions, downloading only what ``cache`` lacks
    (``cache`` is updated with what was fetched, and loses a module that failed its hash).

    With ``seeds``, a module version other peers announced is fetched from them: its owner is
    asked for the signed release only (the peer says it has that version), the tensors come
    from a holder and must match the signed hash, and whatever no holder delivers is asked of
    the owner again, whole. Every version the peer ends up with is held for others.

    ``cache`` keeps the modules of this path only (:func:`keep_path_modules`)."""
    fault_point("peer.fetch")  # sleep:S makes a slow downlink
    keep_path_modules(cache, task.module_versions)
    have = {mid: v for mid, (v, _) in cache.items()}
    if seeds is not None:
        seeded = seeds.find(
            {mid: v for mid, v in task.module_versions.items() if have.get(mid) != v}
        )
        have = {**have, **seeded}  # the owner sends those modules' releases, not their tensors
    versions, hashes, signatures, fresh = _ask_owners(
        links, task, peer_id, run_id, list(task.module_versions), have
    )
    if seeds is not None:
        for mid, v in seeded.items():
            if versions.get(mid) != v or mid in fresh:
                continue  # moved meanwhile (the task is aborted below), or sent anyway
            tensors = seeds.fetch(mid, v, hashes[mid])
            if tensors is not None:
                fresh[mid] = tensors
        missing = [mid for mid in seeded if mid not in fresh and versions.get(mid) == seeded[mid]]
        if missing:  # no holder delivered: the owner sends them after all
            held = {mid: v for mid, (v, _) in cache.items()} | {mid: versions[mid] for mid in fresh}
            honest = {mid: v for mid, v in held.items() if mid not in missing}
            more_versions, more_hashes, more_signatures, more_fresh = _ask_owners(
                links, task, peer_id, run_id, missing, honest
            )
            versions.update(more_versions)
            hashes.update(more_hashes)
            signatures.update(more_signatures)
            fresh.update(more_fresh)
            seeds.from_owner += sum(1 for mid in missing if mid in more_fresh)
    # Every version first: an owner sends no tensors for a task one of whose modules moved.
    for mid, want in task.module_versions.items():
        version = versions.get(mid)
        if version is None:
            links.refresh()
            raise TaskAborted(f"no owner served module {mid}; owners refreshed")
        # An ahead task (overlap) whose module reached the task's round meanwhile trains from
        # the newer version, and says so as the delta's base (the coordinator allows it).
        base = m.trains_from(want, task.round, version)
        if base is None:
            raise TaskAborted(f"module {mid} moved to version {version} since the task was issued")
        task.module_versions[mid] = base
    modules = {}
    for mid, version in task.module_versions.items():
        if mid in fresh:
            tensors = fresh[mid]
        elif mid in cache and cache[mid][0] == version:
            tensors = cache[mid][1]
        else:
            raise TaskAborted(f"module {mid} v{version} was neither sent nor cached")
        if tensors_sha256(tensors) != hashes[mid]:
            cache.pop(mid, None)
            raise TaskAborted(f"module {mid} v{version} failed its hash check")
        cache[mid] = (version, tensors)
        modules[mid] = tensors
        if seeds is not None:
            if mid in fresh and mid not in seeded:
                seeds.from_owner += 1
            seeds.hold(mid, Release(version, hashes[mid], signatures[mid], tensors))
    return modules


def keep_path_modules(cache: Cache, mids: dict[str, int]) -> None:
    """Drop from ``cache`` the modules not in ``mids``: a peer holds one path's modules, not
    every module it has seen (what the next path shares with the last is not fetched again).
    A module received with others is a view of the reply they came in: the modules that stay
    are copied into memory of their own, so that the reply's buffer goes with those that left
    (the copies are of what two paths share, mostly the embedding and the head)."""
    gone = [mid for mid in cache if mid not in mids]
    if not gone:
        return
    for mid in gone:
        del cache[mid]
    for mid, (version, tensors) in cache.items():
        cache[mid] = (version, {name: t.clone() for name, t in tensors.items()})


def _ask_owners(
    links: OwnerLinks,
    task: m.TaskOffer,
    peer_id: str,
    run_id: str | None,
    mids: list[str],
    have: dict[str, int],
) -> tuple[dict[str, int], dict[str, str], dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    """Ask each owner of ``mids`` for its modules (the tensors of those not in ``have`` at
    their version), with every release signature checked: (versions, hashes, signatures,
    tensors by module)."""
    versions: dict[str, int] = {}
    hashes: dict[str, str] = {}
    signatures: dict[str, str] = {}
    fresh: dict[str, dict[str, torch.Tensor]] = {}
    for owner, owned in links.by_owner(mids).items():
        reply = links.ask(
            owner,
            functools.partial(  # a new message for each try
                m.FetchModules,
                peer_id=peer_id,
                task_id=task.task_id,
                have={mid: have[mid] for mid in owned if mid in have},
                ticket=task.ticket,
            ),
            f"waits to fetch the modules of {task.task_id}",
        )
        check_releases(links.link(owner).server_key, reply, run_id)
        versions.update(reply.versions)
        hashes.update(reply.hashes)
        signatures.update(reply.signatures)
        for key, tensor in reply.tensors.items():
            mid, _, name = key.partition("/")
            fresh.setdefault(mid, {})[name] = tensor
    return versions, hashes, signatures, fresh


def check_releases(server_key: str | None, reply: m.Modules, run_id: str | None) -> None:
    """Every module version served is signed by the owner that serves it (``server_key``, the
    key that signed the reply, which the scheduler vouched for), or the task is not trained."""
    for mid, version in reply.versions.items():
        digest = reply.hashes.get(mid, "")
        release = auth.release_payload(run_id, mid, version, digest)
        if not auth.check_payload(
            server_key or "", reply.signatures.get(mid, ""), "release", release
        ):
            raise TaskAborted(f"module {mid} v{version}: its release signature does not verify")


@dataclass
class Eager:
    """The eager start of overlap tasks (``scheduler.overlap_start = "eager"``): for each
    module, the number of paths through it (``paths_through``) and the release before the one
    the peer has now (``previous``, kept by :meth:`saw` as the cache moves on), whose
    difference to the current one is the module's last step."""

    paths_through: Callable[[str], int]
    previous: Cache = field(default_factory=dict)

    def saw(self, before: dict[str, tuple[int, dict[str, torch.Tensor]] | None], cache: Cache):
        """After a fetch: a module whose cached version moved keeps the one it moved from."""
        for mid, entry in before.items():
            if entry is not None and mid in cache and cache[mid][0] != entry[0]:
                self.previous[mid] = entry

    def start(
        self, mid: str, version: int, tensors: dict[str, torch.Tensor], delta: dict
    ) -> dict[str, torch.Tensor]:
        """Release ``tensors`` (at ``version``) moved by 1/n of the peer's ``delta`` and
        (n-1)/n of the module's last step (none if the previous release is unknown)."""
        share = 1.0 / max(1, self.paths_through(mid))
        base_version, base = self.previous.get(mid, (version, {}))
        steps = version - base_version
        last = (1.0 - share) / steps if steps > 0 else 0.0
        return {
            name: t - share * delta[name] - (last * (base[name] - t) if last else 0.0)
            for name, t in tensors.items()
        }


def continued(
    task: m.TaskOffer,
    modules: dict[str, dict[str, torch.Tensor]],
    end: tuple[int, dict[str, dict[str, torch.Tensor]]] | None,
    eager: Eager | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Overlap: an ahead task of a path this peer trained for the round before starts where
    that training ended. A module still at that round's version has not applied the peer's
    delta yet, so the start is the release minus that delta (deltas are fetched minus
    trained); a module past it has applied it and starts from its release. From the release
    alone, the delta would carry the last round's move again, on top of the step that applies
    it. ``end``: the path's last task on this peer, as (its round, its per-module delta).
    With ``eager``, such a module starts instead where its step is likely to take it
    (:meth:`Eager.start`)."""
    if end is None or end[0] != task.round - 1:
        return modules
    last_round, delta = end
    out = {}
    for mid, tensors in modules.items():
        version = task.module_versions[mid]
        if version != last_round or mid not in delta:
            out[mid] = tensors
        elif eager is not None:
            out[mid] = eager.start(mid, version, tensors, delta[mid])
        else:
            out[mid] = {name: t - delta[mid][name] for name, t in tensors.items()}
    return out


def keep_end(
    ends: Ends,
    task: m.TaskOffer,
    delta: dict[str, dict[str, torch.Tensor]] | None,
    config: dict,
) -> None:
    """With overlap (the run's ``scheduler.overlap``), remember where a finished task of the
    path ended, as its round and delta, for :func:`continued`; the newest KEEP_ENDS paths."""
    if delta is None or not config.get("run", {}).get("scheduler", {}).get("overlap", False):
        return
    ends.pop(task.path, None)
    ends[task.path] = (task.round, delta)
    while len(ends) > KEEP_ENDS:
        del ends[next(iter(ends))]


class Starts:
    """Overlap: where a peer's tasks start. ``ends`` keeps each path's last task
    (:func:`keep_end`); a task a round ahead starts from there (:func:`continued`), or eagerly
    (:class:`Eager`, with the run's ``scheduler.overlap_start = "eager"``)."""

    def __init__(self) -> None:
        self.ends: Ends = {}
        self.eager: Eager | None = None

    def fetch(
        self,
        task: m.TaskOffer,
        fetch: Callable[[m.TaskOffer], dict[str, dict[str, torch.Tensor]]],
        cache: Cache,
        config: dict,
        topology: Any,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """The task's modules (``fetch``, which fills ``cache``), moved to where it starts."""
        eager = None
        if config.get("run", {}).get("scheduler", {}).get("overlap_start") == "eager":
            if self.eager is None:
                self.eager = Eager(lambda mid: len(topology.paths_through(mid)))
            eager = self.eager
        before = {mid: cache.get(mid) for mid in task.module_versions}
        modules = fetch(task)
        if eager is not None:
            eager.saw(before, cache)
        return continued(task, modules, self.ends.get(task.path), eager)

    def keep(
        self, task: m.TaskOffer, delta: dict[str, dict[str, torch.Tensor]] | None, config: dict
    ) -> None:
        keep_end(self.ends, task, delta, config)
