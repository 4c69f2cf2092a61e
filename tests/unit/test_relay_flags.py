"""``dipaco-coordinator start``'s relay flags: ``--relay`` on a hivemind scheduler (or standby),
``--via-relay`` on another module owner; any other mix stops at once with one line."""

from __future__ import annotations

import pytest

from dipaco.cli.coordinator import main as coordinator_cli

JOIN = "/ip4/127.0.0.1/tcp/1/p2p/QmVU5mQbPsVvWbCTy4ZdmxQh4bDKrVxTQ4Q5B7yV8rZjmN"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--relay", "--transport", "loopback"], "--relay is for a hivemind scheduler"),
        (["--relay", "--join", JOIN, "--owns", "L1.M0"], "an owner behind NAT uses --via-relay"),
        (["--via-relay"], "--via-relay is for another module owner"),
        (["--via-relay", "--standby", "--join", JOIN], "a standby must be reachable itself"),
    ],
)
def test_a_relay_flag_in_the_wrong_place_is_one_clear_error(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_info:
        coordinator_cli(["start", "--run-dir", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert says in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
