"""The paper-table benchmark end to end, at its smallest size: every model trains and is
evaluated, the table, JSON and chart are written, and a second run reuses finished models."""

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    out, other = tmp_path / "table", tmp_path / "other"
    with ThreadPoolExecutor(1) as pool:
        # Meanwhile, a run on another corpus, for the merge below (it needs nothing of this one).
        small_run = pool.submit(
            run_bench, other, "--only", "dense", "--max-docs", "60", "--dim", "16", "--layers", "2"
        )
        first = run_bench(out)
        small_run.result()
    result = json.loads((out / "paper_table.json").read_text())
    models = [r["model"] for r in result["rows"]]
    expected = [
        "dense",
        "dense, 4x steps",
        "dense, DiPaCo-2x2 params",
        "dense, DiPaCo-4x4 params",
        "DiLoCo-4, i.i.d. shards",
        "DiLoCo-4, k-means shards",
        "flat MoE-4 (k-means)",
        "DiPaCo 2x2 (k-means)",
        "DiLoCo-16, i.i.d. shards",
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
    # Equal compute: DiLoCo-16 trains exactly DiPaCo 4x4's tokens and FLOPs; both state what
    # they move per token, and a dense model trained alone moves nothing.
    assert by["DiLoCo-16, i.i.d. shards"]["tokens"] == by["DiPaCo 4x4 (k-means)"]["tokens"]
    assert by["DiLoCo-16, i.i.d. shards"]["flops"] == by["DiPaCo 4x4 (k-means)"]["flops"]
    assert by["DiPaCo 4x4 (k-means)"]["bytes_per_token"] > 0
    assert by["dense"]["bytes_per_token"] == 0
    assert by["flat MoE-4 (k-means)"]["bytes_per_token"] == 0  # its paths share nothing
    # The discriminative phase re-sharded the 4x4 run.
    assert (out / "dipaco4x4_disc" / "routing-phase1.json").exists()
    table = (out / "paper_table.md").read_text()
    assert "| DiPaCo 2x2 (k-means) |" in table and "Orderings" in table
    assert "bytes / token" in table and "0.92x DiLoCo-16" in table
    assert (out / "paper_table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation ppl" in first

    # Every row names what it was trained on; one corpus here.
    fingerprint = by["dense"]["corpus"]["fingerprint"]
    assert {r["corpus"]["fingerprint"] for r in result["rows"]} == {fingerprint}
    assert f"fingerprint `{fingerprint}`" in table

    # A table merged from runs on different corpora would compare what does not compare
    # (builtin:mixed changes when the machine gains a package): refused, unless asked for.
    small = json.loads((other / "paper_table.json").read_text())["rows"][0]
    assert small["corpus"]["fingerprint"] != fingerprint
    # --dim shrinks the path (16 wide instead of the smoke preset's 32).
    assert small["params_per_path"] < by["dense"]["params_per_path"]
    merge = [str(out / "paper_table.json"), str(other / "paper_table.json")]
    with ThreadPoolExecutor(1) as pool:
        # Side by side: the merge that is refused, and a second run that reuses finished models.
        refusal = pool.submit(
            subprocess.run,
            [sys.executable, str(BENCH), "--preset", "smoke", "--out", str(tmp_path / "m"),
             "--merge", *merge],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        again = run_bench(out, "--only", "dense", "dipaco2x2")
        refused = refusal.result()
    assert "[dense] already done" in again and "[dipaco2x2] already done" in again
    assert "round 1/" not in again
    assert refused.returncode != 0
    assert "different corpora" in refused.stderr and "--mixed-corpora" in refused.stderr
    run_bench(tmp_path / "m", "--mixed-corpora", "--merge", *merge)
    assert "Rows from different corpora" in (tmp_path / "m" / "paper_table.md").read_text()


def test_the_capacity_preset_quick_form_trains_its_core_rows_with_curves(tmp_path):
    out = tmp_path / "capacity"
    # Paths half as wide and half as deep as the preset's: what is checked here is which rows
    # train, their curves and the routing study, not the model's size.
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--preset", "capacity", "--quick", "--out", str(out),
         "--dim", "32", "--layers", "2"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "paper_table.json").read_text())
    models = [r["model"] for r in result["rows"]]
    assert models == [
        "dense",
        "dense, DiPaCo-4x4 params",
        "DiLoCo-4, i.i.d. shards",
        "DiPaCo 2x2 (k-means)",
        "DiLoCo-16, i.i.d. shards",
        "DiPaCo 4x4 (k-means)",
    ]
    for row in result["rows"]:
        # One evaluation after each of the quick form's 2 rounds, falling from the first.
        assert [c["round"] for c in row["curve"]] == [1, 2]
        assert row["curve"][1]["ppl"] < row["curve"][0]["ppl"], row
        assert row["curve"][-1]["ppl"] == row["ppl"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    claims = {c["claim"] for c in result["orderings"]}
    assert "DiPaCo 4x4 at or below 0.92x DiLoCo-16 (equal compute)" in claims
    # The corpus is the mixed one: documents of several kinds were trained on.
    from dipaco.data.shards import TokenShard

    kinds = {d.split("/")[0] for d in TokenShard(out / "dense" / "data" / "train").doc_ids}
    assert len(kinds) >= 3, kinds

    # The routing study reads those runs: shard purity by source, probes, routed against dense.
    study = subprocess.run(
        [sys.executable, str(BENCH.parent / "routing_study.py"), "--table", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert study.returncode == 0, study.stdout[-3000:] + study.stderr[-3000:]
    report = json.loads((out / "routing_study.json").read_text())
    comp = report["phases"][0]["composition"]
    assert len(comp["paths"]) == 16
    assert sum(p["documents"] for p in comp["paths"].values()) == sum(comp["sources"].values())
    assert 0 < comp["baseline_purity"] <= comp["purity"] <= 1
    assert 0 <= report["probe"]["token_bag_accuracy"] <= 1
    assert report["losses"]["all"]["oracle"] <= report["losses"]["all"]["routed"]
    assert "| source python |" in (out / "routing_study.md").read_text()


def groups_of(rows: list[dict]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r["ppl"])
    return groups


def test_the_outer_sweep_gives_every_group_its_runs_and_marks_the_best(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH.parent / "outer_sweep.py"),
            "--preset",
            "smoke",
            "--out",
            str(out),
            "--lr",
            "0.002",
            # One round per run: every group still gets its runs, each a curve and a perplexity.
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "outer_sweep.json").read_text())["rows"]
    # --lr sets every run's inner lr; the dense group sweeps around it.
    assert {r["inner_lr"] for r in rows if r["group"] != "dense: inner lr"} == {0.002}
    assert sorted(r["inner_lr"] for r in rows if r["group"] == "dense: inner lr") == [
        0.001,
        0.002,
        0.004,
    ]
    assert len(groups_of(rows)["DiPaCo 4x4, token-bag routing: rescale"]) == 2
    groups = groups_of(rows)
    # Each baseline gets as many learning rates as DiPaCo's outer lr sweep has runs.
    assert len(groups["DiLoCo-16: outer lr"]) == 3 and len(groups["dense: inner lr"]) == 3
    assert len(groups["DiPaCo 4x4: rescale"]) == 4
    assert all(math.isfinite(p) for ps in groups.values() for p in ps)
    table = (out / "outer_sweep.md").read_text()
    assert table.count("**best**") >= len(groups)
    assert (out / "outer_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
