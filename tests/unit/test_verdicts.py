"""The scheduler's verdicts on whole-path deltas (coordinator/verdicts.py): a digest that names
exactly the encoded tensors an owner got, a verdict read only for its run, task, path and key,
and a scheduler that takes a whole path's delta even when it owns less than that."""

from __future__ import annotations

import torch
from _tiny import TOPO, initial_modules

from dipaco.coordinator import tickets, verdicts
from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.model.transformer import ModelConfig, PathModel
from dipaco.protocols.auth import Identity


def test_a_digest_names_the_tensors_exactly():
    wire = {
        "A/w": torch.arange(6, dtype=torch.int8).reshape(2, 3),
        "A/s": torch.ones(1),
        "B/w": torch.zeros(3),
    }
    same = {k: v.clone() for k, v in wire.items()}
    assert verdicts.digest(wire, "A") == verdicts.digest(same, "A")
    assert verdicts.digest(wire, "A") != verdicts.digest(wire, "B")
    changed = dict(same, **{"A/w": same["A/w"].clone()})
    changed["A/w"][1, 2] += 1  # one byte
    assert verdicts.digest(changed, "A") != verdicts.digest(wire, "A")
    reshaped = dict(same, **{"A/w": same["A/w"].reshape(3, 2)})  # the same bytes, another shape
    assert verdicts.digest(reshaped, "A") != verdicts.digest(wire, "A")
    # Only the module's own tensors count: another module's change leaves it as it was.
    assert verdicts.digest(dict(wire, **{"B/w": torch.ones(3)}), "A") == verdicts.digest(wire, "A")


def test_a_verdict_is_read_only_for_its_run_task_path_and_key():
    scheduler = Identity.generate()
    wire = {"A/w": torch.ones(4)}
    digests = {"A": verdicts.digest(wire, "A")}
    signed = tickets.sign_ticket(
        scheduler,
        verdicts.payload("run", "P1-r0", 1, "key", 0.5, False, digests),
        tickets.VERDICT,
    )
    payload = tickets.read_ticket(scheduler.public_key, signed, tickets.VERDICT)
    got = verdicts.check(payload, "run", "P1-r0", 1, "key", wire, ["A"])
    assert got == verdicts.ScoredVerdict(0.5, False)
    assert tickets.read_ticket(scheduler.public_key, signed) is None  # not a ticket
    for run, task, path, key, why in [
        ("other", "P1-r0", 1, "key", "another run"),
        ("run", "P2-r0", 1, "key", "another task"),
        ("run", "P1-r0", 2, "key", "another path"),
        ("run", "P1-r0", 1, "thief", "another key"),
    ]:
        assert why in verdicts.check(payload, run, task, path, key, wire, ["A"])
    swapped = {"A/w": torch.full((4,), 2.0)}
    assert "not the one the scheduler scored" in verdicts.check(
        payload, "run", "P1-r0", 1, "key", swapped, ["A"]
    )
    assert "no verdict" in verdicts.check(None, "run", "P1-r0", 1, "key", wire, ["A"])
    bad = dict(payload, trust=1.5)
    assert "not in (0, 1]" in verdicts.check(bad, "run", "P1-r0", 1, "key", wire, ["A"])


def test_a_scheduler_takes_a_whole_paths_delta_whatever_it_owns(tmp_path):
    model = ModelConfig(vocab_size=32_000, dim=256, n_layers=2, n_heads=2)  # 65 MB a path
    path = PathModel(model)
    assert verdicts.path_bytes(model.to_dict()) == 4 * sum(p.numel() for p in path.parameters())
    assert verdicts.path_bytes({"no_such_field": 1}) == 0 and verdicts.path_bytes(None) == 0
    co = Coordinator(
        tmp_path, TOPO, rounds=2, inner_steps=5, step_offset=0, total_steps=10, seed=0,
        outer=OuterSettings(), lease_seconds=10.0, run_id="t",
        peer_config={"model": model.to_dict()},
    )  # fmt: skip
    co.start(initial_modules())  # the tiny test modules: far smaller than the model's path
    assert co.gate.max_request_bytes >= 2 * verdicts.path_bytes(model.to_dict())
