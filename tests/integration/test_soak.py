"""Load, the CI form of bench/soak.py: 64 peers against one coordinator for a few rounds.

64 simulated peers (threads, each with its own key and loopback connection) do the real protocol
against one coordinator process on 127.0.0.1. The run must reach its last round with every
acknowledged (module, task) applied in exactly one outer step, no peer left hanging, the
coordinator's memory not growing with the rounds, and its record of issued tasks pruned. Only
outcomes are asserted, never a timing: the figures are bench/soak.py's job.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def _soak():
    """bench/soak.py as a module (bench/ is not a package; its dataclasses need sys.modules)."""
    name = "dipaco_bench_soak"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _SOAK)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.timeout(240)
def test_64_peers_against_one_coordinator_lose_and_repeat_no_delta(tmp_path):
    soak = _soak()
    rounds = 3
    result = soak.run_load(tmp_path / "load", peers=64, rounds=rounds, dim=16, timeout=150)
    assert soak.problems(result) == []
    # The same facts, spelled out.
    assert result["final_round"] == rounds and result["finished"]
    assert result["paths"] >= 64 and result["submits"] == result["paths"] * rounds
    assert all(n == 1 for n in result["acked"].values())
    assert result["stepped"] == result["acked"] == result["peer_acked"]
    assert set(result["steps_per_module"].values()) == {rounds}
    # Tasks of rounds that no delta can join any more are forgotten (Scheduler.issued): with
    # max staleness 1, only the last completed round's tasks remain at the end.
    assert result["issued_final"] == result["paths"]
    assert result["rss_final"] - result["rss_round1"] < 2 * result["model_bytes"] + (48 << 20)


@pytest.mark.timeout(120)
def test_peers_spread_over_processes_are_counted_as_one_run(tmp_path):
    """``--peer-processes``: each worker's peers report back, and the run's facts add up as if
    the peers had been threads of the driver (every delta acknowledged once, by its peer)."""
    soak = _soak()
    result = soak.run_load(tmp_path / "load", peers=6, rounds=2, dim=16, timeout=60, processes=2)
    assert soak.problems(result) == []
    assert result["peers"] == 6 and result["submits"] == result["paths"] * 2
    assert result["stepped"] == result["acked"] == result["peer_acked"]
    assert result["peers_cpu_s"] > 0 and result["coordinator_fsyncs"] > 0


def test_the_load_section_of_the_reliability_doc_is_ours_alone(tmp_path):
    soak = _soak()
    doc = tmp_path / "reliability.md"
    doc.write_text("# Reliability\n\n## Crashes\n\ntheirs\n\n## Later\n\nalso theirs\n")
    soak.append_row(doc, "| row 1 |\n")
    soak.append_row(doc, "| row 2 |\n")
    text = doc.read_text()
    assert text.count("## Load") == 1 and text.count("| row") == 2
    assert text.index("| row 1 |") < text.index("| row 2 |")
    assert "## Crashes\n\ntheirs\n" in text and "## Later\n\nalso theirs\n" in text
    # A section in the middle of the file grows in place.
    doc.write_text("# R\n\n## Load\n\n| a |\n|---|\n| old |\n\n## Other\n\nx\n")
    soak.append_row(doc, "| new |\n")
    assert doc.read_text() == "# R\n\n## Load\n\n| a |\n|---|\n| old |\n| new |\n\n## Other\n\nx\n"


@pytest.mark.timeout(150)
def test_peers_push_each_modules_delta_to_its_owner_process_and_none_is_lost(tmp_path):
    """``--owners 2``: a scheduler and two module owner processes, which take their shares of
    the modules over (HandOver, ConfirmOwnership) and report back; the peers ask where the
    owners are, fetch from and push to each owner, and tell the scheduler TaskDone. Every
    acknowledged delta, wherever it was acknowledged, is applied in exactly one outer step."""
    soak = _soak()
    rounds = 2
    result = soak.run_load(tmp_path / "load", peers=9, rounds=rounds, dim=16, timeout=90, owners=2)
    assert soak.problems(result) == []
    assert result["owners"] == 2 and result["submits"] == result["paths"] * rounds
    assert result["stepped"] == result["acked"] == result["peer_acked"]
    # Each owner process acknowledged deltas and stepped modules of its own share.
    for k in range(2):
        events = (tmp_path / "load" / f"events-owner{k}.jsonl").read_text()
        assert '"delta_acked"' in events and '"outer_step"' in events
    latencies = result["latency_ms"]
    assert latencies["GetOwners"]["n"] == 9 and latencies["TaskDone"]["n"] >= result["submits"]
