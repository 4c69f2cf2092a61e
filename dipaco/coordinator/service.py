"""The bytes layer: a signed request in, a signed reply out. It opens the envelope, refuses
replays, admits the key (bans, rate limits, size), decodes the message, runs the operation under
the coordinator's lock for that caller, and counts every refusal once.

Functions of the coordinator (bound as its methods in core.py).
"""

from __future__ import annotations

import logging

from dipaco.coordinator.base import (
    CoordinatorBase,
    RequestSlot,
    acting_for,
    holding_slot,
)
from dipaco.coordinator.durable import deferring
from dipaco.errors import DipacoError, RejectedError
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)


OPS = {
    m.Hello: "hello",
    m.ClaimTask: "claim",
    m.FetchModules: "fetch",
    m.Heartbeat: "heartbeat",
    m.SubmitDelta: "submit",
    m.ReleaseTask: "release",
    m.GetStatus: "status",
    m.TaskDone: "task_done",
    m.GetOwners: "get_owners",
    m.FetchReleases: "fetch_releases",
    m.FetchFile: "fetch_file",
    m.OwnerReport: "owner_report",
    m.HandOver: "hand_over",
    m.ConfirmOwnership: "confirm_ownership",
    m.StandbySync: "standby_sync",
}


def handle(core: CoordinatorBase, data: bytes) -> bytearray | memoryview:
    """Open the signed request, admit its key, run the operation, sign the reply.

    Every refusal is an Error reply with its reason, counted once (per peer id when the
    message names one, else per key) and against the key's ban budget.
    """
    with holding_slot(core.request_slots) as slot:
        return handle_in_slot(core, data, slot)


def handle_in_slot(core: CoordinatorBase, data: bytes, slot: RequestSlot) -> bytearray | memoryview:
    nonce, key, who = "", None, "unknown"
    try:
        header, body = auth.split_request(data)  # parsed once; a refusal answers its nonce
        nonce = header["nonce"]
        slot.take()  # the signature and hash checks, the decoding: CPU (see SLOTTED)
        signed = auth.open_split(header, body)
        nonce, key, who = signed.nonce, signed.key, f"key:{auth.fingerprint(signed.key)}"
        with core.lock:  # replays first: a replayed request costs its signer nothing
            core.guard.check(signed)
        core.access.reload()
        core.access.admit(key)
        if len(signed.body) > core.max_request_bytes:
            raise RejectedError(
                f"a request of {len(signed.body)} bytes exceeds this coordinator's limit "
                f"of {core.max_request_bytes}",
                reason=Reason.TOO_LARGE,
            )
        req = m.decode_message(signed.body)
        if OPS.get(type(req)) not in SLOTTED:
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
        peer = core.peers.get(who)
        if peer is not None:
            peer.bytes_in += len(data)
            peer.bytes_out += len(sealed)
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


# Operations that take the coordinator's lock themselves, for their short state transitions
# only: a delta's decoding, checks and durable write run while other requests are served.
SELF_LOCKING = {"submit"}
# Operations that run in a request slot (``core.request_slots``: a few threads at once): a
# module fetch, a shard file's, and a delta's admission, which gives its slot back before it
# waits for a module's outer step or makes one (admission.py). Every request opens its envelope
# and is decoded in one (handle); the others give it back then. Nothing waits for another
# request while it holds a slot: a claim's long poll holds none.
SLOTTED = {"fetch", "fetch_file", "submit"}


def perform(core: CoordinatorBase, key: str, req: m.Message) -> m.Message:
    op = OPS.get(type(req))
    if op is None:
        raise RejectedError(f"{type(req).__name__} is not a request", reason=Reason.BAD_MESSAGE)
    if op not in SLOTTED:
        return run_op(core, key, req, op)
    with holding_slot(core.request_slots) as slot:  # handle's, or act_for's own
        slot.take()
        return run_op(core, key, req, op)


def run_op(core: CoordinatorBase, key: str, req: m.Message, op: str) -> m.Message:
    name = getattr(req, "peer_id", None) or getattr(req, "owner_id", None)
    try:
        with acting_for(key), deferring():
            with core.lock:
                if name:
                    core.access.bind(name, key)
                core._tick(step=False)
                reply = getattr(core, op)(req) if op not in SELF_LOCKING else None
            if reply is None:
                reply = getattr(core, op)(req)
        core.step_due()  # the outer steps a deadline made due: outside the lock
    finally:  # what the request changed is on disk before its reply (or refusal) goes out
        core.journal.flush()
    return reply
