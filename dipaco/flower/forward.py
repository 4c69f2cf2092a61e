"""The ClientApp's fast path: hand the message to the node's warm trainer.

Every Flower message starts a fresh ``flwr-clientapp`` process. Importing torch and dipaco and
building the model cost that process seconds per round. ``dipaco-peer join --flower`` therefore
keeps a trainer running in its own long-lived process (:class:`dipaco.flower.client.NodeTrainer`)
and tells the SuperNode where it is (node config ``trainer`` and ``trainer-key``). The ClientApp
then only moves bytes to it on 127.0.0.1 and back; multiprocessing's HMAC challenge, keyed with a
file in the node's state folder (mode 0600), keeps other local users out.

This module must stay light: no torch, no dipaco modules that import it.
"""

from __future__ import annotations

import json
import struct
from multiprocessing.connection import Client
from typing import Any

from dipaco.errors import WireError
from dipaco.flower import records as rec

MAGIC = b"DPF1"
MAX_HEADER = 1 << 20


def encode(op: str, meta: dict[str, Any], parts: dict[str, bytes]) -> bytes:
    """``op``, the small fields, and named byte strings (``meta:``, ``blob:``, ``file:``)."""
    simple = {k: v for k, v in meta.items() if not isinstance(v, bytes)}
    named = [(f"meta:{k}", v) for k, v in meta.items() if isinstance(v, bytes)]
    named += list(parts.items())
    header = json.dumps(
        {"op": op, "meta": simple, "parts": [[n, len(v)] for n, v in named]}
    ).encode()
    return b"".join([MAGIC, struct.pack(">I", len(header)), header, *(v for _, v in named)])


def decode(data: bytes) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """The inverse of :func:`encode`; WireError for anything malformed."""
    view = memoryview(data)
    if bytes(view[:4]) != MAGIC or len(view) < 8:
        raise WireError("not a dipaco trainer frame")
    (size,) = struct.unpack(">I", view[4:8])
    if size > MAX_HEADER or 8 + size > len(view):
        raise WireError("trainer frame header too long or cut short")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
        op, meta, layout = header["op"], header["meta"], header["parts"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise WireError(f"trainer frame header is malformed: {exc}") from None
    if not (isinstance(op, str) and isinstance(meta, dict) and isinstance(layout, list)):
        raise WireError("trainer frame header has malformed fields")
    parts, offset = {}, 8 + size
    for entry in layout:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and type(entry[1]) is int
            and 0 <= entry[1] <= len(view) - offset
        ):
            raise WireError("trainer frame part is malformed or cut short")
        name, length = entry
        value = bytes(view[offset : offset + length])
        offset += length
        if name.startswith("meta:"):
            meta[name[5:]] = value
        else:
            parts[name] = value
    if offset != len(view):
        raise WireError("trainer frame has trailing bytes")
    return op, meta, parts


def request_parts(content: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A Flower message's dipaco fields and its named byte strings, as :func:`encode` takes."""
    meta = rec.meta_of(content)
    parts = {f"blob:{k}": v for k, v in rec.blobs_of(content).items()}
    parts.update({f"file:{k}": v for k, v in rec.files_of(content).items()})
    return meta, parts


def ask(node_config: dict[str, Any], op: str, content: Any) -> Any:
    """The reply content for a message, computed by the node's warm trainer."""
    host, _, port = str(node_config["trainer"]).rpartition(":")
    with open(str(node_config["trainer-key"])) as f:
        key = bytes.fromhex(f.read().strip())
    meta, parts = request_parts(content)
    with Client((host, int(port)), authkey=key) as conn:
        conn.send_bytes(encode(op, meta, parts))
        reply = conn.recv_bytes()
    _, meta, parts = decode(reply)
    return rec.pack(meta, {k[5:]: v for k, v in parts.items() if k.startswith("blob:")})
