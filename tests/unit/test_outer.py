"""Golden numbers for the outer step, computed by hand (see the comments)."""

import math
from dataclasses import replace

import pytest
import torch

from dipaco.coordinator.outer import (
    OuterSettings,
    apply_round,
    at_step,
    nesterov_step,
    outer_gradient,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_weighted_average_and_square_root_rescale():
    # Two paths: deltas [1, 2] with 1,000 tokens and [3, -1] with 3,000 tokens.
    # weights 0.25 / 0.75 -> [2.5, -0.25]; times sqrt(2) -> [3.5355339, -0.3535534]
    deltas = [({"w": t(1, 2)}, 1000), ({"w": t(3, -1)}, 3000)]
    g = outer_gradient(deltas, OuterSettings(rescale="sqrt"))
    assert g["w"].tolist() == pytest.approx([2.5 * math.sqrt(2), -0.25 * math.sqrt(2)], abs=1e-6)
    plain = outer_gradient(deltas, OuterSettings(rescale="none", weight_by_tokens=False))
    assert plain["w"].tolist() == pytest.approx([2.0, 0.5], abs=1e-7)  # the plain mean
    one = outer_gradient([({"w": t(4, 5)}, 7)], OuterSettings(rescale="sqrt"))
    assert one["w"].tolist() == pytest.approx([4.0, 5.0])  # sqrt(1) = 1, weight 1


def test_nesterov_golden_two_steps():
    s = OuterSettings(lr=0.7, momentum=0.9)
    theta = {"w": t(1.0, 1.0)}
    # step 1: b = g = [1, -2]; update = g + 0.9 b = [1.9, -3.8]; theta = 1 - 0.7 * update
    p1, b1 = nesterov_step(theta, None, {"w": t(1.0, -2.0)}, s)
    assert b1["w"].tolist() == pytest.approx([1.0, -2.0])
    assert p1["w"].tolist() == pytest.approx([1 - 1.33, 1 + 2.66])
    # step 2: g = [0.5, 0.5]; b = 0.9 * [1, -2] + g = [1.4, -1.3]
    # update = g + 0.9 b = [1.76, -0.67]; theta = [-0.33, 3.66] - 0.7 * update = [-1.562, 4.129]
    p2, b2 = nesterov_step(p1, b1, {"w": t(0.5, 0.5)}, s)
    assert b2["w"].tolist() == pytest.approx([1.4, -1.3])
    assert p2["w"].tolist() == pytest.approx([-1.562, 4.129], abs=1e-5)
    assert theta["w"].tolist() == [1.0, 1.0]  # inputs untouched


def test_nesterov_agrees_with_torch_sgd():
    torch.manual_seed(0)
    s = OuterSettings(lr=0.7, momentum=0.9)
    w = torch.nn.Parameter(torch.randn(5))
    sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    params, momentum = {"w": w.detach().clone()}, None
    for _ in range(4):
        g = torch.randn(5)
        w.grad = g.clone()
        sgd.step()
        params, momentum = nesterov_step(params, momentum, {"w": g}, s)
        assert torch.allclose(params["w"], w.detach(), atol=1e-6)


@pytest.mark.parametrize("paths", [1, 2, 5])
@pytest.mark.parametrize("with_momentum", [False, True])
def test_the_fused_round_equals_gradient_then_nesterov(paths, with_momentum):
    """apply_round (the store's one-pass form) = outer_gradient + nesterov_step, to rounding."""
    gen = torch.Generator().manual_seed(paths)
    shapes = {"w": (6, 5), "norm": (5,)}
    rand = lambda: {k: torch.randn(*v, generator=gen) for k, v in shapes.items()}  # noqa: E731
    deltas = [(rand(), 1000.0 * (i + 1)) for i in range(paths)]
    params, momentum = rand(), rand() if with_momentum else None
    before = {k: v.clone() for k, v in params.items()}
    s = OuterSettings(rescale="sqrt")
    info: dict = {}
    new_params, new_momentum, norm = apply_round(deltas, params, momentum, s, info)
    grad = outer_gradient(deltas, s)
    want_params, want_momentum = nesterov_step(params, momentum, grad, s)
    for k in shapes:
        assert torch.allclose(new_params[k], want_params[k], atol=1e-5)
        assert torch.allclose(new_momentum[k], want_momentum[k], atol=1e-5)
        assert torch.equal(params[k], before[k])  # inputs untouched
    whole = torch.cat([g.reshape(-1) for g in grad.values()])
    assert norm == pytest.approx(float(whole.norm()), rel=1e-5)
    assert info == {"aggregation": "mean", "rescale": math.sqrt(paths) if paths > 1 else 1.0}
    again = apply_round(deltas, params, momentum, s)
    assert all(torch.equal(again[0][k], new_params[k]) for k in shapes)  # deterministic


@pytest.mark.parametrize("paths", [1, 2, 5])
@pytest.mark.parametrize("with_momentum", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_the_round_into_given_buffers_equals_the_fresh_one(paths, with_momentum, nesterov):
    """apply_round(out=...) writes the same results into the buffers it is given."""
    gen = torch.Generator().manual_seed(10 + paths)
    shapes = {"w": (6, 5), "norm": (5,)}
    rand = lambda: {k: torch.randn(*v, generator=gen) for k, v in shapes.items()}  # noqa: E731
    deltas = [(rand(), 1000.0 * (i + 1)) for i in range(paths)]
    params, momentum = rand(), rand() if with_momentum else None
    kept = [({k: v.clone() for k, v in d.items()}, w) for d, w in deltas]
    s = OuterSettings(nesterov=nesterov)
    fresh = apply_round(deltas, params, momentum, s)
    out = (rand(), rand())  # garbage in, overwritten
    into = apply_round(deltas, params, momentum, s, out=out)
    assert into[0] is out[0] and into[1] is out[1]
    for k in shapes:
        assert torch.equal(into[0][k], fresh[0][k])  # bit for bit: restarts redo steps exactly
        assert torch.equal(into[1][k], fresh[1][k])
        assert all(torch.equal(d[k], c[k]) for (d, _), (c, _) in zip(deltas, kept, strict=True))
    assert into[2] == fresh[2]


@pytest.mark.parametrize("paths", [1, 2, 5])
@pytest.mark.parametrize("rescale", ["sqrt", "norm"])
@pytest.mark.parametrize("with_momentum", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_a_round_stepped_in_pieces_equals_one_over_whole_tensors(
    monkeypatch, paths, rescale, with_momentum, nesterov
):
    """Large tensors are stepped in pieces (outer.PIECE elements): the same element-wise
    operations, so the same bits as whole tensors (the "norm" rescale's factor comes from the
    norm, summed piece by piece: equal to rounding), and fresh = into given buffers exactly."""
    import dipaco.coordinator.outer as outer

    gen = torch.Generator().manual_seed(20 + paths)
    shapes = {"w": (9, 7), "v": (50,), "norm": (5,), "bias": (3,)}
    rand = lambda: {k: torch.randn(*v, generator=gen) for k, v in shapes.items()}  # noqa: E731
    deltas = [(rand(), 1000.0 * (i + 1)) for i in range(paths)]
    params, momentum = rand(), rand() if with_momentum else None
    s = OuterSettings(rescale=rescale, nesterov=nesterov)
    whole = apply_round(deltas, params, momentum, s)
    monkeypatch.setattr(outer, "PIECE", 8)  # w and v in pieces of 8, norm and bias together
    assert len(outer._pieces([63, 50, 5, 3])) == 1 + 8 + 7
    fresh = apply_round(deltas, params, momentum, s)
    into = apply_round(deltas, params, momentum, s, out=(rand(), rand()))
    grad = outer_gradient(deltas, s)
    want_params, want_momentum = nesterov_step(params, momentum, grad, s)
    for k in shapes:
        assert torch.equal(into[0][k], fresh[0][k]) and torch.equal(into[1][k], fresh[1][k])
        assert torch.allclose(fresh[0][k], want_params[k], atol=1e-5)
        assert torch.allclose(fresh[1][k], want_momentum[k], atol=1e-5)
        if rescale == "sqrt":
            assert torch.equal(fresh[0][k], whole[0][k]) and torch.equal(fresh[1][k], whole[1][k])
        else:
            assert torch.allclose(fresh[0][k], whole[0][k], atol=1e-6)
    assert into[2] == fresh[2] == pytest.approx(whole[2], rel=1e-6)


@pytest.mark.parametrize("rescale", ["none", "sqrt", "linear", "norm"])
def test_each_rescale_scales_the_average_as_documented(rescale):
    gen = torch.Generator().manual_seed(7)
    n = 4
    deltas = [({"w": torch.randn(40, generator=gen)}, 1.0) for _ in range(n)]
    s = OuterSettings(rescale=rescale, weight_by_tokens=False)
    info: dict = {}
    g = outer_gradient(deltas, s, info)
    average = torch.stack([d["w"] for d, _ in deltas]).mean(0)
    mean_norm = sum(float(d["w"].norm()) for d, _ in deltas) / n
    want = {
        "none": 1.0,
        "sqrt": 2.0,
        "linear": 4.0,
        "norm": min(2.0, mean_norm / float(average.norm())),
    }[rescale]
    assert info["rescale"] == pytest.approx(want, rel=1e-6)
    assert torch.allclose(g["w"], want * average, atol=1e-6)
    # The fused round uses the same factor.
    fused: dict = {}
    apply_round(deltas, {"w": torch.zeros(40)}, None, s, fused)
    assert fused["rescale"] == pytest.approx(want, rel=1e-6)


def test_norm_rescale_is_one_when_the_paths_agree_and_sqrt_n_when_orthogonal():
    same = [({"w": torch.ones(8)}, 1.0) for _ in range(4)]
    info: dict = {}
    outer_gradient(same, OuterSettings(rescale="norm"), info)
    assert info["rescale"] == pytest.approx(1.0)
    eye = torch.eye(4)
    orthogonal = [({"w": eye[i]}, 1.0) for i in range(4)]
    outer_gradient(orthogonal, OuterSettings(rescale="norm"), info)
    assert info["rescale"] == pytest.approx(2.0)


def test_outer_lr_warmup_ramps_the_first_steps_then_holds():
    s = OuterSettings(lr=0.8, warmup_rounds=4)
    assert [at_step(s, v).lr for v in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    assert at_step(OuterSettings(lr=0.7), 0).lr == 0.7


def test_the_old_sqrt_rescale_switch_is_refused_by_name():
    from dipaco.config import load_config_dict

    with pytest.raises(Exception, match="sqrt_rescale"):
        load_config_dict({"outer": {"sqrt_rescale": True}})


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median"])
def test_one_key_on_many_paths_is_one_vote_in_a_robust_combiner(aggregation):
    # Eight paths through a module: honest deltas near +1, four sign-flipped at 2.5x (-2.5).
    # As four keys (Sybils) they are half of the values and drag the trim and the median far
    # off; sent by one key they merge into one value of five and the centre stays honest.
    g = torch.Generator().manual_seed(0)
    honest = [({"w": 1 + 0.1 * torch.randn(64, generator=g)}, 100) for _ in range(4)]
    flipped = [({"w": -2.5 * d["w"]}, w) for d, w in honest]
    deltas = honest + flipped
    s = OuterSettings(aggregation=aggregation, rescale="none", trim_fraction=0.2)
    sybil = outer_gradient(deltas, s, info := {}, [f"h{i}" for i in range(4)] + list("abcd"))
    assert info["voters"] == 8
    one_key = outer_gradient(deltas, s, info := {}, [f"h{i}" for i in range(4)] + ["x"] * 4)
    assert info["voters"] == 5 and info["aggregation"] == aggregation
    truth = outer_gradient(honest, s)["w"]
    assert float((one_key["w"] - truth).abs().max()) < 0.25
    assert float(one_key["w"].mean()) > 0.8  # the step still goes the honest way
    assert float(sybil["w"].mean()) < 0.1  # without the merge: stalled or reversed


def test_the_plain_mean_ignores_voters_bit_for_bit():
    deltas = [({"w": t(1, 2)}, 1000), ({"w": t(3, -1)}, 3000), ({"w": t(-2, 5)}, 500)]
    a = outer_gradient(deltas, OuterSettings())
    b = outer_gradient(deltas, OuterSettings(), voters=["k", "k", "k"])
    assert torch.equal(a["w"], b["w"])


def test_a_robust_combiner_merges_a_keys_deltas_by_their_weights():
    # Keys a (two deltas, 100 and 300 tokens) and b, c: a's vote is (1*100 + 5*300) / 400 = 4
    # with weight 200 (one path's worth); the median of [4, 0, 10] is 4.
    deltas = [({"w": t(1.0)}, 100), ({"w": t(5.0)}, 300), ({"w": t(0.0)}, 1), ({"w": t(10.0)}, 1)]
    s = OuterSettings(aggregation="median", rescale="none")
    g = outer_gradient(deltas, s, info := {}, ["a", "a", "b", "c"])
    assert g["w"].tolist() == pytest.approx([4.0]) and info["voters"] == 3
    # In a trimmed mean that keeps every value, a's vote weighs as one path, not as two:
    # (4 * 200 + 0 * 1 + 10 * 1) / 202.
    t0 = outer_gradient(
        deltas, OuterSettings(aggregation="trimmed_mean", rescale="none", trim_fraction=0.0),
        info := {}, ["a", "a", "b", "c"],
    )  # fmt: skip
    assert t0["w"].tolist() == pytest.approx([(4 * 200 + 10) / 202])


def test_by_default_three_sign_flipped_deltas_of_eight_do_not_reverse_the_step():
    # Issue 17, break 8: with the old default (the plain mean) 3 of 8 deltas at -2.5x turned a
    # module's step around: (5 * 1 - 3 * 2.5) / 8 < 0. The default of an open run is robust.
    from dipaco.config import load_config_dict
    from dipaco.run.factory import outer_settings

    s = outer_settings(load_config_dict({}))
    g = torch.Generator().manual_seed(1)
    honest = [({"w": 1 + 0.2 * torch.randn(256, generator=g)}, 100) for _ in range(8)]
    deltas = honest[:5] + [({"w": -2.5 * d["w"]}, w) for d, w in honest[5:]]
    keys = [f"k{i}" for i in range(8)]  # eight keys: no merging helps here
    step = outer_gradient(deltas, s, info := {}, keys)["w"]
    assert info["aggregation"] == "trimmed_mean"
    truth = outer_gradient(honest, s, voters=keys)["w"]
    cosine = float(step @ truth / (step.norm() * truth.norm()))
    assert cosine > 0.5, cosine  # 3 of 8 is more than the 20% trimmed: weakened, not reversed
    plain = outer_gradient(deltas, replace(s, aggregation="mean"))["w"]
    assert float(plain @ truth) < 0  # what the mean did: the step reversed


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median"])
def test_with_too_few_keys_to_trim_the_grouping_does_not_change_the_step(aggregation):
    # Two keys share four deltas (fewer votes than min_paths_for_robust): whichever key sent
    # which, nothing is clipped and the step is the weighted mean of the deltas, bit for bit.
    g = torch.Generator().manual_seed(2)
    deltas = [({"w": 1 + 0.1 * torch.randn(32, generator=g)}, 100 * (i + 1)) for i in range(4)]
    s = OuterSettings(aggregation=aggregation, rescale="norm")
    steps = [
        outer_gradient(deltas, s, info := {}, voters)["w"]
        for voters in (["a", "a", "a", "b"], ["a", "b", "b", "b"], ["a", "b", "a", "b"])
    ]
    assert info["aggregation"] == "clipped_mean" and info["voters"] == 2
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[0], steps[2])
    mean = outer_gradient(deltas, replace(s, aggregation="mean"))["w"]
    assert torch.allclose(steps[0], mean, atol=1e-6)


def test_each_module_steps_at_the_lr_of_its_sharing_count(prepared_tiny, tiny_config, tmp_path):
    """outer.lr_by_sharing: in a 2x2, the embedding and head (4 paths) step at one lr and the
    level modules (2 paths each) at another. With the shared modules' lr a millionth of the
    level modules', after a round they have barely moved while the level modules moved."""
    import threading

    from dipaco.prepare.pipeline import prepare
    from dipaco.run.factory import build_coordinator
    from dipaco.run.local import run_local_peers
    from dipaco.run.metrics_log import MetricsLog

    config = tiny_config.replace(
        train={"inner_steps": 4, "rounds": 1},
        outer={"momentum": 0.0, "lr_by_sharing": {"4": 1e-6, "2": 1.0}},
    )
    root = tmp_path / "run"
    prep = prepare(root, config, reuse=prepared_tiny)
    co = build_coordinator(prep, MetricsLog(root / "m.jsonl"), evaluate=False)
    before = {
        mid: {k: v.clone() for k, v in co.store.params(mid).items()} for mid in co.store.modules
    }
    assert co.outer_settings_of("S.embed").lr == 1e-6
    assert co.outer_settings_of("L0.M1").lr == 1.0
    threads = run_local_peers(co, prep, 1, stop=threading.Event())
    for t in threads:
        t.join(120)
    assert co.finished and co.failure is None

    def moved(mid: str) -> float:
        after = co.store.params(mid)
        change = sum(float((after[k] - before[mid][k]).norm() ** 2) for k in after) ** 0.5
        return change / sum(float(v.norm() ** 2) for v in before[mid].values()) ** 0.5

    for mid in ("S.embed", "S.head"):
        assert moved(mid) < 1e-6, mid
    for mid in ("L0.M0", "L0.M1", "L1.M0", "L1.M1"):
        assert moved(mid) > 1e-4, mid


def test_outer_settings_default_to_the_run_configs():
    """One source for every default: a step made without a config (the simulator, a bench)
    is the one a default run makes."""
    from dataclasses import replace

    from dipaco.config import RunConfig
    from dipaco.run.factory import outer_settings

    # Only the robust combiner differs: "auto" takes it for the default (open) run, and the
    # paper's mean when a step has no run to ask.
    default_run = outer_settings(RunConfig())
    assert default_run.aggregation == "trimmed_mean"
    assert OuterSettings() == replace(default_run, aggregation="mean")
