"""Fuzzing delta codecs: wire tensors from a peer decode to float32 deltas or a WireError.

A coordinator decodes every compressed delta against its own module's names and shapes before it
touches any state, so ``codecs.decode`` must turn every wrong dtype, shape, name, scale or code
into a WireError; and whatever it accepts must be finite float32 of the reference's shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from _fuzzing import FUZZ, assert_clean_error
from hypothesis import given
from hypothesis import strategies as st

from dipaco.errors import DipacoError, WireError
from dipaco.protocols import codecs, wire

LIKE = {"w": torch.zeros(3, 5), "b": torch.zeros(7), "s": torch.zeros(()), "big": torch.zeros(300)}
ODD_VALUES = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e38, -128, 127, 65504.0, 1e-45]


@st.composite
def wire_cases(draw: st.DrawFn) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(codec the wire was made with, codec claimed, wire tensors mutated in one way)."""
    made = draw(st.sampled_from(codecs.CODECS))
    claimed = draw(st.one_of(st.just(made), st.sampled_from([*codecs.CODECS, "zstd", ""])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    delta = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in LIKE.items()}
    tensors = dict(codecs.encode(made, delta))
    names = sorted(tensors)
    kind = draw(
        st.sampled_from(["none", "drop", "add", "rename", "dtype", "shape", "value", "swap"])
    )
    name = draw(st.sampled_from(names))
    t = tensors[name]
    if kind == "drop":
        del tensors[name]
    elif kind == "add":
        extra = ["x", "w#scale", "b#scale#scale", name + "#scale", name + "#idx", "w#idx#idx"]
        tensors[draw(st.sampled_from(extra))] = t
    elif kind == "rename":
        tensors[name + draw(st.sampled_from(["_", "#scale", "/x", "#idx"]))] = tensors.pop(name)
    elif kind == "dtype":
        tensors[name] = t.to(wire.DTYPES[draw(st.sampled_from(sorted(wire.DTYPES)))])
    elif kind == "shape":
        shape = draw(st.lists(st.integers(0, 8), max_size=3))
        tensors[name] = torch.zeros(shape, dtype=t.dtype)
    elif kind == "value" and t.numel():
        flat = t.clone().reshape(-1)
        bad = draw(st.sampled_from(ODD_VALUES))
        if t.dtype == torch.uint8:  # top-k codes and index bytes: any byte is possible
            bad = int(abs(bad)) % 256 if math.isfinite(bad) else 255
        elif not t.is_floating_point():
            bad = int(max(-128, min(127, bad))) if math.isfinite(bad) else -128
        flat[draw(st.integers(0, flat.numel() - 1))] = bad
        tensors[name] = flat.reshape(t.shape)
    elif kind == "swap" and len(names) > 1:
        other = draw(st.sampled_from(names))
        tensors[name], tensors[other] = tensors[other], tensors[name]
    return made, claimed, tensors


@FUZZ
@given(wire_cases())
def test_codec_decode_returns_finite_float32_of_the_right_shapes_or_raises(case):
    _, claimed, tensors = case
    try:
        out = codecs.decode(claimed, tensors, LIKE)
    except DipacoError as exc:
        assert isinstance(exc, WireError)
        assert_clean_error(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped codecs.decode: {exc!r}")
    assert set(out) == set(LIKE)
    for name, ref in LIKE.items():
        assert out[name].dtype == torch.float32 and out[name].shape == ref.shape
        assert bool(torch.isfinite(out[name]).all())


@FUZZ
@given(st.sampled_from(codecs.CODECS), st.integers(0, 2**16))
def test_valid_encodings_decode_within_the_documented_bounds(codec, seed):
    g = torch.Generator().manual_seed(seed)
    delta = {k: torch.randn(v.shape, generator=g) for k, v in LIKE.items()}
    # Through the wire as well: what a peer sends is what the coordinator decodes.
    frame = wire.decode(wire.encode(wire.Frame("SubmitDelta", {}, codecs.encode(codec, delta))))
    out = codecs.decode(codec, frame.tensors, LIKE)
    for name, x in delta.items():
        err = (out[name] - x).abs()
        if codec == "lossless":
            assert torch.equal(out[name], x)
        elif codec == "int8":
            assert float(err.max()) <= float(x.abs().max()) / 254 + 1e-6  # per block: its own max
        elif codec == "sign1":
            # Every sign, and per block the mean magnitude (so the decoded L1 norm is the sent).
            assert bool((torch.sign(out[name]) == torch.sign(x)).all())
            blocks = -(-x.numel() // codecs.BLOCK)
            scale = frame.tensors[name + "#scale"]
            assert float(out[name].abs().sum()) == pytest.approx(float(x.abs().sum()), rel=1e-4)
            assert scale.shape == (blocks,) and float(out[name].abs().max()) <= float(scale.max())
        elif codec.startswith("topk"):
            # Sent elements: the sign, and the magnitude within half a level of [lo, hi]; the
            # others decode to exactly 0 (the peer's error feedback keeps them).
            levels = 2 ** (codecs.get(codec).bits - 1)
            scale = frame.tensors[name + "#scale"]
            half = float((scale[:, 1] - scale[:, 0]).max()) / (2 * levels)
            sent = out[name] != 0
            assert bool((err[sent] <= half + 1e-6).all())
            assert bool((torch.sign(out[name][sent]) == torch.sign(x[sent])).all())
            chunk = min(codecs.SPARSE_CHUNK, x.numel())  # k per chunk, index pairs or bitmap
            k = math.ceil(codecs.SPARSE_DENSITY * chunk)
            assert int(sent.sum()) <= k * frame.tensors[name + "#idx"].shape[0]
        else:
            rel = 2**-11 if codec == "fp16" else 2**-8
            assert bool((err <= rel * x.abs() + 2**-24).all())


@pytest.mark.parametrize("wire_tensors", [None, [], "w", {"w": [1.0]}])
def test_wire_that_is_not_a_dict_of_tensors_is_a_wire_error(wire_tensors):
    with pytest.raises(WireError):
        codecs.decode("lossless", wire_tensors, {"w": torch.zeros(1)})
