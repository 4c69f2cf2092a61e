"""Commands at their edges (issue 49): a folder that is not there, a reader that goes away."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
