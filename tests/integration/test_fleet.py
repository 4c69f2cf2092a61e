"""A mixed fleet: one peer much slower than the others. The scheduler gives it fewer inner
steps once it has measured it, so rounds close without waiting for its full H; each delta's
outer-step weight follows the tokens it reports (the shard's weight times the share of H)."""

import threading
import time

from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog

H = 16
# Seconds a step sleeps on top of training (a rate limit). The slow peer also sleeps three times
# what its step's training took, so that its steps take several times the others' however
# loaded the machine is (a fixed sleep alone drowned in a loaded run's slower training).
FAST, SLOW, SLOWER = 0.01, 0.06, 3.0


def rate_limit(fixed: float, factor: float = 0.0):
    """A peer's on_progress that sleeps ``fixed`` seconds after each step, plus ``factor``
    times that step's own work: the time since the task's previous step ended (nothing for a
    task's first step, whose time also holds the claim and the fetch)."""
    ended: dict[str, float] = {}

    def on_progress(info: dict) -> None:
        last = ended.get(info["task"])
        work = time.monotonic() - last if last is not None else 0.0
        time.sleep(fixed + factor * work)
        ended.clear()
        ended[info["task"]] = time.monotonic()

    return on_progress


def test_a_slow_peer_gets_shorter_tasks_and_its_deltas_weigh_their_tokens(
    prepared_tiny, tiny_config, tmp_path
):
    config = tiny_config.replace(
        train={"inner_steps": H, "rounds": 8},
        scheduler={
            "quorum": 1.0,
            "lease_seconds": 30.0,
            "deadline_floor": 0.0,
            "deadline_mads": 1.0,
            "deadline_slack": 0.5,
            "min_step_fraction": 0.25,
        },
        validation={"heldout_check": False},  # a delta's weight: its tokens, not also its score
    )
    root = tmp_path / "run"
    metrics = MetricsLog(root / "m.jsonl")
    co = build_coordinator(prepare(root, config, reuse=prepared_tiny), metrics, evaluate=False)
    stop = threading.Event()

    def peer(name: str, limit) -> Peer:
        return Peer(
            LocalTransport(co.handle), name, root / name, device="cpu", stop=stop, on_progress=limit
        )

    peers = [peer(f"fast{i}", rate_limit(FAST)) for i in range(3)]
    peers.append(peer("slow", rate_limit(SLOW, SLOWER)))
    threads = [threading.Thread(target=p.run, daemon=True) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    stop.set()
    assert co.finished, "the run did not finish"
    assert all(p.run_finished for p in peers), [p.error for p in peers]

    log = metrics.read()
    issued = {e["task"]: e for e in log if e["event"] == "task_issued"}
    slow_steps = [e["steps"] for e in issued.values() if e["peer"] == "slow"]
    assert slow_steps[:2] == [H, H]  # judged on two whole tasks first
    assert min(slow_steps) < H, slow_steps  # then offered what it can finish in time
    assert min(slow_steps) >= H // 4  # never below min_step_fraction
    assert all(e["steps"] == H for e in issued.values() if e["peer"] != "slow")

    tc = config.train
    full = H * tc.batch_size * tc.seq_len
    shards = co.shard_tokens
    acked = {(e["module"], e["task"]): e for e in log if e["event"] == "delta_acked"}
    shortened = 0
    for step in (e for e in log if e["event"] == "outer_step"):
        for task, weight in zip(step["tasks"], step["weights"], strict=True):
            delta = acked[(step["module"], task)]
            assert delta["tokens"] == issued[task]["steps"] * tc.batch_size * tc.seq_len
            assert weight == delta["weight"]
            assert abs(weight - shards[delta["path"]] * delta["tokens"] / full) < 1e-6 * weight
            shortened += delta["tokens"] < full
    assert shortened > 0  # the short tasks' deltas were applied, at their smaller weight
