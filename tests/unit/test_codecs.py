import hashlib
import math

import pytest
import torch

from dipaco.errors import WireError
from dipaco.protocols import codecs
from dipaco.protocols import wire as w
from dipaco.protocols.codecs import (
    BLOCK,
    CODECS,
    Codec,
    decode,
    encode,
    wire_bytes,
)
from dipaco.protocols.feedback import ErrorFeedback


def sample_delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    zero_block = torch.randn(3 * BLOCK, generator=g)
    zero_block[BLOCK : 2 * BLOCK] = 0.0  # one all-zero block in the middle
    outliers = torch.randn(1000, generator=g) * 1e-3
    outliers[[3, 500, 999]] = torch.tensor([1e3, -5e2, 2e3])
    return {
        "vec": torch.randn(17, generator=g),  # 1-D, smaller than a block
        "odd": torch.randn(7, 45, generator=g),  # 315 elements: not a multiple of BLOCK
        "mat": torch.randn(33, 64, generator=g) * 0.01,
        "cube": torch.randn(3, 5, 11, generator=g) * 100,
        "zero_block": zero_block,
        "outliers": outliers,
        "all_zero": torch.zeros(300),
        "scalar": torch.tensor(0.123),
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_shapes_dtypes_and_names(codec):
    delta = sample_delta()
    wire = encode(codec, delta)
    for t in wire.values():
        assert t.device.type == "cpu" and t.is_contiguous()
        assert t.dtype in w._DTYPE_NAMES  # every wire dtype is on the wire allowlist
    companions = {
        "int8": ["#scale"],
        "sign1": ["#scale"],
        "topk2": ["#idx", "#scale"],
        "topk4": ["#idx", "#scale"],
    }
    expected = set(delta) | {n + c for n in delta for c in companions.get(codec, [])}
    assert set(wire) == expected
    out = decode(codec, wire, delta)
    assert set(out) == set(delta)
    for name, x in delta.items():
        assert out[name].dtype == torch.float32 and out[name].shape == x.shape, name


def test_lossless_is_exact_and_sends_the_tensors_themselves():
    delta = sample_delta()
    wire = encode("lossless", delta)
    for name, x in delta.items():
        assert wire[name].data_ptr() == x.data_ptr()  # already contiguous cpu float32: no copy
    out = decode("lossless", wire, delta)
    for name, x in delta.items():
        assert torch.equal(out[name], x), name


@pytest.mark.parametrize("codec,bound", [("fp16", 2**-11), ("bf16", 2**-8)])
def test_half_precision_relative_error(codec, bound):
    g = torch.Generator().manual_seed(1)
    # normal-range magnitudes spanning many binades, both signs, odd shape
    mag = torch.exp(torch.empty(4099).uniform_(math.log(1e-4), math.log(6e4), generator=g))
    sign = torch.where(torch.rand(4099, generator=g) < 0.5, -1.0, 1.0)
    delta = {"x": (mag * sign).reshape(-1), "y": torch.randn(13, 7, generator=g)}
    out = decode(codec, encode(codec, delta), delta)
    for name, x in delta.items():
        rel = ((out[name] - x).abs() / x.abs()).max().item()
        assert rel <= bound, (name, rel)
        assert rel > 0  # it really is lossy


def test_fp16_refuses_values_it_cannot_carry():
    with pytest.raises(ValueError, match="fp16"):
        encode("fp16", {"x": torch.tensor([1.0, 1e5])})
    out = decode("bf16", encode("bf16", {"x": torch.tensor([1e30])}), {"x": torch.zeros(1)})
    assert abs(out["x"].item() / 1e30 - 1) <= 2**-8


@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_input_is_refused(codec):
    with pytest.raises(ValueError, match="'x'"):
        encode(codec, {"x": torch.tensor([1.0, float("nan"), 2.0])})


def blockmax(x: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of its int8 block."""
    flat = x.reshape(-1)
    nb = -(-flat.numel() // BLOCK)
    padded = torch.cat([flat.abs(), flat.new_zeros(nb * BLOCK - flat.numel())])
    return padded.view(nb, BLOCK).amax(1).repeat_interleave(BLOCK)[: flat.numel()].view(x.shape)


def test_int8_error_is_at_most_half_a_step_of_its_block():
    delta = sample_delta()
    delta["big"] = torch.randn(100_003, generator=torch.Generator().manual_seed(2))
    wire = encode("int8", delta)
    out = decode("int8", wire, delta)
    for name, x in delta.items():
        nb = -(-x.numel() // BLOCK)
        assert wire[name].shape == (nb, BLOCK) and wire[name].dtype == torch.int8
        scale = wire[f"{name}#scale"]
        assert scale.shape == (nb,) and scale.dtype == torch.float32
        bm = blockmax(x)
        err = (out[name] - x).abs()
        assert bool((err <= bm / 254 * (1 + 1e-5) + 1e-30).all()), (name, err.max().item())
    # the all-zero block has scale 0 and decodes to exact zeros; so does an all-zero tensor
    assert wire["zero_block#scale"][1].item() == 0.0
    assert bool((out["zero_block"][BLOCK : 2 * BLOCK] == 0).all())
    assert bool((out["all_zero"] == 0).all()) and bool((wire["all_zero#scale"] == 0).all())
    # small values in blocks without outliers keep their precision
    o = delta["outliers"]
    assert (out["outliers"][512:768] - o[512:768]).abs().max() <= o[512:768].abs().max() / 254
    # the extremes of each block are exact up to rounding
    assert out["outliers"][999].item() == pytest.approx(2e3, rel=1e-6)


def test_int8_matches_the_documented_formula():
    x = torch.tensor([0.5, -1.0, 0.25, 0.0, 0.1])
    wire = encode("int8", {"x": x})
    assert wire["x#scale"].tolist() == [1.0]
    q = wire["x"][0, :5].tolist()
    assert q == [round(v * 127) for v in x.tolist()]
    assert bool((wire["x"][0, 5:] == 0).all())  # zero padding


def test_sign1_sends_every_sign_and_each_blocks_mean_magnitude():
    delta = sample_delta()
    wire = encode("sign1", delta)
    out = decode("sign1", wire, delta)
    for name, x in delta.items():
        nb = -(-x.numel() // BLOCK)
        assert wire[name].shape == (nb, BLOCK // 8) and wire[name].dtype == torch.uint8
        flat, got = x.reshape(-1), out[name].reshape(-1)
        assert bool((torch.sign(got[flat != 0]) == torch.sign(flat[flat != 0])).all()), name
        # one magnitude per block: the block's mean |x| over its own elements (the short last
        # block's padding is left out), so the decoded L1 norm is the sent one
        for b in range(nb):
            part = slice(b * BLOCK, (b + 1) * BLOCK)
            assert bool((got[part].abs() == got[part][:1].abs()).all()), (name, b)
            assert got[part].abs().sum().item() == pytest.approx(
                flat[part].abs().sum().item(), rel=1e-5, abs=1e-30
            ), (name, b)
    assert bool((out["all_zero"] == 0).all())  # scale 0: zeros, whatever the sign bits
    x = torch.tensor([0.5, -1.0, 0.0, 2.5])
    w1 = encode("sign1", {"x": x})
    assert w1["x#scale"].tolist() == [1.0]  # (0.5 + 1 + 0 + 2.5) / 4, not over 256
    assert w1["x"][0, 0].item() == 0b0010 and bool((w1["x"][0, 1:] == 0).all())
    assert decode("sign1", w1, {"x": x})["x"].tolist() == [1.0, -1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "name,bad,why",
    [
        ("w", torch.zeros(2, BLOCK // 8, dtype=torch.int8), "must be uint8"),
        ("w", torch.zeros(2, BLOCK // 4, dtype=torch.uint8), "must be uint8"),
        ("w", torch.zeros(3, BLOCK // 8, dtype=torch.uint8), "must be uint8"),
        ("w#scale", torch.zeros(2, dtype=torch.float64), "dtype torch.float64, expected"),
        ("w#scale", torch.zeros(3), r"shape \[3\], expected \[2\]"),
        ("w#scale", torch.tensor([1.0, float("nan")]), "non-finite"),
        ("w#scale", torch.tensor([1.0, float("inf")]), "non-finite"),
        ("w#scale", torch.tensor([1.0, -0.5]), "negative"),
    ],
)
def test_sign1_decode_refuses_what_it_cannot_have_sent(name, bad, why):
    like, wire = good("sign1")
    wire[name] = bad
    with pytest.raises(WireError, match=why):
        decode("sign1", wire, like)


def test_wire_sizes():
    x = {"w": torch.randn(1 << 20)}
    full = wire_bytes(encode("lossless", x))
    assert full == 4 << 20
    assert wire_bytes(encode("fp16", x)) == full // 2
    assert wire_bytes(encode("bf16", x)) == full // 2
    ratio = wire_bytes(encode("int8", x)) / full
    assert 0.25 < ratio < 0.27, ratio
    ratio = wire_bytes(encode("sign1", x)) / full  # 1 bit and 4 / 256 bytes an element
    assert 0.035 < ratio < 0.036, ratio


@pytest.mark.parametrize("codec", CODECS)
def test_wire_tensors_survive_a_dipaco_frame(codec):
    delta = sample_delta()
    sent = encode(codec, delta)
    received = w.decode(w.encode(w.Frame("Delta", {"codec": codec}, sent))).tensors
    a, b = decode(codec, sent, delta), decode(codec, received, delta)
    for name in delta:
        assert torch.equal(a[name], b[name]), name


# ---- error feedback ---------------------------------------------------------------------------


def run_stream(steps: int, use_ef: bool, codec: str = "int8"):
    g = torch.Generator().manual_seed(3)
    like = {"a": torch.zeros(1000), "b": torch.zeros(33, 17)}
    ef = ErrorFeedback()
    true_sum = {n: torch.zeros_like(t) for n, t in like.items()}
    sent_sum = {n: torch.zeros_like(t) for n, t in like.items()}
    for _ in range(steps):
        delta = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in like.items()}
        wire = ef.compress(codec, "P3", delta) if use_ef else encode(codec, delta)
        got = decode(codec, wire, like)
        for n in like:
            true_sum[n] += delta[n]
            sent_sum[n] += got[n]
    err = math.sqrt(sum(((sent_sum[n] - true_sum[n]) ** 2).sum().item() for n in like))
    return err, ef, true_sum, sent_sum


def test_error_feedback_keeps_the_accumulated_error_bounded():
    steps = 50
    err_ef, ef, true_sum, sent_sum = run_stream(steps, use_ef=True)
    err_plain, *_ = run_stream(steps, use_ef=False)
    err_one, *_ = run_stream(1, use_ef=False)
    # the accumulated error is exactly the final residual ...
    state = ef.state_tensors()
    assert set(state) == {"P3|a", "P3|b"}
    for n in ("a", "b"):
        torch.testing.assert_close(true_sum[n] - sent_sum[n], state[f"P3|{n}"], rtol=0, atol=1e-5)
    # ... which stays at about one step's quantisation error, while without feedback it grows
    # roughly like sqrt(steps)
    assert err_ef < 2 * err_one
    assert err_plain > 0.5 * math.sqrt(steps) * err_one
    assert err_ef < err_plain / 3


def test_error_feedback_lossless_stores_nothing_and_flushes_residuals():
    ef = ErrorFeedback()
    delta = {"a": torch.randn(300)}
    assert torch.equal(ef.compress("lossless", "P1", delta)["a"], delta["a"])
    assert ef.state_tensors() == {}
    ef.compress("int8", "P1", delta)
    residual = ef.state_tensors()["P1|a"]
    assert residual.abs().max() > 0
    sent = ef.compress("lossless", "P1", delta)
    assert torch.equal(sent["a"], delta["a"] + residual)
    assert ef.state_tensors() == {}


def test_error_feedback_streams_are_independent_and_resettable():
    ef = ErrorFeedback()
    delta = {"a": torch.randn(300)}
    ef.compress("int8", "P1", delta)
    ef.compress("bf16", "P2", delta)
    assert set(ef.state_tensors()) == {"P1|a", "P2|a"}
    ef.reset("P1")
    assert set(ef.state_tensors()) == {"P2|a"}
    # after a reset the stream starts fresh: same output as a brand-new ErrorFeedback
    assert torch.equal(ef.compress("int8", "P1", delta)["a"], encode("int8", delta)["a"])
    with pytest.raises(ValueError, match="shape"):
        ef.compress("int8", "P1", {"a": torch.randn(301)})
    with pytest.raises(ValueError):
        ef.compress("int8", "bad|key", delta)


def test_error_feedback_state_round_trip_gives_identical_outputs(tmp_path):
    g = torch.Generator().manual_seed(4)
    steps = [{"a": torch.randn(700, generator=g), "b": torch.randn(5, 9, generator=g)}]
    steps += [{k: torch.randn(v.shape, generator=g) for k, v in steps[0].items()} for _ in range(5)]
    ef = ErrorFeedback()
    for delta in steps[:3]:
        ef.compress("int8", "P3", delta)
        ef.compress("fp16", "P7", delta)
    path = tmp_path / "ef.dpco"
    w.write_tensor_file(path, w.Frame("ErrorFeedback", {}, ef.state_tensors()))
    restored = ErrorFeedback()
    restored.load_state_tensors(w.read_tensor_file(path).tensors)
    for delta in steps[3:]:
        for codec, key in (("int8", "P3"), ("fp16", "P7")):
            a, b = ef.compress(codec, key, delta), restored.compress(codec, key, delta)
            assert set(a) == set(b)
            for n in a:
                assert torch.equal(a[n], b[n]), (key, n)
    with pytest.raises(ValueError):
        restored.load_state_tensors({"no-separator": torch.zeros(3)})


# ---- decode never trusts the wire -------------------------------------------------------------


def good(codec: str = "int8"):
    like = {"w": torch.zeros(10, 30), "b": torch.zeros(7)}
    g = torch.Generator().manual_seed(5)
    return like, encode(codec, {n: torch.randn(t.shape, generator=g) for n, t in like.items()})


@pytest.mark.parametrize("codec", CODECS)
def test_decode_rejects_wrong_names(codec):
    like, wire = good(codec)
    missing = dict(wire)
    del missing["w"]
    with pytest.raises(WireError, match="missing.*'w'"):
        decode(codec, missing, like)
    extra = dict(wire, intruder=torch.zeros(3))
    with pytest.raises(WireError, match="unexpected.*'intruder'"):
        decode(codec, extra, like)


def test_decode_rejects_missing_scale():
    like, wire = good()
    del wire["b#scale"]
    with pytest.raises(WireError, match="b#scale"):
        decode("int8", wire, like)


@pytest.mark.parametrize(
    "codec,name,bad",
    [
        ("lossless", "w", torch.zeros(10, 30, dtype=torch.float16)),
        ("fp16", "w", torch.zeros(10, 30, dtype=torch.bfloat16)),
        ("bf16", "w", torch.zeros(10, 30)),
        ("int8", "w", torch.zeros(2, BLOCK, dtype=torch.uint8)),
        ("int8", "w#scale", torch.zeros(2, dtype=torch.float16)),
    ],
)
def test_decode_rejects_wrong_dtype(codec, name, bad):
    like, wire = good(codec)
    wire[name] = bad
    with pytest.raises(WireError, match=f"'{name}'.*dtype"):
        decode(codec, wire, like)


@pytest.mark.parametrize(
    "codec,name,bad",
    [
        ("lossless", "w", torch.zeros(30, 10)),
        ("fp16", "b", torch.zeros(8, dtype=torch.float16)),
        ("bf16", "w", torch.zeros(300, dtype=torch.bfloat16)),
        ("int8", "w", torch.zeros(3, BLOCK, dtype=torch.int8)),  # wrong nblocks
        ("int8", "w", torch.zeros(2, 128, dtype=torch.int8)),  # wrong block size
        ("int8", "w", torch.zeros(2 * BLOCK, dtype=torch.int8)),  # flat
        ("int8", "w#scale", torch.zeros(3)),
        ("int8", "w#scale", torch.zeros(2, 1)),
    ],
)
def test_decode_rejects_wrong_shape(codec, name, bad):
    like, wire = good(codec)
    wire[name] = bad
    with pytest.raises(WireError, match=f"'{name}'.*shape"):
        decode(codec, wire, like)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_decode_rejects_bad_scales(value):
    like, wire = good()
    scale = wire["w#scale"].clone()
    scale[1] = value
    wire["w#scale"] = scale
    with pytest.raises(WireError, match="'w#scale'"):
        decode("int8", wire, like)


def test_decode_rejects_out_of_range_code_and_non_finite_values():
    like, wire = good()
    q = wire["b"].clone()
    q[0, 0] = -128
    wire["b"] = q
    with pytest.raises(WireError, match="'b'"):
        decode("int8", wire, like)
    for codec in ("lossless", "fp16", "bf16"):
        like, wire = good(codec)
        t = wire["w"].clone()
        t[3, 4] = float("nan")
        wire["w"] = t
        with pytest.raises(WireError, match="'w'.*non-finite"):
            decode(codec, wire, like)


def test_decode_rejects_unknown_codec():
    like, wire = good()
    with pytest.raises(WireError, match="unknown codec"):
        decode("zstd", wire, like)
    with pytest.raises(ValueError, match="unknown codec"):
        encode("zstd", {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown codec"):
        ErrorFeedback().compress("zstd", "P1", {"w": torch.zeros(3)})


def test_int8_encode_decode_is_vectorised():
    import time

    x = {"w": torch.randn(4_000_000)}
    start = time.perf_counter()
    decode("int8", encode("int8", x), x)
    assert time.perf_counter() - start < 2.0


# ---- pinned wire bytes ------------------------------------------------------------------------


def fixed_delta() -> dict[str, torch.Tensor]:
    """A small delta built from exact integer arithmetic, so it is the same on every machine."""
    i = torch.arange(600, dtype=torch.int64)
    mat = (((i * 7919) % 1000) - 500).to(torch.float32).reshape(20, 30) / 37.0
    vec = torch.zeros(300, dtype=torch.float32)  # two int8 blocks, the second all zero
    vec[:40] = (torch.arange(40, dtype=torch.float32) - 20.0) / 3.0
    return {"mat": mat, "vec": vec, "scalar": torch.tensor(0.1, dtype=torch.float32)}


def wire_digest(wire: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every wire tensor's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(wire):
        t = wire[name]
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Computed with the codecs as they were before they became classes: the bytes on the wire must
# never change, or peers and coordinators of different versions would misread each other. (The
# top-k pins changed once, on purpose, while top-k was still marked as not for runs: positions
# as a bitmap where that is smaller, and the default density 1/8.)
PINNED = {
    "lossless": "cf2c3b8d03905e1525173b967c951cbf8714a89969fdf3e2478a2e4f1a9958f6",
    "fp16": "2446f608987fececbdfa84fc1398d5fb4e9683407ef69ebe8ff4aede03a8b02a",
    "bf16": "a64906012d3aec8a5e08bf85e061f29517f2f2525a245a1815cbde78ec46740d",
    "int8": "d112dc71eb89bbfea8fdd8029c214557ddc8b23f428b82463b84f094512427bc",
    "sign1": "dc41a3db57e2a3047d03c85bc401d096fafb212d770c12f48f0999af7b1cc1d6",
    "topk2": "7ad716d540fe1c308b9968c47c19362e5e10534959abb896a5ecfcea9d1b3e4e",
    "topk4": "73df6d078fe2fb052108d9322ce386997aced983938a0556b5c88e528b0f1f59",
}


def test_every_builtin_codec_is_pinned():
    assert tuple(PINNED) == CODECS == codecs.names()


@pytest.mark.parametrize("codec", sorted(PINNED))
def test_encoded_bytes_are_pinned(codec):
    assert wire_digest(encode(codec, fixed_delta())) == PINNED[codec]


# ---- the registry -----------------------------------------------------------------------------


def test_builtin_codecs_are_classes_in_the_registry():
    kinds = {
        "lossless": codecs.Lossless,
        "fp16": codecs.Fp16,
        "bf16": codecs.Bf16,
        "int8": codecs.Int8Blockwise,
        "sign1": codecs.Sign1,
        "topk2": codecs.TopK2,
        "topk4": codecs.TopK4,
    }
    for name, cls in kinds.items():
        c = codecs.get(name)
        assert type(c) is cls and c.name == name
        assert c.lossless == (name == "lossless")


def test_unknown_names_and_bad_registrations_are_refused():
    with pytest.raises(ValueError, match=r"unknown codec 'zstd'; expected one of \('lossless'"):
        codecs.get("zstd")
    with pytest.raises(ValueError, match="already registered"):
        codecs.register(codecs.Fp16)
    with pytest.raises(TypeError, match="not a subclass of Codec"):
        codecs.register(dict)  # type: ignore[arg-type]


class Negated(Codec):
    """A toy codec: sends -x as float32 and negates it back (exact)."""

    name = "toy-negated"
    lossless = True

    def encode_tensor(self, name, x):
        return {name: x.neg()}

    def decode_tensor(self, name, wire, shape):
        t = wire[name]
        if t.dtype != torch.float32 or t.shape != shape:
            raise WireError(f"tensor {name!r} is not float32 of shape {list(shape)}")
        return t.neg()


@pytest.fixture
def toy_codec():
    codecs.register(Negated)
    try:
        yield Negated.name
    finally:
        codecs.unregister(Negated.name)


def test_a_new_codec_is_one_class_and_one_register_call(toy_codec):
    assert toy_codec in codecs.CODECS  # the module attribute follows the registry
    delta = sample_delta()
    sent = encode(toy_codec, delta)
    for name, x in delta.items():
        assert torch.equal(sent[name], -x), name
    received = w.decode(w.encode(w.Frame("Delta", {"codec": toy_codec}, sent))).tensors
    out = decode(toy_codec, received, delta)
    for name, x in delta.items():
        assert torch.equal(out[name], x), name
    # The shared checks apply to it too.
    with pytest.raises(WireError, match="wrong tensor names"):
        decode(toy_codec, {}, delta)
    ef = ErrorFeedback()
    ef.compress(toy_codec, "P1", delta)
    assert ef.state_tensors() == {}  # lossless: no residual kept


def test_unregistered_codec_is_unknown_again(toy_codec):
    codecs.unregister(toy_codec)
    try:
        with pytest.raises(WireError, match="unknown codec"):
            decode(toy_codec, {}, {})
        assert toy_codec not in codecs.CODECS
    finally:
        codecs.register(Negated)  # the fixture unregisters it


# ---- sparse: chunked top-k with 2- or 4-bit values --------------------------------------------


@pytest.mark.parametrize("codec", ["topk2", "topk4"])
def test_topk_sends_the_largest_elements_of_each_chunk_within_half_a_level(codec):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3 * codecs.SPARSE_CHUNK + 100, generator=g)  # 4 chunks, the last one short
    wire = encode(codec, {"x": x}, density=1 / 64)  # positions as byte pairs
    k = wire["x#idx"].shape[1] // 2
    assert k == 64
    assert wire["x"].shape == (4, k * codecs.get(codec).bits // 8)
    y = decode(codec, wire, {"x": x})["x"]
    sent = y != 0
    assert int(sent.sum()) == 4 * k
    # Each chunk's sent elements are its k largest in magnitude.
    for c in range(4):
        part = slice(c * codecs.SPARSE_CHUNK, (c + 1) * codecs.SPARSE_CHUNK)
        chunk_x, chunk_sent = x[part], sent[part]
        assert float(chunk_x[~chunk_sent].abs().max()) <= float(chunk_x[chunk_sent].abs().min())
    levels = 2 ** (codecs.get(codec).bits - 1)
    span = wire["x#scale"][:, 1] - wire["x#scale"][:, 0]
    assert float((y - x)[sent].abs().max()) <= float(span.max()) / (2 * levels) + 1e-6
    assert bool((torch.sign(y[sent]) == torch.sign(x[sent])).all())
    # Per chunk: 2 bytes an index, bits/8 bytes a value, 8 bytes of scales. 2-bit at density
    # 1/64: 2.25 bytes a sent element, 0.9% of float32 for whole chunks.
    bits = codecs.get(codec).bits
    assert codecs.wire_bytes(wire) == 4 * (2 * k + k * bits // 8 + 8)


def test_topk_with_error_feedback_sends_everything_eventually():
    """What top-k leaves out waits in the residual: the decoded sum tracks the true sum."""
    g = torch.Generator().manual_seed(9)
    ef = ErrorFeedback()
    true_sum, sent_sum = torch.zeros(5000), torch.zeros(5000)
    for _ in range(100):
        d = torch.randn(5000, generator=g)
        true_sum += d
        sent_sum += decode("topk2", ef.compress("topk2", "P0", {"d": d}), {"d": d})["d"]
    residual = ef.state_tensors()["P0|d"]
    torch.testing.assert_close(sent_sum + residual, true_sum, atol=1e-3, rtol=0)
    assert float(residual.norm()) < 0.5 * float(true_sum.norm())  # bounded, not growing


def topk_wire():
    x = torch.randn(2 * codecs.SPARSE_CHUNK, generator=torch.Generator().manual_seed(1))
    return x, dict(encode("topk2", {"x": x}, density=1 / 64))  # positions as byte pairs


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda w: w["x#idx"].__setitem__((0, 1), 0x20), "index past its chunk"),
        (lambda w: w["x#idx"][0, 2:4].copy_(w["x#idx"][0, 0:2]), "repeats an index"),
        (lambda w: w["x#scale"].__setitem__((1, 0), float("nan")), "non-finite scales"),
        (lambda w: w["x#scale"].__setitem__((1, 0), 5.0), "0 <= lo <= hi"),
        (lambda w: w["x#scale"].__setitem__((0, 0), -1.0), "0 <= lo <= hi"),
        (lambda w: w.__setitem__("x#idx", w["x#idx"][:, :-1]), "not 2k"),
        (lambda w: w.__setitem__("x#idx", w["x#idx"].to(torch.int32)), "must be uint8"),
        (lambda w: w.__setitem__("x", w["x"][:, :-1]), "must be uint8"),
        (lambda w: w.__setitem__("x#scale", w["x#scale"][:1]), r"float32 \[2, 2\]"),
    ],
)
def test_topk_decoder_refuses_what_an_encoder_never_sends(corrupt, message):
    x, wire = topk_wire()
    corrupt(wire)
    with pytest.raises(WireError, match=message):
        decode("topk2", wire, {"x": x})


def test_topk_density_is_the_senders_choice_within_a_chunk():
    """The decoder reads k from the wire: a peer may send more or fewer per chunk, never more
    than the chunk holds."""
    x, _ = topk_wire()
    dense = codecs.TopK2()
    dense.density = 1.0  # every element: exact magnitudes only where lo == hi, but all sent
    wire = dense.encode_tensor("x", x)
    assert wire["x#idx"].shape[1] == codecs.SPARSE_CHUNK // 8  # a bitmap, not 4096 byte pairs
    y = decode("topk2", wire, {"x": x})["x"]
    assert bool((y != 0).all())
    too_many = dict(wire)
    too_many["x#idx"] = torch.zeros(2, 2 * (codecs.SPARSE_CHUNK + 1), dtype=torch.uint8)
    with pytest.raises(WireError, match="not 2k"):
        decode("topk2", too_many, {"x": x})


@pytest.mark.parametrize("density", [1 / 16, 0.25])
def test_dense_topk_sends_positions_as_a_bitmap_when_it_is_smaller(density):
    """From 1/16 of a chunk on, k byte pairs take as much as a bit per element: the positions
    go as a bitmap, and the bytes per element fall to 1/8 plus the values'."""
    x, _ = topk_wire()
    codec = codecs.TopK2()
    codec.density = density
    wire = codec.encode_tensor("x", x)
    k = math.ceil(density * codecs.SPARSE_CHUNK)
    assert wire["x#idx"].shape == (2, codecs.SPARSE_CHUNK // 8)
    assert codecs.wire_bytes(wire) == 2 * (codecs.SPARSE_CHUNK // 8 + k * 2 // 8 + 8)
    y = decode("topk2", wire, {"x": x})["x"]
    sent = y != 0
    assert int(sent.sum()) == 2 * k
    for c in range(2):  # still each chunk's k largest
        part = slice(c * codecs.SPARSE_CHUNK, (c + 1) * codecs.SPARSE_CHUNK)
        assert float(x[part][~sent[part]].abs().max()) <= float(x[part][sent[part]].abs().min())
    assert torch.equal(y, codec.decode_own("x", wire, x.shape))


def bitmap_wire(density: float = 0.25):
    x, _ = topk_wire()
    return x, dict(encode("topk2", {"x": x}, density=density))


def flip_bit(wire, row, position):
    wire["x#idx"][row, position // 8] ^= 1 << (position % 8)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda w: flip_bit(w, 1, int(w["x#idx"][1].argmin()) * 8), "same number"),
        (lambda w: w["x#idx"].zero_(), "at least 1"),
        (lambda w: w["x#idx"].__setitem__(..., 255), "must be uint8"),  # k = chunk: values too few
    ],
)
def test_topk_decoder_refuses_a_bitmap_an_encoder_never_sends(corrupt, message):
    x, wire = bitmap_wire()
    corrupt(wire)
    with pytest.raises(WireError, match=message):
        decode("topk2", wire, {"x": x})


def test_topk_decoder_refuses_a_bitmap_bit_past_a_short_chunk():
    x = torch.randn(12, generator=torch.Generator().manual_seed(3))  # one chunk of 12: 2 bytes
    wire = dict(encode("topk2", {"x": x}))
    assert wire["x#idx"].shape == (1, 2)  # k = 1: one byte pair would be as large
    wire["x#idx"][0, 1] |= 0x80  # position 15
    with pytest.raises(WireError, match="past its chunk"):
        decode("topk2", wire, {"x": x})
