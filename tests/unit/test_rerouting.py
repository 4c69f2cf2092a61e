"""Test-time re-routing (DiPaCo §2.4.3): chunk routes read only earlier tokens, and each chunk's
tokens are scored by that chunk's path; with one chunk it is routing once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dipaco.model.transformer import ModelConfig, PathModel, new_dense_model
from dipaco.routing.evaluate import (
    chunk_routes,
    heldout_loss,
    rerouted_perplexity,
    routed_perplexity,
)
from dipaco.routing.features import prefix_features
from dipaco.routing.kmeans import fit_router

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=64)
SEQ, PREFIX = 32, 8


@pytest.fixture(scope="module")
def models() -> dict[str, PathModel]:
    out = {"initial": new_dense_model(CFG, 0), "a": new_dense_model(CFG, 1)}
    out["b"] = new_dense_model(CFG, 2)
    # Make path 1 clearly different from path 0 so a switch shows in the loss.
    with torch.no_grad():
        out["b"].lm_head.weight.mul_(40.0)
    for m in out.values():
        m.eval()
    return out


def load_of(models):
    return lambda p: models["a"] if p == 0 else models["b"]


@pytest.fixture(scope="module")
def docs() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = [40, 33, 60, 12, 26, 9, 45, 34, 50, 41, 38, 20, 64, 36, 44, 7]
    return [rng.integers(0, CFG.vocab_size, size=n).astype(np.int64) for n in lengths]


@pytest.fixture(scope="module")
def router(models, docs):
    rng = np.random.default_rng(1)
    train = [rng.integers(0, CFG.vocab_size, size=40) for _ in range(60)]
    r = fit_router(prefix_features(models["initial"], train, PREFIX), [2], seed=0)
    assert len(set(r.assign(prefix_features(models["initial"], docs, PREFIX)))) == 2
    return r


def sensitive_assign(features: np.ndarray) -> np.ndarray:
    """A route that changes with any change of its feature (to catch information leaks)."""
    return (np.floor(np.abs(features).sum(1) * 1e5).astype(np.int64) % 9973).astype(np.int64)


def per_token_reference(models, docs, routes, window):
    """Independent computation: every path on every document, pick each target's path."""
    nll, count, per_path = 0.0, 0, {}
    with torch.no_grad():
        for d, doc in enumerate(docs):
            w = torch.from_numpy(np.asarray(doc[: SEQ + 1], dtype=np.int64))
            logp = {
                p: F.log_softmax(load_of(models)(p)(w[None, :-1])[0].float(), -1) for p in (0, 1)
            }
            for j in range(PREFIX - 1, len(w) - 1):
                p = int(routes[d, j // window])
                nll -= float(logp[p][j, w[j + 1]])
                count += 1
                per_path[p] = per_path.get(p, 0) + 1
    return nll / count, count, per_path


@pytest.mark.parametrize("window", [SEQ, SEQ + 5])
def test_one_chunk_is_routing_once(models, docs, router, window):
    routes = chunk_routes(
        models["initial"], router.assign, docs, window=window, seq_len=SEQ, prefix_tokens=PREFIX
    )
    paths = router.assign(prefix_features(models["initial"], docs, PREFIX))
    assert routes.shape == (len(docs), 1) and routes.dtype == np.int64
    np.testing.assert_array_equal(routes[:, 0], paths)
    once = routed_perplexity(load_of(models), docs, paths, seq_len=SEQ, prefix_tokens=PREFIX)
    re = rerouted_perplexity(
        load_of(models), docs, routes, window=window, seq_len=SEQ, prefix_tokens=PREFIX
    )
    assert re["ppl"] == pytest.approx(once["ppl"], rel=1e-6)
    assert re["loss"] == pytest.approx(once["loss"], rel=1e-6)
    assert re["tokens"] == once["tokens"] > 0
    assert re["window"] == window and re["switches"] == 0
    assert set(re["per_path"]) == set(once["per_path"]) == {0, 1}
    for p in (0, 1):
        assert re["per_path"][p]["tokens"] == once["per_path"][p]["tokens"]
        assert re["per_path"][p]["docs"] == once["per_path"][p]["docs"]
        assert re["per_path"][p]["ppl"] == pytest.approx(once["per_path"][p]["ppl"], rel=1e-6)


def test_chunk_zero_is_the_prefix_route(models, docs, router):
    for prefix, window in ((PREFIX, 8), (32, 16)):
        routes = chunk_routes(
            models["initial"],
            router.assign if prefix == PREFIX else sensitive_assign,
            docs,
            window=window,
            seq_len=SEQ if prefix == PREFIX else 48,
            prefix_tokens=prefix,
        )
        expected = (router.assign if prefix == PREFIX else sensitive_assign)(
            prefix_features(models["initial"], docs, prefix)
        )
        np.testing.assert_array_equal(routes[:, 0], expected)
    assert routes.shape == (len(docs), 3)


def test_route_reads_only_the_previous_chunks(models, docs):
    window = 8
    kw = dict(window=window, seq_len=SEQ, prefix_tokens=PREFIX)
    base = chunk_routes(models["initial"], sensitive_assign, docs, **kw)
    assert base.shape == (len(docs), 4)
    rng = np.random.default_rng(5)
    d = 2  # 60 tokens long: every chunk covers targets
    for i in range(1, 4):
        changed = list(docs)
        doc = docs[d].copy()
        doc[i * window :] = (
            doc[i * window :] + rng.integers(1, CFG.vocab_size, size=doc.size - i * window)
        ) % CFG.vocab_size
        changed[d] = doc
        routes = chunk_routes(models["initial"], sensitive_assign, changed, **kw)
        # Chunks up to i read only tokens before position i * window: unchanged.
        np.testing.assert_array_equal(routes[:, : i + 1], base[:, : i + 1])
        # The next chunk reads the changed tokens, so the test can see a leak.
        if i + 1 < 4:
            assert routes[d, i + 1] != base[d, i + 1]
        # Other documents are untouched.
        others = [k for k in range(len(docs)) if k != d]
        np.testing.assert_array_equal(routes[others], base[others])
    # Changing the last input token of chunk 1 moves chunk 2's route and no earlier one.
    changed = list(docs)
    changed[d] = docs[d].copy()
    changed[d][2 * window - 1] = (changed[d][2 * window - 1] + 1) % CFG.vocab_size
    routes = chunk_routes(models["initial"], sensitive_assign, changed, **kw)
    np.testing.assert_array_equal(routes[d, :2], base[d, :2])
    assert routes[d, 2] != base[d, 2]


def test_chunk_features_are_the_mean_over_the_last_positions_of_the_previous_chunk(models, docs):
    window, seen = 8, []

    def recording(features):
        seen.append(features.copy())
        return np.zeros(len(features), dtype=np.int64)

    doc = docs[2]
    chunk_routes(models["initial"], recording, [doc], window=window, seq_len=SEQ, prefix_tokens=4)
    prefix, later = seen
    with torch.no_grad():
        _, hidden = models["initial"](torch.from_numpy(doc[:SEQ])[None], return_hidden=True)
    np.testing.assert_allclose(prefix[0], hidden[0, :4].mean(0).numpy(), rtol=1e-5, atol=1e-6)
    for i in (1, 2, 3):  # min(window, prefix_tokens) = 4 positions before i * window
        expected = hidden[0, i * window - 4 : i * window].mean(0).numpy()
        np.testing.assert_allclose(later[i - 1], expected, rtol=1e-5, atol=1e-6)


def test_short_documents_repeat_their_last_route(models, docs):
    routes = chunk_routes(
        models["initial"], sensitive_assign, docs, window=8, seq_len=SEQ, prefix_tokens=PREFIX
    )
    for d, doc in enumerate(docs):
        n_targets = min(len(doc), SEQ + 1) - 1
        covering = max(1, math.ceil(n_targets / 8))
        assert (routes[d, covering:] == routes[d, covering - 1]).all()
        if covering >= 3:  # a real, fresh route (chunk 1 reads positions 0..7, the prefix)
            assert routes[d, covering - 1] != routes[d, covering - 2]


def test_batch_size_does_not_change_routes_or_perplexity(models, docs, router):
    kw = dict(window=8, seq_len=SEQ, prefix_tokens=PREFIX)
    r32 = chunk_routes(models["initial"], router.assign, docs, **kw)
    r3 = chunk_routes(models["initial"], router.assign, docs, batch_size=3, **kw)
    np.testing.assert_array_equal(r32, r3)
    a = rerouted_perplexity(load_of(models), docs, r32, **kw)
    b = rerouted_perplexity(load_of(models), docs, r32, batch_size=3, **kw)
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and a["tokens"] == b["tokens"]


def test_switching_routes_score_each_token_with_its_chunk_path(models, docs):
    window = 8
    routes = np.array([[(d + i) % 2 for i in range(4)] for d in range(len(docs))], dtype=np.int64)
    kw = dict(window=window, seq_len=SEQ, prefix_tokens=PREFIX)
    re = rerouted_perplexity(load_of(models), docs, routes, **kw)
    loss, count, per_path = per_token_reference(models, docs, routes, window)
    assert re["loss"] == pytest.approx(loss, rel=1e-6)
    assert re["ppl"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert re["tokens"] == count
    assert {p: v["tokens"] for p, v in re["per_path"].items()} == per_path
    once = routed_perplexity(load_of(models), docs, routes[:, 0], seq_len=SEQ, prefix_tokens=PREFIX)
    assert once["tokens"] == re["tokens"]
    assert abs(once["loss"] - re["loss"]) > 1e-3
    # Switches over the chunks that cover targets: 3 for a full document, fewer for short ones.
    covering = [max(1, math.ceil((min(len(d), SEQ + 1) - 1) / window)) for d in docs]
    assert re["switches"] == pytest.approx(np.mean([c - 1 for c in covering]))


def test_one_document_by_hand(models, docs):
    # 60 tokens, seq_len 32, W 8, prefix 8: targets 7..31 scored; chunk 0 scores target 7 only.
    doc = docs[2]
    routes = np.array([[0, 1, 0, 1]])
    re = rerouted_perplexity(
        load_of(models), [doc], routes, window=8, seq_len=SEQ, prefix_tokens=PREFIX
    )
    assert re["per_path"][0]["tokens"] == 1 + 8 and re["per_path"][1]["tokens"] == 16
    assert re["switches"] == 3
    w = torch.from_numpy(doc[: SEQ + 1])
    with torch.no_grad():
        la = F.cross_entropy(models["a"](w[None, :-1])[0], w[1:], reduction="none")
        lb = F.cross_entropy(models["b"](w[None, :-1])[0], w[1:], reduction="none")
    path0 = float(la[7:16].sum() - la[8:16].sum() + la[16:24].sum())
    path1 = float(lb[8:16].sum() + lb[24:32].sum())
    assert re["per_path"][0]["loss"] == pytest.approx(path0 / 9, rel=1e-6)
    assert re["per_path"][1]["loss"] == pytest.approx(path1 / 16, rel=1e-6)
    assert re["loss"] == pytest.approx((path0 + path1) / 25, rel=1e-6)
    # A document that never uses path 1 in a scoring chunk does not load it.
    loaded = []

    def load(p):
        loaded.append(p)
        return load_of(models)(p)

    rerouted_perplexity(
        load, [doc], np.array([[1, 0, 0, 0]]), window=8, seq_len=SEQ, prefix_tokens=16
    )
    assert loaded == [0]


def test_real_router_reroutes_match_the_reference(models, docs, router):
    kw = dict(window=8, seq_len=SEQ, prefix_tokens=PREFIX)
    routes = chunk_routes(models["initial"], router.assign, docs, **kw)
    re = rerouted_perplexity(load_of(models), docs, routes, **kw)
    loss, count, _ = per_token_reference(models, docs, routes, 8)
    assert re["loss"] == pytest.approx(loss, rel=1e-6) and re["tokens"] == count


def test_routes_of_the_wrong_shape_are_refused(models, docs):
    with pytest.raises(ValueError, match="routes has shape"):
        rerouted_perplexity(
            load_of(models), docs, np.zeros((len(docs), 3), dtype=np.int64), window=8, seq_len=SEQ
        )
    with pytest.raises(ValueError, match="window"):
        chunk_routes(models["initial"], sensitive_assign, docs, window=0, seq_len=SEQ)


def test_heldout_loss_is_routed_loss_of_one_path(models, docs):
    loss, tokens = heldout_loss(models["a"], docs, seq_len=SEQ, prefix_tokens=PREFIX, batch_size=5)
    ref = routed_perplexity(
        lambda p: models["a"],
        docs,
        np.zeros(len(docs), dtype=np.int64),
        seq_len=SEQ,
        prefix_tokens=PREFIX,
    )
    assert loss == pytest.approx(ref["loss"], rel=1e-6) and tokens == ref["tokens"] > 0
    other, _ = heldout_loss(models["b"], docs, seq_len=SEQ, prefix_tokens=PREFIX)
    assert abs(other - loss) > 1e-3
    nothing, none = heldout_loss(models["a"], [docs[5]], seq_len=SEQ, prefix_tokens=32)
    assert none == 0 and math.isnan(nothing)


def test_window_features_are_what_chunk_routes_read_and_a_later_router_routes_later_chunks():
    from dipaco.routing.evaluate import window_features

    torch.manual_seed(0)
    model = PathModel(CFG)
    docs = [np.random.default_rng(i).integers(0, CFG.vocab_size, 60) for i in range(3)]
    feats, index = window_features(model, docs, seq_len=48, span=8, stride=8)
    # One window per 8 tokens of each 48-input window, the first equal to the prefix feature.
    assert feats.shape == (3 * 6, CFG.dim) and list(index) == [0, 1, 2] * 6
    np.testing.assert_allclose(feats[:3], prefix_features(model, docs, 8), rtol=1e-5, atol=1e-6)
    # Chunk 0 keeps the prefix router; later chunks take the other one.
    routes = chunk_routes(
        model,
        lambda f: np.zeros(len(f), dtype=np.int64),
        docs,
        window=16,
        seq_len=48,
        prefix_tokens=8,
        assign_later=lambda f: np.ones(len(f), dtype=np.int64),
    )
    assert routes.tolist() == [[0, 1, 1]] * 3


def test_token_features_are_the_prefix_bag_everywhere_routing_reads_a_span():
    from dipaco.routing.evaluate import window_features

    torch.manual_seed(0)
    model = PathModel(CFG)
    docs = [np.random.default_rng(i).integers(0, CFG.vocab_size, 60) for i in range(3)]
    feats = prefix_features(model, docs, 8, kind="tokens")
    # Square-rooted counts of the first 8 token ids, unit length; the model is not consulted.
    want = np.zeros((3, CFG.vocab_size))
    for i, d in enumerate(docs):
        np.add.at(want[i], d[:8], 1.0)
    want = np.sqrt(want) / np.linalg.norm(np.sqrt(want), axis=1, keepdims=True)
    np.testing.assert_allclose(feats, want, rtol=1e-6, atol=1e-7)
    shuffled = [np.concatenate([d[:8][::-1], d[8:]]) for d in docs]  # a bag ignores order
    np.testing.assert_allclose(prefix_features(model, shuffled, 8, kind="tokens"), feats)
    # The learned chunk router's windows and re-routing read the same bags of their spans.
    windows, _ = window_features(model, docs, seq_len=48, span=8, stride=8, kind="tokens")
    assert windows.shape == (3 * 6, CFG.vocab_size)
    np.testing.assert_allclose(windows[:3], feats, rtol=1e-6)
    seen = []
    routes = chunk_routes(
        model,
        lambda f: (seen.append(f), np.zeros(len(f), dtype=np.int64))[1],
        docs,
        window=16,
        seq_len=48,
        prefix_tokens=8,
        kind="tokens",
    )
    assert routes.shape == (3, 3)
    later = [np.concatenate([d[16 - 8 : 16]]) for d in docs]  # chunk 1 reads tokens 8..15
    np.testing.assert_allclose(seen[1][:3], prefix_features(model, later, 8, kind="tokens"))
