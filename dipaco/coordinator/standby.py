"""A standby scheduler's copy of the active one's durable state.

The active scheduler answers ``StandbySync`` with its state files: coordinator.json as of now
(the leases in flight, the tasks issued, the overdue skips, the owners, their keys and
addresses, the epoch) and the access, rotation, phase and score files beside it. Only a request
signed by the scheduler's own key is answered: the standby holds a copy of ``signing.key``, so
that after a takeover its tickets and replies carry the key every owner and peer already trusts.
The standby writes the files into its own ``coordinator/`` folder (``keep``); when it takes over
it starts from them exactly as a restarted scheduler does (``state.start``: a new epoch, the
leases resumed).

Functions of the coordinator (``standby_sync`` is bound as its method in core.py); ``keep`` is
the standby's side.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dipaco.coordinator import state
from dipaco.coordinator.base import CoordinatorBase
from dipaco.errors import WireError
from dipaco.fileio import write_atomic
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

STATE = "coordinator.json"
# The files a standby copies, and the only names it ever writes (a reply naming any other
# file is refused whole).
# key_scores.json: who the scheduler trusts (keyscores.KeyScores), which a takeover keeps.
FILES = (
    STATE,
    "access.json",
    "peers.json",
    "key_rotations.json",
    "decided_phases.json",
    "key_scores.json",
)


def standby_sync(core: CoordinatorBase, req: m.StandbySync) -> m.StandbyState:
    """The state files, to a standby that signs with this scheduler's key."""
    if not core.is_scheduler:
        core.refusals.refuse(
            req.standby_id, Reason.NOT_STANDBY, "this coordinator does not lease tasks: no standby"
        )
    if core._caller != core.identity.public_key:
        core.refusals.refuse(
            req.standby_id,
            Reason.NOT_STANDBY,
            "a standby scheduler signs with the scheduler's own key (copy coordinator/signing.key "
            "to it); this request is signed by another",
        )
    if req.standby_id not in core.standbys:
        core.metrics({"event": "standby_following", "standby": req.standby_id})
    core.standbys[req.standby_id] = core.clock()
    files = {STATE: state.state_bytes(core)}
    for name in FILES[1:]:
        path = core.root / name
        if path.exists():
            files[name] = path.read_bytes()
    tensors = {
        f"file/{name}": torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
        for name, data in files.items()
    }
    return m.StandbyState(epoch=core.epoch, tensors=tensors)


def keep(folder: Path, reply: m.StandbyState) -> int:
    """Write the active scheduler's state files that changed into ``folder`` (each atomically,
    coordinator.json last, so that a crash leaves the other files no older than it); returns
    the active's epoch. A reply with a name outside ``FILES`` is a WireError and nothing is
    written."""
    files = {}
    for name, tensor in reply.tensors.items():
        plain = name.removeprefix("file/")
        if not name.startswith("file/") or plain not in FILES or tensor.dtype != torch.uint8:
            raise WireError(f"a standby state names {name[:80]!r}, not one of {list(FILES)}")
        files[plain] = tensor.numpy().tobytes()
    if STATE not in files:
        raise WireError("a standby state without coordinator.json")
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(files, key=lambda n: n == STATE):
        path = folder / name
        if not path.exists() or path.read_bytes() != files[name]:
            write_atomic(path, files[name])
    return reply.epoch
