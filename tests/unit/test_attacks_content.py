"""Poisoned delta content against a real coordinator core, driven through its wire handler.

Every attack must be refused with its reason and counted against the peer, and leave the
modules exactly as a coordinator that never saw it (or, for a delta that passes every check,
move them far less than a plain mean would).
"""

import math
import threading

import pytest
import torch
from _tiny import delta_message

from dipaco.config import ValidationSection
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import RejectedError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.protocols import messages as m
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
TOPO = Topology.parse("2x2", 2)  # S.embed and S.head are on all 4 paths, level modules on 2
INIT = TOPO.init_modules(new_dense_model(CFG, 0).state_dict())


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


COPY_COSINE = 0.9999  # validation.copy_cosine as docs/security.md recommends it
KEYS: dict[str, Identity] = {}  # one key per peer name, the same after a coordinator restart


class Swarm:
    """A coordinator and one transport, with its own key, per peer name (or one key for all
    the peers named in ``shared_key``: one party running several peers)."""

    def __init__(
        self, root, rounds=4, validation=None, outer=None, heldout_loss=None, shared_key=()
    ):
        self.events: list[dict] = []
        self.shared_key = set(shared_key)
        self.one_key = Identity.generate()
        self.co = Coordinator(
            root,
            TOPO,
            rounds=rounds,
            inner_steps=5,
            step_offset=10,
            total_steps=40,
            seed=0,
            outer=outer or OuterSettings(),
            lease_seconds=100.0,
            run_id="attacks",
            peer_config={},
            clock=Clock(),
            metrics=self.events.append,
            validation=validation,
            heldout_loss=heldout_loss,
        )
        self.co.start(INIT)
        self.transports: dict[str, LocalTransport] = {}

    def tr(self, peer):
        if peer not in self.transports:
            key = (
                self.one_key
                if peer in self.shared_key
                else KEYS.setdefault(peer, Identity.generate())
            )
            self.transports[peer] = LocalTransport(self.co.handle).authenticate(key)
        return self.transports[peer]

    def claim(self, path):
        peer = f"peer{path}"
        task = self.tr(peer).request(m.ClaimTask(peer_id=peer, prefer_path=path))
        assert isinstance(task, m.TaskOffer) and task.path == path
        return task

    def submit(self, task, tensors, **override):
        peer = f"peer{task.path}"
        msg = delta_message(task, peer, tensors, **{"ticket": "", **override})
        return self.tr(peer).request(msg)

    def params(self):
        return {mid: self.co.store.params(mid) for mid in TOPO.module_ids()}


def honest(path, rnd, scale=0.01):
    """A plausible delta: noise, different per path and round, the same in every coordinator."""
    g = torch.Generator().manual_seed(1000 * rnd + path)
    return {
        f"{mid}/{k}": torch.randn(v.shape, generator=g) * scale
        for mid in TOPO.path_modules(path)
        for k, v in INIT[mid].items()
    }


def honest_round(swarm, rnd, skip=()):
    for p in range(TOPO.num_paths):
        if p not in skip:
            swarm.submit(swarm.claim(p), honest(p, rnd))


def first_key(tensors, mid="S.embed"):
    return next(k for k in tensors if k.startswith(mid + "/"))


def poison(kind, tensors):
    key = first_key(tensors)
    bad = dict(tensors)
    if kind == "nan":
        bad[key] = bad[key].clone()
        bad[key][0, 0] = float("nan")
    elif kind == "inf":
        bad[key] = bad[key].clone()
        bad[key][1, 2] = -float("inf")
    elif kind == "shape":
        bad[key] = bad[key][:, :-1].contiguous()
    elif kind == "dtype":
        bad[key] = bad[key].double()
    elif kind == "huge":
        bad = {k: v * 1e6 for k, v in tensors.items()}
    return bad


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("nan", "non-finite"),
        ("inf", "non-finite"),
        ("shape", "wrong-shape"),
        ("dtype", "wrong-dtype"),
        ("huge", "huge-norm"),
    ],
)
def test_bad_content_is_refused_counted_and_leaves_no_trace(tmp_path, kind, reason):
    attacked, reference = Swarm(tmp_path / "attacked"), Swarm(tmp_path / "reference")
    for swarm in (attacked, reference):  # two normal rounds: the norm statistics fill up
        honest_round(swarm, 0)
        honest_round(swarm, 1)
    assert attacked.co.norms.bound("L0.M0") is not None  # 2 paths x 2 rounds observed
    task = attacked.claim(0)
    with pytest.raises(RejectedError) as err:
        attacked.submit(task, poison(kind, honest(0, 2)))
    assert err.value.reason == reason
    assert attacked.co.rejections[reason] == 1
    assert attacked.co.rejections_by_peer["peer0"][reason] == 1
    assert sum(attacked.co.rejections.values()) == 1
    status = attacked.co.status().state
    assert status["rejections_by_peer"]["peer0"] == {reason: 1}
    assert all(not r["pending"] for r in status["modules"].values())  # nothing was stored
    # The same peer then delivers an honest delta; the round ends as if the attack never was.
    attacked.submit(task, honest(0, 2))
    honest_round(attacked, 2, skip={0})
    honest_round(reference, 2)
    assert {attacked.co.store.version(mid) for mid in TOPO.module_ids()} == {3}
    for mid, params in reference.params().items():
        for k, v in params.items():
            assert torch.equal(v, attacked.co.store.params(mid)[k]), (mid, k)
    # The refused norm did not enter the statistics either.
    assert attacked.co.norms.norms == reference.co.norms.norms


def test_a_huge_norm_is_refused_even_after_a_restart(tmp_path):
    swarm = Swarm(tmp_path)
    honest_round(swarm, 0)
    honest_round(swarm, 1)
    again = Swarm(tmp_path)  # the statistics come back from validation.json
    assert again.co.norms.norms == swarm.co.norms.norms and again.co.norms.norms
    with pytest.raises(RejectedError) as err:
        again.submit(again.claim(2), poison("huge", honest(2, 2)))
    assert err.value.reason == "huge-norm" and "median" in str(err.value)


def test_max_norm_refuses_from_the_first_round(tmp_path):
    swarm = Swarm(tmp_path, validation=ValidationSection(max_norm=10.0))
    task = swarm.claim(1)
    with pytest.raises(RejectedError) as err:
        swarm.submit(task, honest(1, 0, scale=1.0))  # norm ~ 90 for S.embed
    assert err.value.reason == "huge-norm" and "max_norm" in str(err.value)
    assert swarm.co.rejections_by_peer["peer1"]["huge-norm"] == 1
    assert swarm.submit(task, honest(1, 0)).accepted  # a normal delta is fine


def test_clip_mode_scales_a_huge_delta_down_and_says_so(tmp_path):
    validation = ValidationSection(norm_check="clip")
    clipped, reference = Swarm(tmp_path / "c", validation=validation), Swarm(tmp_path / "r")
    for swarm in (clipped, reference):
        honest_round(swarm, 0)
        honest_round(swarm, 1)
    bound = clipped.co.norms.bound("S.embed")
    ack = clipped.submit(clipped.claim(0), poison("huge", honest(0, 2)))
    assert sorted(ack.accepted) == sorted(TOPO.path_modules(0))
    events = [e for e in clipped.events if e["event"] == "delta_clipped"]
    assert {e["module"] for e in events} == set(TOPO.path_modules(0))
    embed = next(e for e in events if e["module"] == "S.embed")
    assert embed["clipped_to"] == pytest.approx(bound) and embed["norm"] > 1e3 * bound
    stored = clipped.co.store.delta_tensors(clipped.co.store.modules["S.embed"].pending[0])
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in stored.values()))
    assert norm == pytest.approx(bound, rel=1e-4)
    assert clipped.co.rejections == {}


def run_poisoned_round(root, aggregation, poisoned):
    outer = OuterSettings(aggregation=aggregation, trim_fraction=0.2, min_paths_for_robust=3)
    swarm = Swarm(root, rounds=2, outer=outer)
    for p in range(TOPO.num_paths):
        tensors = honest(p, 0)
        if poisoned and p == 0:
            tensors = {k: v * 50 for k, v in tensors.items()}
        swarm.submit(swarm.claim(p), tensors)
    assert {swarm.co.store.version(mid) for mid in TOPO.module_ids()} == {1}
    return swarm


def distance(a, b):
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median"])
def test_robust_aggregation_limits_a_scaled_delta_that_passes_the_checks(tmp_path, aggregation):
    # Round 0: no statistics yet, so the x50 delta of path 0 is accepted; only the outer step
    # can limit it. S.embed/S.head (4 paths) use the robust combiner, L0.M0/L1.M0 (2 paths:
    # too few) clip it to 3x the median norm.
    truth = run_poisoned_round(tmp_path / "truth", "mean", poisoned=False).params()
    plain = run_poisoned_round(tmp_path / "plain", "mean", poisoned=True)
    robust = run_poisoned_round(tmp_path / "robust", aggregation, poisoned=True)
    assert robust.co.rejections == {} and plain.co.rejections == {}
    for mid in TOPO.path_modules(0):
        moved_plain = distance(plain.params()[mid], truth[mid])
        moved_robust = distance(robust.params()[mid], truth[mid])
        assert moved_plain > 8 * moved_robust, (mid, moved_plain, moved_robust)
    # A module path 0 does not cross is untouched by the poison (and by the combiner choice:
    # it has two paths, neither clipped, so the clipped mean is the plain mean).
    for k, v in truth["L0.M1"].items():
        assert torch.allclose(robust.params()["L0.M1"][k], v, atol=1e-7)
    steps = {e["module"]: e for e in robust.events if e["event"] == "outer_step"}
    assert steps["S.embed"]["aggregation"] == aggregation and not steps["S.embed"]["clipped"]
    assert steps["L0.M0"]["aggregation"] == "clipped_mean"
    assert [c["path"] for c in steps["L0.M0"]["clipped"]] == [0]
    clipped = [e for e in robust.events if e["event"] == "delta_clipped"]
    assert {(e["module"], e["peer"], e["stage"]) for e in clipped} == {
        ("L0.M0", "peer0", "aggregation"),
        ("L1.M0", "peer0", "aggregation"),
    }


def test_heldout_check_refuses_a_delta_that_makes_its_path_worse(tmp_path):
    # A stand-in held-out loss: the squared distance of the path's parameters to a target that
    # honest deltas (params - delta) move towards.
    target = {mid: {k: v - 0.01 for k, v in t.items()} for mid, t in INIT.items()}

    def loss(path, modules):
        return sum(
            float(((modules[mid][k] - target[mid][k]) ** 2).sum())
            for mid in TOPO.path_modules(path)
            for k in modules[mid]
        )

    validation = ValidationSection(heldout_check=True, heldout_tolerance=0.0)
    swarm = Swarm(tmp_path, validation=validation, heldout_loss=loss)
    task = swarm.claim(3)
    good = {
        f"{mid}/{k}": torch.full_like(v, 0.01)
        for mid in TOPO.path_modules(3)
        for k, v in INIT[mid].items()
    }
    with pytest.raises(RejectedError) as err:
        swarm.submit(task, {k: -v for k, v in good.items()})  # a sign-flipped (ascent) delta
    assert err.value.reason == "worse-heldout"
    assert swarm.co.rejections_by_peer["peer3"] == {"worse-heldout": 1}
    assert all(not r.pending for r in swarm.co.store.modules.values())
    assert swarm.submit(task, good).accepted
    checks = [e for e in swarm.events if e["event"] == "heldout_check"]
    assert len(checks) == 2 and checks[1]["after"] < checks[1]["before"]


def test_a_held_out_evaluation_does_not_hold_up_other_peers(tmp_path):
    # The check's forward passes run outside the coordinator's lock: while one is under way
    # (held here until another peer has been served), a claim from another peer is answered.
    evaluating, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def loss(path, modules):
        calls.append(path)
        evaluating.set()
        assert release.wait(10), "the other peer's claim was never answered"
        return 1.0 if len(calls) == 1 else 0.5  # before, then after: the delta helps

    validation = ValidationSection(heldout_check=True, heldout_tolerance=0.0)
    swarm = Swarm(tmp_path, validation=validation, heldout_loss=loss)
    task = swarm.claim(0)
    swarm.tr("peer1")  # its key, made before the race
    result: dict = {}
    pusher = threading.Thread(target=lambda: result.update(ack=swarm.submit(task, honest(0, 0))))
    pusher.start()
    assert evaluating.wait(10)
    other = swarm.claim(1)  # served while the first delta is being scored
    release.set()
    pusher.join(10)
    assert other.path == 1 and result["ack"].accepted
    assert [e["path"] for e in swarm.events if e["event"] == "heldout_check"] == [0]


def test_heldout_check_with_a_prepared_runs_own_documents(prepared_tiny, tiny_config, tmp_path):
    from dipaco.prepare.pipeline import prepare
    from dipaco.run.evaluate import heldout_scorer
    from dipaco.run.factory import coordinator_for

    prep = prepare(prepared_tiny, tiny_config)
    score = heldout_scorer(prep)
    config = tiny_config.replace(validation={"heldout_check": True, "aggregation": "median"})
    co = coordinator_for(config, tmp_path, run_id="heldout", peer_config={}, heldout_loss=score)
    assert co.validation.heldout_check and co.outer.aggregation == "median"
    topo = config.build_topology()
    co.start(topo.init_modules(prep.initial_state()))
    path = next(p for p in range(topo.num_paths) if prep.heldout_docs(p))
    current = {mid: co.store.params(mid) for mid in topo.path_modules(path)}
    before = score(path, current)
    assert math.isfinite(before) and score(path, current) == before
    tr = LocalTransport(co.handle)
    task = tr.request(m.ClaimTask(peer_id="noisy", prefer_path=path))
    g = torch.Generator().manual_seed(0)
    noise = {
        f"{mid}/{k}": torch.randn(v.shape, generator=g)
        for mid, t in current.items()
        for k, v in t.items()
    }
    msg = m.SubmitDelta(
        peer_id="noisy",
        task_id=task.task_id,
        path=path,
        base_versions=task.module_versions,
        tokens=100,
        losses=[1.0],
        tensors=noise,
    )
    with pytest.raises(RejectedError) as err:
        tr.request(msg)
    assert err.value.reason == "worse-heldout"
    assert co.rejections_by_peer["noisy"] == {"worse-heldout": 1}
    # The key's usefulness score fell with it: a delta from it that does not improve its path
    # (no change at all) is refused too, while one that does not make it worse by the tolerance
    # would have passed from a key in good standing.
    msg.tensors = {k: torch.zeros_like(v) for k, v in noise.items()}
    with pytest.raises(RejectedError) as err:
        tr.request(msg)
    assert err.value.reason == "low-score" and "score" in str(err.value)
    assert co.rejections_by_peer["noisy"] == {"worse-heldout": 1, "low-score": 1}
    (scored,) = co.status().state["key_scores"].values()
    assert scored["checks"] == 2 and scored["score"] < -co.validation.heldout_tolerance / 2


def flipped_round(root, shared_key):
    """Round 0 of a median run where paths 0 and 1 send sign-flipped deltas at 2.5x; peers 0
    and 1 are one key or two."""
    swarm = Swarm(
        root,
        validation=ValidationSection(aggregation="median"),
        outer=OuterSettings(aggregation="median"),
        shared_key=shared_key,
    )
    for p in range(TOPO.num_paths):
        tensors = agreeing(p)
        if p in (0, 1):
            tensors = {k: -2.5 * v for k, v in tensors.items()}
        swarm.submit(swarm.claim(p), tensors)
    return swarm


def agreeing(path):
    """Honest deltas that agree on a direction (as trained ones do), with per-path noise."""
    return {k: 0.01 + 0.3 * v for k, v in honest(path, 0).items()}


def test_one_key_holding_half_a_modules_paths_is_one_vote(tmp_path):
    # S.embed is on all four paths. As two keys, the flipped half makes the median the midpoint
    # of an honest and a flipped value; as one key, it is one vote of three.
    truth = Swarm(tmp_path / "truth", outer=OuterSettings(aggregation="median"))
    for p in range(TOPO.num_paths):
        truth.submit(truth.claim(p), agreeing(p))
    sybil = flipped_round(tmp_path / "sybil", shared_key=())
    one = flipped_round(tmp_path / "one", shared_key=("peer0", "peer1"))
    steps = {e["module"]: e for e in one.events if e["event"] == "outer_step"}
    assert steps["S.embed"]["voters"] == 3
    assert [
        e["voters"] for e in sybil.events if e["event"] == "outer_step" and e["module"] == "S.embed"
    ] == [4]
    moved_one = distance(one.params()["S.embed"], truth.params()["S.embed"])
    moved_sybil = distance(sybil.params()["S.embed"], truth.params()["S.embed"])
    assert moved_one < moved_sybil / 2, (moved_one, moved_sybil)


def test_the_voter_of_a_stored_delta_survives_a_restart(tmp_path):
    swarm = Swarm(tmp_path, shared_key=("peer0", "peer1"))
    swarm.submit(swarm.claim(0), honest(0, 0))
    swarm.submit(swarm.claim(1), honest(1, 0))
    voters = {p: d.vote for p, d in swarm.co.store.modules["S.embed"].pending.items()}
    again = Swarm(tmp_path)
    assert {p: d.vote for p, d in again.co.store.modules["S.embed"].pending.items()} == voters
    assert voters[0] == voters[1] == swarm.one_key.public_key


def test_a_key_whose_deltas_keep_hurting_is_weighted_down_then_refused(tmp_path):
    # A stand-in held-out loss that every honest delta (+0.01 everywhere) lowers by the same
    # amount: the sum of the path's parameters. Key peer0 sends -0.6 times that: each of its
    # deltas stays under the per-delta tolerance, so only the key's score can stop it.
    def loss(path, modules):
        return sum(
            float(modules[mid][k].sum()) for mid in TOPO.path_modules(path) for k in modules[mid]
        )

    def good(path, scale=1.0):
        return {
            f"{mid}/{k}": torch.full_like(v, 0.01 * scale)
            for mid in TOPO.path_modules(path)
            for k, v in INIT[mid].items()
        }

    cost = sum(float(v.sum()) for v in good(0).values())  # an honest delta's gain
    validation = ValidationSection(heldout_check=True, heldout_tolerance=cost)
    swarm = Swarm(tmp_path, rounds=6, validation=validation, heldout_loss=loss)
    refused = []
    for rnd in range(4):
        for p in range(TOPO.num_paths):
            task = swarm.claim(p)
            harmful = p == 0
            try:
                swarm.submit(task, good(p, -0.6) if harmful else good(p))
            except RejectedError as err:
                refused.append((rnd, p, err.reason))
                swarm.tr(f"peer{p}").request(
                    m.ReleaseTask(peer_id=f"peer{p}", task_id=task.task_id)
                )
                swarm.submit(swarm.claim(p), good(p))  # the path is trained by someone honest
    checks = [e for e in swarm.events if e["event"] == "heldout_check"]
    mild = [e for e in checks if e["peer"] == "peer0"]
    assert all(e["gain"] > -cost for e in mild)  # each one is under the per-delta tolerance
    assert {r for _, _, r in refused} == {"low-score"} and {p for _, p, _ in refused} == {0}
    trusts = [e["trust"] for e in mild if not e["refused"]]
    assert trusts and trusts[0] < 1.0  # weighted down before it was refused
    assert all(e["trust"] == 1.0 and not e["refused"] for e in checks if e["peer"] != "peer0")
    # Refused for its score, or first for helping far less than the honest keys (useless).
    assert {e["refused"] for e in mild if e["refused"]} <= {"low-score", "useless"}
    assert all(e["key_score"] < -cost / 2 for e in mild if e["refused"] == "low-score")
    # An honest delta from the low-scored key still counts: it lifts the score.
    assert [e["refused"] for e in mild if e["gain"] > 0] == [None] * len(refused)
    assert len(swarm.co.status().state["key_scores"]) == TOPO.num_paths


def test_a_key_whose_deltas_help_nobody_is_weighed_to_near_zero(tmp_path):
    """A key that turns lazy after its first round sends a small random step in place of
    training (harmless: under every tolerance, no norm outlier). Its gain is near zero where
    honest keys' gains in the round before were not, so its first such delta is weighed to next
    to nothing, and the next ones are refused (``low-score``): the path goes back and is
    trained. The modules end where honest deltas alone put them; without the check the random
    step is half of the update of every module on two paths."""

    def loss(path, modules):  # the parameters' mean: every honest delta lowers it by 0.01
        values = [modules[mid][k].reshape(-1) for mid in TOPO.path_modules(path) for k in INIT[mid]]
        return float(torch.cat(values).mean())

    def good(path):
        return {
            f"{mid}/{k}": torch.full_like(v, 0.01)
            for mid in TOPO.path_modules(path)
            for k, v in INIT[mid].items()
        }

    def lazy(rnd):  # zero-mean noise, half an honest delta's size
        g = torch.Generator().manual_seed(77 + rnd)
        return {k: torch.randn(v.shape, generator=g) * 0.005 for k, v in good(0).items()}

    def run(name, lazy_key, check=True):
        validation = ValidationSection(heldout_check=check, heldout_tolerance=0.1)
        swarm = Swarm(tmp_path / name, rounds=5, validation=validation, heldout_loss=loss)
        for rnd in range(4):
            for p in (0, 1, 2, 3):  # the yardstick is the round before: the order is no matter
                task = swarm.claim(p)
                try:
                    swarm.submit(task, lazy(rnd) if lazy_key and p == 0 and rnd else good(p))
                except RejectedError as err:
                    refused.setdefault(name, []).append((rnd, p, err.reason))
                    swarm.tr("peer0").request(m.ReleaseTask(peer_id="peer0", task_id=task.task_id))
                    swarm.submit(swarm.claim(p), good(p))  # trained by someone honest
        return swarm

    refused: dict[str, list] = {}

    reference, scored, unchecked = run("ref", False), run("lazy", True), run("plain", True, False)
    events = [e for e in scored.events if e["event"] == "heldout_check"]
    lazy_checks = [e for e in events if e["peer"] == "peer0" and e["gain"] < 0.005]
    assert len(lazy_checks) == 3
    gain = next(e["gain"] for e in events if e["peer"] == "peer1")
    assert all(abs(e["gain"]) < gain / 10 for e in lazy_checks)  # under every tolerance
    assert lazy_checks[0]["trust"] <= 0.05 and not lazy_checks[0]["refused"]  # weighed down
    assert [e["refused"] for e in lazy_checks[1:]] == ["useless", "useless"]  # then refused
    assert refused == {"lazy": [(2, 0, "low-score"), (3, 0, "low-score")]}
    assert all(e["trust"] == 1.0 and not e["refused"] for e in events if e not in lazy_checks)

    def moved(swarm):
        return torch.cat(
            [(swarm.params()["L0.M0"][k] - INIT["L0.M0"][k]).reshape(-1) for k in INIT["L0.M0"]]
        )

    honest_step = moved(reference)
    off_scored = float((moved(scored) - honest_step).norm() / honest_step.norm())
    off_unchecked = float((moved(unchecked) - honest_step).norm() / honest_step.norm())
    assert off_scored < 0.2 * off_unchecked, (off_scored, off_unchecked)


def test_a_replayed_or_rescaled_copy_of_an_earlier_delta_is_refused_as_copied(tmp_path):
    """A key that sends back its own delta of the last round, or another path's delta scaled by
    2.9 (what a Sybil copies from its other key), gets no credit: both are refused as
    ``copied``, counted as hostile, and nothing is stored; an honest delta then completes the
    round as if the copies never came. A retry of the same task is not a copy of itself."""
    copies = ValidationSection(copy_cosine=COPY_COSINE)
    swarm, reference = Swarm(tmp_path / "s", validation=copies), Swarm(tmp_path / "r")
    for s in (swarm, reference):
        honest_round(s, 0)
        honest_round(s, 1)
    task = swarm.claim(0)
    with pytest.raises(RejectedError) as err:
        swarm.submit(task, honest(0, 1))  # its own last round's delta, sent again
    assert err.value.reason == "copied" and "cosine 1.0000" in str(err.value)
    scaled = {k: v * 2.9 for k, v in honest(1, 1).items() if k.startswith("S.")}
    other = swarm.claim(1)
    with pytest.raises(RejectedError) as err:
        swarm.submit(other, {**honest(1, 2), **scaled})  # S.embed and S.head: path 1's, x2.9
    assert err.value.reason == "copied"
    assert swarm.co.rejections["copied"] == 2
    assert swarm.co.access.offences  # hostile: counted towards a ban
    assert all(not r["pending"] for r in swarm.co.status().state["modules"].values())
    ack = swarm.submit(task, honest(0, 2))
    assert swarm.submit(task, honest(0, 2)).accepted == ack.accepted  # the same task's retry
    swarm.submit(other, honest(1, 2))
    honest_round(swarm, 2, skip={0, 1})
    honest_round(reference, 2)
    for mid, params in reference.params().items():
        for k, v in params.items():
            assert torch.equal(v, swarm.co.store.params(mid)[k]), (mid, k)


def test_an_open_runs_defaults_refuse_a_replay_unless_the_run_is_diverging(tmp_path):
    """With nothing set (an open run: the held-out check and the copy check "auto"), a key that
    sends its last round's delta again is refused as ``copied``. A diverging run (its paths'
    held-out losses above where they started) makes honest copies: there the copy is let
    through, with a ``copy_let_through`` event, and judged as any other delta."""

    def run(name, drift):
        level = {"loss": 5.0}

        def loss(path, modules):  # a stand-in that honest (zero-mean) deltas barely move
            values = [
                modules[mid][k].reshape(-1) for mid in TOPO.path_modules(path) for k in INIT[mid]
            ]
            return level["loss"] + float(torch.cat(values).mean())

        swarm = Swarm(tmp_path / name, heldout_loss=loss)  # the defaults of an open run
        honest_round(swarm, 0)
        level["loss"] += drift
        honest_round(swarm, 1)
        return swarm, swarm.claim(0)

    steady, task = run("steady", 0.0)
    with pytest.raises(RejectedError) as err:
        steady.submit(task, honest(0, 1))  # its own last round's delta, sent again
    assert err.value.reason == "copied" and steady.co.rejections["copied"] == 1
    diverging, task = run("diverging", 1.0)
    diverging.submit(task, honest(0, 1))  # the same copy, in a run gone worse than its start
    let = [e for e in diverging.events if e["event"] == "copy_let_through"]
    assert [(e["path"], e["why"]) for e in let] == [(0, "diverging")]
    assert "copied" not in diverging.co.rejections
    assert [e["task"] for e in diverging.events if e["event"] == "heldout_check"][
        -1
    ] == task.task_id


def test_copies_are_judged_on_a_secret_sample_of_each_module():
    """The sketch of a module reads a fixed, secret sample of its coordinates: a copy with a
    little noise added everywhere (0.5% of its scale) is still a copy at 0.9999,
    independent noise is not, and two coordinators (two secrets) sample different
    coordinates. Only a kept (stored) delta can be copied; a retry of its own task is not."""
    from dipaco.coordinator.copies import AUTO_COSINE, DeltaCopies

    cosine = COPY_COSINE
    assert ValidationSection().copy_cosine == "auto"  # on where the held-out check is on
    assert cosine == AUTO_COSINE
    g = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(300, 40, generator=g), "b": torch.randn(40, generator=g)}
    copies = DeltaCopies(cosine)

    def judged(task, peer, delta, keep=True):
        found, sketches = copies.judge(task, {"M": delta})
        if found is None and keep:
            copies.keep(task, peer, sketches)
        return found

    assert judged("t0", "a", first, keep=False) is None  # judged, never stored
    assert judged("t1", "a", first) is None  # so this is no copy
    assert judged("t2", "b", {"w": torch.randn(300, 40), "b": torch.randn(40)}) is None
    assert copies.nearest["M"] < 0.3  # independent noise
    noise = torch.Generator().manual_seed(1)
    patched = {k: v + 0.005 * torch.randn(v.shape, generator=noise) for k, v in first.items()}
    found = judged("t3", "c", patched)
    assert found is not None and found.task == "t1" and found.peer == "a"
    assert found.cosine >= cosine
    assert judged("t1", "a", first) is None  # its own task again: a retry
    one, two = DeltaCopies(cosine), DeltaCopies(cosine)
    one.judge("x", {"M": first})
    two.judge("x", {"M": first})
    assert not torch.equal(one._where["M"][0][1], two._where["M"][0][1])
    assert DeltaCopies(None).judge("t9", {"M": first}) == (None, {})  # off
