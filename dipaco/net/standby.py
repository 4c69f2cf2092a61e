"""A standby scheduler: follow the active one, copy its state, take over when it stops answering.

``dipaco-coordinator start --standby --join ADDRESS --run-dir DIR`` runs ``follow``: it finds the
run in the DHT, checks that DIR holds the same prepared run (the manifest hash) and the
scheduler's signing key (a copy of ``coordinator/signing.key``), then asks the active scheduler
for its state files every ``sync_seconds`` (``StandbySync``) and keeps them in
``DIR/coordinator/``. When the active one has not answered for ``takeover_seconds``, and the
DHT names no newer scheduler, ``follow`` returns and the caller starts a scheduler from the
copied state: exactly a restart (a new epoch, the leases in flight and the overdue skips
resumed), on this machine. Its DHT entry carries the new epoch; owners and peers whose
requests to the old scheduler fail read it and follow (``hivemind.SchedulerLink``), and an
old scheduler that comes back sees it and stops (``Fence``).

Modules the active scheduler still owns itself are not copied: hand every module to owners
(``--owns``) for a run without a single point of failure; the standby says so while it follows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dipaco.coordinator import standby
from dipaco.errors import ConfigError, RejectedError, TransportError, WireError
from dipaco.net.hivemind import run_entry, supersedes
from dipaco.protocols import discovery
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)


@dataclass
class Following:
    """What the standby knows of the scheduler it follows."""

    scheduler: str
    epoch: int
    link: Any
    synced: float | None = None  # monotonic time of the last state copied
    answered: float = 0.0  # monotonic time of the last answer (or of the start of following)


def follow(
    node: Any,
    me: Identity,
    run_id: str,
    manifest: dict[str, Any],
    folder: Path,
    *,
    sync_seconds: float,
    takeover_seconds: float,
    say: Callable[[str], None],
    stopping: Callable[[], bool],
) -> bool:
    """Copy the active scheduler's state into ``folder`` until it stops answering for
    ``takeover_seconds`` (True: take over now) or the run finishes (False). ``manifest`` is
    this folder's run manifest: it must be the announced one but for the scheduler's node id."""
    found, entry, announced = discovery.find_run(node, run_id)
    if announced.get("coordinator_key") != me.public_key:
        raise ConfigError(
            "this folder's coordinator/signing.key is not the active scheduler's key: a standby "
            "signs with a copy of it"
        )
    differ = sorted(
        k
        for k in {*manifest, *announced} - {"owner_id", "shards_dir"}
        if manifest.get(k) != announced.get(k)
    )
    if differ:
        raise ConfigError(
            f"run {found} in the DHT differs from the run in this folder ({', '.join(differ)}): "
            "a standby needs a copy of the active scheduler's prepared run folder"
        )
    if entry.get("scheduler") == node.peer_id:
        raise ConfigError(
            "this folder's coordinator/identity.key is the active scheduler's own node key: a "
            "standby needs its own (delete the copied identity.key; one is made on start)"
        )
    now = time.monotonic()
    active = _connect(node, me, entry, now)
    warned: set[str] = set()
    while not stopping():
        try:
            reply = active.link.request(m.StandbySync(standby_id=node.peer_id))
            epoch = standby.keep(folder, reply)
            now = time.monotonic()
            if active.synced is None:
                say(
                    f"standby for run {found}: following scheduler {active.scheduler} "
                    f"(epoch {epoch}); it takes over after {takeover_seconds:g} s without an "
                    "answer"
                )
            active.synced = active.answered = now
            _warn_owned(folder, active.scheduler, warned, say)
        except RejectedError as exc:
            if exc.reason == Reason.NOT_STANDBY:
                raise ConfigError(f"the active scheduler refused this standby: {exc}") from None
            log.warning("the active scheduler refused a state copy: %s", exc)
        except (TransportError, WireError) as exc:
            log.info("no state from the active scheduler: %s", exc)
        if _finished(node, found):
            return False
        silent = time.monotonic() - active.answered
        if silent > takeover_seconds:
            entry = run_entry(node, found)
            if supersedes(entry, active.scheduler, active.epoch):
                # Another standby took over first, or the scheduler restarted elsewhere:
                # follow that one.
                say(f"the run's scheduler is now {entry['scheduler']}: following it")
                active = _connect(node, me, entry, time.monotonic())
                continue
            if active.synced is None:
                say(
                    f"the active scheduler has not answered for {silent:.0f} s, but this standby "
                    "never copied its state: it cannot take over; still waiting"
                )
                active.answered = time.monotonic()
                continue
            say(
                f"the active scheduler {active.scheduler} has not answered for {silent:.0f} s: "
                "taking over"
            )
            return True
        time.sleep(sync_seconds)
    return False


def _connect(node: Any, me: Identity, entry: dict[str, Any], now: float) -> Following:
    link = node.transport(entry["scheduler"], list(entry.get("addresses", [])), timeout=30.0)
    # The standby signs with the scheduler's key, and accepts replies signed by it only.
    link.authenticate(me, me.public_key)
    epoch = entry.get("epoch", 0)
    return Following(entry["scheduler"], epoch if isinstance(epoch, int) else 0, link, None, now)


def _finished(node: Any, run_id: str) -> bool:
    try:
        progress = node.get(discovery.key(run_id, "progress"))
    except Exception:  # noqa: BLE001 - the DHT is best effort
        return False
    return isinstance(progress, dict) and progress.get("finished") is True


def _warn_owned(folder: Path, scheduler: str, warned: set[str], say: Callable[[str], None]):
    """Say once which modules the active scheduler still owns itself: a takeover loses them."""
    try:
        owners = json.loads((folder / standby.STATE).read_text()).get("owners") or {}
    except (OSError, ValueError):
        return
    held = sorted(mid for mid, owner in owners.items() if owner == scheduler)
    if held and set(held) - warned:
        warned.update(held)
        say(
            f"warning: the active scheduler still owns {', '.join(held)}: a takeover cannot "
            "recover them; hand them to other owners (--owns) for a run without a single point "
            "of failure"
        )


class Fence:
    """A scheduler's check that it is still the run's: at every DHT refresh it reads the run's
    entry; once a newer scheduler claims the run (``supersedes``), it publishes nothing more
    and ``superseded`` says by whom."""

    def __init__(self, node: Any, run_id: str, epoch: int) -> None:
        self.node, self.run_id, self.epoch = node, run_id, epoch
        self.superseded: str | None = None

    def check(self) -> bool:
        """True while this scheduler is the run's."""
        if self.superseded is None:
            entry = run_entry(self.node, self.run_id)
            if supersedes(entry, self.node.peer_id, self.epoch):
                self.superseded = f"{entry['scheduler']} (epoch {entry['epoch']})"
        return self.superseded is None
