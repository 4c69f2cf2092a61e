"""A peer accounts for its time (claim, fetch, train, push, save) and for the tokens it trained."""

from dipaco.cli.peer import time_summary
from dipaco.coordinator.prepare import prepare
from dipaco.coordinator.run import MetricsLog, build_coordinator
from dipaco.peer.peer import TIMED, Peer
from dipaco.protocols.transport import LocalTransport


def test_a_peer_times_each_part_of_its_tasks_and_counts_its_tokens(run_copy, tiny_config):
    root = run_copy()
    co = build_coordinator(prepare(root, tiny_config), MetricsLog(root / "m.jsonl"), evaluate=False)
    peer = Peer(LocalTransport(co.handle), "solo", root / "peer", max_tasks=2)
    assert peer.run() == 2
    t = tiny_config.train
    assert peer.tokens_trained == 2 * t.inner_steps * t.batch_size * t.seq_len
    assert set(peer.timings) == set(TIMED)
    assert all(seconds > 0 for seconds in peer.timings.values()), peer.timings
    line = time_summary(peer.timings)
    assert line.startswith("time: train ") and "waiting for work" in line
