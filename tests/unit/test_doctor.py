import argparse
import json
import socket

import pytest

from dipaco.cli.doctor import add_doctor_command, print_checks
from dipaco.config import preset_config
from dipaco.peer.checks import (
    Check,
    all_passed,
    check_memory,
    clock_check,
    parse_address,
    run_checks,
)


@pytest.fixture
def listening():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.fixture
def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused, and no other
    yield f"127.0.0.1:{s.getsockname()[1]}"  # process can take the port meanwhile
    s.close()


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_listening_socket_is_reachable(listening):
    checks = by_name(run_checks(listening, device="cpu", timeout=2.0))
    assert checks["reachability"].ok and not checks["reachability"].skipped
    assert checks["round trip"].ok and "ms" in checks["round trip"].detail
    # the loopback coordinator tells no time: the clock is not compared, and not called ok
    assert checks["clock skew"].skipped and not checks["clock skew"].ok


def test_a_multiaddr_is_probed_over_tcp(listening):
    port = listening.rsplit(":", 1)[1]
    checks = by_name(run_checks(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWabc", device="cpu"))
    assert checks["reachability"].ok


def test_a_closed_port_fails_with_advice(closed_port):
    checks = run_checks(closed_port, device="cpu", timeout=2.0)
    reach = by_name(checks)["reachability"]
    assert not reach.ok
    assert "not running" in reach.advice and "firewall" in reach.advice
    assert by_name(checks)["round trip"].skipped
    assert not all_passed(checks)


@pytest.mark.parametrize("bad", ["nonsense", "host:notaport", "/ip4/1.2.3.4/udp/9/quic"])
def test_a_malformed_address_fails_clearly(bad):
    with pytest.raises(ValueError, match="HOST:PORT|multiaddr"):
        parse_address(bad)
    reach = by_name(run_checks(bad, device="cpu"))["reachability"]
    assert not reach.ok and "wrong address" in reach.advice


def test_memory_flags_a_model_that_cannot_fit():
    config = preset_config("demo")
    tiny = check_memory(config, "cpu", memory_bytes=1 << 20)  # 1 MiB
    assert not tiny.ok and not tiny.skipped
    assert "smaller" in tiny.advice and "parameters" in tiny.detail
    roomy = check_memory(config, "cpu", memory_bytes=64 << 30)
    assert roomy.ok and not roomy.advice


def test_memory_advises_micro_batches_when_only_some_fit():
    config = preset_config("demo")
    from dipaco.peer.device import path_memory_bytes

    model, seq = config.build_model_config(), config.train.seq_len
    between = int(path_memory_bytes(model, 2, seq) / 0.8) + 1  # micro-batch 2 fits, 16 does not
    check = check_memory(config, "cpu", memory_bytes=between)
    assert check.ok and "micro-batches of 2" in check.advice


def test_memory_without_a_config_is_skipped():
    check = check_memory(None, "cpu", memory_bytes=1 << 30)
    assert check.skipped and not check.ok


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_doctor_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *argv])
    return args.fn(args)


def test_json_output_shape_and_exit_codes(listening, closed_port, capsys):
    assert _cli([listening, "--device", "cpu", "--preset", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    assert [c["name"] for c in out["checks"]] == [
        "device",
        "memory",
        "reachability",
        "round trip",
        "clock skew",
    ]
    for c in out["checks"]:
        assert set(c) == {"name", "ok", "detail", "advice", "skipped", "outcome"}
        assert isinstance(c["detail"], str)
        # a skipped check neither passed nor failed: null, not false
        if c["skipped"]:
            assert c["ok"] is None and c["outcome"] == "skipped"
        else:
            assert isinstance(c["ok"], bool) and c["outcome"] == ("passed" if c["ok"] else "failed")
    assert any(c["skipped"] for c in out["checks"])  # the loopback coordinator tells no time
    assert _cli([closed_port, "--device", "cpu", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert _cli([listening, "--device", "cpu", "--preset", "tiny", "--memory-gb", "0.001"]) == 1
    assert "✗" in capsys.readouterr().out


def test_clock_is_compared_with_an_http_date(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        clock = by_name(run_checks(None, device="cpu", time_url=url))["clock skew"]
        assert clock.ok and not clock.skipped and "s from the coordinator" in clock.detail
    finally:
        server.shutdown()
        server.server_close()


def test_a_loopback_coordinator_is_recognised():
    from dipaco.protocols.transport import LoopbackServer

    server = LoopbackServer(lambda data: data, authkey=b"k" * 32)
    try:
        reach = by_name(run_checks(server.address, device="cpu"))["reachability"]
        assert reach.ok and "dipaco loopback coordinator" in reach.detail and not reach.advice
    finally:
        server.close()


def test_a_plain_listener_is_reachable_but_questioned(listening):
    reach = by_name(run_checks(listening, device="cpu", timeout=0.5))["reachability"]
    assert reach.ok and "key challenge" in reach.advice


def test_a_measured_clock_offset_fails_past_half_the_window():
    assert clock_check(12.0, 300.0, "measured at Hello").ok
    late = clock_check(-160.0, 300.0, "measured at Hello")
    assert not late.ok and "-160.0 s from the coordinator's" in late.detail
    assert "more than 300 s off are refused" in late.advice


def test_doctor_in_a_file_is_one_line_per_check_and_names_what_it_skipped(closed_port, capsys):
    from dipaco.cli.common import console
    from dipaco.peer.checks import Check

    before = console.mode
    console.configure("plain")
    try:
        checks = [
            Check("device", True, "cpu, 2 cores"),
            Check("reachability", False, "nothing listens at " + closed_port,
                  "check the address: dipaco-peer doctor ADDRESS " + "x" * 200),
        ]  # fmt: skip
        print_checks(checks, console)
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 3, lines  # a line per check, whatever its length, then the verdict
        assert lines[0].endswith("✓ device: cpu, 2 cores")
        assert "✗ reachability: nothing listens" in lines[1] and lines[1].endswith("x" * 200)
        assert "some checks failed" in lines[2] and "skipped" not in lines[2]
        print_checks([Check("device", True, "cpu")], console)
        verdict = capsys.readouterr().out.splitlines()[-1]
        assert verdict.endswith("all checks passed")  # nothing skipped, nothing said of it
        print_checks([Check("device", True, "cpu"), Check("clock skew", False, "-", skipped=True)],
                     console)  # fmt: skip
        verdict = capsys.readouterr().out.splitlines()[-1]
        assert verdict.endswith("all checks passed (clock skew skipped: nothing to compare with)")
    finally:
        console.configure(before)
