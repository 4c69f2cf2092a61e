"""Discriminative routing: likelihood scoring, labels, the logistic router with bias correction,
router scores and top-n paths, and overlapping shards."""

from __future__ import annotations

import gc
import hashlib
import json
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dipaco.data.shards import TokenShard
from dipaco.errors import ConfigError, CorruptFileError, DataError
from dipaco.model.transformer import ModelConfig, PathModel, new_dense_model
from dipaco.routing.discriminative import (
    LogisticRouter,
    best_paths,
    fit_logistic_router,
    score_documents,
)
from dipaco.routing.kmeans import KMeansRouter, fit_router
from dipaco.routing.routers import load_router
from dipaco.routing.sharding import is_heldout, write_path_shards

CFG = ModelConfig(vocab_size=12, dim=16, n_layers=1, n_heads=2, max_seq_len=64)
GROUPS = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)]  # path g is trained on group g
PREFIX, SEQ_LEN = 6, 40


def group_docs(group: int, count: int, seed: int) -> list[np.ndarray]:
    """Documents of random tokens from one token group, of varied lengths (some > SEQ_LEN+1)."""
    rng = np.random.default_rng(seed)
    return [rng.choice(GROUPS[group], size=int(rng.integers(12, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def path_states() -> list[dict[str, torch.Tensor]]:
    """Three tiny paths, path g trained briefly on documents made of token group g."""
    states = []
    for g in range(3):
        torch.manual_seed(g)
        model = new_dense_model(CFG, seed=g)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        rng = np.random.default_rng(100 + g)
        for _ in range(40):
            batch = torch.from_numpy(rng.choice(GROUPS[g], size=(8, 25)))
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def loader(states, loaded: list[int] | None = None, alive: list | None = None):
    def load_path(p: int) -> PathModel:
        if alive is not None:
            gc.collect()
            # Streaming: every path handed out before must be gone by the time the next loads.
            assert all(ref() is None for ref in alive), "a previous path is still in memory"
        model = PathModel(CFG)
        model.load_state_dict(states[p])
        if loaded is not None:
            loaded.append(p)
        if alive is not None:
            alive.append(weakref.ref(model))
        return model

    return load_path


def reference_score(state: dict[str, torch.Tensor], doc: np.ndarray) -> float:
    """Independent per-document sum of log p(token) over the first SEQ_LEN+1 tokens, prefix
    excluded, computed in float64 from one unbatched forward pass."""
    model = PathModel(CFG)
    model.load_state_dict(state)
    model.eval()
    window = torch.from_numpy(np.asarray(doc[: SEQ_LEN + 1], dtype=np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(window[:, :-1]).double(), dim=-1)[0]
    targets = window[0, 1:]
    total = 0.0
    for j in range(PREFIX, window.shape[1]):  # token j is predicted at position j - 1
        total += float(logp[j - 1, targets[j - 1]])
    return total


def test_discriminative_labels_come_from_the_highest_path_likelihood(path_states):
    docs, truth = [], []
    for g in range(3):
        docs += group_docs(g, 7, seed=g)
        truth += [g] * 7
    loaded, alive, seen = [], [], []
    scores = score_documents(
        loader(path_states, loaded, alive),
        docs,
        3,
        seq_len=SEQ_LEN,
        prefix_tokens=PREFIX,
        batch_size=4,
        on_path=seen.append,
    )
    assert scores.shape == (21, 3) and scores.dtype == np.float64
    assert loaded == [0, 1, 2] and seen == [0, 1, 2]
    for i in (0, 9, 20):  # one document of each group, of different lengths
        for p in range(3):
            assert scores[i, p] == pytest.approx(reference_score(path_states[p], docs[i]), abs=1e-4)
    labels = best_paths(scores)
    np.testing.assert_array_equal(labels, np.argmax(scores, axis=1))
    # Each path was trained on one token group, so it is the likeliest for that group's docs.
    np.testing.assert_array_equal(labels, truth)


def test_candidates_score_only_the_listed_pairs(path_states):
    docs = group_docs(0, 4, seed=5) + group_docs(1, 4, seed=6)
    full = score_documents(loader(path_states), docs, 3, seq_len=SEQ_LEN, prefix_tokens=PREFIX)
    candidates = np.array([[0, 1]] * 4 + [[1, 1]] * 3 + [[0, 1]])
    loaded: list[int] = []
    part = score_documents(
        loader(path_states, loaded),
        docs,
        3,
        seq_len=SEQ_LEN,
        prefix_tokens=PREFIX,
        candidates=candidates,
        batch_size=3,
    )
    assert loaded == [0, 1], "a path no document lists must not be loaded"
    wanted = np.zeros((8, 3), dtype=bool)
    for i, row in enumerate(candidates):
        wanted[i, row] = True
    assert np.isneginf(part[~wanted]).all()
    np.testing.assert_allclose(part[wanted], full[wanted], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(best_paths(part), [0, 0, 0, 0, 1, 1, 1, 1])


def test_documents_too_short_to_score_are_rejected(path_states):
    docs = group_docs(0, 3, seed=1) + [np.array([0, 1, 2, 3, 0, 1, 2])]  # 7 < PREFIX + 2
    with pytest.raises(DataError, match="document 3 has 7 tokens"):
        score_documents(loader(path_states), docs, 3, seq_len=SEQ_LEN, prefix_tokens=PREFIX)
    with pytest.raises(ConfigError, match="seq_len"):
        score_documents(loader(path_states), docs[:3], 3, seq_len=PREFIX, prefix_tokens=PREFIX)


def test_best_paths_breaks_ties_low_and_rejects_unscored_rows():
    scores = np.array([[-3.0, -1.0, -1.0], [-np.inf, -5.0, -np.inf], [2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(best_paths(scores), [1, 1, 0])
    assert best_paths(scores).dtype == np.int64
    with pytest.raises(DataError, match="no scored path"):
        best_paths(np.array([[-1.0, 0.0], [-np.inf, -np.inf]]))


def skewed(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Four well-separated feature blobs; labels put 90% on path 0, 5% on 1 and 2, none on 3."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(0).normal(size=(4, 6)) * 4
    blob = rng.choice(4, size=n, p=[0.55, 0.15, 0.15, 0.15])
    x = centers[blob] + rng.normal(size=(n, 6))
    labels = np.where(blob == 3, 0, blob)  # blob 3's documents also prefer path 0
    flip = rng.uniform(size=n) < 0.5
    labels = np.where((blob == 1) & flip, 0, labels)
    labels = np.where((blob == 2) & flip, 0, labels)
    return x, labels


def test_bias_correction_leaves_no_path_empty_on_a_skewed_set():
    x, labels = skewed(2000, seed=1)
    counts = np.bincount(labels, minlength=4)
    assert counts[0] / counts.sum() > 0.8 and counts[3] == 0
    fresh, _ = skewed(3000, seed=2)
    plain = fit_logistic_router(x, labels, [2, 2], balance=0.0, assign_features=fresh)
    assert (plain.offsets == 0).all()
    plain_counts = np.bincount(plain.assign(fresh), minlength=4)
    assert plain_counts[3] == 0, "the plain classifier leaves the unlabelled path empty"
    router = fit_logistic_router(x, labels, [2, 2], balance=0.5, assign_features=fresh)
    shares = np.bincount(router.assign(fresh), minlength=4) / len(fresh)
    assert shares.min() >= 0.5 / 4 - 1e-12 and shares.max() <= 1.5 / 4 + 1e-12
    # The correction is a bias only: the classifier itself is unchanged.
    np.testing.assert_array_equal(router.weights, plain.weights)
    np.testing.assert_array_equal(router.bias, plain.bias)


def test_two_labelled_paths_of_four_still_fill_every_path():
    x, labels = skewed(800, seed=3)
    labels = np.where(labels == 2, 1, labels)  # only paths 0 and 1 labelled: a binary fit
    router = fit_logistic_router(x, labels, [4], balance=0.8, seed=7)
    plain = np.argmax(router.logits(x), axis=1)
    assert np.mean(plain == labels) > 0.8, "the binary fit must still classify its labels"
    counts = np.bincount(router.assign(x), minlength=4)
    assert counts.min() >= np.ceil(800 * 0.8 / 4) and counts.max() <= 800 * 1.2 / 4


def test_logistic_router_save_load_round_trip(tmp_path):
    x, labels = skewed(600, seed=4)
    router = fit_logistic_router(x, labels, [2, 2], balance=0.5, seed=3)
    path = tmp_path / "router.json"
    router.save(path)
    assert json.loads(path.read_text())["format"] == "dipaco-logistic-router/1"
    loaded = LogisticRouter.load(path)
    assert loaded.sha256 == router.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.levels == [2, 2] and loaded.balance == 0.5 and loaded.seed == 3
    for name in ("mean", "scale", "weights", "bias", "offsets"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(router, name))
    np.testing.assert_array_equal(loaded.assign(x), router.assign(x))
    np.testing.assert_array_equal(loaded.top_paths(x, 3), router.top_paths(x, 3))
    again = load_router(path)
    assert isinstance(again, LogisticRouter) and again.sha256 == router.sha256
    assert not [p for p in tmp_path.iterdir() if p.name != "router.json"], "no temp files left"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: raw[: len(raw) // 2],
        lambda raw: b"",
        lambda raw: raw.replace(b"dipaco-logistic-router/1", b"dipaco-logistic-router/7"),
        lambda raw: json.dumps({**json.loads(raw), "offsets": [0.0, 1.0]}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "weights": [[1.0, "x"]]}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "scale": [0.0] * 6}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "levels": [2, 3]}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "extra": 1}).encode(),
        lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != "bias"}).encode(),
        lambda raw: raw.replace(b'"balance":0.5', b'"balance":true'),
    ],
    ids=[
        "truncated",
        "empty",
        "format",
        "offsets",
        "weights",
        "scale",
        "levels",
        "extra",
        "missing",
        "bool",
    ],
)
def test_tampered_logistic_router_file_is_corrupt(tmp_path, mangle):
    x, labels = skewed(300, seed=5)
    path = tmp_path / "router.json"
    fit_logistic_router(x, labels, [2, 2], balance=0.5).save(path)
    raw = path.read_bytes()
    path.write_bytes(mangle(raw))
    assert path.read_bytes() != raw
    with pytest.raises(CorruptFileError, match="router.json"):
        LogisticRouter.load(path)
    with pytest.raises(CorruptFileError, match="router.json"):
        load_router(path)


def test_load_router_picks_the_kind_and_rejects_unknown_formats(tmp_path):
    x = np.random.default_rng(0).normal(size=(200, 6))
    km = fit_router(x, [2, 2], method="product")
    km.save(tmp_path / "km.json")
    loaded = load_router(tmp_path / "km.json")
    assert isinstance(loaded, KMeansRouter) and loaded.sha256 == km.sha256
    (tmp_path / "odd.json").write_text(json.dumps({"format": "dipaco-tree-router/1"}))
    with pytest.raises(CorruptFileError, match="unknown format"):
        load_router(tmp_path / "odd.json")
    with pytest.raises(DataError, match="nope.json"):
        load_router(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("method", "levels"),
    [("kmeans", [6]), ("kmeans", [2, 3]), ("product", [2, 3]), ("product", [2, 2, 2])],
)
def test_kmeans_path_scores_and_top_paths_agree_with_assign(method, levels):
    x = np.random.default_rng(1).normal(size=(900, 9))
    router = fit_router(x, levels, method=method, balance=0.5)
    scores = router.path_scores(x)
    assert scores.shape == (900, router.num_paths)
    assigned = router.assign(x)
    np.testing.assert_array_equal(np.argmax(scores, axis=1), assigned)
    top = router.top_paths(x, 3)
    assert top.shape == (900, 3) and top.dtype == np.int64
    np.testing.assert_array_equal(top[:, 0], assigned)
    assert all(len(set(row)) == 3 for row in top.tolist())
    ranked = np.take_along_axis(scores, top, axis=1)
    assert (np.diff(ranked, axis=1) <= 0).all(), "best first"
    if method == "kmeans":  # the score is the negated offset squared distance, up to ||z||^2
        z = (x - router.mean) / router.scale
        d2 = ((z[:, None, :] - router.centroids[0][None]) ** 2).sum(-1) + router.offsets[0]
        np.testing.assert_allclose(scores - (z * z).sum(1, keepdims=True), -d2, atol=1e-9)
    with pytest.raises(ConfigError):
        router.top_paths(x, router.num_paths + 1)


def test_logistic_top_paths_agree_with_assign():
    x, labels = skewed(500, seed=6)
    router = fit_logistic_router(x, labels, [4], balance=0.5)
    top = router.top_paths(x, 2)
    np.testing.assert_array_equal(top[:, 0], router.assign(x))
    assert (top[:, 0] != top[:, 1]).all()
    np.testing.assert_array_equal(router.assign_levels(x)[:, 0], router.assign(x))


def write_shards(root, docs, ids, paths, seed=0):
    return write_path_shards(
        root, docs, ids, paths, 4, 50, heldout_fraction=0.25, seed=seed, min_train_tokens=1
    )


def read_ids(root, part: str) -> dict[int, list[str]]:
    return {p: TokenShard(root / f"P{p}" / part).doc_ids for p in range(4)}


def test_overlapping_shards_duplicate_train_docs_but_not_heldout(tmp_path):
    rng = np.random.default_rng(0)
    n = 200
    docs = [rng.integers(0, 50, size=int(rng.integers(5, 20))) for _ in range(n)]
    ids = [f"doc{i}" for i in range(n)]
    top2 = np.stack([rng.permutation(4)[:2] for _ in range(n)])
    held = {d for d in ids if is_heldout(d, 0.25, 0)}
    assert 10 < len(held) < 90

    stats2 = write_shards(tmp_path / "top2", docs, ids, top2)
    stats1 = write_shards(tmp_path / "top1", docs, ids, top2[:, 0])
    assert stats2["overlap"] == 2 and stats1["overlap"] == 1
    train2 = read_ids(tmp_path / "top2", "train")
    heldout2 = read_ids(tmp_path / "top2", "heldout")
    for i, doc_id in enumerate(ids):
        in_train = [p for p in range(4) if doc_id in train2[p]]
        in_heldout = [p for p in range(4) if doc_id in heldout2[p]]
        if doc_id in held:
            assert in_train == [] and in_heldout == [int(top2[i, 0])]
        else:
            assert in_train == sorted(top2[i].tolist()) and in_heldout == []
    assert sum(stats2["train"]["docs"]) == 2 * (n - len(held))
    assert stats2["train"]["docs"] == [len(train2[p]) for p in range(4)]
    # The held-out slices, the evaluation data, do not change with the overlap.
    assert read_ids(tmp_path / "top1", "heldout") == heldout2
    assert stats1["heldout"] == stats2["heldout"]
    for p in range(4):
        a, b = TokenShard(tmp_path / "top1" / f"P{p}" / "heldout"), heldout2[p]
        c = TokenShard(tmp_path / "top2" / f"P{p}" / "heldout")
        assert len(a) == len(b) == len(c)
        for j in range(len(a)):
            np.testing.assert_array_equal(a[j], c[j])
    # The train shard of a path holds the same tokens as the documents routed there.
    shard = TokenShard(tmp_path / "top2" / "P1" / "train")
    for j, doc_id in enumerate(shard.doc_ids):
        np.testing.assert_array_equal(shard[j], docs[ids.index(doc_id)])


def test_overlapping_rows_must_hold_distinct_valid_paths(tmp_path):
    docs = [np.arange(5)] * 3
    ids = ["a", "b", "c"]
    with pytest.raises(DataError, match="twice"):
        write_shards(tmp_path / "dup", docs, ids, np.array([[0, 1], [2, 2], [3, 0]]))
    with pytest.raises(DataError, match=r"\[0, 4\)"):
        write_shards(tmp_path / "range", docs, ids, np.array([[0, 1], [2, 4], [3, 0]]))
    with pytest.raises(DataError, match="shape"):
        write_shards(tmp_path / "shape", docs, ids, np.array([[0, 1], [2, 3]]))


def test_one_labelled_path_still_fills_every_path_and_too_few_documents_fail():
    x, _ = skewed(400, seed=8)
    router = fit_logistic_router(x, np.zeros(400, dtype=np.int64), [2, 3], balance=0.5)
    counts = np.bincount(router.assign(x), minlength=6)
    assert counts.min() >= np.ceil(400 * 0.5 / 6) and counts.max() <= 400 * 1.5 / 6
    with pytest.raises(DataError, match="without documents"):
        fit_logistic_router(x, np.zeros(400, dtype=np.int64), [6], assign_features=x[:4])
