"""Ed25519 identities, and the signed envelope around every request and every reply.

Every node (peer or coordinator) has an Ed25519 key pair kept in a file only its owner can read
(:class:`Identity`). Its public key, written ``ed25519:<base64url>``, is who it is: allow-lists,
bans, quotas and the binding of a peer id to its owner all use it.

Each request frame travels in an envelope that the sender signs::

    b"DPQ1" | u32 header length | header JSON | body (the encoded message)
    header: {"key": public key, "ts": unix seconds, "nonce": 32 hex, "blake3": of the body,
             "sig": Ed25519 over "dipaco/request" key ts nonce blake3}

and each reply in one the coordinator signs, bound to the request's nonce so that a recorded
reply cannot answer another request::

    b"DPR1" | u32 header length | header JSON | body
    header: {"key": public key, "nonce": the request's nonce, "blake3": ..., "sig": Ed25519 over
             "dipaco/reply" key nonce blake3}

The body's hash is BLAKE3 (256 bits, a cryptographic hash several times faster than SHA-256, on
every core for a large body): a delta's envelope costs little more than its frame. The receiver
checks the body's hash and the signature before it decodes the body; the
coordinator also refuses a timestamp outside its clock-skew window and a nonce it has seen
(:class:`ReplayGuard`), so a captured request cannot be sent again. This works the same on every
transport (local, loopback, hivemind), underneath them all. Nothing here is ever unpickled.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dipaco import faults
from dipaco.errors import ConfigError, RejectedError, WireError
from dipaco.fileio import write_private
from dipaco.protocols.reasons import Reason
from dipaco.protocols.wire import (
    MESSAGE_ALIGN,
    ByteBuffer,
    Outgoing,
    Pieces,
    joined,
    loads_checked,
)

KEY_PREFIX = "ed25519:"
REQUEST_MAGIC, REPLY_MAGIC = b"DPQ1", b"DPR1"
MAX_ENVELOPE_HEADER = 4096
# Free bytes to leave in front of a message (``encode_message(msg, room=ENVELOPE_ROOM)``) so that
# sealing it writes the envelope's header there, in place, and never copies the body.
ENVELOPE_ROOM = 8 + MAX_ENVELOPE_HEADER
DEFAULT_SKEW_SECONDS = 300.0


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def canonical(payload: Any) -> bytes:
    """The one byte form of a JSON payload that a signature covers."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """``ed25519:<base64url of 32 bytes>`` as a key; a ValueError saying what is wrong else."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise ValueError(f"a public key looks like {KEY_PREFIX}<43 base64url characters>")
    return _parse_key(text)


@functools.lru_cache(maxsize=4096)
def _parse_key(text: str) -> Ed25519PublicKey:
    """Every signed request names its key: the few thousand last parsed are kept (a key
    object is immutable; a refused text is not kept, and a flood of new keys only evicts)."""
    try:
        raw = _unb64(text[len(KEY_PREFIX) :])
    except (binascii.Error, ValueError):
        raise ValueError("the public key is not base64url") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, this one {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def check_public_key(text: str) -> str:
    """``text`` if it is a well-formed public key, else a ConfigError naming the problem."""
    try:
        parse_public_key(text)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a dipaco public key: {exc}") from None
    return text


def fingerprint(public_key: str) -> str:
    """A short, stable name for a key (logs, counters, the status page)."""
    return hashlib.sha256(public_key.encode()).hexdigest()[:12]


def verify(public_key: str, signature: str, data: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of ``data``; never raises."""
    try:
        parse_public_key(public_key).verify(_unb64(signature), data)
        return True
    except (InvalidSignature, ValueError, TypeError, binascii.Error):
        return False


class Identity:
    """An Ed25519 key pair: the private half signs, the public half names its owner."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        raw = private.public_key().public_bytes_raw()
        self.public_key = KEY_PREFIX + _b64(raw)
        self.fingerprint = fingerprint(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Read a key file; refuse one that others can read, or that is not a key."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such key file") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{path}: the private key is readable by others (mode {stat.S_IMODE(mode):o}); "
                f"run: chmod 600 {path}"
            )
        prefix = "ed25519-private:"
        try:
            if not text.startswith(prefix):
                raise ValueError("missing the ed25519-private: prefix")
            seed = _unb64(text[len(prefix) :])
            return cls(Ed25519PrivateKey.from_private_bytes(seed))
        except (ValueError, binascii.Error) as exc:
            raise ConfigError(f"{path}: not a dipaco private key file ({exc})") from None

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """The key in ``path``, made (owner-only, 0600) on first use."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def save(self, path: str | Path) -> None:
        seed = self._private.private_bytes_raw()
        write_private(path, f"ed25519-private:{_b64(seed)}\n")

    def sign(self, data: bytes) -> str:
        return _b64(self._private.sign(data))


_PROCESS_IDENTITY: list[Identity] = []
_PROCESS_LOCK = threading.Lock()


def process_identity() -> Identity:
    """A key made once per process, in memory: what a transport signs with when given none."""
    with _PROCESS_LOCK:
        if not _PROCESS_IDENTITY:
            _PROCESS_IDENTITY.append(Identity.generate())
        return _PROCESS_IDENTITY[0]


# ---- envelopes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signed:
    """An opened envelope: who signed it, and what."""

    key: str
    nonce: str
    ts: float
    body: bytes | memoryview


def _request_text(key: str, ts: float, nonce: str, digest: str) -> bytes:
    return f"dipaco/request\n{key}\n{ts!r}\n{nonce}\n{digest}".encode()


def _reply_text(key: str, nonce: str, digest: str) -> bytes:
    return f"dipaco/reply\n{key}\n{nonce}\n{digest}".encode()


# Bodies from this size on are hashed on every core (blake3 releases the GIL while it hashes).
_THREADED_HASH_BYTES = 1 << 20


def body_digest(body: ByteBuffer | Pieces) -> str:
    """The envelope's hash of a body (one buffer, or Pieces hashed in turn): BLAKE3, hex."""
    threads = blake3.blake3.AUTO if len(body) >= _THREADED_HASH_BYTES else 1
    if isinstance(body, Pieces):
        hasher = blake3.blake3(max_threads=threads)
        for part in body.parts:
            hasher.update(part)
        return hasher.hexdigest()
    return blake3.blake3(body, max_threads=threads).hexdigest()


def _payload(body: bytes | bytearray | Pieces, room: int) -> ByteBuffer | Pieces:
    return body.after(room) if isinstance(body, Pieces) else memoryview(body)[room:]


@overload
def _pack(magic: bytes, header: dict[str, Any], body: Pieces, room: int = 0) -> Pieces: ...


@overload
def _pack(
    magic: bytes, header: dict[str, Any], body: bytes | bytearray, room: int = 0
) -> bytearray | memoryview: ...


def _pack(
    magic: bytes, header: dict[str, Any], body: bytes | bytearray | Pieces, room: int = 0
) -> bytearray | memoryview | Pieces:
    """The envelope: magic, header length, header, then the body (``body[room:]``). With
    ``room``, the header goes into the free bytes in front of the body and the envelope is a
    view of ``body`` from there: no copy of the body at all. Pieces stay Pieces (the header
    goes into the room of the first). The header is padded with spaces to a multiple of
    MESSAGE_ALIGN with its 8 bytes of magic and length, so that the body keeps the alignment
    of its tensors (wire.MESSAGE_ALIGN)."""
    head = canonical(header)
    head += b" " * (-(8 + len(head)) % MESSAGE_ALIGN)
    start = room - 8 - len(head)
    if isinstance(body, Pieces):
        first = body.parts[0]
        if room and start >= 0 and not first.readonly:
            first[start : start + 4], first[start + 4 : start + 8] = (
                magic,
                struct.pack("<I", len(head)),
            )
            first[start + 8 : room] = head
            return Pieces([first[start:], *body.parts[1:]])
        lead = magic + struct.pack("<I", len(head)) + head
        return Pieces([lead, *body.after(room).parts])
    if room and start >= 0 and isinstance(body, bytearray):
        body[start : start + 4], body[start + 4 : start + 8] = magic, struct.pack("<I", len(head))
        body[start + 8 : room] = head
        return memoryview(body)[start:]
    payload = memoryview(body)[room:]
    out = bytearray(8 + len(head) + len(payload))  # the one copy of the body, into place
    out[:4], out[4:8], out[8 : 8 + len(head)] = magic, struct.pack("<I", len(head)), head
    out[8 + len(head) :] = payload
    return out


def _split(data: ByteBuffer, magic: bytes) -> tuple[dict[str, Any], memoryview]:
    if len(data) < 8 or bytes(data[:4]) != magic:
        kind = "request" if magic == REQUEST_MAGIC else "reply"
        raise RejectedError(
            f"the {kind} is not in a signed dipaco envelope", reason=Reason.UNSIGNED
        )
    (size,) = struct.unpack("<I", bytes(data[4:8]))
    if size > MAX_ENVELOPE_HEADER or 8 + size > len(data):
        raise RejectedError(
            f"envelope header of {size} bytes is too long or cut short", reason=Reason.BAD_ENVELOPE
        )
    try:
        header = loads_checked(memoryview(data)[8 : 8 + size], "envelope header")
    except WireError as exc:  # not JSON, or a NaN, an endless number, a lone surrogate
        raise RejectedError(str(exc), reason=Reason.BAD_ENVELOPE) from None
    if not isinstance(header, dict):
        raise RejectedError("envelope header is not a JSON object", reason=Reason.BAD_ENVELOPE)
    body = memoryview(data)[8 + size :]  # no copy: the body may be a large delta
    for name in ("key", "nonce", "blake3", "sig"):
        if not isinstance(header.get(name), str):
            raise RejectedError(f"envelope header lacks {name!r}", reason=Reason.BAD_ENVELOPE)
    return header, body


def _unpack(data: ByteBuffer, magic: bytes) -> tuple[dict[str, Any], memoryview]:
    header, body = _split(data, magic)
    _check_digest(header, body)
    return header, body


def _check_digest(header: dict[str, Any], body: memoryview) -> None:
    if body_digest(body) != header["blake3"]:
        raise RejectedError(
            "the body does not match the envelope's hash", reason=Reason.BAD_SIGNATURE
        )


@overload
def seal_request(
    identity: Identity, body: Pieces, now: float | None = None, *, room: int = 0
) -> tuple[Pieces, str]: ...


@overload
def seal_request(
    identity: Identity, body: bytes | bytearray, now: float | None = None, *, room: int = 0
) -> tuple[bytearray | memoryview, str]: ...


def seal_request(
    identity: Identity,
    body: bytes | bytearray | Pieces,
    now: float | None = None,
    *,
    room: int = 0,
) -> tuple[bytearray | memoryview | Pieces, str]:
    """The signed request frame, and its nonce (the reply must carry it back). ``room``: the
    body starts after that many free bytes (``encode_message(msg, room=ENVELOPE_ROOM)``),
    which the envelope's header fills in place."""
    ts = round(faults.now() if now is None else now, 3)  # faults.now: time.time(), unless a
    # fault-injection run skews this process's clock (DIPACO_CLOCK_SKEW)
    nonce = secrets.token_hex(16)
    digest = body_digest(_payload(body, room))
    sig = identity.sign(_request_text(identity.public_key, ts, nonce, digest))
    header = {"key": identity.public_key, "ts": ts, "nonce": nonce, "blake3": digest, "sig": sig}
    return _pack(REQUEST_MAGIC, header, body, room), nonce


def open_request(data: ByteBuffer) -> Signed:
    """The verified request; a RejectedError (unsigned, bad-envelope, bad-signature) else."""
    return open_split(*split_request(data))


def split_request(data: ByteBuffer) -> tuple[dict[str, Any], memoryview]:
    """A request's envelope header (its nonce, say) and body, not yet verified: for a server
    that answers even a refusal to the request's nonce, and parses the header once
    (:func:`open_split` verifies). A RejectedError (unsigned, bad-envelope) if it is not one."""
    return _split(data, REQUEST_MAGIC)


def open_split(header: dict[str, Any], body: memoryview) -> Signed:
    """The request of :func:`split_request`, verified: its body's hash and its signature."""
    _check_digest(header, body)
    ts = header.get("ts")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise RejectedError("envelope header lacks a timestamp", reason=Reason.BAD_ENVELOPE)
    text = _request_text(header["key"], ts, header["nonce"], header["blake3"])
    if not verify(header["key"], header["sig"], text):
        raise RejectedError("the request's signature does not verify", reason=Reason.BAD_SIGNATURE)
    return Signed(header["key"], header["nonce"], float(ts), body)


def peek_nonce(data: ByteBuffer) -> str:
    """A request's nonce before it is verified ("" if there is none), so that even a refusal
    of a request that fails its checks reaches the sender as an answer to that request."""
    try:
        header, _ = _split(data, REQUEST_MAGIC)
    except RejectedError:
        return ""
    return header["nonce"]


def seal_reply(
    identity: Identity, nonce: str, body: bytes | bytearray, *, room: int = 0
) -> bytearray | memoryview:
    """The signed reply to the request with ``nonce``; ``room`` as for :func:`seal_request`.
    One buffer, never Pieces: a reply's tensors (modules) may change once it is made."""
    digest = body_digest(memoryview(body)[room:])
    sig = identity.sign(_reply_text(identity.public_key, nonce, digest))
    header = {"key": identity.public_key, "nonce": nonce, "blake3": digest, "sig": sig}
    return _pack(REPLY_MAGIC, header, body, room)


def open_reply(data: Outgoing, nonce: str, expected_key: str | None) -> Signed:
    """The verified reply to the request with ``nonce``, signed by ``expected_key`` if given.

    Raises WireError: a reply that fails these checks did not come from the coordinator we
    meant to talk to (or was tampered with on the way), so nothing in it may be used.
    Pieces (a reply from this process) are joined first.
    """
    try:
        header, body = _unpack(joined(data), REPLY_MAGIC)
    except RejectedError as exc:
        raise WireError(f"reply refused: {exc}", reason="untrusted-reply") from None
    if header["nonce"] != nonce:
        raise WireError(
            "reply refused: it answers another request (nonce differs)", reason="untrusted-reply"
        )
    if expected_key is not None and header["key"] != expected_key:
        raise WireError(
            f"reply refused: signed by {fingerprint(header['key'])}, "
            f"expected the coordinator {fingerprint(expected_key)}",
            reason="untrusted-reply",
        )
    if not verify(
        header["key"], header["sig"], _reply_text(header["key"], nonce, header["blake3"])
    ):
        raise WireError("reply refused: its signature does not verify", reason="untrusted-reply")
    return Signed(header["key"], nonce, 0.0, body)


class ReplayGuard:
    """Refuses requests from outside the clock-skew window, and any nonce seen inside it."""

    def __init__(self, skew_seconds: float = DEFAULT_SKEW_SECONDS, max_nonces: int = 1 << 18):
        self.skew = skew_seconds
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its timestamp, by arrival

    def check(self, signed: Signed, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if not abs(signed.ts - now) <= self.skew:  # a NaN fails this, as it must
            raise RejectedError(
                f"the request's clock is {signed.ts - now:+.0f} s off the coordinator's (at most "
                f"{self.skew:.0f} s allowed): set the machine's clock (NTP)",
                reason=Reason.CLOCK_SKEW,
            )
        if signed.nonce in self._seen:
            raise RejectedError("this request was already received once", reason=Reason.REPLAY)
        self._seen[signed.nonce] = signed.ts
        # Forget nonces whose timestamps have left the window: such requests fail the time check.
        while self._seen:
            oldest_nonce, oldest_ts = next(iter(self._seen.items()))
            if now - oldest_ts <= 2 * self.skew and len(self._seen) <= self.max_nonces:
                break
            del self._seen[oldest_nonce]


def sign_payload(identity: Identity, purpose: str, payload: Any) -> str:
    """A detached signature of a JSON payload for one purpose (releases, manifests, tickets)."""
    return identity.sign(purpose.encode() + b"\n" + canonical(payload))


def check_payload(public_key: str, signature: str, purpose: str, payload: Any) -> bool:
    return isinstance(signature, str) and verify(
        public_key, signature, purpose.encode() + b"\n" + canonical(payload)
    )


def release_payload(run_id: str | None, mid: str, version: int | None, digest: str | None) -> dict:
    """What an owner signs (purpose "release") for one module version it serves, and what a
    peer, an owner or a gathering scheduler checks: the run, the module, its version, its hash."""
    return {"run": run_id, "module": mid, "version": version, "hash": digest}
