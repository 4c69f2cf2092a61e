"""A run whole: every module at the version its owner last reported, in the scheduler's folder.

With other module owners (``dipaco-coordinator start --join ... --owns ...``) each owner keeps
its modules' versions in its own folder; the scheduler's folder holds only the version it handed
over. The scheduler does know, from the owners' signed reports, each remote module's final
version and content hash (``coordinator.json``: ``owners``, ``remote``, ``addresses``,
``owner_keys``). Gathering fetches each remote module at that version, checks it against that
hash (and, over the network, against its owner's release signature), and writes it under
``<run-dir>/gathered/<module>/`` (the version file and a ``head.json``), from where
``dipaco eval``, ``export`` and ``generate`` read it.

Two sources, tried in order: an owner's folder on this machine (``--owner-dir``), and the owner
itself over the run's transport (``FetchReleases``, signed by the scheduler's key, which every
owner admits). The scheduler gathers by itself when its run finishes, while its owners still
serve; a module that can be had from neither is named with its owner and where it was last seen.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from dipaco.coordinator.store import write_version
from dipaco.errors import DataError, DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport
from dipaco.protocols.wire import read_tensor_file, tensors_sha256

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
# (owner id, its addresses, its public key) -> a transport to it that checks its replies' key
Connect = Callable[[str, list[str], str | None], Transport]


@dataclass(frozen=True)
class RemoteModule:
    """A module another coordinator owns, as the scheduler last heard of it."""

    module: str
    owner: str
    version: int
    hash: str
    addresses: tuple[str, ...]
    key: str | None


def remote_modules(run_dir: str | Path) -> list[RemoteModule]:
    """The modules of the run in ``run_dir`` (the scheduler's folder) that others own."""
    state_file = Path(run_dir) / "coordinator" / "coordinator.json"
    if not state_file.exists():
        return []
    try:
        state = json.loads(state_file.read_text())
    except ValueError as exc:
        raise DataError(f"{state_file}: not readable coordinator state: {exc}") from None
    me = state.get("owner_id")
    out = []
    for mid, owner in sorted((state.get("owners") or {}).items()):
        if owner == me:
            continue
        info = (state.get("remote") or {}).get(mid) or {}
        out.append(
            RemoteModule(
                mid,
                owner,
                int(info.get("version", 0)),
                str(info.get("hash", "")),
                tuple((state.get("addresses") or {}).get(owner, [])),
                (state.get("owner_keys") or {}).get(owner),
            )
        )
    return out


def gathered_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "gathered"


def _read_release(folder: Path, r: RemoteModule) -> Tensors | None:
    """``r`` from a module folder (a head.json and its version file) if it holds ``r`` at the
    version and hash the scheduler recorded, else None."""
    try:
        head = json.loads((folder / "head.json").read_text())
        if head.get("version") != r.version or head.get("hash") != r.hash:
            return None
        tensors = read_tensor_file(folder / f"v{r.version}.dpt").tensors
    except FileNotFoundError:
        return None
    except (ValueError, OSError, DipacoError) as exc:
        log.warning("%s unreadable (%s): looking elsewhere", folder, exc)
        return None
    return tensors if tensors_sha256(tensors) == r.hash else None


def read_gathered(run_dir: str | Path, r: RemoteModule) -> Tensors | None:
    """The gathered copy of ``r`` if there is one at its final version and hash, else None."""
    return _read_release(gathered_dir(run_dir) / r.module, r)


def _write(run_dir: Path, r: RemoteModule, tensors: Tensors, source: str) -> None:
    folder = gathered_dir(run_dir) / r.module
    write_version(folder, r.module, r.version, tensors)
    write_json_atomic(
        folder / "head.json",
        {"version": r.version, "hash": r.hash, "owner": r.owner, "source": source},
    )
    for old in folder.glob("v*.dpt"):
        if old.name != f"v{r.version}.dpt":
            old.unlink(missing_ok=True)


def _from_folder(folder: Path, r: RemoteModule) -> Tensors | None:
    """``r`` from an owner's run folder, if that folder holds it at its final version."""
    return _read_release(folder / "coordinator" / "modules" / r.module, r)


def _ask(
    connect: Connect, owner: str, addresses: list[str], key: str | None, mids: list[str], who: str
) -> m.Modules:
    """``FetchReleases`` of ``mids`` from ``owner``; DataError when it cannot be had. The peer
    id names the signing key too (``who-<fingerprint>``): an owner binds a peer id to the first
    key that used it, and a scheduler whose key was rotated asks under its new key."""
    try:
        link = connect(owner, addresses, key)
        if link.identity is not None:
            who = f"{who}-{auth.fingerprint(link.identity.public_key)}"
        try:
            reply = link.request(m.FetchReleases(peer_id=who, modules=mids))
        finally:
            link.close()
    except DipacoError as exc:
        raise DataError("unreachable: " + " ".join(str(exc).split())) from None
    if not isinstance(reply, m.Modules):
        raise DataError(f"answered {type(reply).__name__}, not modules")
    return reply


def _signed(reply: m.Modules, mid: str, run_id: str, key: str | None) -> Tensors | None:
    """``mid``'s tensors in ``reply`` if its owner's release signature and its hash verify."""
    version, digest = reply.versions.get(mid), reply.hashes.get(mid)
    release = auth.release_payload(run_id, mid, version, digest)
    if not auth.check_payload(key or "", reply.signatures.get(mid, ""), "release", release):
        return None
    tensors = {k.partition("/")[2]: t for k, t in reply.tensors.items() if k.startswith(f"{mid}/")}
    return tensors if tensors_sha256(tensors) == digest else None


def _from_owner(
    connect: Connect, owner: str, wanted: list[RemoteModule], run_id: str
) -> tuple[dict[str, Tensors], str]:
    """The ``wanted`` modules from their owner over the network: (modules got, why not others)."""
    first = wanted[0]
    try:
        reply = _ask(
            connect, owner, list(first.addresses), first.key, [r.module for r in wanted], "gather"
        )
    except DataError as exc:
        return {}, str(exc)
    got: dict[str, Tensors] = {}
    problems = []
    for r in wanted:
        version, digest = reply.versions.get(r.module), reply.hashes.get(r.module)
        tensors = _signed(reply, r.module, run_id, r.key)
        if version != r.version:
            problems.append(f"{r.module} is at v{version}, the scheduler recorded v{r.version}")
        elif digest != r.hash:
            problems.append(
                f"{r.module} v{version} is not the release the scheduler recorded (hash "
                f"{str(digest)[:12]}, recorded {r.hash[:12]})"
            )
        elif tensors is None:
            problems.append(f"{r.module}: its release signature or its tensors do not verify")
        else:
            got[r.module] = tensors
    return got, "; ".join(problems)


def gather(
    run_dir: str | Path,
    *,
    owner_dirs: Iterable[str | Path] = (),
    connect: Connect | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Tensors]:
    """Every remote module of the run at its final version, gathered into ``run_dir``.

    Raises DataError naming each module that could not be had, its owner and where that owner
    was last seen, and what to do about it.
    """
    run_dir = Path(run_dir)
    remote = remote_modules(run_dir)
    out: dict[str, Tensors] = {}
    todo: list[RemoteModule] = []
    for r in remote:
        tensors = read_gathered(run_dir, r)
        if tensors is None:
            todo.append(r)
        else:
            out[r.module] = tensors
    for r in list(todo):
        for folder in owner_dirs:
            tensors = _from_folder(Path(folder), r)
            if tensors is not None:
                _write(run_dir, r, tensors, f"folder {folder}")
                out[r.module] = tensors
                todo.remove(r)
                say(f"gathered {r.module} v{r.version} from {folder}")
                break
    found = {r.module: _found_in(owner_dirs, r) for r in todo}
    why: dict[str, str] = {}
    if todo and connect is not None:
        run_id = _run_id(run_dir)
        by_owner: dict[str, list[RemoteModule]] = {}
        for r in todo:
            by_owner.setdefault(r.owner, []).append(r)
        for owner, wanted in by_owner.items():
            got, problem = _from_owner(connect, owner, wanted, run_id)
            for r in wanted:
                if r.module in got:
                    _write(run_dir, r, got[r.module], f"owner {owner}")
                    out[r.module] = got[r.module]
                    todo.remove(r)
            if got:
                say(f"gathered {', '.join(sorted(got))} from owner {owner}")
            if problem:
                why[owner] = problem
    if todo:
        stale = any(v > r.version for r in todo for _, v in found[r.module])
        raise (BehindTheRun if stale else DataError)(
            missing_message(
                run_dir,
                todo,
                why,
                tried_network=connect is not None,
                found=found,
                owner_dirs=[str(f) for f in owner_dirs],
            )  # fmt: skip
        )
    return out


class BehindTheRun(DataError):
    """An ``--owner-dir`` holds a module at a later version than the run folder recorded: the
    folder's scheduler stopped and the run went on elsewhere; no owner can serve the old one."""


def _found_in(owner_dirs: Iterable[str | Path], r: RemoteModule) -> list[tuple[str, int]]:
    """(folder, version) for each ``--owner-dir`` that holds ``r`` at another version or hash
    than the scheduler recorded (why it was not taken from there)."""
    out = []
    for folder in owner_dirs:
        try:
            head = json.loads(
                (Path(folder) / "coordinator/modules" / r.module / "head.json").read_text()
            )
            out.append((str(folder), int(head["version"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def missing_message(
    run_dir: Path,
    missing: list[RemoteModule],
    why: dict[str, str],
    *,
    tried_network: bool,
    found: dict[str, list[tuple[str, int]]] | None = None,
    owner_dirs: list[str] | None = None,
) -> str:
    """What could not be had and what to do. When an ``--owner-dir`` holds a module at a later
    version than this folder recorded, this folder is behind the run (its scheduler stopped and
    another, a standby, carried the run on): it says so and which folder to use instead."""
    found = found or {}
    by_owner: dict[str, list[RemoteModule]] = {}
    for r in missing:
        by_owner.setdefault(r.owner, []).append(r)
    parts = []
    for owner, rs in by_owner.items():
        mods = ", ".join(f"{r.module} v{r.version}" for r in rs)
        where = rs[0].addresses[0] if rs[0].addresses else "no known address"
        reason = why.get(owner) or ("not reached" if tried_network else "not asked")
        parts.append(f"owner {owner} (last at {where}) holds {mods}: {reason}")
    newer = [
        (r, folder, v) for r in missing for folder, v in found.get(r.module, []) if v > r.version
    ]
    other = [
        (r, folder, v) for r in missing for folder, v in found.get(r.module, []) if v <= r.version
    ]
    if newer:
        r, folder, v = newer[0]
        return (
            f"{run_dir} is behind the run: --owner-dir {folder} holds {r.module} at v{v}, but "
            f"{run_dir} recorded v{r.version}. The run went on after this folder's scheduler "
            "stopped (a standby took it over, or it was restored from an older copy): evaluate "
            "the run folder of the scheduler that carried the run on (the standby's --run-dir), "
            "with the same --owner-dir"
        )
    if other:
        r, folder, v = other[0]
        return (
            f"--owner-dir {folder} holds {r.module} at v{v}, not at the final v{r.version} that "
            f"{run_dir} recorded: that folder is an older copy of its owner's; pass the owner's "
            "current run folder. " + " | ".join(parts)
        )
    tried = f" (looked in --owner-dir {', '.join(owner_dirs)}: not there)" if owner_dirs else ""
    return (
        f"{run_dir} lacks modules other coordinators own, at their final versions{tried}. "
        + " | ".join(parts)
        + ". Start those owners again (dipaco-coordinator start --join ... --run-dir THEIR_DIR) "
        f"and run: dipaco gather --run-dir {run_dir}, or copy their run folders here and pass "
        "--owner-dir DIR"
    )


def _run_id(run_dir: Path) -> str:
    state = json.loads((run_dir / "coordinator" / "coordinator.json").read_text())
    return str(state.get("run_id", ""))


def hivemind_connect(run_dir: str | Path, node) -> Connect:
    """``connect`` over a hivemind node, signing as the scheduler (whose key every owner admits)."""
    me = auth.Identity.load_or_create(Path(run_dir) / "coordinator" / "signing.key")

    def connect(owner: str, addresses: list[str], key: str | None) -> Transport:
        return node.transport(owner, addresses, timeout=30.0).authenticate(me, key)

    return connect


def gather_run(
    run_dir: str | Path,
    *,
    owner_dirs: Iterable[str | Path] = (),
    network: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Tensors]:
    """:func:`gather` for a command run after training: from the gathered copies and
    ``owner_dirs`` first, then (``network``) from the owners over a client hivemind node
    started only when something is still missing."""
    remote = remote_modules(run_dir)
    if not remote:
        return {}
    try:
        return gather(run_dir, owner_dirs=owner_dirs, say=say)
    except BehindTheRun:
        raise  # asking the owners would not help: this folder is not the run's latest
    except DataError:
        if not network:
            raise
    from dipaco.protocols.hivemind import HivemindNode

    say(f"fetching modules from their owners: {', '.join(sorted({r.owner for r in remote}))}")
    with HivemindNode(client_mode=True) as node:
        return gather(
            run_dir, owner_dirs=owner_dirs, connect=hivemind_connect(run_dir, node), say=say
        )


def fetch_current(
    connect: Connect,
    run_id: str,
    wanted: dict[str, tuple[str, list[str], str | None]],
) -> dict[str, Tensors]:
    """The latest release of each wanted module (module -> (owner, its addresses, its key)),
    each checked against its owner's release signature and its hash: for the scheduler's
    per-round evaluation while owners train. A DataError names what could not be had."""
    by_owner: dict[str, list[str]] = {}
    for mid, (owner, _, _) in wanted.items():
        by_owner.setdefault(owner, []).append(mid)
    out: dict[str, Tensors] = {}
    for owner, mids in by_owner.items():
        _, addresses, key = wanted[mids[0]]
        try:
            reply = _ask(connect, owner, addresses, key, mids, "evaluation")
        except DataError as exc:
            raise DataError(f"owner {owner} {exc}") from None
        for mid in mids:
            tensors = _signed(reply, mid, run_id, key)
            if tensors is None:
                raise DataError(f"owner {owner} sent {mid} without a valid signed release")
            out[mid] = tensors
    return out


def whole_run(
    run_dir: str | Path,
    *,
    owner_dirs: Iterable[str | Path] = (),
    network: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[set[str], dict[str, tuple[int, Tensors]]]:
    """What ``open_run`` takes as ``remote``: the modules others own, and each gathered at its
    final version (module -> (version, tensors))."""
    remote = {r.module: r for r in remote_modules(run_dir)}
    got = gather_run(run_dir, owner_dirs=owner_dirs, network=network, say=say)
    return set(remote), {mid: (remote[mid].version, t) for mid, t in got.items()}


# ---- at the end of a run ---------------------------------------------------------------------


def remote_fetcher(coordinator, run_dir: Path, node) -> Callable[[list[str]], dict]:
    """What the per-round evaluation uses to fetch other owners' current modules."""
    connect = hivemind_connect(run_dir, node)

    def fetch(mids: list[str]) -> dict:
        wanted = {}
        for mid in mids:
            owner = coordinator.owners[mid]
            wanted[mid] = (
                owner,
                coordinator.addresses.get(owner, []),
                coordinator.owner_keys.get(owner),
            )
        return fetch_current(connect, coordinator.run_id, wanted)

    return fetch


def gather_at_end(
    coordinator, run_dir: Path, node, say: Callable[[str], None], patience: float = 30.0
) -> None:
    """Fetch the other owners' final modules into this (the scheduler's) folder, so that eval,
    export and generate use the whole trained model; owners wait for it before they exit."""
    remote = remote_modules(run_dir)
    if not remote:
        return
    connect = hivemind_connect(run_dir, node)
    began = time.monotonic()
    while True:
        try:
            got = gather(run_dir, connect=connect)
            break
        except DipacoError as exc:
            if time.monotonic() - began > patience:
                say("could not gather every module: " + " ".join(str(exc).split()))
                return
            time.sleep(1.0)
    with coordinator.lock:
        coordinator.gathered = set(got)
    owners = sorted({r.owner for r in remote})
    say(
        f"gathered {len(got)} modules from {len(owners)} other owner(s) into "
        f"{run_dir / 'gathered'}: dipaco eval, export and generate use them"
    )


def wait_gathered(coordinator, patience: float, say: Callable[[str], None], reporter=None) -> None:
    """An owner, once its modules are final: serve until the scheduler says it holds them, then
    stop reporting (the scheduler is about to leave)."""
    mine = set(coordinator.owned_modules())
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        with coordinator.lock:
            if mine <= coordinator.gathered:
                say(f"the scheduler has this owner's final modules ({', '.join(sorted(mine))})")
                if reporter is not None:
                    reporter.stop.set()
                return
        time.sleep(0.5)
    say(
        f"the scheduler did not fetch this owner's modules within {patience:.0f} s; on its "
        f"machine, `dipaco gather --run-dir RUN_DIR --owner-dir {coordinator.root.parent}` "
        "(with this folder copied there) or with this owner running again gathers them"
    )
