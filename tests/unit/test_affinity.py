"""Path affinity: a path's inner optimizer state lives on the peer that trained it, so the
scheduler leases each path back to that peer where it can (``scheduler.pick_path``)."""

from test_rounds import TOPO, claim, delta_for, make

from dipaco.coordinator.scheduler import pick_path
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport


def test_each_peer_gets_back_the_paths_it_trained_the_round_before(tmp_path):
    co = make(tmp_path)
    tr = LocalTransport(co.handle)
    paths = TOPO.num_paths
    # Round 0: peer i trains path paths-1-i.
    first = {}
    for i in range(paths):
        task = claim(tr, f"p{i}", prefer=paths - 1 - i)
        first[f"p{i}"] = task.path
        tr.request(delta_for(task, f"p{i}"))
    # Round 1: claims without a preference: each peer gets its own path back, not the lowest
    # free one (p0 would get path 0).
    for i in range(paths):
        task = claim(tr, f"p{i}")
        assert isinstance(task, m.TaskOffer) and task.round == 1
        assert task.path == first[f"p{i}"]


def test_pick_prefers_own_then_asked_then_unclaimed_then_any():
    last = {0: "a", 1: "b", 2: "a"}
    assert pick_path("a", [0, 1, 2, 3], None, last) == 0  # its own, lowest first
    assert pick_path("a", [0, 1, 2, 3], 2, last) == 2  # its own, the one it asks for
    assert pick_path("a", [1, 3], 1, last) == 1  # none of its own: the one it asks for
    assert pick_path("c", [0, 1, 3], None, last) == 3  # nobody trained 3 the round before
    assert pick_path("c", [1, 2], None, last) == 1  # only others' paths: the lowest
    assert pick_path("c", [1, 2], None, {}) == 1  # no history: the lowest
