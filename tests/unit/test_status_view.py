"""What `dipaco status` says: peers counted as people count them, saved and finished states not
called live, the grid's "-N" explained, and an answer within seconds while the coordinator is
busy (issue 49)."""

import json
import threading
import time
import urllib.request

from rich.console import Console

from dipaco.cli.watch import fetch_status, peer_count, render
from dipaco.prepare.pipeline import prepare
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog
from dipaco.watch.server import Dashboard


def shown(state: dict) -> str:
    out = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    out.print(render(state))
    return " ".join(out.export_text().split())


def state(peers: dict, machines: dict | None = None, finished: bool = False) -> dict:
    return {
        "run_id": "r",
        "round": 1,
        "rounds": 4,
        "finished": finished,
        "peers": peers,
        "machines": machines or {},
        "leases": {},
        "series": {"routed_ppl": []},
        "grid": [
            {
                "name": "shared",
                "modules": [{"id": "S.embed", "version": 0, "behind": 1, "pending": 2, "paths": 4}],
            }
        ],
        "owners": {},
        "rejections": {},
    }


def test_one_machine_of_two_workers_is_one_peer():
    peers = {
        "lab-w0": {"state": "training", "machine": "lab", "worker": 0},
        "lab-w1": {"state": "idle", "machine": "lab", "worker": 1},
        "solo": {"state": "gone"},
    }
    machines = {"lab": {"workers": ["lab-w0", "lab-w1"], "devices": ["cpu", "cpu"],
                        "state": "training", "tasks_done": 0}}  # fmt: skip
    assert peer_count(state(peers, machines)) == "peers 1 live, 1 gone (2 workers on 1 machine)"


def test_a_finished_run_and_a_saved_state_call_nobody_live(tmp_path):
    peers = {"a": {"state": "idle"}, "b": {"state": "training"}, "c": {"state": "gone"}}
    assert peer_count(state(peers, finished=True)) == "peers 3 took part"
    saved = tmp_path / "dashboard" / "status.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps(state(peers)))
    loaded = fetch_status(str(tmp_path))
    text = shown(loaded)
    assert "peers 3 took part" in text and "live" not in text
    assert "saved when its coordinator stopped" in text and "not running now" in text


def test_the_grid_says_what_minus_n_means():
    text = shown(state({}))
    assert "S.embed v0 -1 (2/4)" in text
    assert "-N: N versions behind the newest module" in text


def test_status_answers_within_seconds_while_the_coordinator_holds_its_lock(run_copy, tiny_config):
    root = run_copy()
    core = build_coordinator(
        prepare(root, tiny_config), MetricsLog(root / "metrics.jsonl"), evaluate=False
    )
    d = Dashboard(core, root).start()
    held, release = threading.Event(), threading.Event()

    def busy() -> None:  # an outer step or a state save, as long as a loaded machine makes it
        with core.lock:
            held.set()
            release.wait(60)

    try:
        url = d.url.split("?")[0] + "api/status"
        first = json.loads(urllib.request.urlopen(url, timeout=30).read())
        assert first["stale_seconds"] == 0
        worker = threading.Thread(target=busy)
        worker.start()
        held.wait(10)
        time.sleep(1.5)
        began = time.monotonic()
        busy_answer = json.loads(urllib.request.urlopen(url, timeout=30).read())
        took = time.monotonic() - began
        release.set()
        worker.join(10)
        assert took < 5, f"{took:.1f} s to answer while the coordinator was busy"
        assert busy_answer["stale_seconds"] >= 1.0
        assert busy_answer["run_id"] == core.run_id
        assert "the coordinator is busy: its state as of" in shown(busy_answer)
        fresh = json.loads(urllib.request.urlopen(url, timeout=30).read())
        assert fresh["stale_seconds"] == 0
    finally:
        release.set()
        d.stop()
