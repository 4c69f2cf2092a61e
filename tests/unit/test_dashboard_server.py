"""The dashboard server on its own: token, read-only, the snapshot, /metrics, cut metrics lines."""

import json
import urllib.error
import urllib.request

import pytest

from dipaco.prepare.pipeline import prepare
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog
from dipaco.watch.server import Dashboard, is_loopback
from dipaco.watch.snapshot import Series


@pytest.fixture
def coordinator(run_copy, tiny_config):
    root = run_copy()
    prep = prepare(root, tiny_config)
    return root, build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)


def get(url, method="GET", headers=None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_token_is_required_when_set_and_refusals_are_counted(coordinator):
    root, c = coordinator
    d = Dashboard(c, root, token="s3cret").start()
    try:
        base = d.url.split("?")[0]
        assert get(base + "api/status")[0] == 401
        assert get(base + "api/status?token=wrong")[0] == 401
        code, body = get(base + "api/status?token=s3cret")
        assert code == 200 and json.loads(body)["run_id"] == c.run_id
        assert get(base + "metrics", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert get(base + "?token=s3cret", method="POST")[0] == 405  # read-only
        assert get(base + "static/plotly.min.js")[0] == 200  # the public library needs none
        assert d.refused == 3
        code, body = get(base + "metrics?token=s3cret")
        assert b"dipaco_dashboard_refused_total 3.0" in body
        token_file = root / "coordinator" / "dashboard.token"
        assert token_file.read_text().strip() == "s3cret"
        assert token_file.stat().st_mode & 0o077 == 0
    finally:
        d.stop()


def test_loopback_is_open_and_elsewhere_gets_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2")


def test_snapshot_before_any_training(coordinator):
    root, c = coordinator
    d = Dashboard(c, root).start()
    try:
        code, body = get(d.url + "api/status")
        s = json.loads(body)
        assert code == 200 and s["round"] == 0 and not s["finished"]
        ids = sorted(m["id"] for row in s["grid"] for m in row["modules"])
        assert ids == sorted(c.topology.module_ids())
        assert [row["name"] for row in s["grid"]] == ["shared", "level 0", "level 1"]
        assert len(s["routing"]["docs"]) == c.topology.num_paths
        page = get(d.url)[1].decode()
        assert "plotly.min.js" in page and 'id="grid"' in page
    finally:
        d.stop()


def test_series_skips_a_cut_line_and_counts_it(tmp_path):
    log = tmp_path / "metrics.jsonl"
    good = {"event": "delta", "time": 5.0, "task": "t1", "peer": "a", "path": 1, "round": 0,
            "tokens": 100, "train_losses": [3.0, 2.0]}  # fmt: skip
    issued = {"event": "task_issued", "time": 4.0, "task": "t1", "peer": "a", "path": 1}
    log.write_text(json.dumps(issued) + "\n" + '{"event": "delta", "ti\n' + json.dumps(good) + "\n")
    s = Series(log)
    s.update()
    d = s.as_dict()
    assert d["malformed_lines"] == 1
    assert d["train_loss"]["1"] == [{"time": 5.0, "round": 0, "loss": 2.5}]
    assert d["throughput"]["a"]["tokens_per_s"] == 100.0
    with open(log, "a") as f:  # a half-written last line waits for its newline
        f.write('{"event": "round", "round": 1, "time": 9.0')
    s.update()
    assert s.as_dict()["rounds"] == []
    with open(log, "a") as f:
        f.write("}\n")
    s.update()
    assert [r["round"] for r in s.as_dict()["rounds"]] == [1]


def test_status_stays_valid_json_when_a_loss_is_nan(coordinator):
    """Issue 17, break 5: one NaN in the metrics left /api/status unparseable for good."""
    root, c = coordinator
    with open(root / "metrics.jsonl", "a") as f:  # what json.dumps writes for a diverged model
        f.write('{"event": "eval", "model": "dipaco", "round": 1, "ppl": NaN, ')
        f.write('"per_path": {"0": Infinity, "1": 12.5}}\n')
    d = Dashboard(c, root).start()
    try:
        code, body = get(d.url + "api/status")

        def refuse(name):
            raise ValueError(f"{name} is not JSON")

        s = json.loads(body, parse_constant=refuse)  # as strict as a browser's JSON.parse
        assert code == 200 and s["series"]["routed_ppl"] == [{"round": 1, "ppl": None}]
        assert s["series"]["val_ppl"]["1"] == [{"round": 1, "ppl": 12.5}]
    finally:
        d.stop()
