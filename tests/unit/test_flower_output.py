"""What `dipaco-coordinator start --transport flower` prints of Flower's stream (issue 49): one
time stamp a line, dipaco's Flower lines and every warning, Flower's own progress only under -v;
and the run's events (the routed validation perplexity among them) from metrics.jsonl."""

import json
import subprocess
import sys

from dipaco.cli.flower_serve import follow, operator_line

RUN_LOG = """\
Using SuperLink: dipaco (127.0.0.1:43783)
Successfully started run 1670626554689766042
INFO :      Starting logstream for run_id `1670626554689766042`
2026-11-29 06:32:13,239 INFO dipaco.flower.strategy: dipaco over Flower: run 09a5, 4 paths, 3 rounds
2026-11-29 06:32:17,129 INFO dipaco.flower.server: flower round 1: 2/2 replies in 3.9 s; outer round 0 of 3
2026-11-29 06:32:22,956 INFO dipaco.coordinator.rounds: outer step L0.M0 -> v1 (paths [0, 1], late [], all)
2026-11-29 06:32:23,001 WARNING dipaco.flower.strategy: node 7 refused: stale ticket
2026-11-29 06:33:06,236 INFO flwr: ServerApp finished running.
WARNING :   Flower says something is off
"""


def test_each_flower_line_is_shown_once_with_no_second_time_stamp():
    quiet = [operator_line(line, verbose=False) for line in RUN_LOG.splitlines()]
    shown = [line for line in quiet if line is not None]
    assert shown == [
        "dipaco over Flower: run 09a5, 4 paths, 3 rounds",
        "flower round 1: 2/2 replies in 3.9 s; outer round 0 of 3",
        "WARNING dipaco.flower.strategy: node 7 refused: stale ticket",
        "WARNING flower: Flower says something is off",
    ]
    loud = [operator_line(line, verbose=True) for line in RUN_LOG.splitlines()]
    assert all(line is not None for line in loud)
    assert "flower: Starting logstream for run_id `1670626554689766042`" in loud
    assert not any(line[:4].isdigit() for line in loud)  # no time stamp of the ServerApp's


def test_the_runs_events_are_printed_as_on_hivemind(tmp_path, capsys):
    from dipaco.cli.common import console

    log, metrics = tmp_path / "run.log", tmp_path / "metrics.jsonl"
    metrics.write_text(
        json.dumps({"event": "eval", "model": "dipaco", "round": 0, "ppl": 1.0}) + "\n"
    )
    log.write_text("2026-11-29 06:30:00,000 INFO dipaco.flower.server: flower round 9: 1/2\n")
    earlier = log.stat().st_size
    # The ServerApp appends while the command follows; what an earlier start left in both files
    # is not repeated.
    script = (
        "import json, time\n"
        f"time.sleep(1.0)\n"
        f"open({str(log)!r}, 'a').write('2026-11-29 06:32:17,129 INFO dipaco.flower.server: flower round 1: 2/2 replies\\n')\n"
        f"open({str(metrics)!r}, 'a').write(json.dumps({{'event': 'eval', 'model': 'dipaco', 'round': 1, 'ppl': 128.98}}) + '\\n')\n"
        f"open({str(metrics)!r}, 'a').write(json.dumps({{'event': 'round', 'round': 1}}) + '\\n')\n"
        "time.sleep(1.0)\n"
    )
    before = console.mode
    console.configure("plain")
    try:
        proc = subprocess.Popen([sys.executable, "-c", script])
        assert follow(proc, log, metrics, verbose=False, log_from=earlier) == 0
    finally:
        console.configure(before)
    out = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert out == [
        "flower round 1: 2/2 replies",
        "round 1: routed validation perplexity 128.98",
        "round 1 complete",
    ]
