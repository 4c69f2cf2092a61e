"""The regime ladder's CI form (bench/regime.py --quick): every model at two points, its table,
its chart, a resumed ladder that trains nothing again, and a diverged run kept as a failed row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def regime(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import regime

    return regime


def test_the_quick_ladder_tables_every_model_and_keeps_a_diverged_run_as_failed(
    regime, monkeypatch, tmp_path, capsys
):
    # DiLoCo's run beyond the grid at an outer lr of 10,000: a real divergence (a NaN training
    # loss, or a model left no better than a uniform guess), kept as a failed row.
    quick = {**regime.PRESETS["quick"]}
    quick["tuning"] = {**quick["tuning"], "diloco_extra": 1e4}
    monkeypatch.setitem(regime.PRESETS, "quick", quick)
    out = tmp_path / "ladder"
    assert regime.main(["--quick", "--out", str(out), "--compile", "off"]) == 0
    result = json.loads((out / "regime.json").read_text())
    rows = result["rows"]
    for target in (1.0, 2.0):
        here = [r for r in rows if r["target_tokens_per_param"] == target]
        families = {r["family"] for r in here if r["ok"]}
        assert families == set(regime.FAMILIES), (target, families)
        failed = [r for r in here if not r["ok"]]
        assert {r["key"] for r in failed} == {"diloco4_lr10000.0", "diloco16_lr10000.0"}
        assert all("diverged" in r["reason"] for r in failed), failed
        for r in here:
            if r["ok"]:
                assert r["tokens_per_param"] > 0 and r["corpus_tokens_per_param"] > 0
                assert r["flops"] > 0 and r["ppl"] > 1
        # The diverged rate is never a "best": no per-module run took it (with one grid rate,
        # the per-module rates equal it, and that run is the grid's, not trained twice).
        assert not any("by_sharing" in r["key"] for r in here)
    second = [r["tokens_per_param"] for r in rows if r["ok"] and r["target_tokens_per_param"] == 2]
    first = [r["tokens_per_param"] for r in rows if r["ok"] and r["target_tokens_per_param"] == 1]
    assert min(second) > max(first)  # the ladder climbs
    assert len(result["ratios"]) == 2
    assert all(e["DiPaCo 4x4 / DiLoCo-16"] > 0 for e in result["ratios"])
    table = (out / "regime.md").read_text()
    assert "**failed**" in table and "4x4 / DiLoCo-16" in table
    assert (out / "regime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resumed: nothing is trained again, the failed runs are not retried, the table is the same.
    capsys.readouterr()
    assert regime.main(["--quick", "--out", str(out), "--compile", "off"]) == 0
    said = capsys.readouterr().out
    assert "round" not in said.replace("rounds", "") and "failed before" in said
    assert json.loads((out / "regime.json").read_text())["rows"] == rows

    # --merge joins ladders without training.
    merged = tmp_path / "merged"
    path = str(out / "regime.json")
    assert regime.main(["--merge", path, "--out", str(merged)]) == 0
    assert len(json.loads((merged / "regime.json").read_text())["rows"]) == len(rows)
    del sys.modules["regime"]


def test_the_per_module_run_takes_dipacos_own_rate_and_diloco_ps_for_the_shared_modules(regime):
    """The plan at a point (no training): once the grid has run, a 4x4's level modules keep its
    best uniform rate and the embedding and head (16 paths) take DiLoCo-16's best; a 2x2's
    take DiLoCo-4's. A failed run is never a best; the same rate twice is not run again."""

    def row(key, ppl, ok=True):
        return {"key": key, "ppl": ppl, "ok": ok}

    done = {
        "diloco16_lr0.7": row("diloco16_lr0.7", 20.0),
        "diloco16_lr1.0": row("diloco16_lr1.0", 19.0),
        "diloco16_lr1.4": row("diloco16_lr1.4", float("nan"), ok=False),
        "dipaco4x4_lr0.5": row("dipaco4x4_lr0.5", 21.0),
        "dipaco4x4_lr0.7": row("dipaco4x4_lr0.7", 20.5),
        "diloco4_lr1.0": row("diloco4_lr1.0", 22.0),
        "dipaco2x2_lr1.0": row("dipaco2x2_lr1.0", 23.0),
    }
    plan = {key: v for _, key, v in regime.models(done, regime.TUNING, 3e-3)}
    four = plan["dipaco4x4_by_sharing"].overrides["outer"]
    assert four["lr_by_sharing"] == {4: 0.7, 16: 1.0} and four["lr"] == 1.0
    assert "(4: 0.7, 16: 1)" in plan["dipaco4x4_by_sharing"].label
    # 2x2's own best is 1.0 and DiLoCo-4's is 1.0: that run is the grid's, planned once.
    assert "dipaco2x2_by_sharing" not in plan and "dipaco2x2_lr1.0" in plan
    # Before the runs it depends on have finished, it is not planned at all.
    assert "dipaco4x4_by_sharing" not in {k for _, k, _ in regime.models({}, regime.TUNING, 3e-3)}
    # The DiPaCo runs carry the preset's routing and rescale.
    cpu = regime.PRESETS["cpu"].get("dipaco", {})
    plan = {key: v for _, key, v in regime.models(done, regime.TUNING, 3e-3, cpu)}
    assert plan["dipaco4x4_lr0.7"].overrides["routing"] == cpu.get("routing", {})
