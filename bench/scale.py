"""Scale with peers: tokens per second of a whole run with 1, 2, 4 and 8 peers, against 1 peer.

Real processes on 127.0.0.1: ``dipaco-coordinator start --transport loopback`` and N
``dipaco-peer join`` processes, each peer pinned to one CPU core (core i mod the cores this
process may use) with one thread (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1), so that peers do not
fight over cores; the coordinator gets one thread too. The run is the tiny preset on a 2x4
topology (8 paths, so that 8 peers all have work each round), quorum 1.0, and the same work for
every N: rounds x 8 paths x H inner steps. The run is prepared once and copied for each N.

Measured per N: the wall time from the first task issued to the coordinator's last ``round``
event in the run's metrics.jsonl (start-up, from launching the peers to the first task, is
printed apart: importing torch N times on a small machine is not training); the tokens
trained (the sum of the peers' ``timings.json``); tokens per second; its ratio to 1 peer and the
efficiency ratio / N; and where the peers' time went, time-weighted over the peers: compute
(train), transfer (fetch, push, save) and waiting (claims, waiting for work or for the round).

On a machine with C cores the ratio cannot exceed about C: with more peers than cores, peers
share cores (the script says so in what it prints).

With ``--slow-peer`` the last peer of each run trains at a quarter of the others' speed
(``--slow-factor F``: 1/F of it; it sleeps F - 1 times the 1-peer run's time per inner step
after each step: the fault point
``peer.inner_step``), and the scheduler offers it fewer steps as a run's does by default (down
to a quarter of H; ``--full-steps``: all H, as every other peer). With ``--overlap`` each run with more than one peer is done twice, with
``scheduler.overlap`` off and on (peers that find no open path train their path's next round,
docs/operations.md "Overlap"), and the final validation perplexity of each is measured, so that
what overlap costs in quality is printed beside the waiting it saves. ``--hedge`` makes the run
with overlap hedge too (``scheduler.hedge``: an idle peer copies a straggler's task).

    python bench/scale.py                 # --peers 1 2 4 8, 3 rounds of H = 100
    python bench/scale.py --quick         # 1 and 2 peers, 1 round (CI's short form)
    python bench/scale.py --peers 3 --slow-peer --overlap --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _report import add_report_args, record
from rich.console import Console
from rich.table import Table

from dipaco.config import SchedulerSection, preset_config
from dipaco.prepare.pipeline import prepare
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.export import open_run

BIN = Path(sys.executable).parent
TOPOLOGY = "2x4"
console = Console(width=150)


def cores() -> list[int]:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "120"}


def pinned(core: int):
    """A preexec_fn that pins the child process to one core."""

    def pin() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})

    return pin


def run_config(
    work: Path,
    rounds: int,
    inner_steps: int,
    overlap: bool = False,
    outer: dict | None = None,
    source: str = "builtin",
    step_fraction: float = 1.0,
    hedge: bool = False,
    stale_damping: float | None = None,
    aggregation: str | None = None,
    overlap_start: str | None = None,
) -> Path:
    file = work / ("run-overlap.toml" if overlap else "run.toml")
    file.write_text(
        f'preset = "tiny"\n[data]\nsource = "{source}"\n[topology]\nlevels = "{TOPOLOGY}"\n'
        f"[train]\ninner_steps = {inner_steps}\nrounds = {rounds}\n"
        f"[scheduler]\nquorum = 1.0\nmin_step_fraction = {step_fraction}\n"
        "heartbeat_seconds = 1.0\n"
        f"overlap = {'true' if overlap else 'false'}\n"
        + ("hedge = true\n" if hedge else "")
        + (f"stale_damping = {stale_damping}\n" if stale_damping is not None else "")
        + (f'overlap_start = "{overlap_start}"\n' if overlap and overlap_start else "")
        # The default 10 s floor under task deadlines is longer than this run's tasks.
        + ("deadline_floor = 0.5\n" if step_fraction < 1 else "")
        + ("[outer]\n" + "".join(f"{k} = {v}\n" for k, v in outer.items()) if outer else "")
        + (f'[validation]\naggregation = "{aggregation}"\n' if aggregation else "")
    )
    return file


def prepare_once(
    work: Path,
    source: str,
    inner_steps: int,
    rounds: int,
    outer: dict | None = None,
    validation: dict | None = None,
) -> Path:
    """The tiny preset on TOPOLOGY, prepared once in ``work/prepared`` (each run copies it)."""
    prepared = work / "prepared"
    console.log(f"preparing the tiny preset ({TOPOLOGY}) once")
    prepare(
        prepared,
        preset_config("tiny").replace(
            data={"source": source},
            topology={"levels": TOPOLOGY},
            train={"inner_steps": inner_steps, "rounds": rounds},
            scheduler={"quorum": 1.0, "min_step_fraction": 1.0, "heartbeat_seconds": 1.0},
            **({"outer": outer} if outer else {}),
            **({"validation": validation} if validation else {}),
        ),
    )
    return prepared


def wait_for(predicate, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise RuntimeError(f"{what}: a process exited with code {p.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def events(root: Path) -> list[dict]:
    file = root / "metrics.jsonl"
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def one_run(
    prepared: Path,
    work: Path,
    config: Path,
    n: int,
    rounds: int,
    timeout: float,
    slow: float = 0.0,
    label: str = "",
    quality: bool = False,
    peer_args: tuple[str, ...] = (),
    peer_faults: str = "",
    slow_peers: int = 1,
    evaluate: bool = False,
) -> dict:
    """One run with ``n`` peers; ``slow`` > 0: the last ``slow_peers`` sleep that long after each
    inner step; ``quality``: measure the final model's validation perplexity too; ``peer_args``
    and ``peer_faults`` (``DIPACO_FAULTS`` rules) for every peer; ``evaluate``: the coordinator
    validates every round (``eval`` events in metrics.jsonl), else ``--no-eval``."""
    root = work / f"peers{n}{label}"
    shutil.copytree(prepared, root)
    logs = work / f"logs{n}{label}"
    logs.mkdir()
    env = one_thread_env()
    faults = [peer_faults] if peer_faults else []
    slow_faults = [f"peer.inner_step=sleep:{slow:.4f}", *faults]
    peer_env = {**env, "DIPACO_FAULTS": ";".join(faults)} if faults else env
    slow_env = {**env, "DIPACO_FAULTS": ";".join(slow_faults)}
    procs: list[subprocess.Popen] = []
    try:
        coordinator = subprocess.Popen(
            [BIN / "dipaco-coordinator", "start", "--config", config, "--run-dir", root,
             *([] if evaluate else ["--no-eval"]), "--transport", "loopback", "--linger", "12"],
            stdout=open(logs / "coordinator.log", "w"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
        procs.append(coordinator)
        address_file = root / "coordinator" / "address"
        address = wait_for(
            lambda: address_file.exists() and address_file.read_text().strip(),
            120,
            "the coordinator to listen",
            procs,
        )
        where = cores()
        began = time.time()
        for i in range(n):
            procs.append(
                subprocess.Popen(
                    [
                        BIN / "dipaco-peer",
                        "join",
                        address,
                        "--authkey-file",
                        root / "coordinator" / "authkey",
                        "--peer-id",
                        f"peer{i}",
                        "--state-dir",
                        root / "peers" / f"peer{i}",
                        "--device",
                        "cpu",
                        *peer_args,
                    ],
                    stdout=open(logs / f"peer{i}.log", "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    env=slow_env if slow > 0 and n > 1 and i >= n - slow_peers else peer_env,
                    preexec_fn=pinned(where[i % len(where)]),
                )  # fmt: skip
            )
        if coordinator.wait(timeout) != 0:
            raise RuntimeError(f"the coordinator failed: {(logs / 'coordinator.log').read_text()}")
        for i, p in enumerate(procs[1:]):
            code = p.wait(60)
            if code != 0:  # its log's end: the folder is gone once the bench cleans up
                tail = (logs / f"peer{i}.log").read_text().splitlines()[-20:]
                raise RuntimeError(f"peer{i} exited with {code}; its log ends:\n" + "\n".join(tail))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log = events(root)
    last = [e["time"] for e in log if e["event"] == "round" and e["round"] == rounds]
    if not last:
        raise RuntimeError(f"{root}: the run did not reach round {rounds}")
    issued = [e["time"] for e in log if e["event"] == "task_issued"]
    peers = [
        json.loads((root / "peers" / f"peer{i}" / "timings.json").read_text()) for i in range(n)
    ]
    seconds = {k: sum(p["seconds"].get(k, 0.0) for p in peers) for k in peers[0]["seconds"]}
    busy = sum(seconds.values()) or 1.0
    # Training time: from the first task handed out to the last round closed. Start-up (the
    # processes importing torch, the peers saying hello) is printed apart: it grows with N on a
    # small machine and says nothing about how a long run scales.
    wall = last[0] - (min(issued) if issued else began)
    tokens = sum(p["tokens"] for p in peers)
    # Every acknowledged delta is applied in exactly one outer step of its module.
    applied = Counter(
        (e["module"], t) for e in log if e["event"] == "outer_step" for t in e["tasks"]
    )
    acked = {(e["module"], e["task"]) for e in log if e["event"] == "delta_acked"}
    ppl = None
    if quality:
        run = open_run(root)
        ppl = evaluate_modules(run.prep, run.store.params)["ppl"]
    return {
        "peers": n,
        "overlap": "overlap" in config.name,
        "slow_sleep_s": slow if n > 1 else 0.0,
        "ppl": ppl,
        # Tasks trained ahead (overlap): some module's base older than the task's round.
        "ahead_tasks": len(
            {e["task"] for e in log if e["event"] == "delta_acked" and "round" in e}
        ),
        # Copies of a straggler's task (hedging), and those whose delta was the one applied.
        "hedged_tasks": sum(1 for e in log if e["event"] == "task_hedged"),
        "hedges_applied": len(
            {e["task"] for e in log if e["event"] == "task_hedged"}
            & {t for e in log if e["event"] == "outer_step" for t in e["tasks"]}
        ),
        "applied_once": all(applied[k] == 1 for k in acked),
        "wall_s": wall,
        "start_s": min(issued) - began if issued else None,  # launch to the first task issued
        "tasks": sum(p["tasks"] for p in peers),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "compute": seconds.get("train", 0.0) / busy,
        "transfer": sum(seconds.get(k, 0.0) for k in ("fetch", "push", "save")) / busy,
        "waiting": seconds.get("claim", 0.0) / busy,
        "peer_seconds": seconds,
        "sent_behind_s": sum(p.get("sent_behind_s", 0.0) for p in peers),
        "fetched_ahead_tasks": sum(p.get("fetched_ahead_tasks", 0) for p in peers),
    }


def plot(rows: list[dict], file: Path) -> Path | None:
    """Tokens/s against peers (with the linear ideal), and the peers' time shares, as HTML."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        return None
    ns = [r["peers"] for r in rows]
    base = rows[0]["tokens_per_s"] / rows[0]["peers"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s", "share of the peers' time"))
    fig.add_trace(go.Scatter(x=ns, y=[r["tokens_per_s"] for r in rows], name="measured"), 1, 1)
    fig.add_trace(
        go.Scatter(x=ns, y=[base * n for n in ns], name="linear", line={"dash": "dash"}), 1, 1
    )
    for part in ("compute", "transfer", "waiting"):
        fig.add_trace(go.Bar(x=[str(n) for n in ns], y=[r[part] for r in rows], name=part), 1, 2)
    fig.update_layout(barmode="stack", title=f"dipaco: scaling with peers ({machine_cores()})")
    fig.update_xaxes(title_text="peers")
    file.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(file, include_plotlyjs="cdn")
    return file


def nth_run(
    args: argparse.Namespace,
    work: Path,
    prepared: Path,
    config: Path,
    outer: dict,
    fraction: float,
    n: int,
    overlap: bool,
    k: int,
    slow: float,
) -> dict:
    """One run of ``n`` peers (the ``k``-th of its kind), with overlap on or off."""
    what = f" (overlap {'on' if overlap else 'off'})" if args.overlap else ""
    again = f", repeat {k + 1} of {args.repeat}" if args.repeat > 1 and n > 1 else ""
    console.log(
        f"{n} peer(s){what}: {args.rounds} rounds x 8 paths x H={args.inner_steps}"
        + (f", the last one sleeping {slow * 1e3:.0f} ms a step" if slow else "")
        + again
    )
    if overlap:
        config = run_config(
            work, args.rounds, args.inner_steps, overlap, outer, args.source, fraction,
            hedge=args.hedge, stale_damping=args.stale_damping, aggregation=args.aggregation,
            overlap_start=args.overlap_start,
        )  # fmt: skip
    label = ("-overlap" if overlap else "") + (f"-{k}" if k else "")
    return one_run(
        prepared, work, config, n, args.rounds, args.timeout, slow, label=label,
        quality=args.overlap,
    )  # fmt: skip


def report_overlap(rows: list[dict], args: argparse.Namespace) -> None:
    """The runs with overlap off and on side by side: where the peers' time went, and the
    final perplexity of each (what overlap costs in quality)."""
    slow = f", the last peer {args.slow_factor:g}x slower" if args.slow_peer else ""
    slow += ", hedging on with overlap" if args.hedge else ""
    slow += f", overlap_start {args.overlap_start}" if args.overlap_start else ""
    slow += f", aggregation {args.aggregation}" if args.aggregation else ""
    table = Table(
        title=f"overlap: tiny preset {TOPOLOGY}, {args.rounds} rounds x 8 paths x "
        f"H={args.inner_steps}{slow}, {len(cores())} cores"
    )
    cols = ("peers", "overlap", "wall", "tokens", "tokens/s", "ahead tasks", "hedged (applied)",
            "compute", "transfer", "waiting", "ppl")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["peers"]),
            "on" if r["overlap"] else "off",
            f"{r['wall_s']:.1f} s",
            f"{r['tokens']:,}",
            f"{r['tokens_per_s']:,.0f}",
            str(r["ahead_tasks"]),
            f"{r['hedged_tasks']} ({r['hedges_applied']})",
            f"{100 * r['compute']:.1f}%",
            f"{100 * r['transfer']:.1f}%",
            f"{100 * r['waiting']:.1f}%",
            f"{r['ppl']:.2f}",
        )
    console.print(table)
    once = all(r["applied_once"] for r in rows)
    console.print(f"every acknowledged delta applied in exactly one outer step: {once}")
    parts = []
    for n in sorted({r["peers"] for r in rows if r["peers"] > 1}):
        off = [r for r in rows if r["peers"] == n and not r["overlap"]]
        on = [r for r in rows if r["peers"] == n and r["overlap"]]
        if not off or not on:
            continue
        mean = lambda runs, key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
        spread = lambda runs: (  # noqa: E731
            f" ({min(r['ppl'] for r in runs):.2f}-{max(r['ppl'] for r in runs):.2f})"
            if len(runs) > 1
            else ""
        )
        cost = 100 * (mean(on, "ppl") / mean(off, "ppl") - 1)
        runs = f" ({len(on)} runs each, means)" if len(on) > 1 else ""
        line = (
            f"{n} peers{runs}: waiting {100 * mean(off, 'waiting'):.1f}% -> "
            f"{100 * mean(on, 'waiting'):.1f}% of the peers' time, tokens/s "
            f"{mean(on, 'tokens_per_s') / mean(off, 'tokens_per_s'):.2f}x, wall "
            f"{mean(on, 'wall_s') / mean(off, 'wall_s'):.2f}x, tokens "
            f"{mean(on, 'tokens') / mean(off, 'tokens'):.2f}x, perplexity "
            f"{mean(off, 'ppl'):.2f}{spread(off)} -> {mean(on, 'ppl'):.2f}{spread(on)} "
            f"({cost:+.2f}%)"
        )
        console.print(line)
        parts.append(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": len(cores()), "rows": rows}, indent=2))
    console.print(f"results: {out}")
    record(
        args,
        "scale",
        f"overlap{slow}: {'; '.join(parts)}; tiny {TOPOLOGY} on {args.source}, {args.rounds} "
        f"rounds, H={args.inner_steps}",
    )


def machine_cores() -> str:
    return f"{len(cores())} CPU cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=100, help="H, inner steps per task")
    ap.add_argument("--quick", action="store_true", help="1 and 2 peers, 1 round of H = 40")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most")
    ap.add_argument("--out", default="runs/bench/scale.json")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    ap.add_argument("--source", default="builtin", help="corpus (builtin, builtin:mixed, a file)")
    ap.add_argument("--outer-lr", type=float, help="outer learning rate (default: the run's)")
    ap.add_argument("--outer-momentum", type=float, help="outer Nesterov momentum")
    ap.add_argument("--plot", default="runs/bench/scale.html", help="'' to skip the plot")
    ap.add_argument(
        "--slow-peer", action="store_true", help="the last peer trains at a quarter speed"
    )
    ap.add_argument(
        "--slow-factor",
        type=float,
        default=4.0,
        help="with --slow-peer: how many times slower the last peer is (4: a quarter speed)",
    )
    ap.add_argument(
        "--full-steps",
        action="store_true",
        help="with --slow-peer: offer it all H steps too (min_step_fraction 1.0)",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="each run with more than one peer twice: scheduler.overlap off and on, with the "
        "final perplexity",
    )
    ap.add_argument(
        "--stale-damping",
        type=float,
        help="scheduler.stale_damping: the weight factor of a delta per version it is behind "
        "(an overlap task's delta is one; default: the run's, 0.5)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --overlap: each run with more than one peer this many times, off and on "
        "(an overlap run's result depends on timing: the means are compared)",
    )
    ap.add_argument(
        "--overlap-start",
        choices=["end", "eager"],
        help="scheduler.overlap_start for the run with overlap (default: the run's, end)",
    )
    ap.add_argument(
        "--aggregation",
        choices=["auto", "mean", "trimmed_mean", "median"],
        help="validation.aggregation (default: the run's, auto: a trimmed mean of one vote per "
        "key in an open run, which with 3 peers is their coordinate-wise median)",
    )
    ap.add_argument(
        "--hedge",
        action="store_true",
        help="with --overlap: the run with overlap on also hedges (scheduler.hedge: idle peers "
        "copy a straggler's task)",
    )
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.peers, args.rounds, args.inner_steps = [1, 2], 1, 40
    peers = sorted(set(args.peers))
    if peers[0] != 1:
        peers.insert(0, 1)  # the baseline
    work = Path(tempfile.mkdtemp(prefix="dipaco-scale-"))
    rows = []
    try:
        outer = {
            k: v
            for k, v in (("lr", args.outer_lr), ("momentum", args.outer_momentum))
            if v is not None
        }
        # The same work for every N, except that a slow peer is offered fewer steps as a run's
        # scheduler does by default (at least a quarter of H), so that its tasks end with the
        # others' rather than hold every round back.
        default = SchedulerSection().min_step_fraction
        fraction = default if args.slow_peer and not args.full_steps else 1.0
        config = run_config(
            work, args.rounds, args.inner_steps, outer=outer, source=args.source,
            step_fraction=fraction, stale_damping=args.stale_damping,
            aggregation=args.aggregation,
        )  # fmt: skip
        validation = {"aggregation": args.aggregation} if args.aggregation else None
        prepared = prepare_once(work, args.source, args.inner_steps, args.rounds, outer, validation)
        slow = 0.0
        for n in peers:
            for overlap in (False, True) if args.overlap and n > 1 else (False,):
                for k in range(args.repeat if args.overlap and n > 1 else 1):
                    rows.append(
                        nth_run(args, work, prepared, config, outer, fraction, n, overlap, k, slow)
                    )
            if n == 1 and args.slow_peer:  # 1/F of one peer's speed: F - 1 times its step's time
                one = rows[0]
                step = one["peer_seconds"]["train"] / (one["tasks"] * args.inner_steps)
                slow = (args.slow_factor - 1) * step
    finally:
        if args.keep:
            console.print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.overlap:
        report_overlap(rows, args)
        return
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / base
        r["efficiency"] = r["ratio"] / r["peers"]
    n_cores = len(cores())
    table = Table(
        title=f"scaling with peers: tiny preset {TOPOLOGY}, {args.rounds} rounds x 8 paths x "
        f"H={args.inner_steps}, one core and one thread per peer, {n_cores} cores"
    )
    for col in ("peers", "wall", "start", "tasks", "tokens", "tokens/s", "vs 1 peer",
                "efficiency", "compute", "transfer", "waiting"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["peers"]),
            f"{r['wall_s']:.1f} s",
            f"{r['start_s']:.1f} s" if r["start_s"] is not None else "-",
            str(r["tasks"]),
            f"{r['tokens']:,}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ratio']:.2f}x",
            f"{100 * r['efficiency']:.0f}%",
            f"{100 * r['compute']:.0f}%",
            f"{100 * r['transfer']:.0f}%",
            f"{100 * r['waiting']:.0f}%",
        )
    console.print(table)
    console.print(
        "wall: from the first task issued to the last round's end (start: from launching the "
        "peers to the first task, torch's import included); compute / transfer / waiting: the peers' time in "
        "train / fetch+push+save / claims and waiting for work or for the round to close"
    )
    for r in rows[1:]:
        console.print(
            f"ratio {r['peers']} peers / 1 peer: {r['ratio']:.2f}x tokens/s "
            f"(linear would be {r['peers']}x; efficiency {100 * r['efficiency']:.0f}%)"
        )
    capped = [r["peers"] for r in rows if r["peers"] > n_cores]
    if capped:
        console.print(
            f"[yellow]this machine has {n_cores} CPU cores:[/] with {', '.join(map(str, capped))} "
            f"peers, peers share cores, so the ratio cannot exceed about {n_cores}x there"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": n_cores, "rows": rows}, indent=2))
    console.print(f"results: {out}")
    if args.plot:
        html = plot(rows, Path(args.plot))
        console.print(f"plot: {html}" if html else "plot skipped (plotly is not installed)")
    result = ", ".join(
        f"{r['peers']} peers {r['tokens_per_s']:,.0f} tok/s ({r['ratio']:.2f}x)" for r in rows
    )
    record(
        args,
        "scale",
        f"{result}; {n_cores} cores, tiny {TOPOLOGY}, {args.rounds} rounds, H={args.inner_steps}",
    )


if __name__ == "__main__":
    main()
