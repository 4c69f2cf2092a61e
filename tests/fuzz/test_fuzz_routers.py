"""Fuzzing saved routers: a damaged router file loads as a router or raises a DataError.

Peers and evaluation load the run's router from JSON; a mutated file must be refused with a
CorruptFileError (or DataError) that names it, never a numpy, overflow or recursion error, and a
router that loads must still route features without raising anything but the project's errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _fuzzing import FUZZ, assert_clean_error, byte_mutations, json_mutations
from hypothesis import given
from hypothesis import strategies as st

from dipaco.errors import DataError, DipacoError
from dipaco.routing.discriminative import fit_logistic_router
from dipaco.routing.kmeans import fit_router
from dipaco.routing.routers import load_router

_rng = np.random.default_rng(0)
FEATURES = np.concatenate([_rng.normal(size=(40, 6)) + 4 * (i % 2) for i in range(4)])
LABELS = np.repeat(np.arange(4), 40)
ROUTERS = {
    "kmeans": fit_router(FEATURES, [4], balance=0.5, seed=1),
    "product": fit_router(FEATURES, [2, 2], method="product", balance=0.5, seed=1),
    "logistic": fit_logistic_router(FEATURES, LABELS, [2, 2], balance=0.5, seed=1),
}
VALID = {name: r.canonical_json() for name, r in ROUTERS.items()}


@st.composite
def damaged_routers(draw: st.DrawFn) -> bytes:
    raw = VALID[draw(st.sampled_from(sorted(VALID)))]
    if draw(st.booleans()):
        return json.dumps(draw(json_mutations(json.loads(raw)))).encode()
    return draw(byte_mutations(raw))


@FUZZ
@given(st.one_of(damaged_routers(), st.binary(max_size=200)))
def test_damaged_router_files_load_or_raise_data_errors(tmp_path_factory, raw):
    path = tmp_path_factory.getbasetemp() / "fuzz-router.json"
    path.write_bytes(raw)
    try:
        router = load_router(path)
    except DipacoError as exc:
        assert isinstance(exc, DataError), type(exc).__name__
        assert_clean_error(exc)
        assert str(path) in str(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped load_router: {exc!r}")
    # A router that loads routes the documents' features to valid paths (or refuses them).
    try:
        paths = router.assign(FEATURES)
    except DipacoError as exc:
        assert_clean_error(exc)
        return
    num_paths = int(np.prod(router.levels))
    assert paths.shape == (len(FEATURES),) and ((paths >= 0) & (paths < num_paths)).all()


def test_deeply_nested_router_json_is_a_corrupt_file(tmp_path):
    path = tmp_path / "router.json"
    path.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match="router.json"):
        load_router(path)
