"""The dashboard in a real headless Chromium during a live run of real processes, and
``dipaco status --json`` against the coordinator's own state."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _waiting import wait_for

BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def artifacts(tmp_path: Path) -> Path:
    """Where the screenshot goes: ``DIPACO_ARTIFACTS`` when CI asks to keep it, else the test's
    own folder (never the checkout, which may be read-only)."""
    return Path(os.environ.get("DIPACO_ARTIFACTS") or tmp_path / "artifacts")


def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    assert binary and driver, (
        "Debian's chromium and chromium-driver are needed (.ci/run installs them)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1500"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(driver))


def start_peer(address, root, tmp_path, i) -> subprocess.Popen:
    with (tmp_path / f"peer{i}.log").open("w") as log:  # read when a wait fails
        return subprocess.Popen(
            [BIN / "dipaco-peer", "join", address, "--authkey-file",
             root / "coordinator" / "authkey", "--peer-id", f"peer{i}", "--state-dir",
             tmp_path / f"peer{i}", "--metrics-port", "0"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def story(what, browser, procs, tmp_path):
    """A failed wait's message: what the page says, and what each process did and wrote, with
    every thread's stack of those still running."""

    def tell():
        try:
            shown = page(browser, "return document.getElementById('state').textContent")
        except Exception as err:  # noqa: BLE001 (the browser itself may be what failed)
            shown = f"(the page cannot be read: {err})"
        parts = [f"{what}; the page says {shown!r}"]
        for proc in procs:  # where each process is, into its log (`kill -USR1`), to read below
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        names = ["coordinator.log"] + [f"peer{i}.log" for i in range(len(procs) - 1)]
        for proc, name in zip(procs, names, strict=True):
            tail = (tmp_path / name).read_text()[-2500:] if (tmp_path / name).exists() else ""
            parts.append(f"--- {name} (exit {proc.poll()}):\n{tail}")
        return "\n".join(parts)

    return tell


def page(browser, script):
    return browser.execute_script(script)


LOSS_POINTS = "return document.getElementById('loss').data.map(t => t.y.length)"
GRID_IDS = (
    "return document.getElementById('grid').data[0].text.flat().filter(Boolean)"
    ".map(s => s.split('<br>')[0])"
)


def test_dashboard_in_chromium_and_status_json_during_a_live_run(run_copy, tmp_path):
    root = run_copy()
    config = tmp_path / "run.toml"
    config.write_text(
        'preset = "tiny"\n[train]\ninner_steps = 30\nrounds = 2\n'
        "[scheduler]\nlease_seconds = 5.0\nheartbeat_seconds = 0.5\n"
    )
    cmd = [BIN / "dipaco-coordinator", "start", "--config", config, "--run-dir", root,
           "--transport", "loopback", "--dashboard", "127.0.0.1:0", "--linger", "120"]  # fmt: skip
    # The log goes to a file, not a pipe: nobody reads a pipe until the end, and a coordinator
    # that fills one (64 KiB) blocks on its next print and cannot stop on Ctrl-C.
    log_path = tmp_path / "coordinator.log"
    log_file = log_path.open("w")
    coordinator = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    procs, browser = [coordinator], None
    try:
        url_file = root / "coordinator" / "dashboard"
        url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 120, "the URL")
        address = (root / "coordinator" / "address").read_text().strip()
        browser = chromium()
        browser.get(url)
        wait_for(lambda: page(browser, "return document.body.dataset.updates"), 30, "a refresh")
        assert page(browser, "return document.getElementById('round').dataset.round") == "0"
        modules = sorted(_module_ids(root))
        assert sorted(page(browser, GRID_IDS)) == modules  # the grid has every module, at v0

        procs += [start_peer(address, root, tmp_path, i) for i in range(2)]
        # Round 1 closes: the page follows without a reload.
        wait_for(
            lambda: (
                int(page(browser, "return document.getElementById('round').dataset.round")) >= 1
            ),
            240,
            story("the page to show round 1", browser, procs, tmp_path),
        )
        # `kill -USR1` prints every thread's stack to the log, and the run goes on.
        coordinator.send_signal(signal.SIGUSR1)
        wait_for(lambda: "most recent call first" in log_path.read_text(), 30, "a stack dump")
        # A peer's own /metrics, while the run goes on.
        peer_metrics = (tmp_path / "peer0" / "metrics_address").read_text().strip()
        scraped = urllib.request.urlopen(f"http://{peer_metrics}/metrics", timeout=10).read()
        assert b'dipaco_peer_info{device="cpu",peer="peer0"} 1.0' in scraped
        assert b"dipaco_peer_tasks_total" in scraped and b"dipaco_peer_step" in scraped
        wait_for(lambda: all(page(browser, LOSS_POINTS)), 60, "a loss point for every path")
        assert len(page(browser, LOSS_POINTS)) == 4  # one curve per path
        wait_for(
            lambda: (
                page(browser, "return document.getElementById('state').textContent") == "finished"
            ),
            300,
            story("the page to say finished", browser, procs, tmp_path),
        )
        assert min(page(browser, LOSS_POINTS)) >= 2  # a point per path per round
        versions = page(
            browser,
            "return document.getElementById('grid').data[0].z.flat().filter(v => v !== null)",
        )
        assert set(versions) == {2}
        peer_rows = page(browser, "return document.querySelectorAll('#peers tbody tr').length")
        assert peer_rows == 2
        shots = artifacts(tmp_path)
        shots.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(shots / "dashboard.png"))
        assert (shots / "dashboard.png").stat().st_size > 20_000

        # `dipaco status --json` says what the coordinator's files say (and `dipaco status`,
        # run meanwhile, says it in lines).
        command = [BIN / "dipaco", "status", url]
        with ThreadPoolExecutor(1) as pool:
            lines = pool.submit(subprocess.run, command, capture_output=True, text=True, timeout=60)
            out = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
            text = lines.result()
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        heads = {
            h.parent.name: json.loads(h.read_text())["version"]
            for h in (root / "coordinator" / "modules").glob("*/head.json")
        }
        assert {mid: info["version"] for mid, info in status["modules"].items()} == heads
        saved = json.loads((root / "coordinator" / "coordinator.json").read_text())
        assert status["rejections"] == saved["rejections"]
        assert sorted(status["peers"]) == ["peer0", "peer1"]
        assert sum(p["tasks_done"] for p in status["peers"].values()) == 8
        assert all(p["bytes_in"] > 0 and p["bytes_out"] > 0 for p in status["peers"].values())
        deltas = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
        assert len([e for e in deltas if e["event"] == "delta"]) == 8

        metrics = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
        assert "dipaco_finished 1.0" in metrics
        assert 'dipaco_module_version{module="L0.M0"} 2.0' in metrics

        assert text.returncode == 0 and "peer0" in text.stdout and "2/2" in text.stdout
    finally:
        if browser is not None:
            browser.quit()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(60)  # the coordinator gives requests in flight 10 s to finish
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)  # where it is stuck, into the log, then kill it
                time.sleep(2)
                p.kill()
                p.wait()
    log_file.close()
    log = log_path.read_text()
    assert coordinator.returncode in (0, 130), log[-3000:]  # 130: stopped by Ctrl-C, cleanly
    assert "Traceback" not in log, log[-3000:]
    assert "ERROR" not in log and "\x1b" not in log, log[-3000:]

    # The final state stays viewable once the coordinator is gone: a saved page, and the same
    # snapshot for `dipaco status RUN_DIR`.
    assert f"the dashboard's last state: {root / 'dashboard' / 'index.html'}" in log
    page_html = (root / "dashboard" / "index.html").read_text()
    assert (
        "window.DIPACO_STATUS = " in page_html and (root / "dashboard" / "plotly.min.js").exists()
    )
    out = subprocess.run(
        [BIN / "dipaco", "status", root, "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    final = json.loads(out.stdout)
    assert final["finished"] and sorted(final["peers"]) == ["peer0", "peer1"]
    assert all(p["task"] is None for p in final["peers"].values())  # no departed peer's task
    assert [o["scheduler"] for o in final["owners"].values()] == [True]  # owners are not peers
    assert sorted(next(iter(final["owners"].values()))["modules"]) == sorted(_module_ids(root))


def _module_ids(root):
    from dipaco.config import load_config_dict

    config = load_config_dict(json.loads((root / "config.json").read_text()), origin="config.json")
    return config.build_topology().module_ids()


def test_status_without_a_dashboard_says_how_to_get_one(tmp_path):
    out = subprocess.run(
        [BIN / "dipaco", "status", "127.0.0.1:9", "--json"], capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "--dashboard" in out.stdout + out.stderr
