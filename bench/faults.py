"""The fault harness, long form: many randomized fault scenarios, results in docs/reliability.md.

    .venv/bin/python bench/faults.py --scenarios 20 --seed 0

Each scenario is a whole run of the harness's config (tiny preset, 4 paths, 2 rounds) with a
real ``dipaco-coordinator`` and two ``dipaco-peer`` processes on 127.0.0.1, and faults drawn at
random: the coordinator killed (SIGKILL) at a random hit of a random fault point (inside the
outer step, inside an atomic checkpoint write, between a durable delta and its ack) or from
outside at a random moment, once to three times; a peer killed before its push or mid-task;
the connections dropped and delayed by a proxy; the disk full for a while; a peer's clock
skewed. After each, the checks of ``tests/faults``: the run finished, every acknowledged delta
was applied exactly once (none lost), and the modules equal the fault-free reference run's.
The short form of the same scenarios runs in CI (``pytest tests/faults``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "faults"))

from fault_harness import Cluster, check_run, compare_params, prepare_run  # noqa: E402
from proxy import Proxy  # noqa: E402

DOC = REPO / "docs" / "reliability.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
# Hits per run of each coordinator fault point (6 modules x 2 rounds of outer steps, 8 submits,
# ~100 atomic writes): a random hit in range lands somewhere in the run.
COORDINATOR_POINTS = {
    "outer_step.params_written": 12,
    "outer_step.momentum_written": 12,
    "outer_step.committed": 12,
    "atomic.before_rename": 100,
    "submit.committed": 8,
    "submit.before_ack": 8,
}
KINDS = ["coordinator-point", "coordinator-external", "peer", "proxy", "disk-full", "clock-skew"]


@dataclass
class Result:
    index: int
    kind: str
    spec: str
    seconds: float
    faults: int
    coordinator_restarts: int
    peer_restarts: int
    acked: int
    applied: int
    lost: int
    doubled: int
    equal: bool
    ok: bool
    error: str = ""


def scenario(rng: random.Random, kind: str, c: Cluster) -> tuple[str, dict]:
    """Set up ``c`` for a random scenario of ``kind``; returns its description and hooks."""
    hooks: dict = {}
    if kind == "coordinator-point":
        lives = []
        for _ in range(rng.randint(1, 3)):
            point = rng.choice(sorted(COORDINATOR_POINTS))
            lives.append(f"{point}=kill@{rng.randint(1, COORDINATOR_POINTS[point])}")
        c.coordinator_faults = lives
        return " then ".join(lives), hooks
    if kind == "coordinator-external":
        at = sorted(rng.uniform(2, 25) for _ in range(rng.randint(1, 3)))
        state = {"began": None, "left": list(at)}

        def killer(c: Cluster) -> None:
            if state["began"] is None:
                state["began"] = time.monotonic()
            if state["left"] and time.monotonic() - state["began"] >= state["left"][0]:
                state["left"].pop(0)
                c.kill_coordinator()

        hooks["during"] = killer
        return "kill -9 at " + ", ".join(f"{t:.1f}s" for t in at), hooks
    if kind == "peer":
        victim = rng.randrange(2)
        c.peer_restart_delay = rng.choice([0.0, 6.0])
        if rng.random() < 0.5:
            n = rng.randint(1, 4)
            c.peer_env = {victim: {"DIPACO_FAULTS": f"peer.before_push=kill@{n}"}}
            return (
                f"peer{victim} peer.before_push=kill@{n}, back after {c.peer_restart_delay:.0f}s",
                hooks,
            )
        at = rng.uniform(3, 20)
        state = {"began": None}

        def peer_killer(c: Cluster) -> None:
            if state["began"] is None:
                state["began"] = time.monotonic()
            if state["began"] is not False and time.monotonic() - state["began"] >= at:
                state["began"] = False
                c.kill_peer(victim)

        hooks["during"] = peer_killer
        return f"kill -9 peer{victim} at {at:.1f}s, back after {c.peer_restart_delay:.0f}s", hooks
    if kind == "proxy":
        delay, drop, blip = rng.choice([0.0, 0.01, 0.05]), rng.uniform(0, 0.05), rng.uniform(2, 6)
        hooks["proxy"] = {"delay": delay, "drop_prob": drop, "blip_every": blip}
        return (
            f"proxy delay {delay * 1000:.0f} ms, drop {drop:.3f}/chunk, cut all every {blip:.1f}s",
            hooks,
        )
    if kind == "disk-full":
        flag = c.workdir / "diskfull"
        after, hold = rng.randint(0, 24), rng.uniform(1, 8)
        c.coordinator_faults = [f"atomic.write=enospc@if:{flag}"]
        state = {"filled": None}

        def disk(c: Cluster) -> None:
            if state["filled"] is None and c.acked_count() >= after:
                flag.touch()
                state["filled"] = time.monotonic()
            elif state["filled"] and flag.exists() and time.monotonic() - state["filled"] > hold:
                flag.unlink()

        hooks["during"] = disk
        return f"disk full after {after} acks for {hold:.1f}s", hooks
    skew = rng.choice([-1, 1]) * rng.uniform(5, 240)
    c.peer_env = {rng.randrange(2): {"DIPACO_CLOCK_SKEW": f"{skew:.0f}"}}
    return f"a peer's clock {skew:+.0f}s", hooks


def run_one(
    index: int, kind: str, rng: random.Random, prepared: Path, work: Path, ref: Path
) -> Result:
    root = work / f"s{index}" / "run"
    shutil.copytree(prepared, root)
    c = Cluster(root, work / f"s{index}" / "work")
    spec, hooks = scenario(rng, kind, c)
    began = time.monotonic()
    error, proxy = "", None
    try:
        if "proxy" in hooks:
            proxy = Proxy(c.target, seed=index, **hooks["proxy"])
            c.peer_address = proxy.address
        c.run(timeout=300, during=hooks.get("during"))
    except AssertionError as exc:
        error = str(exc).splitlines()[0]
    finally:
        if proxy is not None:
            proxy.close()
    check = check_run(root, c.workdir / "peers")
    mismatched = compare_params(root, ref) if c.finished and not check.problems else ["n/a"]
    faults = len(c.faults_injected()) + (proxy.dropped if proxy else 0)
    if kind == "disk-full":  # every refused write is logged; count the episodes
        faults = 1 if c.faults_injected() else 0
        refused = _rejections(root).get("disk-full", 0)
        spec += f" ({len(c.faults_injected())} writes failed, {refused} submits refused)"
    result = Result(
        index, kind, spec, time.monotonic() - began, faults, c.lives - 1,
        c.peer_starts - c.n_peers,
        check.acked, check.applied, len(check.lost), len(check.doubled), not mismatched,
        check.ok and not error and not mismatched, error or "; ".join(check.problems)[:120],
    )  # fmt: skip
    if result.ok:
        shutil.rmtree(work / f"s{index}", ignore_errors=True)
    return result


def _rejections(root: Path) -> dict[str, int]:
    try:
        return json.loads((root / "coordinator" / "coordinator.json").read_text())["rejections"]
    except (OSError, ValueError, KeyError):
        return {}


def machine() -> str:
    import torch

    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}),"
        f" Python {platform.python_version()}, torch {torch.__version__}"
    )


def write_doc(results: list[Result], command: str, seconds: float) -> None:
    total = len(results)
    summary = {
        "scenarios run": total,
        "scenarios passed": sum(r.ok for r in results),
        "faults injected": sum(r.faults for r in results),
        "coordinator restarts": sum(r.coordinator_restarts for r in results),
        "peer restarts": sum(r.peer_restarts for r in results),
        "deltas acknowledged": sum(r.acked for r in results),
        "deltas applied": sum(r.applied for r in results),
        "deltas lost": sum(r.lost for r in results),
        "deltas applied twice": sum(r.doubled for r in results),
        "parameter mismatches (vs the reference run)": sum(not r.equal for r in results),
    }
    lines = [
        START,
        f"Command: `{command}`  ",
        f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}, {seconds / 60:.0f} minutes  ",
        f"Machine: {machine()}",
        "",
        "| | |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in summary.items()],
        "",
        "| # | kind | faults | injected | coord. restarts | peer restarts | acked | applied "
        "| lost | twice | params equal | s | ok |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.index} | {r.kind} | {r.spec} | {r.faults} | {r.coordinator_restarts} "
            f"| {r.peer_restarts} | {r.acked} | {r.applied} | {r.lost} | {r.doubled} "
            f"| {'yes' if r.equal else 'no'} | {r.seconds:.0f} | {'yes' if r.ok else r.error} |"
        )
    lines.append(END)
    block = "\n".join(lines)
    text = DOC.read_text() if DOC.exists() else f"# Reliability\n\n{START}\n{END}\n"
    if START not in text:
        text += f"\n{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + block + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, help="start no scenario after this many minutes")
    parser.add_argument("--work", help="folder for the runs (default: a temporary one)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/reliability.md")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="dipaco-faults-"))
    began = time.monotonic()
    print(f"preparing the harness's run in {work} ...", flush=True)
    prepared = prepare_run(work / "prepared" / "run")
    shutil.copytree(prepared, work / "reference" / "run")
    reference = Cluster(work / "reference" / "run", work / "reference" / "work")
    reference.run(timeout=300)
    print(f"reference run: {time.monotonic() - began:.0f} s", flush=True)
    results: list[Result] = []
    for i in range(args.scenarios):
        if args.minutes and time.monotonic() - began > args.minutes * 60:
            break
        kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
        r = run_one(i, kind, rng, prepared, work, reference.root)
        results.append(r)
        print(
            f"[{i:3d}] {r.kind:21s} {'ok  ' if r.ok else 'FAIL'} {r.seconds:5.0f}s "
            f"faults {r.faults:3d} restarts {r.coordinator_restarts}/{r.peer_restarts} "
            f"acked {r.acked:3d} applied {r.applied:3d} lost {r.lost} twice {r.doubled} "
            f"equal {r.equal}  {r.spec}  {r.error}",
            flush=True,
        )
    seconds = time.monotonic() - began
    print(
        f"scenarios {len(results)}, passed {sum(r.ok for r in results)}, faults injected "
        f"{sum(r.faults for r in results)}, deltas acknowledged {sum(r.acked for r in results)}, "
        f"applied {sum(r.applied for r in results)}, lost {sum(r.lost for r in results)}, "
        f"applied twice {sum(r.doubled for r in results)}, parameter mismatches "
        f"{sum(not r.equal for r in results)}, {seconds / 60:.1f} min"
    )
    if not args.no_doc:
        command = (
            f".venv/bin/python bench/faults.py --scenarios {args.scenarios} --seed {args.seed}"
        )
        if args.minutes:
            command += f" --minutes {args.minutes:g}"
        write_doc(results, command, seconds)
        print(f"wrote {DOC.relative_to(REPO)}")
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
