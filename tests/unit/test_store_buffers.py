"""The store's outer steps write into the version before the head's buffers, never into anything
someone else can still see, and give the same parameters as fresh buffers would."""

import torch

from dipaco.coordinator.outer import OuterSettings
from dipaco.coordinator.store import ModuleStore


def module(fill: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 256), fill), "norm": torch.full((256,), fill)}


def steps(store: ModuleStore, n: int, hold=None) -> list[int]:
    """n outer steps of two paths each; returns where each version's "w" lives in memory."""
    versions = []
    for r in range(n):
        for p in range(2):
            store.add_delta("m", p, 1.0 + p, f"t{r}-{p}", "peer", module(0.01 * (r + p + 1)))
        store.outer_step("m", OuterSettings())
        versions.append(store.params("m")["w"].data_ptr())
        if hold is not None:
            hold(r, store.params("m"))
    return versions


def test_buffers_alternate_and_the_results_equal_fresh_ones(tmp_path):
    reused, fresh = ModuleStore(tmp_path / "a"), ModuleStore(tmp_path / "b")
    fresh.reuse_buffers = False
    for store in (reused, fresh):
        store.initialize({"m": module(0.5)})
    ptr, _ = steps(reused, 6), steps(fresh, 6)
    assert ptr[2] == ptr[0] and ptr[4] == ptr[2] and ptr[3] == ptr[1] and ptr[1] != ptr[0]
    for name in ("w", "norm"):
        assert torch.equal(reused.params("m")[name], fresh.params("m")[name])
        assert torch.equal(reused.modules["m"].momentum[name], fresh.modules["m"].momentum[name])


def test_what_someone_still_holds_is_never_overwritten(tmp_path):
    store = ModuleStore(tmp_path)
    store.initialize({"m": module(0.5)})
    held: dict = {}

    def hold(r, params):  # version 2: its dict; version 3: one tensor; version 4: a view
        if r == 1:
            held["dict"] = (params, {k: v.clone() for k, v in params.items()})
        if r == 2:
            held["tensor"] = (params["w"], params["w"].clone())
        if r == 3:
            held["view"] = (params["norm"][:10], params["norm"][:10].clone())

    steps(store, 8, hold)
    params, copy = held["dict"]
    assert all(torch.equal(params[k], copy[k]) for k in copy)
    for key in ("tensor", "view"):
        tensor, copy = held[key]
        assert torch.equal(tensor, copy), key
