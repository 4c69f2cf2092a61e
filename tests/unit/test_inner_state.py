"""A path's inner optimizer state follows the path between peers that share a state folder.

The state of round r is on disk before the first delta of round r reaches an owner: once the
owners acknowledge, the round may close and another peer may take the path's next round at
once (the fault harness caught a peer that saved only after its push returned, and the next
round trained from a fresh optimizer)."""

from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


def test_the_inner_state_of_a_round_is_saved_before_its_deltas_are_sent(run_copy, tiny_config):
    root = run_copy()
    co = build_coordinator(prepare(root, tiny_config), MetricsLog(root / "m.jsonl"), evaluate=False)
    state = root / "peer"
    seen: list[tuple[str, bool]] = []

    peer = Peer(LocalTransport(co.handle), "solo", state)
    ask = peer.links.ask  # every request to a module owner, deltas included, goes through it

    def watched(owner, make, doing=""):
        msg = make()
        if isinstance(msg, m.SubmitDelta):
            path, rnd = msg.task_id.split("-")[:2]  # "P<path>-r<round>-..."
            seen.append((msg.task_id, (state / "inner" / f"{path}-{rnd}.dpt").exists()))
        return ask(owner, make, doing)

    peer.links.ask = watched
    done = peer.run()
    paths = tiny_config.build_topology().num_paths
    assert done == paths * tiny_config.train.rounds
    assert seen and all(saved for _, saved in seen), seen
    assert any("-r1-" in task for task, _ in seen)  # a second round, loading the first's state
    # Each path keeps its last two rounds' states (a retried round loads the one before).
    names = sorted(f.name for f in (state / "inner").glob("P0-r*.dpt"))
    assert names == ["P0-r0.dpt", "P0-r1.dpt"]
