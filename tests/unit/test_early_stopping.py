"""Per-path early stopping (Table 3): the snapshot with the lowest held-out loss is kept, survives
a restart, and a crash between the snapshot and its record never leaves them disagreeing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dipaco.coordinator import early_stopping as es_module
from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.errors import CorruptFileError
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.routing.evaluate import heldout_loss

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=64)


def state_of(r: int) -> dict[str, torch.Tensor]:
    """A distinct state per round, with several dtypes."""
    return {
        "w": torch.full((3, 2), float(r)) + torch.arange(6.0).view(3, 2),
        "h": torch.tensor([r, -r], dtype=torch.bfloat16),
        "step": torch.tensor(r, dtype=torch.int64),
    }


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_keeps_the_lowest_loss_across_rounds_and_restarts(tmp_path):
    es = EarlyStopping(tmp_path / "es")
    improved = [
        es.update(0, r, loss, state_of(r), tokens=100 + r)
        for r, loss in enumerate([3.0, 2.5, 2.7, 2.4, 2.6])
    ]
    assert improved == [True, True, False, True, False]
    assert es.best(0) == {"round": 3, "loss": 2.4, "tokens": 103, "phase": 0}
    assert_state_equal(es.state(0), state_of(3))
    assert not es.update(0, 5, float("nan"), state_of(5))
    assert not es.update(0, 6, 2.4, state_of(6))  # equal is not strictly lower
    assert es.best(0)["round"] == 3
    record = json.loads((tmp_path / "es" / "best.json").read_text())
    assert record["paths"]["0"]["round"] == 3 and record["paths"]["0"]["loss"] == 2.4
    again = EarlyStopping(tmp_path / "es")
    assert again.paths() == [0]
    assert again.best(0) == {"round": 3, "loss": 2.4, "tokens": 103, "phase": 0}
    assert_state_equal(again.state(0), state_of(3))
    assert not again.update(0, 7, 2.45, state_of(7))
    assert again.update(0, 8, 2.0, state_of(8))
    assert_state_equal(EarlyStopping(tmp_path / "es").state(0), state_of(8))


def test_nan_and_inf_never_become_best(tmp_path):
    es = EarlyStopping(tmp_path)
    assert not es.update(4, 0, float("nan"), state_of(0))
    assert not es.update(4, 1, math.inf, state_of(1))
    assert es.best(4) is None and es.paths() == []
    assert not (tmp_path / "P4.dpt").exists()
    with pytest.raises(KeyError):
        es.state(4)
    assert es.update(4, 2, 9.0, state_of(2))
    assert not es.update(4, 3, float("nan"), state_of(3))
    assert es.best(4)["round"] == 2
    assert_state_equal(EarlyStopping(tmp_path).state(4), state_of(2))


def test_paths_are_kept_separately(tmp_path):
    es = EarlyStopping(tmp_path)
    for r, (a, b) in enumerate([(3.0, 1.0), (2.0, 1.5), (2.5, 0.5)]):
        es.update(0, r, a, state_of(10 + r))
        es.update(7, r, b, state_of(20 + r))
    assert es.paths() == [0, 7]
    assert es.best(0)["round"] == 1 and es.best(7)["round"] == 2
    assert_state_equal(es.state(0), state_of(11))
    assert_state_equal(es.state(7), state_of(22))
    summary = es.summary()
    assert summary["num_paths"] == 2
    assert summary["mean_loss"] == pytest.approx((2.0 + 0.5) / 2)
    assert summary["paths"]["7"] == {"round": 2, "loss": 0.5, "tokens": 0, "phase": 0}
    assert EarlyStopping(tmp_path / "empty").summary()["mean_loss"] is None


def test_a_crash_before_the_record_is_written_is_adopted_on_reopen(tmp_path, monkeypatch):
    es = EarlyStopping(tmp_path)
    es.update(2, 0, 3.0, state_of(0), tokens=50)

    def crash(*args, **kwargs):
        raise OSError("power lost")

    monkeypatch.setattr(es_module, "write_json_atomic", crash)
    with pytest.raises(OSError):
        es.update(2, 1, 2.0, state_of(1), tokens=60)
    monkeypatch.undo()
    # best.json still says round 0; the snapshot on disk is round 1. Reopening agrees with it.
    assert json.loads((tmp_path / "best.json").read_text())["paths"]["2"]["round"] == 0
    again = EarlyStopping(tmp_path)
    assert again.best(2) == {"round": 1, "loss": 2.0, "tokens": 60, "phase": 0}
    assert_state_equal(again.state(2), state_of(1))
    assert json.loads((tmp_path / "best.json").read_text())["paths"]["2"]["round"] == 1
    assert not again.update(2, 2, 2.5, state_of(2))


def test_rescore_after_a_routing_phase_changes_what_later_rounds_compete_with(tmp_path):
    es = EarlyStopping(tmp_path)
    es.update(5, 0, 2.0, state_of(0), tokens=10)
    assert not es.update(5, 1, 2.2, state_of(1), phase=0)
    # A new phase: the kept snapshot measures 2.5 on the new held-out slice.
    es.rescore(5, 2.5, 12, phase=1)
    assert es.best(5) == {"round": 0, "loss": 2.5, "tokens": 12, "phase": 1}
    assert_state_equal(es.state(5), state_of(0))
    again = EarlyStopping(tmp_path)  # the rescored loss survives; the snapshot is not re-adopted
    assert again.best(5) == {"round": 0, "loss": 2.5, "tokens": 12, "phase": 1}
    assert again.update(5, 2, 2.3, state_of(2), 12, phase=1)
    assert EarlyStopping(tmp_path).best(5) == {"round": 2, "loss": 2.3, "tokens": 12, "phase": 1}
    # A snapshot that breaks on the new slice loses to any finite loss.
    again.rescore(5, float("nan"), 12, phase=2)
    assert EarlyStopping(tmp_path).best(5)["loss"] == math.inf
    assert again.update(5, 3, 50.0, state_of(3), phase=2)
    assert_state_equal(EarlyStopping(tmp_path).state(5), state_of(3))
    with pytest.raises(KeyError):
        again.rescore(6, 1.0)


def test_a_crash_while_writing_the_snapshot_keeps_the_old_one(tmp_path, monkeypatch):
    es = EarlyStopping(tmp_path)
    es.update(1, 0, 3.0, state_of(0))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(es_module, "write_tensor_file", crash)
    with pytest.raises(OSError):
        es.update(1, 1, 2.0, state_of(1))
    monkeypatch.undo()
    again = EarlyStopping(tmp_path)
    assert again.best(1)["round"] == 0
    assert_state_equal(again.state(1), state_of(0))


def test_a_damaged_snapshot_is_reported(tmp_path):
    es = EarlyStopping(tmp_path)
    es.update(3, 0, 1.0, state_of(0))
    snap = tmp_path / "P3.dpt"
    snap.write_bytes(snap.read_bytes()[:-10])
    with pytest.raises(CorruptFileError):
        EarlyStopping(tmp_path).state(3)
    snap.unlink()
    with pytest.raises(CorruptFileError):
        EarlyStopping(tmp_path).state(3)
    (tmp_path / "best.json").write_text("{not json")
    with pytest.raises(CorruptFileError):
        EarlyStopping(tmp_path)


def test_early_stopping_keeps_the_model_with_the_lowest_heldout_loss(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, CFG.vocab_size, size=40) for _ in range(6)]
    models = [new_dense_model(CFG, s) for s in range(4)]
    with torch.no_grad():
        models[1].lm_head.weight.mul_(30.0)  # a much worse round
    es = EarlyStopping(tmp_path)
    losses = []
    for r, m in enumerate(models):
        loss, tokens = heldout_loss(m, docs, seq_len=32, prefix_tokens=8)
        losses.append(loss)
        es.update(0, r, loss, m.state_dict(), tokens=tokens)
    best = int(np.argmin(losses))
    assert es.best(0)["round"] == best and es.best(0)["tokens"] == 6 * 25
    restored = new_dense_model(CFG, 99)
    restored.load_state_dict(EarlyStopping(tmp_path).state(0))
    assert heldout_loss(restored, docs, seq_len=32, prefix_tokens=8)[0] == pytest.approx(
        losses[best], rel=1e-6
    )
