"""Commands at their edges (issue 49): a folder that is not there, a reader that goes away."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from _waiting import wait_for

BIN = Path(sys.executable).parent


def run_into_closed_pipe(*argv) -> subprocess.CompletedProcess:
    """Run a command whose stdout is a pipe nobody reads any more (`| head` that has exited)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [str(a) for a in argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)


def saved_run(tmp_path: Path) -> Path:
    """A run folder holding the state its dashboard saved (what `dipaco status DIR` reads)."""
    state = {
        "run_id": "r1", "round": 2, "rounds": 4, "finished": False, "leases": {}, "owners": {},
        "peers": {f"peer{i}": {"state": "idle", "tasks_done": i} for i in range(40)},
        "machines": {}, "series": {"routed_ppl": []}, "rejections": {},
        "grid": [{"name": "shared", "modules": [
            {"id": "S.embed", "version": 2, "behind": 0, "pending": 0, "paths": 4}]}],
    }  # fmt: skip
    (tmp_path / "dashboard").mkdir()
    (tmp_path / "dashboard" / "status.json").write_text(json.dumps(state))
    return tmp_path


def test_commands_end_quietly_when_their_reader_goes_away(tmp_path):
    run = saved_run(tmp_path)
    for argv in (
        [BIN / "dipaco", "status", run],
        [BIN / "dipaco", "status", run, "--json"],
        [BIN / "dipaco", "--help"],
        [BIN / "dipaco-peer", "doctor", "--help"],
        [BIN / "dipaco-coordinator", "start", "--help"],
    ):
        done = run_into_closed_pipe(*argv)
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, (
            argv,
            done.stderr,
        )
        assert done.returncode in (0, 141), (argv, done.returncode, done.stderr)
    # The status table is long enough that its writes meet the closed pipe: 141, as a shell
    # reports a writer whose reader left.
    assert run_into_closed_pipe(BIN / "dipaco", "status", run).returncode == 141


def test_gather_refuses_a_folder_that_is_not_there_or_not_a_run(tmp_path):
    missing = subprocess.run(
        [BIN / "dipaco", "gather", "--run-dir", tmp_path / "nosuch"],
        capture_output=True, text=True,
    )  # fmt: skip
    said = " ".join(missing.stdout.split())
    assert missing.returncode == 2 and f"run folder {tmp_path / 'nosuch'} does not exist" in said
    (tmp_path / "empty").mkdir()
    empty = subprocess.run(
        [BIN / "dipaco", "gather", "--run-dir", tmp_path / "empty"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert empty.returncode == 2 and "not a run folder" in empty.stdout, empty.stdout
    (tmp_path / "never" / "x").mkdir(parents=True)
    (tmp_path / "never" / "config.json").write_text("{}")
    never = subprocess.run(
        [BIN / "dipaco", "gather", "--run-dir", tmp_path / "never"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert never.returncode == 2 and "never started" in never.stdout, never.stdout


def test_start_without_a_config_resumes_a_run_folder_or_asks_for_one(tmp_path, run_copy):
    empty = subprocess.run(
        [BIN / "dipaco-coordinator", "start", "--run-dir", tmp_path / "new", "--transport",
         "loopback"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = " ".join(empty.stdout.split())
    assert empty.returncode == 2 and "no config was given" in said and "--preset" in said, said
    assert not (tmp_path / "new" / "config.json").exists()  # no demo run prepared behind our back
    root = run_copy()
    log = tmp_path / "coordinator.log"
    proc = subprocess.Popen(
        [BIN / "dipaco-coordinator", "start", "--run-dir", root, "--transport", "loopback",
         "--listen", "127.0.0.1:0", "--no-eval"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: "listening on" in log.read_text() or proc.poll() is not None, 120, "it")
        text = " ".join(log.read_text().split())
        assert f"resuming {root} with the config it saved" in text, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130  # stopped before its run was done
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
