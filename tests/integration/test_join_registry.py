"""A new transport is one file and a registration: a toy transport joins a real run through
``dipaco-peer join`` and trains its tasks, with nothing else in dipaco changed."""

from __future__ import annotations

import json

import pytest

from dipaco.cli.peer import main as peer_main
from dipaco.errors import ConfigError
from dipaco.net import joins
from dipaco.net.joins import Joined, JoinRequest
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


def test_a_registered_toy_transport_carries_a_peer_through_its_tasks(
    run_copy, tiny_config, tmp_path, monkeypatch
) -> None:
    root = run_copy()
    prep = prepare(root, tiny_config)
    coordinator = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    joined: list[JoinRequest] = []

    # The whole toy transport: requests go to the coordinator in this process, as bytes.
    def join_inproc(request: JoinRequest) -> Joined:
        joined.append(request)
        transport = LocalTransport(coordinator.handle).authenticate(request.me, *request.trust)
        return Joined(transport, note="joined in-process", close=transport.close)

    joins.register("inproc", join_inproc, claims=lambda address: address.startswith("inproc://"))
    try:
        with pytest.raises(ValueError):  # one name, one transport
            joins.register("inproc", join_inproc)
        state = tmp_path / "peer"
        monkeypatch.setenv("DIPACO_LOG_FORMAT", "plain")
        with pytest.raises(SystemExit) as ended:
            peer_main(["join", "inproc://here", "--state-dir", str(state), "--max-tasks", "2",
                       "--device", "cpu"])  # fmt: skip
        assert ended.value.code in (0, None)
    finally:
        joins.unregister("inproc")
    assert [r.address for r in joined] == ["inproc://here"]
    # The coordinator saw the peer's two tasks through the toy transport, signed by its key.
    status = coordinator.status().state
    (peer,) = status["peers"].values()
    assert peer["tasks_done"] == 2 and peer["bytes_in"] > 0
    acked = [json.loads(line) for line in (state / "acks.jsonl").read_text().splitlines()]
    assert len({a["task"] for a in acked}) == 2
    # Unregistered, the address is nobody's again.
    with pytest.raises(ConfigError):
        joins.kind_of("inproc://here", None)
