"""Shared strategies for the fuzz tests: random bytes and mutations of valid encodings.

Random bytes alone almost never get past a decoder's first check (the magic), so most of the
examples here start from a *valid* encoding and change it a little: flip bits, cut it short,
extend it, overwrite a span, rewrite a length, or (for frames) edit the JSON header and re-pack
it with a consistent length so that the mutation reaches the validators behind the framing.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dipaco.errors import DipacoError

# Fast and hermetic: no example database in the shared working tree, no per-example deadline
# (a 2-core CI box shared with other jobs has noisy timings). DIPACO_FUZZ_EXAMPLES raises the
# examples per test for the long form (bench/fuzz.py), which draws new examples every run; the
# suite's 200 per test are the same on every run, so that it never passes by luck (a random
# draw once found an integer no float holds in coordinator.json, in one CI-like run of many).
LONG_FORM = "DIPACO_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("DIPACO_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=not LONG_FORM,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

HUGE_INTS = [2**31 - 1, 2**32, 2**63 - 1, 2**64 + 7, 10**30, 10**400, -1, -(2**63)]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(HUGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def assert_clean_error(exc: BaseException) -> None:
    """The project's own error class, with a reason slug and a message a person can read."""
    assert isinstance(exc, DipacoError), f"{type(exc).__name__} escaped: {exc!r}"
    assert str(exc).strip(), f"{type(exc).__name__} without a message"
    assert isinstance(exc.reason, str) and exc.reason


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes, focus: int | None = None) -> bytes:
    """A small byte-level change of ``data``; ``focus`` biases positions to the first bytes."""
    data = bytearray(data)
    n = len(data)
    kind = draw(
        st.sampled_from(["flip", "truncate", "extend", "overwrite", "u32", "duplicate", "delete"])
    )

    def pos() -> int:
        if n == 0:
            return 0
        hi = n - 1 if focus is None or draw(st.booleans()) else min(n - 1, focus)
        return draw(st.integers(0, hi))

    if kind == "flip" and n:
        for _ in range(draw(st.integers(1, 8))):
            data[pos()] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del data[draw(st.integers(0, max(0, n - 1))) :]
    elif kind == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "overwrite" and n:
        at = pos()
        chunk = draw(st.binary(min_size=1, max_size=16))
        data[at : at + len(chunk)] = chunk
    elif kind == "u32" and n >= 4:  # a length-like field rewritten: huge, zero, off by one
        at = min(pos(), n - 4)
        value = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 9, n, n + 1]))
        data[at : at + 4] = struct.pack("<I", value)
    elif kind == "duplicate" and n:
        at = pos()
        data[at:at] = data[at : at + draw(st.integers(1, 32))]
    elif kind == "delete" and n:
        at = pos()
        del data[at : at + draw(st.integers(1, 32))]
    else:
        data[:0] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def split_frame(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A valid frame's header (parsed) and its tensor payload bytes."""
    (header_len,) = struct.unpack_from("<I", data, 5)
    return json.loads(data[9 : 9 + header_len]), bytes(data[9 + header_len :])


def pack_frame(header: Any, payload: bytes, header_len: int | None = None) -> bytes:
    """A frame around ``header`` (any JSON value, NaN allowed) with ``payload`` after it."""
    text = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    size = len(text) if header_len is None else header_len
    return b"DPCO" + struct.pack("<BI", 1, size) + text + payload


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every container path inside a JSON value (to pick a spot to edit)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


@st.composite
def json_mutations(draw: st.DrawFn, obj: Any) -> Any:
    """``obj`` (a JSON value, copied) with one spot replaced, dropped, added to or swapped."""
    obj = json.loads(json.dumps(obj))
    spots = _paths(obj)
    spot = draw(st.sampled_from(spots))
    kind = draw(st.sampled_from(["replace", "drop", "add", "swap", "scale"]))
    if not spot:
        return draw(json_values) if kind == "replace" else obj
    parent, key = _get(obj, spot[:-1]), spot[-1]
    if kind == "replace":
        parent[key] = draw(json_values)
    elif kind == "drop":
        del parent[key]
    elif kind == "add":
        if isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_values)
        else:
            parent.insert(key, draw(json_values))
    elif kind == "swap":  # two fields exchange their values (a header field swap)
        other = draw(st.sampled_from(spots))
        if other and other[: len(spot)] != spot and spot[: len(other)] != other:
            oparent, okey = _get(obj, other[:-1]), other[-1]
            parent[key], oparent[okey] = oparent[okey], parent[key]
    else:  # numbers pushed to the edges
        value = parent[key]
        if isinstance(value, int | float) and not isinstance(value, bool):
            parent[key] = draw(
                st.sampled_from([-1, 0, math.inf, -math.inf, math.nan, 10**30, value * 2**40])
            )
    return obj


@st.composite
def frame_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """A mutation of a valid frame: its bytes, or its header re-packed (consistent or not)."""
    header, payload = split_frame(data)
    header_len = len(data) - len(payload) - 9
    choice = draw(st.sampled_from(["bytes", "header", "header", "header-len", "random"]))
    if choice == "bytes":
        return draw(byte_mutations(data, focus=9 + header_len))
    if choice == "random":
        return draw(st.binary(max_size=256))
    new = draw(json_mutations(header))
    if choice == "header":
        return pack_frame(new, payload)
    wrong = draw(st.sampled_from([0, 1, header_len - 1, header_len + 1, 2**31, 2**32 - 1]))
    return pack_frame(new, payload, header_len=max(0, wrong))
