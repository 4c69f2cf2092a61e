"""The synchronous schedule against the fed one, on a real run: validation perplexity per
wall-clock second and per token, with some peers at a tenth of the others' speed.

Real processes on 127.0.0.1, as ``bench/scale.py`` runs them (the tiny preset on 2x4, each peer
pinned to a core with one thread, the coordinator on loopback). ``--peers N`` peers, the last
``--slow-peers`` of them ``--slow-factor`` (10) times slower: each sleeps F - 1 times a fast
peer's step after each inner step (the fault point ``peer.inner_step``), as a GPU a tenth as fast
would. The two schedules:

- ``sync``: the scheduler's defaults before issue 52 (``overlap`` and ``hedge`` off, plain
  ``dipaco-peer join``): a peer that finds no open path waits for the round to close.
- ``fed``: ``scheduler.overlap = true`` (a peer with no open path trains its path's next round),
  ``scheduler.hedge = "last"`` (copies of a straggler's task in the last round only), and the
  peers join with ``--push-behind --fetch-ahead`` (``--no-pipeline``: without them).

Everything else is the library's default (quorum 0.5 and a quarter of H at least for a slow
peer, not the tiny preset's 1 and all H; deadlines, the outer step, the combiner), except
``heartbeat_seconds`` 1 and ``deadline_floor`` 0.5 s (these tasks last about a second; the
default 10 s floor is longer than a round). The coordinator validates every round
(``eval.max_docs`` documents of the validation split), so each run gives a curve: the round's
perplexity at the wall time the round closed (from the first task issued) and at the tokens
acknowledged by then, from round 0 (the initial modules at 0 s and 0 tokens, which both schedules
share). The two schedules are compared on those curves, interpolated in log perplexity: at equal
wall time (over the span both runs cover, and at its end) and at equal tokens. Each schedule runs ``--repeat`` times (the runs alternate, so that the machine's
load falls on both alike); the curves of a schedule's runs are averaged. Each run checks that
every acknowledged delta was applied in exactly one outer step.

    python bench/schedules.py                          # builtin, 4 peers (2 slow), 16 rounds
    python bench/schedules.py --rounds 20 --repeat 3 --aggregation mean --source builtin:mixed

(An open run's default combiner, a trimmed mean of 4 keys' votes, spreads one setting's runs
wider than the schedules differ: decide with the mean and 3 runs or more; docs/operations.md,
"The fed schedule on a real run".)
    python bench/schedules.py --quick                  # CI's short form: 2 rounds, H = 20

One part changed at a time: ``--fed-scheduler 'overlap_start = "eager"'`` (a further
``[scheduler]`` line of the fed schedule), ``--outer 'momentum = 0.0'`` (an ``[outer]`` line of
both), ``--fed-outer`` (of the fed schedule alone; its run is prepared apart, the outer step
being the run's) and ``--validation 'heldout_check = false'`` (a ``[validation]`` line of both).
docs/operations.md has what each candidate did.

Each comparison is followed by the same ratio for each path's validation documents alone, and
their geometric mean over paths: the run's perplexity is a mean over all validation tokens, and
one path a slow peer keeps can swing it by more than every other path together.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import tempfile
import tomllib
from pathlib import Path

from _report import add_report_args, record
from rich.table import Table
from scale import TOPOLOGY, console, cores, events, one_run, prepare_once

from dipaco.config import SchedulerSection, read_run_config
from dipaco.prepare.pipeline import prepare
from dipaco.run.evaluate import evaluate_modules

SCHEDULES = ("sync", "fed")
DEFAULT = SchedulerSection()
PIPELINE = ("--push-behind", "--fetch-ahead")


def schedule_config(work: Path, schedule: str, args: argparse.Namespace) -> Path:
    """The run config of one schedule: the run's defaults, but for the schedule's settings."""
    fed = schedule == "fed"
    file = work / f"run-{schedule}.toml"
    file.write_text(
        f'preset = "tiny"\n[data]\nsource = "{args.source}"\n[topology]\nlevels = "{TOPOLOGY}"\n'
        f"[train]\ninner_steps = {args.inner_steps}\nrounds = {args.rounds}\n"
        "[scheduler]\nheartbeat_seconds = 1.0\ndeadline_floor = 0.5\n"
        # The library's defaults, not the tiny preset's (quorum 1, every peer all H).
        f"quorum = {DEFAULT.quorum}\nmin_step_fraction = {DEFAULT.min_step_fraction}\n"
        f"overlap = {'true' if fed else 'false'}\n"
        + ('hedge = "last"\n' if fed else "hedge = false\n")
        + "".join(f"{line}\n" for line in (args.fed_scheduler if fed else []))
        + f"[eval]\nevery_round = true\nmax_docs = {args.eval_docs}\n"
        + ("[outer]\n" + "".join(f"{line}\n" for line in outer_lines(schedule, args)))
        + "[validation]\n"
        + (f'aggregation = "{args.aggregation}"\n' if args.aggregation else "")
        + "".join(f"{line}\n" for line in args.validation)
    )
    return file


def outer_lines(schedule: str, args: argparse.Namespace) -> list[str]:
    """The [outer] lines of a schedule's config: ``--outer``'s, then the fed one's own."""
    return [*args.outer, *(args.fed_outer if schedule == "fed" else [])]


def initial_ppl(root: Path) -> dict:
    """The validation perplexity of a run's initial modules (its round 0), as the coordinator
    validates a round: the run folder's config, its documents, the routed paths; ``ppl`` and
    ``per_path`` (path -> perplexity, the paths with validation documents)."""
    prep = prepare(root, read_run_config(root))
    initial = prep.config.build_topology().init_modules(prep.initial_state())
    result = evaluate_modules(prep, initial.__getitem__)
    paths = {str(p): float(v["ppl"]) for p, v in result["per_path"].items()}
    return {"ppl": float(result["ppl"]), "per_path": paths}


def curve(root: Path, start: dict) -> list[dict]:
    """Each round's validation: the wall time its round closed (from the first task issued), the
    tokens of the tasks acknowledged by then, and the perplexity; from round 0 (the initial
    modules, at 0 s and 0 tokens), which every schedule shares, so that any two runs' curves
    cover a common span however late their first rounds close."""
    log = events(root)
    began = min(e["time"] for e in log if e["event"] == "task_issued")
    closed = {e["round"]: e["time"] for e in log if e["event"] == "round"}
    acked: dict[str, tuple[float, int]] = {}
    for e in log:
        if e["event"] == "delta_acked" and e["task"] not in acked:
            acked[e["task"]] = (e["time"], int(e["tokens"]))
    points = [{"round": 0, "wall_s": 0.0, "tokens": 0, **start}]
    for e in log:
        if e["event"] == "eval" and e["round"] in closed:
            t = closed[e["round"]]
            tokens = sum(n for when, n in acked.values() if when <= t)
            points.append({"round": e["round"], "wall_s": t - began, "tokens": tokens,
                           "ppl": e["ppl"], "per_path": e.get("per_path", {})})  # fmt: skip
    return sorted(points, key=lambda p: p["round"])


def at(points: list[dict], key: str, x: float, path: str | None = None) -> float | None:
    """The log perplexity (of ``path``'s documents alone, if given) at ``x`` of ``key``
    (wall_s or tokens), linear between rounds; None outside the curve or where a round did
    not validate the path."""

    def ppl(point: dict) -> float | None:
        return point["ppl"] if path is None else point.get("per_path", {}).get(path)

    for a, b in itertools.pairwise(points):
        if a[key] <= x <= b[key]:
            pa, pb = ppl(a), ppl(b)
            if pa is None or pb is None:
                return None
            span = b[key] - a[key]
            w = 0.0 if span == 0 else (x - a[key]) / span
            return (1 - w) * math.log(pa) + w * math.log(pb)
    return None


def mean_at(runs: list[list[dict]], key: str, x: float, path: str | None = None) -> float | None:
    values = [at(points, key, x, path) for points in runs]
    if any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def compare(curves: dict[str, list[list[dict]]], key: str) -> dict:
    """fed against sync at equal ``key`` (wall_s or tokens): the perplexity ratio at the end of
    the span every run covers, and the mean ratio over 20 points of it."""
    lo = max(points[0][key] for runs in curves.values() for points in runs)
    hi = min(points[-1][key] for runs in curves.values() for points in runs)
    if hi <= lo:
        return {"from": lo, "to": hi, "end": None, "mean": None}
    grid = [lo + (hi - lo) * i / 19 for i in range(20)]
    ratios = []
    for x in grid:
        sync, fed = mean_at(curves["sync"], key, x), mean_at(curves["fed"], key, x)
        if sync is not None and fed is not None:
            ratios.append((x, math.exp(fed - sync)))
    return {
        "from": lo,
        "to": hi,
        "end": ratios[-1][1] if ratios else None,
        "mean": math.exp(sum(math.log(r) for _, r in ratios) / len(ratios)) if ratios else None,
        "sync_end_ppl": math.exp(mean_at(curves["sync"], key, hi) or 0.0),
        "fed_end_ppl": math.exp(mean_at(curves["fed"], key, hi) or 0.0),
    }


def per_path(curves: dict[str, list[list[dict]]], key: str) -> dict[str, float]:
    """fed / sync perplexity of each path's documents at the end of the span every run covers
    (``key``: wall_s or tokens). The run's perplexity is a mean over all validation tokens, so
    one path whose perplexity swings by orders of magnitude (a path a slow peer keeps) moves it
    more than every other path together (docs/operations.md); this says which paths differ."""
    hi = min(points[-1][key] for runs in curves.values() for points in runs)
    paths = sorted(
        {p for runs in curves.values() for pts in runs for p in pts[-1].get("per_path", {})},
        key=int,
    )
    ratios = {}
    for p in paths:
        sync, fed = mean_at(curves["sync"], key, hi, p), mean_at(curves["fed"], key, hi, p)
        if sync is not None and fed is not None:
            ratios[p] = math.exp(fed - sync)
    return ratios


def plot(curves: dict[str, list[list[dict]]], file: Path, title: str) -> Path | None:
    """Perplexity against wall time and against tokens, every run, as HTML."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("per wall-clock second", "per token"))
    colors = {"sync": "#1f77b4", "fed": "#d62728"}
    for schedule, runs in curves.items():
        for k, points in enumerate(runs):
            for col, key in ((1, "wall_s"), (2, "tokens")):
                fig.add_trace(
                    go.Scatter(
                        x=[p[key] for p in points],
                        y=[p["ppl"] for p in points],
                        name=f"{schedule} {k + 1}",
                        line={"color": colors[schedule]},
                        showlegend=col == 1,
                    ),
                    1,
                    col,
                )
    fig.update_yaxes(type="log", title_text="validation perplexity")
    fig.update_xaxes(title_text="seconds from the first task", row=1, col=1)
    fig.update_xaxes(title_text="tokens acknowledged", row=1, col=2)
    fig.update_layout(title=title)
    file.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(file, include_plotlyjs="cdn")
    return file


def step_seconds(work: Path, args: argparse.Namespace) -> float:
    """A fast peer's seconds per inner step: one peer alone trains a run of one round."""
    work = work / "probe"
    work.mkdir()
    prepared = prepare_once(work, args.source, args.inner_steps, 1)
    config = work / "run-probe.toml"
    config.write_text(
        f'preset = "tiny"\n[data]\nsource = "{args.source}"\n[topology]\nlevels = "{TOPOLOGY}"\n'
        f"[train]\ninner_steps = {args.inner_steps}\nrounds = 1\n"
    )
    console.log("one peer alone, one round: a fast peer's step")
    row = one_run(prepared, work, config, 1, 1, args.timeout)
    return row["peer_seconds"]["train"] / (row["tasks"] * args.inner_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--slow-peers", type=int, default=2)
    ap.add_argument("--slow-factor", type=float, default=10.0, help="how much slower they are")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--inner-steps", type=int, default=100, help="H, inner steps per task")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each schedule")
    ap.add_argument("--source", default="builtin", help="corpus (builtin, builtin:mixed, a file)")
    ap.add_argument("--eval-docs", type=int, default=64, help="eval.max_docs per validation")
    ap.add_argument("--aggregation", choices=["auto", "mean", "trimmed_mean", "median"])
    ap.add_argument("--no-pipeline", action="store_true", help="fed peers without the pipelines")
    ap.add_argument(
        "--fed-scheduler",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='a further [scheduler] line of the fed schedule, in TOML (overlap_start = "eager")',
    )
    ap.add_argument(
        "--outer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an [outer] line of both schedules, in TOML (momentum = 0.0)",
    )
    ap.add_argument(
        "--validation",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [validation] line of both schedules, in TOML (heldout_check = false)",
    )
    ap.add_argument(
        "--fed-outer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an [outer] line of the fed schedule alone (prepared apart)",
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds of H = 20 (CI's short form)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    ap.add_argument("--out", default="runs/bench/schedules.json")
    ap.add_argument("--plot", default="runs/bench/schedules.html", help="'' to skip the plot")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.inner_steps, args.eval_docs = 2, 20, 8
    if not 0 <= args.slow_peers < args.peers:
        ap.error("--slow-peers must leave at least one fast peer")
    work = Path(tempfile.mkdtemp(prefix="dipaco-schedules-"))
    rows: list[dict] = []
    curves: dict[str, list[list[dict]]] = {s: [] for s in SCHEDULES}
    start: dict[str, float] = {}
    try:
        # The outer step is the run's (not operational): a fed schedule with its own is
        # prepared apart (the same data, tokenizer and start: prepare is deterministic).
        prepared = {}
        for schedule in SCHEDULES:
            lines = outer_lines(schedule, args)
            outer = tomllib.loads("\n".join(lines)) if lines else None
            if schedule == "fed" and not args.fed_outer:
                prepared[schedule] = prepared["sync"]
                continue
            folder = work if schedule == "sync" else work / "fed-outer"
            folder.mkdir(exist_ok=True)
            prepared[schedule] = prepare_once(
                folder, args.source, args.inner_steps, args.rounds, outer
            )
        step = step_seconds(work, args)
        slow = (args.slow_factor - 1) * step if args.slow_peers else 0.0
        for k in range(args.repeat):
            for schedule in SCHEDULES:
                console.log(
                    f"{schedule}, run {k + 1} of {args.repeat}: {args.peers} peers "
                    f"({args.slow_peers} sleeping {slow * 1e3:.0f} ms a step), {args.rounds} "
                    f"rounds x 8 paths x H={args.inner_steps}"
                )
                fed = schedule == "fed" and not args.no_pipeline
                row = one_run(
                    prepared[schedule], work, schedule_config(work, schedule, args), args.peers,
                    args.rounds, args.timeout, slow, label=f"-{schedule}-{k}",
                    peer_args=PIPELINE if fed else (), slow_peers=args.slow_peers,
                    evaluate=True,
                )  # fmt: skip
                root = work / f"peers{args.peers}-{schedule}-{k}"
                if schedule not in start:  # the same modules and documents every run
                    start[schedule] = initial_ppl(root)
                points = curve(root, start[schedule])
                if len(points) < 2:
                    raise RuntimeError(f"{schedule} run {k + 1}: no round was validated")
                row.update(schedule=schedule, repeat=k, curve=points)
                rows.append(row)
                curves[schedule].append(points)
                console.log(
                    f"  {row['wall_s']:.0f} s, {row['tokens']:,} tokens trained, "
                    f"final perplexity {points[-1]['ppl']:.2f}, waiting "
                    f"{100 * row['waiting']:.1f}%, applied once: {row['applied_once']}"
                )
    finally:
        if args.keep:
            console.print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(rows, curves, args, step)


def report(
    rows: list[dict], curves: dict[str, list[list[dict]]], args: argparse.Namespace, step: float
) -> None:
    what = (
        f"tiny {TOPOLOGY} on {args.source}, {args.peers} peers ({args.slow_peers} at "
        f"1/{args.slow_factor:g} speed), {args.rounds} rounds x H={args.inner_steps}, "
        f"{len(cores())} cores"
    )
    table = Table(title=f"sync against fed: {what}")
    for col in ("schedule", "run", "wall", "tokens trained", "tokens acked", "ahead", "copies",
                "compute", "transfer", "waiting", "final ppl", "applied once"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["schedule"],
            str(r["repeat"] + 1),
            f"{r['wall_s']:.0f} s",
            f"{r['tokens']:,}",
            f"{r['curve'][-1]['tokens']:,}",
            str(r["ahead_tasks"]),
            f"{r['hedged_tasks']} ({r['hedges_applied']})",
            f"{100 * r['compute']:.1f}%",
            f"{100 * r['transfer']:.1f}%",
            f"{100 * r['waiting']:.1f}%",
            f"{r['curve'][-1]['ppl']:.2f}",
            str(r["applied_once"]),
        )
    console.print(table)
    per_wall, per_token = compare(curves, "wall_s"), compare(curves, "tokens")
    lines = []
    for name, c, unit in (("wall-clock second", per_wall, "s"), ("token", per_token, "")):
        if c["end"] is None:
            line = f"per {name}: the runs share no span to compare"
        else:
            span = f"{c['from']:,.0f}-{c['to']:,.0f}{unit and ' ' + unit}"
            line = (
                f"per {name}: fed / sync perplexity {c['end']:.3f} at {c['to']:,.0f}"
                f"{unit and ' ' + unit} ({c['fed_end_ppl']:.2f} against {c['sync_end_ppl']:.2f}),"
                f" {c['mean']:.3f} on average over {span}"
            )
        console.print(line)
        lines.append(line)
        paths = per_path(curves, "wall_s" if unit else "tokens")
        if paths:
            geo = math.exp(sum(math.log(r) for r in paths.values()) / len(paths))
            console.print(
                "  each path's documents at the end: "
                + ", ".join(f"P{p} {r:.3f}" for p, r in paths.items())
                + f"; geometric mean over paths {geo:.3f}",
                soft_wrap=True,
            )
            lines.append(f"paths' geometric mean {geo:.3f}")
    once = all(r["applied_once"] for r in rows)
    console.print(f"every acknowledged delta applied in exactly one outer step: {once}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cores": len(cores()), "step_s": step, "rows": rows}, indent=2))
    console.print(f"results: {out}")
    if args.plot:
        html = plot(curves, Path(args.plot), f"sync against fed: {what}")
        console.print(f"plot: {html}" if html else "plot skipped (plotly is not installed)")
    record(args, "schedules", f"{'; '.join(lines)}; {what}, {args.repeat} run(s) each")


if __name__ == "__main__":
    main()
