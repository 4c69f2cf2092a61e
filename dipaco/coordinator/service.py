"""The bytes layer: a signed request in, a signed reply out. It opens the envelope, refuses
replays, admits the key (bans, rate limits, size), decodes the message, runs the operation under
the coordinator's lock for that caller, and counts every refusal once.

Functions of the coordinator (bound as its methods in core.py); ``OPS`` maps each request to
the part's function that answers it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from dipaco.coordinator import admission, ownership, rounds, scoring, standby, status, tasks
from dipaco.coordinator.base import CoordinatorBase, acting_for
from dipaco.coordinator.durable import deferring
from dipaco.coordinator.gate import RequestSlot
from dipaco.errors import DipacoError, RejectedError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason
from dipaco.protocols.wire import ByteBuffer, is_received

log = logging.getLogger(__name__)


class Op(NamedTuple):
    """An operation: its function, whether the service runs it under the coordinator's lock
    (``submit`` takes the lock itself, for its short state transitions only: a delta's decoding,
    checks and durable write run while other requests are served), and whether it runs in a
    request slot (``core.gate.slots``: a few threads at once). A module fetch, a shard
    file's and a delta's admission are slotted; the admission gives its slot back before it
    waits for a module's outer step or makes one (admission.py). Every request opens its
    envelope and is decoded in one (handle); the others give it back then. Nothing waits for
    another request while it holds a slot: a claim's long poll holds none."""

    run: Callable[[Any, Any], m.Message]
    locked: bool = True
    slotted: bool = False


OPS: dict[type[m.Message], Op] = {
    m.Hello: Op(tasks.hello),
    m.ClaimTask: Op(tasks.claim),
    m.FetchModules: Op(tasks.fetch, slotted=True),
    m.Heartbeat: Op(tasks.heartbeat),
    m.SubmitDelta: Op(admission.submit, locked=False, slotted=True),
    m.ScoreDelta: Op(scoring.score, locked=False, slotted=True),
    m.ReleaseTask: Op(tasks.release),
    m.GetStatus: Op(status.status),
    m.TaskDone: Op(rounds.task_done),
    m.GetOwners: Op(ownership.get_owners),
    m.FetchReleases: Op(tasks.fetch_releases),
    m.FetchFile: Op(tasks.fetch_file, slotted=True),
    m.OwnerReport: Op(ownership.owner_report),
    m.HandOver: Op(ownership.hand_over),
    m.ConfirmOwnership: Op(ownership.confirm_ownership),
    m.StandbySync: Op(standby.standby_sync),
}


def handle(core: CoordinatorBase, data: ByteBuffer) -> bytearray | memoryview:
    """Open the signed request, admit its key, run the operation, sign the reply.

    Every refusal is an Error reply with its reason, counted once (per peer id when the
    message names one, else per key) and against the key's ban budget.
    """
    with core.gate.holding() as slot:
        return handle_in_slot(core, data, slot)


def handle_in_slot(
    core: CoordinatorBase, data: ByteBuffer, slot: RequestSlot
) -> bytearray | memoryview:
    nonce, key, who = "", None, "unknown"
    try:
        header, body = auth.split_request(data)  # parsed once; a refusal answers its nonce
        nonce = header["nonce"]
        slot.take()  # the signature and hash checks, the decoding: CPU (see SLOTTED)
        signed = auth.open_split(header, body)
        nonce, key, who = signed.nonce, signed.key, f"key:{auth.fingerprint(signed.key)}"
        with core.lock:  # replays first: a replayed request costs its signer nothing
            core.gate.guard.check(signed)
        core.access.reload()
        core.access.admit(key)
        if len(signed.body) > core.gate.max_request_bytes:
            raise RejectedError(
                f"a request of {len(signed.body)} bytes exceeds this coordinator's limit "
                f"of {core.gate.max_request_bytes}",
                reason=Reason.TOO_LARGE,
            )
        # A request received into a buffer of its own (transport.Handler) is decoded in place:
        # a delta's tensors are views of it, not a second copy.
        req = m.decode_message(signed.body, copy=not is_received(data))
        op = OPS.get(type(req))
        if op is None or not op.slotted:
            slot.give()
        who = getattr(req, "peer_id", None) or getattr(req, "owner_id", None) or who
        reply = perform(core, key, req)
    except DipacoError as exc:
        if not exc.counted:
            with core.lock, acting_for(key):
                core.refusals.count(who, exc.reason)
        log.info("rejected %s: %s (%s)", who, exc, exc.reason)
        reply = m.Error(reason=exc.reason, message=str(exc))
    room = auth.ENVELOPE_ROOM  # sealed in place: a large reply's body is never copied
    sealed = auth.seal_reply(core.identity, nonce, m.encode_message(reply, room=room), room=room)
    with core.lock:  # bytes moved, for the dashboard and `dipaco status`
        core.roster.moved(who, len(data), len(sealed))
    return sealed


def act_for(core: CoordinatorBase, key: str, req: m.Message) -> m.Message:
    """Run ``req`` as the holder of ``key`` would, without an envelope: for a transport that
    runs in this process and has authenticated the key itself (the Flower ServerApp claims
    and fetches for its nodes, whose keys it learned from their signed Hello). The key is
    admitted, rate-limited and bound to the request's name exactly as in :meth:`handle`;
    a refusal raises :class:`RejectedError`, counted once."""
    try:
        core.access.reload()
        core.access.admit(key)
        return perform(core, key, req)
    except DipacoError as exc:
        if not exc.counted:
            who = getattr(req, "peer_id", None) or f"key:{auth.fingerprint(key)}"
            with core.lock, acting_for(key):
                core.refusals.count(who, exc.reason)
            exc.counted = True
        raise


def refuse(core: CoordinatorBase, who: str, reason: str, message: str) -> None:
    """Count a refusal a transport made before the core saw the request (a malformed
    Flower reply, say), as :meth:`handle` counts its own."""
    with core.lock:
        core.refusals.count(who, reason)
    log.info("rejected %s: %s (%s)", who, message, reason)


def perform(core: CoordinatorBase, key: str, req: m.Message) -> m.Message:
    op = OPS.get(type(req))
    if op is None:
        raise RejectedError(f"{type(req).__name__} is not a request", reason=Reason.BAD_MESSAGE)
    if not op.slotted:
        return run_op(core, key, req, op)
    with core.gate.holding() as slot:  # handle's, or act_for's own
        slot.take()
        return run_op(core, key, req, op)


def run_op(core: CoordinatorBase, key: str, req: m.Message, op: Op) -> m.Message:
    name = getattr(req, "peer_id", None) or getattr(req, "owner_id", None)
    try:
        with acting_for(key), deferring():
            with core.lock:
                if name:
                    core.access.bind(name, key)
                rounds.tick_now(core, step=False)
                if op.locked:
                    reply = op.run(core, req)
            if not op.locked:
                reply = op.run(core, req)
        rounds.step_due(core)  # the outer steps a deadline made due: outside the lock
    finally:  # what the request changed is on disk before its reply (or refusal) goes out
        core.journal.flush()
    return reply
