"""The demo command itself: interrupted with Ctrl-C midway, run again, it continues and finishes."""

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

pytestmark = pytest.mark.slow


def test_demo_interrupted_and_run_again_continues_to_the_table(tmp_path):
    config = tmp_path / "demo.toml"
    config.write_text('preset = "tiny"\n[train]\ninner_steps = 20\nrounds = 5\n')
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dipaco.cli.main",
        "demo",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
    ]
    # A shell that starts the test suite in the background ignores SIGINT in its children, and
    # Python then installs no KeyboardInterrupt handler: give the demo the default disposition.
    first = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count('"event": "delta"') >= 5:
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 130, out
    assert "interrupted" in out
    done_before = metrics.read_text().count('"event": "delta"')
    assert 5 <= done_before < 20

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "DiPaCo 2x2" in second.stdout and "dense" in second.stdout
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Every path trained every round exactly once across the two invocations...
    deltas = Counter((e["path"], e["round"]) for e in events if e["event"] == "delta")
    assert deltas == Counter({(p, r): 1 for p in range(4) for r in range(5)})
    # ...and every module stepped once per version.
    steps = Counter((e["module"], e["version"]) for e in events if e["event"] == "outer_step")
    assert set(steps.values()) == {1} and len(steps) == 6 * 5
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    assert [r["model"] for r in rows] == [
        "DiPaCo 2x2",
        "dense (path-sized)",
        "DiLoCo-4 (equal compute)",
    ]
    # DiLoCo-4 trains exactly DiPaCo's tokens: the comparison at equal compute.
    assert rows[2]["tokens_seen"] == rows[0]["tokens_seen"]
    assert all(r["ppl"] > 1 for r in rows)
    assert (run_dir / "loss_curves.png").stat().st_size > 10_000

    # The demo's model in use: the prompt is routed to a path, which writes text.
    gen = subprocess.run(
        [sys.executable, "-m", "dipaco.cli.main", "generate", "def parse(self, text):",
         "--run-dir", str(run_dir), "--max-new-tokens", "24", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stdout + gen.stderr
    out = json.loads(gen.stdout)
    assert out["path"] in range(4) and out["new_tokens"] > 0 and out["text"].strip()
