"""Fetching a task's modules from their owners, and the checks before the peer trains.

The run manifest must be the one announced, name the key of the scheduler that sent it, and be
signed by it (``check_manifest``). For a task's modules, the peer asks each owner only for the
modules its cache lacks at the task's versions. Every module version it trains on must be the
one the task names, must be signed (its release) by the owner that served it, under the key the
scheduler vouched for, and must match the hash in that release; otherwise the task is aborted
(``TaskAborted``) and handed back.
"""

from __future__ import annotations

import torch

from dipaco.errors import ConfigError
from dipaco.peer.links import OwnerLinks
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.discovery import manifest_sha256
from dipaco.protocols.wire import tensors_sha256

# module id -> (version, its tensors by name)
Cache = dict[str, tuple[int, dict[str, torch.Tensor]]]


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
    links: OwnerLinks, task: m.TaskOffer, peer_id: str, run_id: str | None, cache: Cache
) -> dict[str, dict[str, torch.Tensor]]:
    """The path's modules at the task's versions, downloading only what ``cache`` lacks
    (``cache`` is updated with what was fetched, and loses a module that failed its hash)."""
    have = {mid: v for mid, (v, _) in cache.items()}
    versions: dict[str, int] = {}
    hashes: dict[str, str] = {}
    fresh: dict[str, dict[str, torch.Tensor]] = {}
    for owner, mids in links.by_owner(list(task.module_versions)).items():
        reply = links.ask(
            owner,
            lambda mids=mids: m.FetchModules(
                peer_id=peer_id,
                task_id=task.task_id,
                have={mid: have[mid] for mid in mids if mid in have},
                ticket=task.ticket,
            ),
        )
        check_releases(links.link(owner).server_key, reply, run_id)
        versions.update(reply.versions)
        hashes.update(reply.hashes)
        for key, tensor in reply.tensors.items():
            mid, _, name = key.partition("/")
            fresh.setdefault(mid, {})[name] = tensor
    modules = {}
    for mid, want in task.module_versions.items():
        version = versions.get(mid)
        if version is None:
            links.refresh()
            raise TaskAborted(f"no owner served module {mid}; owners refreshed")
        if version != want:
            raise TaskAborted(f"module {mid} moved to version {version} since the task was issued")
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
    return modules


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
