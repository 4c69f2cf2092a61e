"""A peer that crashes mid-task and restarts with the same id and state folder resumes the task."""

import threading

import pytest
import torch

from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


class Crash(Exception):
    pass


def test_a_restarted_peer_resumes_its_task_from_its_checkpoint(run_copy, tiny_config, caplog):
    config = tiny_config.replace(scheduler={"quorum": 1.0, "lease_seconds": 30.0})
    ref_root = run_copy("reference")
    reference = build_coordinator(
        prepare(ref_root, config), MetricsLog(ref_root / "m.jsonl"), evaluate=False
    )
    Peer(LocalTransport(reference.handle), "solo", ref_root / "peer").run()
    assert reference.finished

    root = run_copy("crashed")
    metrics = MetricsLog(root / "m.jsonl")
    co = build_coordinator(prepare(root, config), metrics, evaluate=False)

    def crash_at_step_12(info):
        if info["step"] == 12:
            raise Crash("power cut")

    first = Peer(
        LocalTransport(co.handle),
        "solo",
        root / "peer",
        on_progress=crash_at_step_12,
        checkpoint_seconds=0.0,
    )
    with pytest.raises(Crash):
        first.run()
    held = co.status().state["leases"]
    assert len(held) == 1  # the crashed peer's lease is still live
    caplog.set_level("INFO", logger="dipaco.peer.peer")
    again = Peer(LocalTransport(co.handle), "solo", root / "peer", stop=threading.Event())
    again.run()
    assert co.finished
    assert any("resuming" in r.message and "at step 11" in r.message for r in caplog.records)
    issued = [e for e in metrics.read() if e["event"] == "task_issued"]
    assert len(issued) == 4 * config.train.rounds  # the interrupted task was not issued twice
    for mid, record in reference.store.modules.items():
        for name, tensor in record.params.items():
            assert torch.equal(co.store.params(mid)[name], tensor), (mid, name)
