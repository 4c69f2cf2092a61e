"""Keys and allow-lists with real processes on 127.0.0.1: what an operator and a volunteer type."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _waiting import wait_for

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def cli(*args) -> str:
    done = subprocess.run([BIN / args[0], *map(str, args[1:])], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def join(address, root, state, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "dipaco-peer", "join", address, "--authkey-file", root / "coordinator" / "authkey",
         "--peer-id", state.name, "--state-dir", state, *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def said(proc: subprocess.CompletedProcess) -> str:
    """What a command printed, with rich's line wrapping undone."""
    return " ".join((proc.stdout + proc.stderr).split())


def test_an_allow_list_run_admits_allowed_keys_only(run_copy, tmp_path):
    root = run_copy()
    config = tmp_path / "run.toml"
    config.write_text(
        # The prepared run's schedule (tests/conftest.py), with an allow-list.
        'preset = "tiny"\n[train]\ninner_steps = 30\nrounds = 2\n[security]\njoin = "allow-list"\n'
    )
    volunteer = tmp_path / "volunteer"
    with ThreadPoolExecutor(4) as pool:  # commands that need nothing of each other, side by side
        # The volunteer makes its key on its own machine (and someone else makes one).
        volunteer_key = pool.submit(cli, "dipaco-peer", "key", "--state-dir", volunteer)
        other_key = pool.submit(cli, "dipaco-peer", "key", "--state-dir", tmp_path / "someone-else")
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--config", config, "--run-dir", root,
             "--no-eval", "--transport", "loopback", "--linger", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            address_file = root / "coordinator" / "address"
            address = wait_for(
                lambda: address_file.exists() and address_file.read_text().strip(),
                120,
                "the address",
            )
            published = pool.submit(cli, "dipaco-coordinator", "key", "--run-dir", root)
            # A stranger's key is refused, and told what its operator must run.
            stranger = pool.submit(join, address, root, tmp_path / "stranger")
            coordinator_key = published.result()
            assert coordinator_key.startswith("ed25519:")
            stranger = stranger.result()
            assert stranger.returncode != 0
            assert "dipaco-coordinator allow ed25519:" in said(stranger)

            # A peer that insists on another coordinator key refuses this coordinator.
            key = volunteer_key.result()
            assert (volunteer / "signing.key").stat().st_mode & 0o777 == 0o600
            cli("dipaco-coordinator", "allow", key, "--run-dir", root, "--note", "volunteer")
            impostor = join(address, root, volunteer, "--coordinator-key", other_key.result())
            assert impostor.returncode != 0
            assert "untrusted-reply" in said(impostor)
            assert "expected the coordinator" in said(impostor)

            # Allowed, and checking the coordinator's published key: it trains the whole run.
            ok = join(address, root, volunteer, "--coordinator-key", coordinator_key)
            assert ok.returncode == 0, ok.stdout + ok.stderr
            out, _ = coordinator.communicate(timeout=120)
            assert coordinator.returncode == 0 and "run finished" in out, out
        finally:
            if coordinator.poll() is None:
                coordinator.kill()
                coordinator.wait()
    events = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    deltas = [e for e in events if e["event"] == "delta"]
    assert {e["peer"] for e in deltas} == {"volunteer"} and len(deltas) == 8
    peers = json.loads((root / "coordinator" / "peers.json").read_text())
    assert peers["names"]["volunteer"] == key and "stranger" not in peers["names"]
