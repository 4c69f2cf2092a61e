"""k-means / product k-means routers: determinism, balance control, persistence, bad input."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time

import numpy as np
import pytest

from dipaco.errors import ConfigError, CorruptFileError, DataError
from dipaco.routing.kmeans import KMeansRouter, fit_router, routing_stats


def blobs(
    masses: list[float], n: int, dim: int = 8, spread: float = 8.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Well-separated gaussian blobs holding the given fractions of ``n`` documents."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(len(masses), dim)) * spread
    labels = np.repeat(np.arange(len(masses)), np.round(np.array(masses) * n).astype(int))
    rng.shuffle(labels)
    return centers[labels] + rng.normal(size=(labels.size, dim)), labels


def product_data(n: int, half: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """First and last ``half`` dims each carry an independent 2-cluster structure."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 2, size=n), rng.integers(0, 2, size=n)
    ca, cb = rng.normal(size=(2, half)) * 6, rng.normal(size=(2, half)) * 6
    x = np.concatenate([ca[a], cb[b]], axis=1) + rng.normal(size=(n, 2 * half))
    return x, 2 * a + b


def shares(paths: np.ndarray, num_paths: int) -> np.ndarray:
    return np.bincount(paths, minlength=num_paths) / paths.size


def test_same_seed_gives_identical_router_and_assignment():
    x, _ = blobs([0.4, 0.3, 0.2, 0.1], 600)
    r1 = fit_router(x, [4], balance=0.5, seed=3)
    r2 = fit_router(x, [4], balance=0.5, seed=3)
    assert r1.sha256 == r2.sha256
    for c1, c2 in zip(r1.centroids + r1.offsets, r2.centroids + r2.offsets, strict=True):
        np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(r1.assign(x), r2.assign(x))


def test_save_load_round_trip_keeps_assignment_and_hash(tmp_path):
    x, _ = product_data(500)
    router = fit_router(x, [2, 2], method="product", balance=0.7, seed=1)
    path = tmp_path / "router.json"
    router.save(path)
    loaded = KMeansRouter.load(path)
    assert json.loads(path.read_text())["format"] == "dipaco-kmeans-router/1"
    assert loaded.sha256 == router.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.levels == [2, 2] and loaded.method == "product"
    for a, b in zip(
        router.centroids + router.offsets, loaded.centroids + loaded.offsets, strict=True
    ):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(loaded.assign(x), router.assign(x))
    np.testing.assert_array_equal(loaded.assign_levels(x), router.assign_levels(x))
    assert not list(tmp_path.glob("*.tmp")), "the temporary file must be gone after save"


def test_different_seeds_can_give_different_routers():
    x = np.random.default_rng(0).uniform(size=(400, 6))
    hashes = {fit_router(x, [8], balance=0.0, seed=s).sha256 for s in range(4)}
    assert len(hashes) > 1


def test_balance_zero_reproduces_the_imbalance_of_the_data():
    x, labels = blobs([0.7, 0.1, 0.1, 0.1], 2000)
    router = fit_router(x, [4], balance=0.0)
    assert all((o == 0).all() for o in router.offsets)
    s = shares(router.assign(x), 4)
    assert s.max() == pytest.approx(0.7, abs=0.02)
    assert s.min() == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize("balance", [0.5, 0.8])
def test_balance_keeps_every_path_within_the_band(balance):
    x, _ = blobs([0.7, 0.1, 0.1, 0.1], 2000)
    router = fit_router(x, [4], balance=balance)
    s = shares(router.assign(x), 4)
    assert s.min() >= balance / 4 - 1e-12
    assert s.max() <= (2 - balance) / 4 + 1e-12
    # Fresh documents from the same distribution land close to the band too.
    fresh, _ = blobs([0.7, 0.1, 0.1, 0.1], 4000, seed=0)
    fresh = fresh + np.random.default_rng(9).normal(size=fresh.shape) * 0.01
    s_fresh = shares(router.assign(fresh), 4)
    assert s_fresh.min() >= balance / 4 - 0.03
    assert s_fresh.max() <= (2 - balance) / 4 + 0.03


def test_full_balance_splits_documents_as_equally_as_possible():
    x, _ = blobs([0.55, 0.25, 0.15, 0.05], 2002, dim=16)
    for levels in ([4], [2, 3]):
        router = fit_router(x, levels, balance=1.0)
        counts = np.bincount(router.assign(x), minlength=router.num_paths)
        p = router.num_paths
        assert counts.min() >= math.floor(2002 / p) and counts.max() <= math.ceil(2002 / p)


def test_balancing_is_fast_and_silent_at_production_size(caplog):
    x, _ = blobs([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05], 5000, dim=128, spread=3.0)
    with caplog.at_level(logging.WARNING, logger="dipaco.routing.balance"):
        start = time.perf_counter()
        router = fit_router(x, [16], balance=0.9, seed=0)
        elapsed = time.perf_counter() - start
    s = shares(router.assign(x), 16)
    assert s.min() >= 0.9 / 16 - 1e-12 and s.max() <= 1.1 / 16 + 1e-12
    assert not caplog.records
    assert elapsed < 10.0  # k-means itself included; balancing alone takes milliseconds


def test_identical_documents_are_split_by_the_fits_assignment(caplog):
    """80 identical documents cannot be split by offsets; the fit's balanced assignment splits
    them 50/30 between the two clusters (the lowest-numbered first), and a new document with
    those features still routes to one of them."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.zeros((80, 3)), rng.normal(size=(20, 3)) + 10])
    with caplog.at_level(logging.WARNING, logger="dipaco.routing.balance"):
        router = fit_router(x, [2], balance=1.0)
    assert not caplog.records  # met, not warned about
    assert np.bincount(router.fit_choice, minlength=2).tolist() == [50, 50]
    assert len(set(router.fit_choice[:80].tolist())) == 2
    assert router.fit_choice.tolist() == fit_router(x, [2], balance=1.0).fit_choice.tolist()
    assert router.assign(np.zeros((1, 3)))[0] in (0, 1)
    # Where the offsets alone reach the band, the fit keeps no assignment of its own.
    blobs_x, _ = blobs([0.5, 0.5], 200, dim=4)
    assert fit_router(blobs_x, [2], balance=0.5).fit_choice is None


def test_product_kmeans_recovers_independent_halves():
    x, truth = product_data(800)
    router = fit_router(x, [2, 2], method="product", balance=0.5)
    paths = router.assign(x)
    # Each true (first-half, second-half) pair maps to exactly one path, and vice versa.
    pairs = {(int(t), int(p)) for t, p in zip(truth, paths, strict=True)}
    assert len(pairs) == 4
    assert sorted(p for _, p in pairs) == [0, 1, 2, 3]
    assert router.slices == [(0, 6), (6, 12)]


def test_path_ids_are_row_major_in_the_level_choices():
    x, _ = product_data(300)
    for method in ("kmeans", "product"):
        router = fit_router(x, [2, 3], method=method, balance=0.5)
        choices = router.assign_levels(x)
        assert choices.shape == (300, 2) and choices.dtype == np.int64
        np.testing.assert_array_equal(router.assign(x), choices[:, 0] * 3 + choices[:, 1])
        assert router.num_paths == 6


@pytest.mark.parametrize("method", ["kmeans", "product"])
def test_every_path_gets_documents(method):
    x = np.random.default_rng(1).normal(size=(1600, 10))
    router = fit_router(x, [4, 4], method=method, balance=0.5)
    paths = router.assign(x)
    assert paths.dtype == np.int64
    assert np.bincount(paths, minlength=16).min() > 0


def test_product_slices_split_odd_dimensions_nearly_equally():
    x = np.random.default_rng(2).normal(size=(200, 7))
    router = fit_router(x, [2, 2, 2], method="product")
    assert router.slices == [(0, 3), (3, 5), (5, 7)]
    assert router.assign(x).max() < 8


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: raw[: len(raw) // 2],
        lambda raw: b"\x00\xffnot json",
        lambda raw: b"",
        lambda raw: raw.replace(b"dipaco-kmeans-router/1", b"dipaco-kmeans-router/9"),
        lambda raw: json.dumps({**json.loads(raw), "offsets": [[0.0]]}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "centroids": [[[1.0, "x"]]]}).encode(),
        lambda raw: json.dumps({**json.loads(raw), "levels": [2]}).encode(),
        lambda raw: json.dumps([1, 2, 3]).encode(),
    ],
    ids=["truncated", "binary", "empty", "format", "offsets", "centroids", "levels", "list"],
)
def test_loading_a_corrupt_file_names_the_file(tmp_path, mangle):
    x, _ = blobs([0.5, 0.5], 100)
    path = tmp_path / "router.json"
    fit_router(x, [2, 2], balance=0.5).save(path)
    path.write_bytes(mangle(path.read_bytes()))
    with pytest.raises(CorruptFileError, match="router.json"):
        KMeansRouter.load(path)


def test_loading_a_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="nope.json"):
        KMeansRouter.load(tmp_path / "nope.json")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_are_rejected(bad):
    x, _ = blobs([0.5, 0.5], 100)
    router = fit_router(x, [2])
    x[7, 1] = bad
    with pytest.raises(DataError, match="non-finite"):
        fit_router(x, [2])
    with pytest.raises(DataError, match="non-finite"):
        router.assign(x)


def test_features_of_the_wrong_width_are_rejected():
    x, _ = blobs([0.5, 0.5], 100)
    router = fit_router(x, [2])
    with pytest.raises(DataError, match="dimensions"):
        router.assign(x[:, :5])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"levels": [16], "n": 10}, "documents"),
        ({"levels": [2, 8], "n": 15}, "documents"),
        ({"balance": 1.5}, "balance"),
        ({"balance": -0.1}, "balance"),
        ({"levels": []}, "levels"),
        ({"levels": [0, 2]}, "levels"),
        ({"method": "spectral"}, "method"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, field):
    n = kwargs.pop("n", 100)
    x = np.random.default_rng(0).normal(size=(n, 4))
    args = {"levels": [2], "balance": 0.5, "method": "kmeans"} | kwargs
    with pytest.raises(ConfigError, match=field):
        fit_router(x, **args)


def test_routing_stats_counts_documents_and_tokens():
    paths = np.array([0, 2, 2, 1, 2, 0])
    tokens = np.array([10, 5, 5, 7, 1, 3])
    stats = routing_stats(paths, tokens, 4)
    assert stats["docs"] == [2, 1, 3, 0]
    assert stats["tokens"] == [13, 7, 11, 0]
    assert stats["min_share"] == 0.0
    assert stats["max_share"] == pytest.approx(0.5)
    assert routing_stats(paths, None, 3)["tokens"] is None
    with pytest.raises(DataError):
        routing_stats(np.array([0, 5]), None, 4)
    with pytest.raises(DataError):
        routing_stats(paths, tokens[:3], 4)
