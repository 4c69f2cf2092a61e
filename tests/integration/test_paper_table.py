"""The paper-table benchmark end to end, at its smallest size: every model trains and is
evaluated, the table, JSON and chart are written, and a second run reuses finished models."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "paper_table.py"


def run_bench(out: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "smoke", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_paper_table_trains_every_model_and_writes_table_and_chart(tmp_path):
    out = tmp_path / "table"
    first = run_bench(out)
    result = json.loads((out / "paper_table.json").read_text())
    models = [r["model"] for r in result["rows"]]
    expected = [
        "dense",
        "dense, 4x steps",
        "dense, DiPaCo-2x2 params",
        "DiLoCo-4, i.i.d. shards",
        "DiLoCo-4, k-means shards",
        "flat MoE-4 (k-means)",
        "DiPaCo 2x2 (k-means)",
        "DiPaCo 4x4 (k-means)",
        "DiPaCo 4x4 + discriminative",
        "DiPaCo 4x4 + discriminative + early stopping",
    ]
    assert [m for m in models if m in expected] == expected
    assert any(m.endswith("learned chunk router") for m in models)
    assert any("discriminative + early stopping + re-routing" in m for m in models)
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in result["rows"])
    by = {r["model"]: r for r in result["rows"]}
    # Same per-path size everywhere but the bigger dense, whose total matches DiPaCo 2x2's.
    assert (
        by["dense, DiPaCo-2x2 params"]["total_params"] == by["DiPaCo 2x2 (k-means)"]["total_params"]
    )
    assert by["DiPaCo 4x4 (k-means)"]["params_per_path"] == by["dense"]["params_per_path"]
    assert by["dense, 4x steps"]["tokens"] > by["dense"]["tokens"]
    # The discriminative phase re-sharded the 4x4 run.
    assert (out / "dipaco4x4_disc" / "routing-phase1.json").exists()
    table = (out / "paper_table.md").read_text()
    assert "| DiPaCo 2x2 (k-means) |" in table and "Orderings" in table
    assert (out / "paper_table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation ppl" in first

    again = run_bench(out, "--only", "dense", "dipaco2x2")
    assert "[dense] already done" in again and "[dipaco2x2] already done" in again
    assert "round 1/" not in again
