"""The internet on one machine: real runs between network namespaces (bench/internet.py's short
forms; ``python bench/internet.py --long`` is the long form).

Each test builds its own testbed (bench/netbed.py): a public switch, home routers with NAT, rate
limits and random loss in the kernel. The coordinator, the owner and each peer are real
processes, each in its own namespace, talking over hivemind. Each test asserts what a user would
notice: the run finishes, every acknowledged delta is applied exactly once, transfers take what
bytes / rate says, and nothing is left behind (no namespace, no process in one).

Needs root, ``ip``, ``tc`` and ``iptables`` (``.ci/run`` installs them): elsewhere these tests
skip with the reason, unless ``DIPACO_NETNS=require`` (CI), where they fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import internet
import netbed
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _testbed_possible():
    why = netbed.missing()
    if why is not None:
        if os.environ.get("DIPACO_NETNS") == "require":
            pytest.fail(f"the network testbed cannot run here: {why}")
        pytest.skip(f"the network testbed cannot run here: {why}")
    yield
    assert netbed.ours() == [], "a test left namespaces behind"


@pytest.fixture
def testbed():
    """A testbed of one's own (bench/netbed.py), removed afterwards whatever happened."""
    with netbed.Netbed() as net:
        yield net


def scenario(name: str, tmp_path, **kwargs) -> dict:
    result = internet.run_scenario(name, tmp_path / name, **kwargs)
    assert result["left"] == [], result
    return result


def test_peers_behind_nat_and_an_owner_behind_another_train_to_the_end(tmp_path):
    result = scenario("nat", tmp_path)
    assert result["problems"] == [], "\n".join(result["problems"])
    # The owner behind the second NAT was reached only through the scheduler's relay: every
    # task pushes to it and fetches from it (3 rounds x 4 paths).
    assert result["relayed"] >= 12, result
    # The public peer never asked a module server behind the home's NAT (it could not dial
    # one: its 192.168.1.x is on no network of the public peer's), and said it skipped them...
    assert result["public_peer_from_nat"] == [] and result["public_peer_dial_failures"] == []
    assert result["skipped_by_public_peer"] >= 1, result
    # ... while the peers behind that NAT took module versions from one another and from the
    # public one.
    assert sum(result["seeds"][name][0] for name in ("nat0", "nat1", "nat2")) >= 1, result
    # The kernel's count of each peer's bytes is the program's, plus the DHT and the framing
    # (docs/volunteers.md states the overhead: with tasks this short, the DHT's share is at
    # its largest, and grows with the run's length on a loaded machine).
    for name, wire in result["wire"].items():
        assert wire["program_up"] > 0 and wire["program_down"] > 0, (name, wire)
        assert 1.0 < wire["up_ratio"] < internet.WIRE_OVERHEAD_MAX, (name, wire)
        assert 1.0 < wire["down_ratio"] < internet.WIRE_OVERHEAD_MAX, (name, wire)


def test_a_thin_uplink_costs_what_bytes_over_rate_says(tmp_path):
    result = scenario("thin", tmp_path)
    assert result["problems"] == [], "\n".join(result["problems"])
    for label, row in result["rows"].items():
        assert row["tasks"] >= 1, (label, row)
        # The kernel's limit holds (no faster than the rate), and the peer loses little on top
        # of it (within the stated factor), with or without its own --max-mbps at that rate.
        assert 0.9 <= row["ratio"] <= internet.THIN_FACTOR, (label, row)
        # What went up on the wire is the messages plus framing and the DHT's chatter.
        assert 1.0 < row["wire_bytes_over_rate_s"] / row["bytes_over_rate_s"] < 1.5, row


@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_random_loss_on_the_router_costs_no_task_and_no_delta(tmp_path, fraction):
    result = scenario("loss", tmp_path, fraction=fraction)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["expired"] == 0


def test_a_link_cut_for_30_s_mid_upload_is_survived_and_applied_once(tmp_path):
    result = scenario("cut", tmp_path)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["acked_before_cut"] == 0  # the cut did land in the middle of the upload
    assert result["expired"] == 0  # the lease (60 s) outlived the cut
    assert result["ack_after_link_back_s"] < internet.CUT_RECOVERY_MAX, result


def test_a_flash_crowd_of_16_peers_behind_one_nat(tmp_path):
    result = scenario("crowd", tmp_path, peers=16)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["started_within_s"] < 1.0
    assert result["finished"] == 16  # every one heard the run end and left cleanly
    assert result["trained"] == 4 * 2  # 2 rounds of 4 paths: each task trained once


def test_who_can_dial_whom_is_judged_from_inside_each_network(testbed):
    """``addresses.reachable``, asked in each namespace: a home's private addresses from the
    home itself and from outside, a public one from behind NAT."""
    code = (
        "import sys; from dipaco.protocols.addresses import reachable; "
        "print(' '.join(str(reachable(a)) for a in sys.argv[1:]))"
    )
    outside = testbed.public("outside")
    home = testbed.home("home")
    first, second = home.host("first"), home.host("second")
    other = testbed.home("other").host("elsewhere")  # 192.168.2.2: another home's LAN
    addresses = [f"/ip4/{second.address}/tcp/4001", f"/ip4/{outside.address}/tcp/4001",
                 "/ip4/127.0.0.1/tcp/4001"]  # fmt: skip

    def judged(host: netbed.Host) -> list[str]:
        return host.run(sys.executable, "-c", code, *addresses).stdout.split()

    assert judged(first) == ["True", "True", "True"]  # its LAN, the internet, itself
    assert judged(outside) == ["False", "True", "True"]  # behind a NAT: not from outside
    assert judged(other) == ["False", "True", "True"]  # nor from behind another one


def test_a_crashed_testbed_is_swept_and_a_failed_one_leaves_nothing():
    child = subprocess.Popen(
        [sys.executable, "-c", "import netbed, time\nnet = netbed.Netbed()\nnet.home('h').host('p')"
         "\nprint('built', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(netbed.__file__),
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "built"
        theirs = [ns for ns in netbed.namespaces() if ns.startswith(f"dnb-{child.pid}-")]
        assert len(theirs) == 3, theirs  # the public core, the home router, the host
    finally:
        child.send_signal(signal.SIGKILL)  # it never removes them
        child.wait()
    with pytest.raises(RuntimeError, match="in the middle"):
        # Sweeps the dead process's namespaces first (another test's testbed, in a worker
        # beside this one, may have swept them already).
        with netbed.Netbed() as net:
            assert not any(ns in netbed.namespaces() for ns in theirs)
            host = net.home("h").host("p")
            sleeper = host.popen(["sleep", "600"])
            raise RuntimeError("a test failing in the middle")
    time.sleep(0.1)
    assert sleeper.wait(10) == -signal.SIGKILL  # what ran inside was stopped
    assert netbed.ours() == []
