"""The delta-norm judge and the robust combiners, as pure functions (hand-checked numbers)."""

import json
import math

import pytest
import torch

from dipaco.config import load_config_dict
from dipaco.coordinator.outer import OuterSettings, outer_gradient
from dipaco.coordinator.validation import (
    NormTracker,
    clip_to_median_norm,
    coordinate_median,
    delta_norm,
    nonfinite,
    trim_count,
    trimmed_mean,
    weighted_mean,
)
from dipaco.errors import ConfigError, CorruptFileError
from dipaco.run.factory import heldout_check, outer_settings


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def honest_and_poisoned(n_honest=4, seed=0, poison=50.0):
    g = torch.Generator().manual_seed(seed)
    honest = [
        {"w": torch.randn(6, 5, generator=g) * 0.01, "b": torch.randn(5, generator=g) * 0.01}
        for _ in range(n_honest)
    ]
    bad = {k: v * poison for k, v in honest[0].items()}
    return honest, bad


def distance(a, b):
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


def test_trimmed_mean_and_median_by_hand():
    deltas = [{"w": t(1, 10)}, {"w": t(2, 20)}, {"w": t(3, 30)}, {"w": t(1000, -1000)}]
    # k = ceil(0.2 * 4) = 1 per end: coordinate 0 keeps [2, 3], coordinate 1 keeps [10, 20].
    assert trim_count(4, 0.2) == 1 and trim_count(3, 0.4) == 1 and trim_count(10, 0.2) == 2
    assert trim_count(4, 0.0) == 0 and trim_count(2, 0.45) == 0  # one value always stays
    assert trimmed_mean(deltas, None, 0.2)["w"].tolist() == pytest.approx([2.5, 15.0])
    # Weights apply to the values kept, renormalised: coordinate 0 keeps 2 (w=3) and 3 (w=1).
    weighted = trimmed_mean(deltas, [1.0, 3.0, 1.0, 1.0], 0.2)["w"].tolist()
    assert weighted == pytest.approx([(2 * 3 + 3) / 4, (10 + 20 * 3) / 4])
    assert coordinate_median(deltas)["w"].tolist() == pytest.approx([2.5, 15.0])
    assert coordinate_median(deltas[:3])["w"].tolist() == pytest.approx([2.0, 20.0])
    # trim fraction 0 is the weighted mean.
    assert torch.allclose(
        trimmed_mean(deltas, [1, 2, 3, 4], 0.0)["w"], weighted_mean(deltas, [1, 2, 3, 4])["w"]
    )


@pytest.mark.parametrize("combine", ["trimmed_mean", "median"])
def test_robust_combiners_drop_a_poisoned_path(combine):
    honest, bad = honest_and_poisoned()
    poisoned = [bad, *honest[1:]]
    truth = weighted_mean(honest)
    fn = (lambda d: trimmed_mean(d, None, 0.2)) if combine == "trimmed_mean" else coordinate_median
    robust, plain = fn(poisoned), weighted_mean(poisoned)
    # The plain mean is dragged about 49/4 honest deltas away; the robust centre stays close.
    assert distance(plain, truth) > 10 * distance(robust, truth)
    for name in robust:  # every coordinate stays within the honest paths' range
        stack = torch.stack([h[name].double() for h in honest])
        assert (robust[name] <= stack.max(0).values + 1e-12).all()
        assert (robust[name] >= stack.min(0).values - 1e-12).all()


def test_clip_to_median_norm_bounds_the_outlier_only():
    honest, bad = honest_and_poisoned(n_honest=2)
    clipped, factors = clip_to_median_norm([honest[1], bad], ratio=3.0)
    # The lower median is the honest norm: the poisoned delta is scaled to 3x it, the other kept.
    assert factors[0] == 1.0 and factors[1] < 1.0
    assert clipped[0] is honest[1]
    assert delta_norm(clipped[1]) == pytest.approx(3 * delta_norm(honest[1]), rel=1e-5)
    assert clip_to_median_norm([honest[0]], 3.0)[1] == [1.0]  # one path: nothing to compare


def test_outer_gradient_robust_modes_keep_the_sqrt_rescale_and_report_clipping():
    honest, bad = honest_and_poisoned()
    deltas = [(bad, 100.0)] + [(h, 100.0) for h in honest[1:]]
    info: dict = {}
    g = outer_gradient(deltas, OuterSettings(aggregation="median", rescale="sqrt"), info)
    assert info["aggregation"] == "median"
    expected = coordinate_median([d for d, _ in deltas])
    assert torch.allclose(g["w"], (2.0 * expected["w"]).float())  # sqrt(4) = 2
    two: dict = {}
    outer_gradient(deltas[:2], OuterSettings(aggregation="trimmed_mean", rescale="sqrt"), two)
    assert two["aggregation"] == "clipped_mean" and two["clip_factors"][0] < 1.0
    plain: dict = {}
    mean = outer_gradient(deltas, OuterSettings(rescale="sqrt"), plain)
    assert plain == {"aggregation": "mean", "rescale": 2.0}
    same = outer_gradient(
        deltas, OuterSettings(aggregation="trimmed_mean", trim_fraction=0.0, rescale="sqrt")
    )
    assert torch.allclose(mean["w"], same["w"], atol=1e-7)


def test_tracker_judges_by_median_and_mad_once_it_has_enough(tmp_path):
    tr = NormTracker(tmp_path / "v.json", min_observations=4, mads=6.0, ratio=3.0)
    assert tr.judge("m", 1e9).action == "ok"  # nothing known yet: only max_norm could refuse
    for x in [1.0, 1.1, 0.9, 1.05]:
        tr.record("m", x)
    med, mad, count = tr.stats("m")
    assert (med, count) == (pytest.approx(1.0), 4) and mad == pytest.approx(0.05)
    # bound = max(1.0 + 6 * 0.05, 3 * 1.0) = 3.0
    assert tr.bound("m") == pytest.approx(3.0)
    assert tr.judge("m", 2.9).action == "ok"
    assert tr.judge("m", 0.0).action == "ok"  # small deltas are never refused
    huge = tr.judge("m", 1e6)
    assert huge.action == "reject" and huge.limit == pytest.approx(3.0) and "median" in huge.why
    assert tr.judge("other", 1e6).action == "ok"  # per module
    assert tr.judge("m", math.inf).action == "reject"
    clip = NormTracker(None, mode="clip", min_observations=1)
    clip.record("m", 2.0)
    assert clip.judge("m", 100.0).action == "clip" and clip.judge("m", 100.0).limit == 6.0
    off = NormTracker(None, mode="off", min_observations=1, max_norm=50.0)
    off.record("m", 2.0)
    assert off.judge("m", 40.0).action == "ok"  # the statistics are off...
    assert off.judge("m", 60.0).action == "reject"  # ...the absolute bound is not
    first = NormTracker(None, max_norm=5.0)
    assert first.judge("m", 6.0).action == "reject"  # max_norm holds from the first delta
    assert first.judge("m", 4.0).action == "ok"


def test_tracker_mad_rule_catches_outliers_of_a_spread_module():
    tr = NormTracker(None, min_observations=4, mads=6.0, ratio=1.0)
    for x in [1.0, 2.0, 3.0, 4.0, 5.0]:
        tr.record("m", x)
    # median 3, MAD 1: bound max(3 + 6, 1 * 3) = 9.
    assert tr.bound("m") == pytest.approx(9.0)
    assert tr.judge("m", 8.9).action == "ok" and tr.judge("m", 9.1).action == "reject"


def test_tracker_window_and_persistence_across_restart(tmp_path):
    path = tmp_path / "validation.json"
    tr = NormTracker(path, window=5, min_observations=4)
    for x in range(1, 9):
        tr.record("m", float(x))
    tr.save()
    again = NormTracker(path, window=5, min_observations=4)
    assert list(again.norms["m"]) == [4.0, 5.0, 6.0, 7.0, 8.0]  # the last window only
    assert again.bound("m") == tr.bound("m") and again.judge("m", 1e6).action == "reject"
    assert json.loads(path.read_text())["norms"]["m"] == [4.0, 5.0, 6.0, 7.0, 8.0]
    path.write_text("{oops")
    with pytest.raises(CorruptFileError, match="validation.json"):
        NormTracker(path)
    path.write_text(json.dumps({"norms": {"m": ["x"]}}))
    with pytest.raises(CorruptFileError):
        NormTracker(path)


def test_tracker_judges_a_delta_by_the_norms_of_its_round_and_those_before(tmp_path):
    path = tmp_path / "validation.json"
    tr = NormTracker(path, min_observations=3, mads=6.0, ratio=3.0)
    for x in [1.0, 1.1, 0.9]:
        tr.record("m", x, 0)  # the first round's deltas are large...
    for x in [0.2, 0.25, 0.22, 0.21, 0.24]:
        tr.record("m", x, 1)  # ...the next round's far smaller
    assert tr.judge("m", 1.05, 0).action == "ok"  # a late round-0 delta: as its round's
    late = tr.judge("m", 1.05, 1)  # as a round-1 delta it is an outlier
    assert late.action == "reject" and "rounds up to 1" in late.why
    assert tr.judge("m", 1.05).action == "reject"  # no round: every norm, as before
    assert tr.stats("m", 0)[2] == 3 and tr.stats("m", 1)[2] == 8
    tr.save()
    again = NormTracker(path, min_observations=3, mads=6.0, ratio=3.0)
    assert list(again.rounds["m"]) == [0, 0, 0, 1, 1, 1, 1, 1]
    assert again.judge("m", 1.05, 0).action == "ok" and tr.snapshot() == again.snapshot()
    assert json.loads(tr.snapshot_bytes()) == tr.snapshot()
    # A file from before the rounds were kept: its norms count for every round.
    path.write_text(json.dumps({"norms": {"m": [1.0, 1.1, 0.9]}}))
    old = NormTracker(path, min_observations=3)
    assert list(old.rounds["m"]) == [0, 0, 0] and old.stats("m", 0)[2] == 3
    path.write_text(json.dumps({"norms": {"m": [1.0, 1.1]}, "rounds": {"m": [0]}}))
    with pytest.raises(CorruptFileError):
        NormTracker(path)


def _listed():
    return {"security": {"join": "allow-list"}}


def test_validation_config_defaults_and_errors():
    cfg = load_config_dict({})
    v = cfg.validation
    assert (v.norm_check, v.aggregation, v.max_norm, v.heldout_check) == (
        "reject",
        "auto",
        None,
        "auto",
    )
    # "auto": robust and scored where anyone may join, the paper's mean unscored on an allow-list.
    assert outer_settings(cfg).aggregation == "trimmed_mean" and heldout_check(cfg)
    listed = load_config_dict({"security": {"join": "allow-list"}})
    assert outer_settings(listed).aggregation == "mean" and not heldout_check(listed)
    assert heldout_check(load_config_dict({"validation": {"heldout_check": True}, **_listed()}))
    assert not heldout_check(load_config_dict({"validation": {"heldout_check": False}}))
    with pytest.raises(ConfigError, match="validation.heldout_check"):
        load_config_dict({"validation": {"heldout_check": "sometimes"}})
    assert cfg.validation.copy_cosine == "auto"
    assert load_config_dict({"validation": {"copy_cosine": False}}).validation.copy_cosine is None
    assert load_config_dict({"validation": {"copy_cosine": 0.999}}).validation.copy_cosine == 0.999
    for bad in (0, 1.5, True, "sometimes"):
        with pytest.raises(ConfigError, match="validation.copy_cosine"):
            load_config_dict({"validation": {"copy_cosine": bad}})
    chosen = load_config_dict(
        {"security": {"join": "allow-list"}, "validation": {"aggregation": "median"}}
    )
    assert outer_settings(chosen).aggregation == "median"
    with pytest.raises(ConfigError, match="validation.trim_fraction"):
        load_config_dict({"validation": {"trim_fraction": 0.5}})
    with pytest.raises(ConfigError, match="validation.aggregation"):
        load_config_dict({"validation": {"aggregation": "mode"}})
    with pytest.raises(ConfigError, match="norm_window"):
        load_config_dict({"validation": {"norm_window": 2, "min_observations": 4}})


def test_auto_takes_the_mean_where_the_heldout_check_scores_every_delta(tmp_path):
    from dipaco.model.transformer import new_dense_model
    from dipaco.run.factory import coordinator_for

    def build(name, validation, heldout=True):
        config = load_config_dict({"validation": validation, "topology": {"levels": "2x2"}})
        co = coordinator_for(
            config,
            tmp_path / name,
            run_id=name,
            peer_config={},
            heldout_loss=(lambda p, modules: 1.0) if heldout else None,
        )
        model = new_dense_model(config.build_model_config(), 0)
        co.start(co.topology.init_modules(model.state_dict()))
        return co

    checked = build("checked", {"heldout_check": True})
    assert checked.outer.aggregation == "trimmed_mean"
    assert {
        checked.outer_settings_of(mid).aggregation for mid in checked.topology.module_ids()
    } == {"mean"}
    default = build("default", {})  # an open run scores every delta by default
    assert default.heldout_loss is not None
    assert default.outer_settings_of("S.embed").aggregation == "mean"
    plain = build("plain", {"heldout_check": False})  # no held-out check: every module robust
    assert plain.heldout_loss is None
    assert plain.outer_settings_of("S.embed").aggregation == "trimmed_mean"
    chosen = build("chosen", {"heldout_check": True, "aggregation": "median"})
    assert chosen.outer_settings_of("S.embed").aggregation == "median"
    unscored = build("unscored", {"heldout_check": True}, heldout=False)
    assert unscored.outer_settings_of("S.embed").aggregation == "trimmed_mean"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_a_modules_norm_and_its_nan_or_inf_are_found_whatever_the_dtype(dtype, strided):
    """Float32/16/64 modules are measured at once in NumPy; bfloat16 and strided tensors the
    slow way, per tensor in torch: the same answers."""
    g = torch.Generator().manual_seed(1)
    delta = {
        "w": torch.randn(64, 33, generator=g).to(dtype),
        "b": torch.randn(33, generator=g).to(dtype),
        "s": torch.tensor(2.5, dtype=dtype),  # a scalar, as a norm's gain can be
    }
    if strided:
        delta["t"] = torch.randn(8, 8, generator=g).to(dtype).t()
    exact = math.sqrt(sum(float((v.double() ** 2).sum()) for v in delta.values()))
    assert delta_norm(delta) == pytest.approx(exact, rel=1e-12)
    assert nonfinite(delta) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = {k: v.clone() for k, v in delta.items()}
        spoiled["b"][7] = bad
        assert nonfinite(spoiled) == "b"
        assert not math.isfinite(delta_norm(spoiled))


def test_a_run_is_diverging_when_half_its_paths_score_worse_than_at_their_start(tmp_path):
    from dipaco.coordinator.keyscores import KeyScores

    scores = KeyScores(tmp_path / "k.json", 0.1)
    for p in range(4):
        scores.scored(p, 4.0)
    scores.scored(3, 4.8)  # one path worse: a path that loses to the others, not a divergence
    assert not scores.diverging()
    scores.scored(2, 4.5)
    assert scores.diverging()
    scores.scored(2, 4.05)  # within the tolerance
    assert not scores.diverging()


def test_a_key_whose_deltas_help_other_paths_more_than_their_own_is_weighed_then_refused(
    tmp_path,
):
    """A delta trained on another path's shard helps its own path's held-out documents less
    than other paths' (bench/poison.py other-shard-25: the median specific gain of such deltas
    was below 0, an honest one's above). Once a key has sent two, half or more of its compared
    deltas, each further one is weighed 0.02 and refused once per path and round; an honest
    key with one such delta among several keeps its full weight."""
    from dipaco.coordinator.keyscores import MIN_USEFUL, KeyScores

    scores = KeyScores(tmp_path / "k.json", 0.1)
    for k in range(4):  # round 0: the yardstick (other keys' gains of 0.2)
        scores.judge(f"honest{k}", 5.0, 4.8, 0, path=k, foreign=0.1)
    honest = scores.judge("honest0", 5.0, 4.85, 1, path=0, foreign=0.2)  # one below: 0.15 < 0.2
    assert honest.refuse is None and honest.trust == 1.0
    assert scores.judge("honest0", 5.0, 4.8, 2, path=0, foreign=0.1).trust == 1.0
    first = scores.judge("lazy", 5.0, 4.85, 1, path=5, foreign=0.2)
    assert first.refuse is None and first.trust == 1.0  # one is no pattern
    second = scores.judge("lazy", 5.0, 4.85, 2, path=5, foreign=0.2)
    assert second.refuse == "off-shard" and second.trust == MIN_USEFUL
    again = scores.judge("lazy", 5.0, 4.85, 2, path=5, foreign=0.2)  # its retry: let through
    assert again.refuse is None and again.trust == MIN_USEFUL
    trained = scores.judge("lazy", 5.0, 4.8, 2, path=5, foreign=0.1)  # trained on its shard
    assert trained.refuse is None and trained.trust == 1.0
    # Without a foreign measurement (a coordinator without other paths' documents): no change.
    assert scores.judge("lazy", 5.0, 4.85, 2, path=6).refuse is None
    scores.save()
    assert (
        KeyScores(tmp_path / "k.json", 0.1).offshard
        == scores.offshard
        == {
            "honest0": (2, 1),
            "lazy": (4, 3),
        }
    )
    # A run whose shards do not differ (DiLoCo's random ones): half of the honest deltas help
    # other paths' documents more, by chance; nothing is judged off-shard there.
    diloco = KeyScores(tmp_path / "d.json", 0.1)
    for k in range(4):
        diloco.judge(f"honest{k}", 5.0, 4.8, 0, path=k, foreign=0.1 if k % 2 else 0.3)
    for rnd in (1, 2, 3):
        verdict = diloco.judge("lazy", 5.0, 4.85, rnd, path=5, foreign=0.2)
        assert verdict.refuse is None and verdict.trust == 1.0


def test_key_scores_survive_a_restart_and_refuse_a_damaged_file(tmp_path):
    """What a coordinator knows of each key (its score, its relative gains, the gains of the
    rounds before that are the yardstick, each path's first and latest held-out loss) is the
    same after a restart: the next verdict is the one it would have been."""
    from dipaco.coordinator.keyscores import KeyScores

    def fill(scores):
        for rnd in range(3):
            for k in range(4):
                scores.judge(f"k{k}", 5.0, 5.0 - 0.2 * (k > 0) - 0.001, rnd)
                scores.scored(k, 5.0 + rnd)
        scores.save()

    path = tmp_path / "key_scores.json"
    first = KeyScores(path, 0.1)
    fill(first)
    again = KeyScores(path, 0.1)
    assert (again.scores, again.relative, again.recent, again.paths) == (
        first.scores,
        first.relative,
        first.recent,
        first.paths,
    )
    assert again.diverging() and again.relative["k0"][2] >= 2  # k0 helps nobody
    assert again.judge("k0", 5.0, 5.0, 3) == first.judge("k0", 5.0, 5.0, 3)
    assert again.judge("k0", 8.0, 8.0, 4, path=0).refuse is None  # the run is diverging
    for p in range(4):  # its paths back where they started: no longer diverging
        again.scored(p, 5.0)
    assert not again.diverging()
    assert again.judge("k0", 5.0, 5.0, 4, path=9).refuse == "useless"
    # Trained again from the same base, the same delta: let through at its low weight.
    assert again.judge("k0", 5.0, 5.0, 4, path=9).refuse is None
    path.write_text('{"scores": {"k": [NaN, 1]}}')
    with pytest.raises(CorruptFileError):
        KeyScores(path, 0.1)
    path.write_text('{"scores": {}, "relative": {"k": [0.5]}}')
    with pytest.raises(CorruptFileError):
        KeyScores(path, 0.1)
