"""Typed records exchanged between peers and coordinators, and their wire form.

Every message is a dataclass registered under its class name. Scalar fields travel in the JSON
header; a message's ``tensors`` field (named ``"<module id>/<parameter>"``) travels as raw bytes.
Decoding checks each field's type against the annotation, so a frame with a missing, unknown or
mistyped field is a :class:`~dipaco.errors.WireError` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dipaco.errors import WireError
from dipaco.protocols.wire import (
    DEFAULT_LIMITS,
    Frame,
    Limits,
    Pieces,
    decode,
    encode,
    encode_gathered,
)

REGISTRY: dict[str, type] = {}

# The protocol's number, for parties of different releases in one run (docs/protocol.md §2).
# A peer says it in Hello (capabilities["protocol"]); a coordinator that knows the number
# answers with its own (Welcome.protocol), one that does not says nothing: protocol 1.
#   1: before the number (ClaimTask.wait, but no TaskDone.wait)
#   2: TaskDone.wait
PROTOCOL = 2


# Free-form values a peer sends are kept and shown to everyone (status, dashboard): each is
# bounded where it arrives, as JSON characters (``from_frame``, reason ``too-large``); any one
# string is at most ``wire.MAX_TEXT`` characters in every frame.


def bounded(limit: int, **kwargs: Any) -> Any:
    """A dataclass field whose value, written as JSON, is at most ``limit`` characters."""
    return field(metadata={"max_json": limit}, **kwargs)


_M = TypeVar("_M")


# dataclass_transform: a type checker reads a @message class as the dataclass it becomes (its
# constructor's fields), and ``bounded`` as a dataclass field.
@typing.dataclass_transform(field_specifiers=(field, bounded))
def message(cls: type[_M]) -> type[_M]:
    cls = dataclass(cls)
    REGISTRY[cls.__name__] = cls
    return cls


# ---- peer -> coordinator ----------------------------------------------------------------------


@message
class Hello:
    peer_id: str = bounded(256)
    device: str = bounded(128, default="cpu")
    capabilities: dict[str, Any] = bounded(4096, default_factory=dict)


@message
class ClaimTask:
    peer_id: str
    prefer_path: int | None = None
    # Tasks the peer holds and trains with the one it asks for (a path-parallel peer): the
    # scheduler leases it another path rather than give one of these back.
    holding: list[str] = field(default_factory=list)
    # Seconds the peer would rather wait for a path to open than get a NoTask now (a long
    # poll); the scheduler waits at most polls.LONG_POLL_SECONDS, and only while it has a slot free.
    wait: float = 0.0


@message
class FetchModules:
    peer_id: str
    task_id: str
    have: dict[str, int] = field(default_factory=dict)  # module id -> version the peer has cached
    ticket: str = ""  # the task's ticket from the scheduler (owners check it)


@message
class Heartbeat:
    peer_id: str
    task_id: str | None = None
    step: int = 0


@message
class SubmitDelta:
    peer_id: str
    task_id: str
    path: int
    base_versions: dict[str, int]
    tokens: int
    losses: list[float]  # the training loss of each inner step
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ticket: str = ""
    codec: str = "lossless"  # how ``tensors`` are encoded (dipaco.protocols.codecs)
    # The scorer's signed verdict on the whole path's delta (``ScoreDelta``), where the task
    # said to get one (``TaskOffer.score_first``): the owners of a path shared between
    # coordinators apply their modules' deltas only with it (coordinator/scoring.py).
    verdict: str = field(default="", metadata={"omit_empty": True})


@message
class ScoreDelta:
    """The whole path's encoded delta to the scheduler, before any owner gets its modules, when
    the path's modules belong to more than one coordinator and the run scores every delta
    (``TaskOffer.score_first``): answered with ``Scored``, the verdict each owner checks."""

    peer_id: str
    task_id: str
    path: int
    base_versions: dict[str, int]
    tokens: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ticket: str = ""
    codec: str = "lossless"


@message
class TaskDone:
    """Sent to the scheduler once every module owner has acknowledged the task's deltas."""

    peer_id: str
    task_id: str
    ticket: str
    tokens: int
    losses: list[float]
    modules: list[str]
    # Seconds the peer would rather wait for another owner's report of its acknowledgement
    # than get a ``not-acked`` refusal now (a long poll, as ClaimTask.wait); the scheduler
    # waits at most REPORT_WAIT_SECONDS (rounds.py), and only while it has a slot free. Left
    # out when 0, so that a coordinator of protocol 1 (which lacks it) decodes the TaskDone.
    wait: float = field(default=0.0, metadata={"omit_empty": True})


@message
class GetOwners:
    pass


@message
class FetchSeed:
    """One released module version from a peer that holds it (peer to peer, docs/protocol.md
    §5): answered with ``Modules`` carrying the owner's release signature, which the asking
    peer checks as if the owner had served it."""

    peer_id: str = bounded(256)
    module: str = bounded(256)
    version: int = 0


@message
class FetchReleases:
    """The latest released version of modules this coordinator owns, outside any task: for
    gathering a run whole (``dipaco gather``, eval, export) once it has trained."""

    peer_id: str
    modules: list[str]


@message
class FetchFile:
    """A byte range of one of the run's files (tokenizer, shards) named in the data manifest."""

    peer_id: str
    name: str
    offset: int
    length: int


# ---- coordinator -> coordinator (module owners and the scheduler) ----------------------------


@message
class OwnerReport:
    """An owner's full state for its modules; idempotent, sent after every change and periodically."""

    owner_id: str
    proof: str
    modules: dict[str, Any]  # module id -> {"version", "hash", "pending": [paths]}
    addresses: list[str] = field(default_factory=list)


@message
class HandOver:
    """A new owner asks for modules' state; the current owner holds their deltas meanwhile."""

    owner_id: str
    proof: str
    modules: list[str]


@message
class ConfirmOwnership:
    owner_id: str
    proof: str
    hashes: dict[str, str]  # module id -> content hash of the adopted version


@message
class StandbySync:
    """A standby scheduler asks the active one for its durable state (coordinator.json and the
    access, rotation and phase files beside it); only the scheduler's own key may ask."""

    standby_id: str  # the standby's node id, for the active's log


@message
class ReleaseTask:
    peer_id: str
    task_id: str


@message
class GetStatus:
    pass


# ---- coordinator -> peer ----------------------------------------------------------------------


@message
class Welcome:
    run_id: str
    config: dict[str, Any]  # the run manifest; config["coordinator_key"] is the scheduler's key
    signature: str = ""  # the scheduler's Ed25519 signature of the manifest ("manifest" purpose)
    # The scheduler's key rotations, oldest first (dipaco.protocols.keyrotation): each signed by
    # the key it retires, so that a party trusting an older key can follow them to this one.
    rotations: list[dict[str, Any]] = field(default_factory=list)
    # The coordinator's clock when it answered ({"now": seconds since the epoch, "window": the
    # clock-skew seconds it allows}), for a peer whose Hello asked (capabilities["clock"]); left
    # out of the frame otherwise, so that a peer from before the field decodes the Welcome.
    clock: dict[str, float] = field(default_factory=dict, metadata={"omit_empty": True})
    # The coordinator's PROTOCOL, for a peer whose Hello said its own (capabilities["protocol"]);
    # left out otherwise, as ``clock``.
    protocol: int = field(default=0, metadata={"omit_empty": True})


@message
class TaskOffer:
    task_id: str
    path: int
    round: int
    module_versions: dict[str, int]
    inner_steps: int
    step_offset: int
    total_steps: int
    lease_seconds: float
    seed: int
    ticket: str = ""  # signed by the scheduler; module owners accept the task's deltas with it
    owners: dict[str, str] = field(default_factory=dict)  # module id -> owner id
    codec: str = "lossless"
    # The task's data: a shard prefix in the run folder ("shards/P3/train", or a later routing
    # phase's "shards/phase1/P3/train") and its files' sizes and SHA-256 for download.
    shard: str = ""
    shard_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The path's modules belong to more than one coordinator and the run scores every delta:
    # send the whole delta to the scheduler first (``ScoreDelta``) and its verdict with each
    # owner's ``SubmitDelta``.
    score_first: bool = field(default=False, metadata={"omit_empty": True})


def trains_from(issued: int, task_round: int, version: int) -> int | None:
    """The base a task issued against a module's version ``issued``, for round ``task_round``,
    trains from when the module is at ``version``: ``issued`` itself, or a newer version no
    later than the task's round (an ahead task, overlap, whose module reached its round before
    the peer fetched it); None when the module moved past it, and the peer gives the task up.
    The one rule the peer's fetch, the owner's fetch reply, admission and hedging apply."""
    if version == issued or issued < version <= task_round:
        return version
    return None


@message
class NoTask:
    reason: str
    retry_after: float
    finished: bool


@message
class Modules:
    versions: dict[str, int]
    hashes: dict[str, str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # module id -> the owner's signature of its release {run, module, version, hash}
    signatures: dict[str, str] = field(default_factory=dict)


@message
class HeartbeatAck:
    lease_ok: bool
    deadline_in: float


@message
class DeltaAck:
    accepted: list[str]
    closed: list[str]  # modules whose round this delta completed
    task_done: bool = True  # False: other owners hold modules of the path; send TaskDone
    # modules this delta was not for (they made all their rounds, closed the task's round
    # without its path, or hold the path's delta for that round from an earlier task of it):
    # their deltas were dropped, not applied
    dropped: list[str] = field(default_factory=list)


@message
class Scored:
    """The scorer's verdict on a path's delta, signed: what the delta's owners apply it with."""

    verdict: str


@message
class ReportAck:
    overdue: list[list[int]]  # [path, round] of tasks past the deadline: their rounds may close
    ended: dict[str, int] = field(default_factory=dict)  # task -> round of released/expired leases
    # modules the scheduler holds a checked copy of at their final version (the run gathered)
    gathered: list[str] = field(default_factory=list)


@message
class Owners:
    owners: dict[str, str]  # module id -> owner id
    addresses: dict[str, list[str]]  # owner id -> how to reach it
    keys: dict[str, str] = field(default_factory=dict)  # owner id -> its Ed25519 public key


@message
class FileChunk:
    name: str
    size: int
    sha256: str
    offset: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # {"data": uint8}


@message
class StandbyState:
    """The active scheduler's state files, each as a uint8 tensor named ``file/<name>``."""

    epoch: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@message
class ModuleState:
    modules: dict[str, Any]  # module id -> {"version", "hash", "deltas": [meta]}
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@message
class Ok:
    pass


@message
class Status:
    state: dict[str, Any]


@message
class Error:
    reason: str
    message: str


Message = Any  # any of the registered dataclasses


def to_frame(msg: Message) -> Frame:
    name = type(msg).__name__
    if REGISTRY.get(name) is not type(msg):
        raise WireError(f"{name} is not a registered message")
    cls: Any = REGISTRY[name]  # a dataclass: message() made it one
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name != "tensors"}
    for omittable in _omit_empty(cls):  # left out when empty (older decoders lack them)
        if not fields[omittable]:
            del fields[omittable]
    return Frame(name, fields, getattr(msg, "tensors", {}))


@functools.cache
def _omit_empty(cls: type) -> tuple[str, ...]:
    """A message class's fields marked ``omit_empty`` (none for most), found once per class."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("omit_empty"))


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A message class's field types and fields (resolving the annotations costs ~60 us, once
    per class rather than per decoded message)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def from_frame(frame: Frame) -> Message:
    cls = REGISTRY.get(frame.type)
    if cls is None:
        raise WireError(f"unknown message type {frame.type!r}")
    hints, declared = _schema(cls)
    unknown = set(frame.fields) - set(declared) | ({"tensors"} & set(frame.fields))
    if unknown:
        raise WireError(f"{frame.type}: unknown fields {sorted(unknown)}")
    if frame.tensors and "tensors" not in declared:
        raise WireError(f"{frame.type} carries no tensors, got {len(frame.tensors)}")
    kwargs: dict[str, Any] = {}
    for name, f in declared.items():
        if name == "tensors":
            kwargs[name] = frame.tensors
            continue
        if name not in frame.fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{frame.type}: missing field {name!r}")
            continue
        value = frame.fields[name]
        if not _conforms(value, hints[name]):
            raise WireError(f"{frame.type}.{name}: {value!r:.80} is not a {hints[name]}")
        _check_size(frame.type, name, value, f.metadata.get("max_json"))
        kwargs[name] = value
    return cls(**kwargs)


def _conforms(value: Any, tp: Any) -> bool:
    """``value`` has the annotated type. Its numbers are already finite and 64-bit, and its
    strings text of at most ``MAX_TEXT`` characters: ``decode`` checked every header value."""
    if tp is Any:
        return True
    origin, args = _parts(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        kt, vt = args
        return isinstance(value, dict) and all(
            _conforms(k, kt) and _conforms(v, vt) for k, v in value.items()
        )
    if origin is list:
        if not isinstance(value, list):
            return False
        (it,) = args
        exact = _SCALARS.get(it)
        if exact is not None:  # a list of names or numbers: its items' types collected in C
            return set(map(type, value)) <= exact
        return all(_conforms(v, it) for v in value)
    return isinstance(value, tp)


# What JSON parses a scalar of each annotated type into (a bool is no int, an int is a float).
_SCALARS: dict[Any, frozenset[type]] = {
    str: frozenset({str}),
    bool: frozenset({bool}),
    int: frozenset({int}),
    float: frozenset({int, float}),
}


@functools.cache
def _parts(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """A type annotation's origin and arguments (``typing`` computes them at every call)."""
    return typing.get_origin(tp), typing.get_args(tp)


def _check_size(kind: str, name: str, value: Any, limit: int | None) -> None:
    if limit is not None and len(json.dumps(value)) > limit:
        raise WireError(
            f"{kind}.{name} is longer than {limit} characters of JSON", reason="too-large"
        )


def encode_message(msg: Message, limits: Limits = DEFAULT_LIMITS, room: int = 0) -> bytearray:
    """The message's frame; ``room`` free bytes before it (wire.encode)."""
    return encode(to_frame(msg), limits, room)


def encode_message_gathered(
    msg: Message, limits: Limits = DEFAULT_LIMITS, room: int = 0
) -> bytearray | Pieces:
    """:func:`encode_message`, a large one as Pieces (wire.encode_gathered): for a transport."""
    return encode_gathered(to_frame(msg), limits, room)


def decode_message(
    data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, copy: bool = True
) -> Message:
    """The message in ``data``; its tensors are views of ``data`` where aligned unless ``copy``
    (for a buffer the caller owns and will not change: a request received into one)."""
    return from_frame(decode(data, limits, copy=copy))
