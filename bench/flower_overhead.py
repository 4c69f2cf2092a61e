"""Round overhead of the Flower transport against hivemind, on the same tiny run.

The same prepared run (tiny preset, 2x2 paths, H inner steps, R outer rounds) is trained twice by
two nodes with real processes on 127.0.0.1:

* hivemind: ``dipaco-coordinator start`` (the DHT and libp2p streams) and two
  ``dipaco-peer join`` processes;
* Flower: ``dipaco-coordinator start --transport flower --local-peers 2`` (a SuperLink with TLS
  and node authentication, two ``dipaco-peer join --flower`` nodes whose ClientApps hand each
  task to the node's warm trainer);
* Flower, cold: the same with ``dipaco-peer join --flower --cold`` nodes, whose ClientApp
  processes (one per message) import torch and train themselves.

Printed, from each run's metrics.jsonl: seconds per outer round (first task issued to the last
outer step, over R), the median task latency (issued -> its delta applied), the wall time
including start-up, and the ratios Flower / hivemind. Both train identical tasks, so the
differences are the transports' own costs. Every process gets one compute thread
(``OMP_NUM_THREADS=1``): two nodes share this machine's cores, and two torch processes with a
thread per core each slow each other down many times over, which would measure the machine
rather than the transport.

    python bench/flower_overhead.py [--rounds 3] [--inner-steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dipaco.config import load_config
from dipaco.flower import deploy
from dipaco.prepare.pipeline import prepare

BIN = Path(sys.executable).parent
console = Console(width=140)


def events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def summarize(root: Path, wall: float, rounds: int) -> dict:
    ev = events(root)
    issued = {e["task"]: e["time"] for e in ev if e["event"] == "task_issued"}
    done = {e["task"]: e["time"] for e in ev if e["event"] == "delta"}
    ends = [e["time"] for e in ev if e["event"] == "round"]
    t0 = min(issued.values())
    latency = [done[t] - issued[t] for t in done if t in issued]
    flower = [e["seconds"] for e in ev if e["event"] == "flower_round"]
    return {
        "per_round": (max(ends) - t0) / rounds,
        "task_latency": statistics.median(latency),
        "wall": wall,
        "tasks": len(done),
        "flower_round": statistics.median(flower) if flower else None,
    }


def wait(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"timed out; see {log}") from None
    if code != 0:
        raise SystemExit(f"exit {code}; see {log}:\n{log.read_text()[-3000:]}")


def run_hivemind(root: Path, config: Path, work: Path, rounds: int) -> dict:
    log = work / "hivemind.log"
    began = time.monotonic()
    with open(log, "w") as out:
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--config", config, "--run-dir", root,
             "--no-eval", "--linger", "1"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        address_file = root / "coordinator" / "address"
        while not address_file.exists():
            if coordinator.poll() is not None or time.monotonic() - began > 120:
                raise SystemExit(f"the coordinator did not start; see {log}")
            time.sleep(0.2)
        address = address_file.read_text().strip()
        key = re.search(r"--coordinator-key (ed25519:\S+)", " ".join(log.read_text().split()))
        peers = [
            subprocess.Popen(
                [
                    BIN / "dipaco-peer",
                    "join",
                    address,
                    "--state-dir",
                    work / f"peer{i}",
                    "--peer-id",
                    f"peer{i}",
                    "--device",
                    "cpu",
                ]
                + (["--coordinator-key", key.group(1)] if key else []),
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for i in range(2)
        ]
        wait(coordinator, log, 900)
        for p in peers:
            p.wait(60)
    return summarize(root, time.monotonic() - began, rounds)


def run_flower(root: Path, config: Path, work: Path, rounds: int, cold: bool = False) -> dict:
    """``--local-peers 2`` (nodes with warm trainers), or two ``dipaco-peer join --flower
    --cold`` nodes whose ClientApp processes train themselves."""
    name = "flower-cold" if cold else "flower"
    log = work / f"{name}.log"
    states = [work / f"{name}-node{i}" for i in range(2)]
    if cold:
        for state in states:
            public = deploy.make_node_key(state / "flower-node.key")
            subprocess.run(
                [BIN / "dipaco-coordinator", "add-peer", public, "--run-dir", root], check=True
            )
    began = time.monotonic()
    nodes = []
    with open(log, "w") as out:
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--transport", "flower", "--config", config,
             "--run-dir", root, "--no-eval", "--local-peers", "0" if cold else "2"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        if cold:
            pattern = r"--flower (\S+) --root-certificates (\S+) --coordinator-key (ed25519:\S+)"
            found = None
            while found is None:
                if coordinator.poll() is not None or time.monotonic() - began > 120:
                    raise SystemExit(f"the coordinator did not start; see {log}")
                found = re.search(pattern, " ".join(log.read_text().split()))
                time.sleep(0.2)
            address, ca, key = found.groups()
            nodes = [
                subprocess.Popen(
                    [
                        BIN / "dipaco-peer",
                        "join",
                        "--flower",
                        address,
                        "--root-certificates",
                        ca,
                        "--coordinator-key",
                        key,
                        "--state-dir",
                        state,
                        "--peer-id",
                        state.name,
                        "--device",
                        "cpu",
                        "--cold",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
                for state in states
            ]
        try:
            wait(coordinator, log, 900)
        finally:
            for node in nodes:
                node.terminate()
                node.wait(60)
    return summarize(root, time.monotonic() - began, rounds)


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every process started below
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--work", help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dipaco-flower-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "run.toml"
    config.write_text(
        f'preset = "tiny"\n[train]\ninner_steps = {args.inner_steps}\nrounds = {args.rounds}\n'
        "[scheduler]\nheartbeat_seconds = 1.0\n"
    )
    base = work / "prepared"
    with console.status("preparing the tiny run"):
        prepare(base, load_config(config))
    results = {}
    runs = (
        ("hivemind", run_hivemind),
        ("flower", run_flower),
        ("flower-cold", lambda *a: run_flower(*a, cold=True)),
    )
    for name, fn in runs:
        root = work / name
        shutil.copytree(base, root)
        with console.status(f"training over {name}"):
            results[name] = fn(root, config, work, args.rounds)
        console.print(f"{name}: {results[name]}")
    table = Table(title=f"tiny 2x2, 2 nodes, H={args.inner_steps}, {args.rounds} outer rounds")
    table.add_column("measure")
    for name in results:
        table.add_column(name, justify="right")
    table.add_column("flower / hivemind", justify="right")
    table.add_column("flower-cold / flower", justify="right")
    h, f, c = results["hivemind"], results["flower"], results["flower-cold"]
    for key, label in (
        ("per_round", "seconds per outer round"),
        ("task_latency", "task latency, median (s)"),
        ("wall", "wall time with start-up (s)"),
    ):
        table.add_row(
            label,
            f"{h[key]:.1f}",
            f"{f[key]:.1f}",
            f"{c[key]:.1f}",
            f"{f[key] / h[key]:.2f}",
            f"{c[key] / f[key]:.2f}",
        )
    table.add_row(
        "Flower round, median (s)",
        "-",
        f"{f['flower_round']:.1f}",
        f"{c['flower_round']:.1f}",
        "-",
        f"{c['flower_round'] / f['flower_round']:.2f}",
    )
    console.print(table)


if __name__ == "__main__":
    main()
