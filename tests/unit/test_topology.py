import pytest
import torch

from dipaco.errors import ConfigError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, PathModel, new_dense_model

CFG = ModelConfig(vocab_size=97, dim=32, n_layers=4, n_heads=2, max_seq_len=32)


def test_2x2_has_four_paths_through_six_modules():
    t = Topology.parse("2x2", 4)
    assert t.num_paths == 4
    assert t.module_ids() == ["S.embed", "S.head", "L0.M0", "L0.M1", "L1.M0", "L1.M1"]
    assert t.path_modules(2) == ["S.embed", "L0.M1", "L1.M0", "S.head"]
    assert t.paths_through("L1.M0") == [0, 2]
    assert t.paths_through("S.embed") == [0, 1, 2, 3]
    assert [t.choices(p) for p in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(t.path_of(t.choices(p)) == p for p in range(4))


@pytest.mark.parametrize(
    ("spec", "paths", "modules"), [("1", 1, 3), ("4x4", 16, 10), ("16x16", 256, 34)]
)
def test_topology_sizes(spec, paths, modules):
    t = Topology.parse(spec, 4)
    assert t.num_paths == paths
    assert len(t.module_ids()) == modules


def test_flat_moe_shares_nothing():
    t = Topology.parse("4", 4, shared=())
    assert t.num_paths == 4
    for mid in t.module_ids():
        assert len(t.paths_through(mid)) == 1


def test_private_blocks_are_path_modules():
    t = Topology.parse("2x2", 6, private_blocks_before=1, private_blocks_after=1)
    assert t.path_modules(3) == ["S.embed", "P3.pre", "L0.M1", "L1.M1", "P3.post", "S.head"]
    assert t.paths_through("P3.pre") == [3]


def test_uneven_levels_are_a_clear_error():
    with pytest.raises(ConfigError, match="do not split evenly"):
        Topology.parse("2x2x2", 4)
    with pytest.raises(ConfigError, match="not module counts"):
        Topology.parse("2by2", 4)


def test_path_from_modules_matches_the_same_weights_as_one_model():
    torch.manual_seed(0)
    t = Topology.parse("2x2", 4)
    # Four different paths' weights, stored only as modules.
    modules = {}
    for p in range(4):
        dense = new_dense_model(CFG, seed=p).state_dict()
        for mid, tensors in t.split_path_state(p, dense).items():
            modules.setdefault(mid, tensors)
    tokens = torch.randint(0, CFG.vocab_size, (3, 20))
    for p in range(4):
        assembled = t.build_path(CFG, p, modules)
        reference = PathModel(CFG)
        reference.load_state_dict(t.join_modules(p, modules))
        assert torch.equal(assembled(tokens), reference(tokens))
    # P1 shares level 0 with P0 but not level 1: its layers 2-3 come from L1.M1.
    p1 = t.join_modules(1, modules)
    assert torch.equal(
        p1["layers.2.mlp.up_proj.weight"], modules["L1.M1"]["layers.0.mlp.up_proj.weight"]
    )


def test_module_state_dicts_round_trip_exactly():
    t = Topology.parse("2x2", 4)
    state = new_dense_model(CFG, seed=3).state_dict()
    for p in range(4):
        split = t.split_path_state(p, state)
        assert set(split) == set(t.path_modules(p))
        joined = t.join_modules(p, split)
        assert joined.keys() == state.keys()
        assert all(torch.equal(joined[k], state[k]) for k in state)


def test_parameter_counts():
    t = Topology.parse("2x2", 4)
    counts = t.parameter_counts(CFG)
    dense = sum(p.numel() for p in PathModel(CFG).parameters())
    assert counts["per_path"] == dense
    level = counts["modules"]["L0.M0"]
    assert counts["total"] == dense + 2 * level  # two extra level modules beyond one path
    assert Topology.parse("1", 4).parameter_counts(CFG)["total"] == dense


def test_init_modules_start_every_module_from_the_dense_weights():
    t = Topology.parse("2x2", 4)
    state = new_dense_model(CFG, seed=1).state_dict()
    modules = t.init_modules(state)
    for p in range(4):
        joined = t.join_modules(p, modules)
        assert all(torch.equal(joined[k], state[k]) for k in state)


def test_replicas_make_diloco_workers_that_share_every_module():
    # DiLoCo-4 is topology "1" with 4 replicas: 4 workers (paths), each with its own data,
    # all pushing into the same three modules, so the outer step averages all four.
    t = Topology.parse("1", 4, replicas=4)
    assert t.num_paths == 4
    assert t.module_ids() == ["S.embed", "S.head", "L0.M0"]
    assert all(t.paths_through(mid) == [0, 1, 2, 3] for mid in t.module_ids())
    assert t.routing_levels == [1, 4]
    assert Topology.from_dict(t.to_dict()) == t
    dense = new_dense_model(CFG, seed=0).state_dict()
    assert {
        k: v.equal(dense[k])
        for k, v in t.build_path(CFG, 3, t.init_modules(dense)).state_dict().items()
    } == {k: True for k in dense}


def test_replicas_of_a_flat_moe_share_their_private_parts():
    t = Topology.parse("2", 4, shared=(), replicas=2)
    assert t.num_paths == 4
    assert t.path_modules(0) == t.path_modules(1) == ["P0.embed", "L0.M0", "P0.head"]
    assert t.path_modules(3) == ["P1.embed", "L0.M1", "P1.head"]
    with pytest.raises(ConfigError):
        Topology.parse("2", 4, replicas=0)


@pytest.mark.parametrize("fault", ["shape", "dtype", "nan", "missing", "extra"])
def test_malformed_modules_are_a_clear_error_not_a_crash_inside_torch(fault):
    """Issue 17, break 8: a peer given malformed modules by its coordinator died with raw
    exceptions; build_path now says what is wrong (the peer aborts the task on it)."""
    from dipaco.errors import DataError

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
    topo = Topology.parse("2x2", 2)
    modules = topo.init_modules(new_dense_model(cfg, 0).state_dict())
    topo.build_path(cfg, 0, modules)  # the honest modules build
    bad = {mid: dict(t) for mid, t in modules.items()}
    name = next(iter(bad["S.embed"]))
    if fault == "shape":
        bad["S.embed"][name] = bad["S.embed"][name][:-1]
    elif fault == "dtype":
        bad["S.embed"][name] = bad["S.embed"][name].double()
    elif fault == "nan":
        bad["S.embed"][name] = bad["S.embed"][name].clone().fill_(float("nan"))
    elif fault == "missing":
        del bad["S.embed"][name]
    else:
        bad["S.embed"]["surprise"] = torch.zeros(3)
    with pytest.raises(DataError, match="malformed modules"):
        topo.build_path(cfg, 0, bad)
