"""Wire encoding: a JSON header plus raw tensor bytes. Nothing is ever unpickled.

Frame layout (all integers little-endian)::

    b"DPCO" | u8 version | u32 header_len | header (UTF-8 JSON) | tensor bytes

The header is ``{"type": str, "fields": {...}, "tensors": [[name, dtype, shape], ...]}``; tensor
payloads follow in header order, each exactly ``prod(shape) * itemsize`` bytes. Decoding checks
every length before it reads, allows only the dtypes in :data:`DTYPES`, and enforces size limits,
so a malformed, truncated or oversized frame is a :class:`~dipaco.errors.WireError`, never a crash.
The same frames are used on disk (:func:`write_tensor_file`) with a trailing checksum (XXH3).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from dipaco.errors import CorruptFileError, WireError
from dipaco.fileio import write_atomic

# A byte string as it travels: bytes, or a view of (or a writable copy in) a larger buffer, or
# a mapping received into (received_buffer).
ByteBuffer = bytes | bytearray | memoryview | mmap.mmap
# A frame whose tensors hold at least this many bytes is sent from their own memory (Pieces).
GATHER_BYTES = 1 << 20
# A message's tensor bytes start at a multiple of this from its start (its header padded with
# spaces, as is the envelope's): a receiver's buffer keeps them aligned, so that its tensors can
# be views of it (decode(copy=False)).
MESSAGE_ALIGN = 8

MAGIC = b"DPCO"
VERSION = 1
# Every number in a header fits in 64 bits: a count, a version or a timestamp beyond it is an
# attack (it overflows a float or a tensor's size), never a value a peer means.
INT_LIMIT = 2**63 - 1
MAX_TEXT = 64 << 10  # characters of any one string in a header (a key, a name, a free field)
_PREFIX = struct.Struct("<4sBI")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}


def host_array(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s values as a flat NumPy array sharing its memory, reached with no torch
    operation; None where that cannot be (another device, bfloat16, a gradient, not contiguous).

    Every torch operation lets the interpreter's lock go and takes it back. In a process whose
    other threads run Python, taking it back waits for one of them to let it go (up to the
    switch interval, 5 ms): a coordinator serving many peers that spent a few torch operations
    per tensor of every delta spent most of its time waiting there (docs/reliability.md,
    *Load*). NumPy on these views keeps the lock for small arrays."""
    if (
        t.dtype not in _NUMPY_DTYPES
        or t.requires_grad
        or t.device.type != "cpu"
        or not t.is_contiguous()
    ):
        return None
    try:
        return t.numpy().reshape(-1)
    except RuntimeError:  # a view with its negative or conjugate bit set
        return None


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 4 << 20
    max_total_bytes: int = 4 << 30
    max_tensors: int = 100_000
    max_ndim: int = 8
    # Nesting of lists and objects in the header's fields. Without a bound, a few MiB of "[[[["
    # would exhaust the parser's recursion (a RecursionError, not a WireError), and a value
    # that only just decodes could still fail to encode again when echoed in a reply.
    max_depth: int = 64


DEFAULT_LIMITS = Limits()


@dataclass
class Frame:
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Pieces:
    """Bytes kept in the buffers they are in, written out one after another (scatter-gather):
    a message's head, then each tensor's own memory. A large delta is sent without being copied
    into one buffer first; a transport that needs one buffer makes it (:meth:`join`, the
    receiver's copy). The tensors must not change until the bytes are sent."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[ByteBuffer]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]

    def __len__(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def after(self, n: int) -> Pieces:
        """The same bytes less the first ``n`` (which lie in the first part)."""
        if n > self.parts[0].nbytes:
            raise ValueError(f"cannot drop {n} bytes of a first part of {self.parts[0].nbytes}")
        return Pieces([self.parts[0][n:], *self.parts[1:]])

    def join(self) -> bytearray:
        """The bytes in one new buffer."""
        out = bytearray(len(self))
        offset = 0
        for p in self.parts:
            out[offset : offset + p.nbytes] = p
            offset += p.nbytes
        return out


# What a transport sends: one buffer, or several in turn.
Outgoing = ByteBuffer | Pieces
# A buffer a transport received bytes into, of its own: whoever it hands it to owns it, and
# may decode tensors as views of it (decode(copy=False)). Any other buffer is the caller's.
Received = bytearray | mmap.mmap


def received_buffer(size: int) -> Received:
    """A new buffer of ``size`` bytes to receive into: from 1 MiB an anonymous mapping, whose
    pages take memory only once written (a bytearray is zeroed, every page, at once; a header
    that claims more bytes than are sent costs only what was sent)."""
    if size < GATHER_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size)


def is_received(data: object) -> bool:
    """``data`` was received into a buffer of its own (:data:`Received`)."""
    return isinstance(data, bytearray | mmap.mmap)


def joined(data: Outgoing) -> ByteBuffer:
    """``data`` as one buffer (Pieces joined into a new one, which the caller owns)."""
    return data.join() if isinstance(data, Pieces) else data


def encode(frame: Frame, limits: Limits = DEFAULT_LIMITS, room: int = 0) -> bytearray:
    """The frame's bytes, after ``room`` free bytes: where the signed envelope's header goes,
    in place (auth.ENVELOPE_ROOM), so that sealing never copies the body."""
    return _into_one(*encode_parts(frame, limits, MESSAGE_ALIGN), room)


def encode_gathered(
    frame: Frame, limits: Limits = DEFAULT_LIMITS, room: int = 0
) -> bytearray | Pieces:
    """:func:`encode`, but a frame of at least GATHER_BYTES of tensors is Pieces: its head
    (after ``room``), then views of the tensors' own memory, none of them copied."""
    head, arrays = encode_parts(frame, limits, MESSAGE_ALIGN)
    if sum(a.nbytes for a in arrays) < GATHER_BYTES:
        return _into_one(head, arrays, room)
    first = bytearray(room + len(head))
    first[room:] = head
    return Pieces([first, *arrays])


def _into_one(head: bytes, arrays: list[memoryview], room: int) -> bytearray:
    out = bytearray(room + len(head) + sum(a.nbytes for a in arrays))  # one copy, into place
    out[room : room + len(head)] = head
    offset = room + len(head)
    for a in arrays:
        out[offset : offset + a.nbytes] = a
        offset += a.nbytes
    return out


def encode_parts(
    frame: Frame, limits: Limits = DEFAULT_LIMITS, align: int = 0
) -> tuple[bytes, list[memoryview]]:
    """The frame as its prefix and header, then each tensor's bytes (views, not copies).
    ``align``: pad the header with spaces (valid JSON) so that the tensor bytes start at a
    multiple of it (FILE_ALIGN for files, MESSAGE_ALIGN for messages)."""
    specs, arrays = [], []
    for name, tensor in frame.tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise WireError(
                f"tensor {name!r} has dtype {tensor.dtype}, not one of {sorted(DTYPES)}"
            )
        specs.append([name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape)])
        host = host_array(tensor)
        if host is not None:  # no torch operation: see host_array
            arrays.append(host.view(np.uint8).data)
            continue
        t = tensor.detach().to("cpu").contiguous()
        arrays.append(t.reshape(-1).view(torch.uint8).numpy().data)
    # What the decoder would refuse is refused here too: a frame we write is one we can read.
    _check_scalars(frame.fields, f"fields of {frame.type}")
    try:
        header = json.dumps(
            {"type": frame.type, "fields": frame.fields, "tensors": specs},
            separators=(",", ":"),
            allow_nan=False,
        ).encode()
    except (TypeError, ValueError) as exc:
        raise WireError(f"fields of {frame.type} are not plain JSON values: {exc}") from None
    if len(header) > limits.max_header_bytes:
        raise WireError(
            f"header of {len(header)} bytes exceeds the limit {limits.max_header_bytes}",
            reason="too-large",
        )
    if align and (_PREFIX.size + len(header)) % align:
        header += b" " * (-(_PREFIX.size + len(header)) % align)
    total = _PREFIX.size + len(header) + sum(a.nbytes for a in arrays)
    if total > limits.max_total_bytes:
        raise WireError(
            f"message of {total} bytes exceeds the limit {limits.max_total_bytes}",
            reason="too-large",
        )
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header, arrays


def decode(data: ByteBuffer, limits: Limits = DEFAULT_LIMITS, copy: bool = True) -> Frame:
    """The frame in ``data``. Each tensor is a private copy, unless ``copy`` is False: then the
    tensors are views of ``data`` (writable, and owned by the caller: a file just read)."""
    view = memoryview(data)
    if len(view) > limits.max_total_bytes:
        raise WireError(
            f"message of {len(view)} bytes exceeds the limit {limits.max_total_bytes}",
            reason="too-large",
        )
    if len(view) < _PREFIX.size:
        raise WireError(
            f"truncated message: {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix"
        )
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"not a dipaco message (magic {bytes(magic)!r})")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this build speaks {VERSION})")
    if header_len > limits.max_header_bytes:
        raise WireError(
            f"header of {header_len} bytes exceeds the limit {limits.max_header_bytes}",
            reason="too-large",
        )
    end = _PREFIX.size + header_len
    if len(view) < end:
        raise WireError(
            f"truncated message: header needs {header_len} bytes, {len(view) - _PREFIX.size} present"
        )
    header = loads_checked(view[_PREFIX.size : end], "header")
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WireError("header must be an object with a string 'type'")
    fields, specs = header.get("fields", {}), header.get("tensors", [])
    if not isinstance(fields, dict) or not isinstance(specs, list):
        raise WireError("header 'fields' must be an object and 'tensors' a list")
    if _depth(fields, limits.max_depth + 1) > limits.max_depth:
        raise WireError(f"header fields nest deeper than the limit {limits.max_depth}")
    if len(specs) > limits.max_tensors:
        raise WireError(
            f"{len(specs)} tensors exceed the limit {limits.max_tensors}", reason="too-large"
        )
    tensors: dict[str, torch.Tensor] = {}
    offset = end
    for spec in specs:
        name, dtype, shape = _check_spec(spec, limits)
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offset + nbytes > len(view):
            raise WireError(
                f"truncated message: tensor {name!r} needs {nbytes} bytes, {len(view) - offset} remain"
            )
        itemsize = DTYPES[dtype].itemsize
        raw: bytearray | memoryview
        if copy or (_address(view) + offset) % itemsize:
            raw = bytearray(view[offset : offset + nbytes])  # a private, writable copy
        else:
            raw = view[offset : offset + nbytes]
        as_numpy = _NUMPY_DTYPES.get(DTYPES[dtype])
        if as_numpy is not None and nbytes:  # one torch call, not two: see host_array
            tensors[name] = torch.from_numpy(np.frombuffer(raw, dtype=as_numpy).reshape(shape))
        else:
            flat = (
                torch.frombuffer(raw, dtype=DTYPES[dtype])
                if nbytes
                else torch.empty(0, dtype=DTYPES[dtype])
            )
            tensors[name] = flat.reshape(shape)
        offset += nbytes
    if offset != len(view):
        raise WireError(f"{len(view) - offset} unexpected trailing bytes after the last tensor")
    return Frame(header["type"], fields, tensors)


def loads_checked(raw: bytes | memoryview, what: str = "header") -> Any:
    """JSON from outside (a frame's header, an envelope's, a record or file someone else wrote),
    parsed so that the only failure is a :class:`WireError` saying why: every number finite and
    within 64 bits, every string text, nesting within Python's recursion limit.

    Numbers are checked as the parser makes them (its hooks, called from C). Strings are walked
    one by one only where the bytes could hold a bad one: a ``\\u`` escape of a surrogate (a
    lone one decodes but is not text), or more bytes than one string may have characters."""
    raw = bytes(raw)
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite, parse_int=_int64)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise WireError(f"{what} nests lists or objects too deeply") from None
    except ValueError as exc:  # an integer beyond Python's int-string limit
        raise WireError(f"{what} holds a number out of range: {str(exc)[:80]}") from None
    except WireError as exc:
        raise WireError(f"{what} holds {exc}") from None
    if len(raw) > MAX_TEXT or _SURROGATE.search(raw):
        _check_scalars(value, what)
    return value


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError(f"{text[:20]}: numbers on the wire are finite")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if abs(value) > INT_LIMIT:
        raise WireError(f"an integer beyond 64 bits ({text[:20]}...)")
    return value


def _no_constant(name: str) -> Any:
    raise WireError(f"{name} is not a number dipaco accepts: numbers on the wire are finite")


def _check_scalars(value: Any, what: str) -> None:
    """Every number is finite and fits in 64 bits, and every string is text (a lone surrogate
    from a ``\\ud800`` escape decodes but breaks whoever writes it out later)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_text(item, what)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if abs(item) > INT_LIMIT:
                raise WireError(f"{what} holds an integer beyond 64 bits ({str(item)[:20]}...)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise WireError(f"{what} holds {item}: numbers on the wire are finite")
        elif isinstance(item, dict):
            for k, v in item.items():
                _check_text(k, what)
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


def _check_text(text: str, what: str) -> None:
    if len(text) > MAX_TEXT:
        raise WireError(
            f"{what} holds a string of {len(text)} characters (at most {MAX_TEXT})",
            reason="too-large",
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise WireError(f"{what} holds a string that is not text: {text[:40]!a}") from None


def _depth(value: Any, cap: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted up to ``cap`` without recursion.
    A container's children are looked at one by one only if one of them is a container (the
    kinds of a long list of numbers or names are collected in C)."""
    if type(value) not in _CONTAINERS:
        return 0
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        level += 1
        deepest = max(deepest, level)
        if deepest >= cap:
            return deepest
        children = item.values() if type(item) is dict else item
        if not _CONTAINERS.isdisjoint(set(map(type, children))):
            stack.extend((v, level) for v in children if type(v) in _CONTAINERS)
    return deepest


_CONTAINERS = frozenset({dict, list})  # what JSON parses objects and arrays into


def _check_spec(spec: Any, limits: Limits) -> tuple[str, str, list[int]]:
    if not (isinstance(spec, list) and len(spec) == 3):
        raise WireError(f"tensor spec {spec!r} is not [name, dtype, shape]")
    name, dtype, shape = spec
    if not isinstance(name, str):
        raise WireError(f"tensor name {name!r} is not a string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(
            f"tensor {name!r} has unknown or forbidden dtype {dtype!r}; allowed: {sorted(DTYPES)}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"tensor {name!r} has an invalid shape {str(shape)[:80]}")
    # Zero elements do not excuse the other sizes: a [0, 2**62, 2**62] tensor is zero bytes, and
    # whoever later computes its strides or its size in elements overflows. Bounding the product
    # of the non-zero sizes bounds each of them.
    if math.prod(d for d in shape if d) * DTYPES[dtype].itemsize > limits.max_total_bytes:
        raise WireError(
            f"tensor {name!r} of shape {shape} exceeds the size limit", reason="too-large"
        )
    return name, dtype, shape


# ---- crash-safe files in the same format ------------------------------------------------------


# A file is its frame, then a checksum trailer. Files never leave this machine, so the checksum
# only has to catch a torn or damaged write: XXH3-128 (xxHash, 35 GB/s on one core here, against
# 2.1 GB/s for SHA-256), followed by a marker.
FILE_MARK = b"DPXXH3\x00\x01"
MAP_BYTES = 1 << 20  # files from this size on are mapped rather than read (read_tensor_file)
FILE_ALIGN = 64  # a file's header is padded so that its tensor bytes start at this alignment
_XXH3_TRAILER = 16 + len(FILE_MARK)


def write_tensor_file(
    path: str | Path,
    frame: Frame,
    sync: bool = True,
    sync_dir: bool = True,
    in_place: bool = False,
) -> None:
    """Write ``frame`` crash-safe (temporary name, rename) with its checksum trailer, straight
    from the tensors' memory. ``sync=False`` leaves the fsync to the caller (store.py syncs an
    outer step's files in the background, before the files they replace are deleted).
    ``in_place``: written under its own new name, which nobody reads before the caller renames it (fileio.AtomicFile)."""
    head, arrays = encode_parts(frame, align=FILE_ALIGN)
    digest = xxhash.xxh3_128(head)
    for a in arrays:
        digest.update(a)
    trailer = digest.digest() + FILE_MARK
    write_atomic(path, head, *arrays, trailer, sync=sync, sync_dir=sync_dir, in_place=in_place)


def read_tensor_file(path: str | Path) -> Frame:
    """The frame in a file written by :func:`write_tensor_file`, its checksum verified; its
    tensors are views of one buffer read from the file (no other copy), aligned."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            raw = _mapped(f, size) if size >= MAP_BYTES else _aligned_read(f, size)
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: file is missing") from None
    body = raw[:-_XXH3_TRAILER]
    ok = size >= _XXH3_TRAILER and bytes(raw[-len(FILE_MARK) :]) == FILE_MARK
    if not ok or xxhash.xxh3_128(body).digest() != bytes(raw[-_XXH3_TRAILER : -len(FILE_MARK)]):
        raise CorruptFileError(f"{path}: checksum mismatch (truncated or corrupt file)")
    try:
        return decode(body, copy=False)
    except WireError as exc:
        raise CorruptFileError(f"{path}: {exc}") from None


def _mapped(f: Any, size: int) -> memoryview:
    """The whole file mapped private (copy on write): no copy of its bytes, each page mapped
    from the page cache when first read (populating a writable private mapping would copy
    every page). A file written by :func:`write_tensor_file` pads its header so that its
    tensor bytes start 64-byte aligned in the file, hence in the mapping."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=prot)
    return memoryview(mapping)


def _aligned_read(f: Any, size: int) -> memoryview:
    """The whole file in a writable buffer placed so that its tensor bytes start 64-byte
    aligned (the frame's prefix says where they start)."""
    prefix = f.read(_PREFIX.size)
    f.seek(0)
    start = size  # not a frame: no alignment to keep
    if len(prefix) == _PREFIX.size:
        start = _PREFIX.size + _PREFIX.unpack(prefix)[2]
    buffer = torch.empty(size + 64, dtype=torch.uint8)
    pad = (-(buffer.data_ptr() + start)) % 64 if start < size else 0
    view = buffer.numpy().data[pad : pad + size]
    got = 0
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return view[:got]


def _address(view: memoryview) -> int:
    """The address of a buffer's first byte (to keep zero-copy tensors aligned)."""
    if view.readonly or not view.nbytes:
        return 1  # never aligned: decode copies
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Content hash of named tensors (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{_DTYPE_NAMES.get(t.dtype, str(t.dtype))}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")  # no copy
    return h.hexdigest()
