"""A task's delta is per module what it was fetched as minus what it was trained to."""

import torch

from dipaco.peer.push import module_deltas


def test_each_module_delta_is_fetched_minus_trained_in_float32():
    base = {
        "S.embed": {"weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]])},
        "L0.0": {"w": torch.tensor([0.5, -1.0, 2.0]), "b": torch.tensor([1.0])},
    }
    trained = {
        "S.embed": {"weight": torch.tensor([[0.5, 2.0], [3.5, 3.0]])},
        "L0.0": {"w": torch.tensor([0.25, -1.0, 1.0]), "b": torch.tensor([3.0])},
        "L0.1": {"w": torch.tensor([9.0])},  # trained but not fetched: not a delta of this task
    }
    delta = module_deltas(base, trained)
    assert set(delta) == {"S.embed", "L0.0"} and set(delta["L0.0"]) == {"w", "b"}
    assert torch.equal(delta["S.embed"]["weight"], torch.tensor([[0.5, 0.0], [-0.5, 1.0]]))
    assert torch.equal(delta["L0.0"]["w"], torch.tensor([0.25, 0.0, 1.0]))
    assert torch.equal(delta["L0.0"]["b"], torch.tensor([-2.0]))
    for tensors in delta.values():
        for t in tensors.values():
            assert t.dtype == torch.float32 and t.is_contiguous()
    assert torch.equal(base["L0.0"]["b"], torch.tensor([1.0]))  # the inputs are left as they were


def test_a_delta_of_a_strided_view_is_contiguous():
    base = {"m": {"w": torch.arange(6.0).reshape(2, 3).t()}}  # a transposed, strided view
    trained = {"m": {"w": torch.zeros(3, 2)}}
    delta = module_deltas(base, trained)["m"]["w"]
    assert delta.is_contiguous() and torch.equal(delta, base["m"]["w"])


def test_a_delta_written_in_place_takes_the_trained_tensors_memory():
    base = {
        "m": {
            "w": torch.tensor([1.0, 2.0, 3.0]),
            "h": torch.tensor([1.0, 2.0], dtype=torch.float64),
        }
    }
    trained = {
        "m": {
            "w": torch.tensor([0.5, 2.5, 3.0]),
            "h": torch.tensor([0.0, 0.0], dtype=torch.float64),
        }
    }
    memory = trained["m"]["w"].data_ptr()
    delta = module_deltas(base, trained, in_place=True)["m"]
    assert delta["w"].data_ptr() == memory  # no new tensor: the trained one holds the delta
    assert torch.equal(delta["w"], torch.tensor([0.5, -0.5, 0.0]))
    assert torch.equal(trained["m"]["w"], delta["w"])
    assert torch.equal(base["m"]["w"], torch.tensor([1.0, 2.0, 3.0]))  # the base is left
    # Not float32: a new tensor, and the trained one is left as it was.
    assert torch.equal(delta["h"], torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert torch.equal(trained["m"]["h"], torch.zeros(2, dtype=torch.float64))
