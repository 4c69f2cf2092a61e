"""CI's short forms of the benchmarks under bench/: each runs, prints its ratio, records its row.

Never a timing: the figures are the benchmarks' own job (docs/benchmarks.md). These keep the
scripts from rotting, and check that each writes its row where it is told (never the docs).
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "bench, extra",
    [
        ("peer_throughput", []),
        ("outer_step", ["--store"]),
        ("codecs", []),
        ("scale", ["--out", "{tmp}/scale.json", "--plot", "{tmp}/scale.html"]),
        ("path_parallel", []),
    ],
)
def test_the_benchmark_runs_prints_its_ratio_and_records_its_row(bench, extra, tmp_path):
    doc = tmp_path / "b.md"
    args = [a.format(tmp=tmp_path) for a in extra]
    done = subprocess.run(
        [sys.executable, REPO / "bench" / f"{bench}.py", "--quick", "--doc", doc, *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("ratio") for line in done.stdout.splitlines()), done.stdout
    rows = [line for line in doc.read_text().splitlines() if line.startswith(f"| {bench} |")]
    assert len(rows) == 1, doc.read_text()
    assert f"bench/{bench}.py --quick" in rows[0]  # the command, as typed
