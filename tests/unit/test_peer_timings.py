"""A peer accounts for its time (claim, fetch, train, push, save) and for the tokens it trained."""

from dipaco.cli.peer_report import link_line, time_summary
from dipaco.peer.peer import TIMED, Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


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
    # In-process transfers are never blamed on a link: "fine", or, on a loaded machine where
    # their fixed cost (connections, hashes, saves) weighs against 0.3 s tasks, said to be that
    # (39% of one CI run's time), never "a thin link".
    link = link_line(peer.timings)
    assert link.startswith("link: transfers took ") and "thin link" not in link, link
    assert link.endswith("fine") or "not the link" in link, link


def test_a_thin_link_is_named_with_what_to_change():
    thin = link_line({"fetch": 30.0, "push": 12.0, "train": 50.0}, (40_000_000, 90_000_000))
    assert "46% on transfers, a thin link" in thin and "codec" in thin
    assert "(40.0 MB up, 90.0 MB down)" in thin
    assert "--push-behind" in thin  # not on yet: it would hide the uploads behind training
    behind = link_line({"fetch": 30.0, "push": 12.0, "train": 50.0}, behind=20.0)
    assert "uploads behind training 20.0 s" in behind and "--push-behind" not in behind
    assert link_line({"fetch": 1.0, "push": 1.0, "train": 18.0}).endswith("10% on transfers, fine")


def test_short_tasks_and_loopback_runs_are_not_called_a_thin_link():
    from dipaco.cli.peer_report import on_loopback

    # One-second tasks on loopback: 63% on transfers, but no link is to blame.
    local = link_line({"fetch": 1.0, "push": 0.7, "train": 1.0}, (500_000, 900_000), local=True)
    assert "63% on transfers, on this machine" in local and "thin link" not in local
    assert "faster link" not in local and "train.inner_steps" in local
    # Short tasks over a network: their fixed costs, not the link.
    short = link_line({"fetch": 3.0, "push": 2.0, "train": 8.0}, tasks=2)
    assert "4.0 s of training each" in short and "thin link" not in short
    # Long tasks over a network: the link it is.
    assert "thin link" in link_line({"fetch": 60.0, "push": 30.0, "train": 120.0}, tasks=2)
    assert on_loopback("127.0.0.1:31337") and on_loopback("/ip4/127.0.0.1/tcp/4001/p2p/QmX")
    assert on_loopback("localhost:1") and not on_loopback("203.0.113.7:31337")
    assert not on_loopback("/ip4/10.0.0.2/tcp/4001") and not on_loopback(None)


def test_a_peer_served_malformed_modules_by_its_own_coordinator_hands_the_task_back(
    run_copy, tiny_config
):
    # The coordinator itself serves a module cut short by one column, with a hash and a
    # release signature that match it: every check of origin passes, only the shapes are
    # wrong. The peer must abort the task and hand it back, not die inside load_state_dict.
    import threading

    from dipaco.protocols.wire import tensors_sha256

    root = run_copy()
    metrics = MetricsLog(root / "m.jsonl")
    co = build_coordinator(prepare(root, tiny_config), metrics, evaluate=False)
    record = co.store.modules["S.embed"]
    record.params = {k: v[..., :-1].contiguous() for k, v in record.params.items()}
    record.hash = tensors_sha256(record.params)
    stop = threading.Event()
    peer = Peer(LocalTransport(co.handle), "victim", root / "peer", stop=stop)
    errors: list[BaseException] = []

    def run():
        try:
            peer.run()
        except BaseException as exc:  # noqa: BLE001 - the property under test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(300):
        if any(e["event"] == "task_released" for e in metrics.read()):
            break
        stop.wait(0.1)
    stop.set()
    thread.join(30)
    assert not thread.is_alive() and errors == [], errors
    released = [e for e in metrics.read() if e["event"] == "task_released"]
    assert released and released[0]["peer"] == "victim"
    assert co.scheduler.leases_of("victim") == []  # nothing held: the path is free again
    assert all(r.version == 0 and not r.pending for r in co.store.modules.values())


def test_an_outage_waited_out_is_not_counted_as_transfer_time():
    # 40 s of "push" of which 36 s waited for a coordinator that was down: 4 s of transfers.
    line = link_line({"fetch": 1.0, "push": 40.0, "train": 60.0}, tasks=1, outage=36.0)
    assert "transfers took 5.0 s" in line and "not counting 36 s" in line
    assert line.endswith("8% on transfers, fine")
