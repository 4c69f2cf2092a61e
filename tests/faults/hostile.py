"""Hostile keys for the fault harness: scripted attackers that speak the real protocol.

Each runs in a thread of the test process, with its own Ed25519 key, over a real loopback
connection to the coordinator process, and keeps its own tally of the refusals it was answered
with (reason by reason), for the test to hold against the coordinator's own counts:

- :class:`Poisoner`: a real peer that trains every task it gets honestly, then pushes -2.5 times
  its delta: sign-flipped, finite, well-shaped and of a plausible size (the poisoned delta at
  the norm bound).
- :class:`Staller`: claims tasks and reports them done with no delta (the stall), releases
  them and then submits a delta with the old ticket (the stale ticket), over and over.
- :class:`Malformer`: sends requests with hostile values where the decoder or the coordinator
  must catch them: oversized free-form fields, NaN, integers past 64 bits, lone surrogates,
  path names, deltas of the wrong shape or with infinities, unknown modules, a replayed
  request, a forged signature.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from dipaco.errors import DipacoError
from dipaco.peer.peer import Peer
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LoopbackTransport


class Poisoner(Peer):
    """Trains honestly, pushes ``-flip`` times the delta."""

    flip = 2.5

    def push(self, task, delta, tokens, losses, before_send=None):  # noqa: ANN001
        delta = {mid: {k: -self.flip * v for k, v in t.items()} for mid, t in delta.items()}
        return super().push(task, delta, tokens, losses, before_send)


def poisoner(address: str, authkey: bytes, peer_id: str, state: Path, stop: threading.Event):
    transport = LoopbackTransport(address, authkey).authenticate(auth.Identity.generate())
    return Poisoner(transport, peer_id, state, stop=stop, give_up_seconds=30.0)


class Scripted(threading.Thread):
    """A hostile key's loop of raw requests; ``refused`` counts the Error replies by reason."""

    def __init__(self, address: str, authkey: bytes, peer_id: str, stop: threading.Event):
        super().__init__(daemon=True, name=peer_id)
        self.identity = auth.Identity.generate()
        self.transport = LoopbackTransport(address, authkey)
        self.peer_id, self.stop = peer_id, stop
        self.refused: Counter[str] = Counter()
        self.sent = 0
        self.server_key: str | None = None
        self.error: BaseException | None = None

    def raw(self, body: bytes, sealed: bytes | None = None) -> m.Message | None:
        """Send a message body (sealed here unless ``sealed`` is given); count a refusal."""
        if sealed is None:
            sealed, nonce = auth.seal_request(self.identity, body)
        else:
            nonce = auth.peek_nonce(sealed)
        self.sent += 1
        try:
            reply = self.transport._roundtrip(sealed)
        except DipacoError:
            return None  # the connection broke (the run ended): nothing was answered
        opened = auth.open_reply(reply, nonce, self.server_key)
        self.server_key = opened.key
        msg = m.decode_message(opened.body)
        if isinstance(msg, m.Error):
            self.refused[msg.reason] += 1
        return msg

    def send(self, msg: m.Message) -> m.Message | None:
        return self.raw(bytes(m.encode_message(msg)))

    def run(self) -> None:
        try:
            self.send(m.Hello(peer_id=self.peer_id))
            while not self.stop.is_set():
                self.attack()
                self.stop.wait(0.3)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def claim(self) -> m.TaskOffer | None:
        offer = self.send(m.ClaimTask(peer_id=self.peer_id))
        return offer if isinstance(offer, m.TaskOffer) else None

    def attack(self) -> None:
        raise NotImplementedError


class Staller(Scripted):
    def attack(self) -> None:
        task = self.claim()
        if task is None:
            return
        mids = sorted(task.module_versions)
        # The stall: the task reported done with no delta acknowledged anywhere.
        self.send(m.TaskDone(self.peer_id, task.task_id, task.ticket, 100, [1.0], mids))
        # The stale ticket: the lease handed back, then a delta sent with its ticket.
        self.send(m.ReleaseTask(self.peer_id, task.task_id))
        self.send(
            m.SubmitDelta(
                self.peer_id,
                task.task_id,
                task.path,
                task.module_versions,
                100,
                [1.0],
                {f"{mid}/x": torch.zeros(1) for mid in mids},
                ticket=task.ticket,
            )
        )


def _frame(type_: str, fields: dict, raw_tokens: dict[str, str] | None = None) -> bytes:
    """A frame written by hand (the encoder refuses what these carry)."""
    text = json.dumps({"type": type_, "fields": fields, "tensors": []}, separators=(",", ":"))
    for marker, token in (raw_tokens or {}).items():
        text = text.replace(json.dumps(marker), token)
    data = text.encode("utf-8", "surrogatepass")
    return b"DPCO" + struct.pack("<BI", 1, len(data)) + data


class Malformer(Scripted):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.turn = 0

    def attack(self) -> None:
        pid = self.peer_id
        self.turn += 1
        kind = self.turn % 8
        if kind == 0:
            self.send(m.Hello(peer_id=pid, capabilities={"x": "y" * 10_000}))
        elif kind == 1:
            self.raw(_frame("Heartbeat", {"peer_id": pid, "step": "@big@"}, {"@big@": "9" * 30}))
        elif kind == 2:
            self.raw(
                _frame(
                    "TaskDone",
                    {"peer_id": pid, "task_id": "t", "ticket": "", "tokens": 1,
                     "losses": ["@nan@"], "modules": []},
                    {"@nan@": "NaN"},
                )
            )  # fmt: skip
        elif kind == 3:
            self.raw(
                _frame("ReleaseTask", {"peer_id": pid, "task_id": "@s@"}, {"@s@": '"\\udc00"'})
            )
        elif kind == 4:
            self.send(m.FetchFile(pid, "../../../etc/passwd", 0, 100))
        elif kind == 5:
            task = self.claim()
            if task is not None:
                mids = sorted(task.module_versions)
                bad = {f"{mid}/nope": torch.full((3,), float("inf")) for mid in mids}
                self.send(
                    m.SubmitDelta(
                        pid, task.task_id, task.path, task.module_versions, 100, [1.0], bad,
                        ticket=task.ticket,
                    )
                )  # fmt: skip
                self.send(m.ReleaseTask(pid, task.task_id))
        elif kind == 6:  # the same sealed request twice: the second is a replay
            sealed, _ = auth.seal_request(self.identity, bytes(m.encode_message(m.GetStatus())))
            self.raw(b"", sealed)
            self.raw(b"", sealed)
        else:  # a signature that is not the key's
            sealed, _ = auth.seal_request(self.identity, bytes(m.encode_message(m.GetOwners())))
            (size,) = struct.unpack_from("<I", sealed, 4)
            header = json.loads(sealed[8 : 8 + size])
            header["sig"] = header["sig"][::-1]
            text = json.dumps(header).encode()
            self.raw(b"", sealed[:4] + struct.pack("<I", len(text)) + text + sealed[8 + size :])


def wait_for(predicate, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False
