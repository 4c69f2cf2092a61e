"""``dipaco``: the demo, and evaluation of a run folder, on this machine."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dipaco.cli.common import (
    LineProgress,
    choose_config,
    command_parser,
    console,
    dispatch,
    say,
)
from dipaco.cli.init import add_init_command
from dipaco.cli.use import add_owner_dir, add_use_commands, gatherer
from dipaco.cli.watch import add_status_command
from dipaco.errors import DataError, DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.model.topology import Topology
from dipaco.prepare.folder import PreparedRun
from dipaco.prepare.pipeline import prepare
from dipaco.run.baseline import train_dense_baseline, train_diloco
from dipaco.run.evaluate import evaluate_modules
from dipaco.run.factory import build_coordinator
from dipaco.run.local import LocalRun
from dipaco.run.metrics_log import MetricsLog
from dipaco.run.report import plot_run, results_markdown, results_table


def _progress() -> Progress | LineProgress:
    """Progress bars on a terminal; a line per finished stage (and every 30 s) otherwise."""
    if console.lines:
        return LineProgress()
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def run_demo(run_dir: Path, config, n_peers: int) -> int:
    t0 = time.time()
    c = config
    topology = c.build_topology()
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    console.rule(
        f"[bold]dipaco demo[/]: DiPaCo {topology.spec} ({topology.num_paths} paths) vs dense, "
        f"run folder {run_dir}"
    )
    with _progress() as progress:
        pre = progress.add_task("dense pretraining", total=c.train.pretrain_steps, info="")

        def on_pretrain(step: int, loss: float) -> None:
            metrics({"event": "pretrain", "step": step, "loss": loss})
            progress.update(pre, advance=1, info=f"loss {loss:.3f}")

        prep = prepare(run_dir, c, stage=lambda s: console.log(s), on_step=on_pretrain)
        progress.update(pre, completed=c.train.pretrain_steps)
    stats = json.loads((run_dir / "shards" / "stats.json").read_text())
    console.log(
        "routing: "
        + ", ".join(
            f"P{p} {docs} docs / {tokens / 1e6:.2f} M tokens"
            for p, (docs, tokens) in enumerate(
                zip(stats["train"]["docs"], stats["train"]["tokens"], strict=True)
            )
        )
    )
    _log_initial_eval(prep, metrics)

    coordinator = build_coordinator(prep, metrics)
    total = topology.num_paths * c.train.rounds * c.train.inner_steps
    with _progress() as progress:
        bar = progress.add_task(f"DiPaCo, {n_peers} local peers", total=total, info="")
        resumed = (
            sum(coordinator.path_round(p) for p in range(topology.num_paths)) * c.train.inner_steps
        )
        progress.update(bar, completed=resumed)

        def on_event(e: dict) -> None:
            if e["event"] == "delta":
                progress.update(
                    bar,
                    advance=c.train.inner_steps,
                    info=f"round {e['round'] + 1}/{c.train.rounds}, P{e['path']} loss {e['train_losses'][-1]:.3f}",
                )
            elif e["event"] == "eval" and e["model"] == "dipaco":
                progress.console.log(f"round {e['round']}: routed validation ppl {e['ppl']:.1f}")

        metrics.listeners.append(on_event)
        try:
            with LocalRun(coordinator, prep, n_peers) as local:
                local.wait()
        finally:
            metrics.listeners.clear()
        if coordinator.failure:
            raise DipacoError(coordinator.failure)

    baseline = None
    if c.baseline:
        steps = c.train.rounds * c.train.inner_steps
        with _progress() as progress:
            bar = progress.add_task("dense baseline", total=steps, info="")

            def on_base(step: int, loss: float) -> None:
                progress.update(
                    bar, completed=step - c.train.pretrain_steps + 1, info=f"loss {loss:.3f}"
                )

            baseline = train_dense_baseline(prep, metrics, on_step=on_base)

    diloco = None
    if c.baseline:
        # DiLoCo with as many workers as DiPaCo has paths: the same compute and communication.
        replicas = topology.num_paths
        total = replicas * c.train.rounds * c.train.inner_steps
        with _progress() as progress:
            bar = progress.add_task(f"DiLoCo-{replicas} (equal compute)", total=total, info="")

            def on_diloco(e: dict) -> None:
                if e["event"] == "delta":
                    progress.update(
                        bar, advance=c.train.inner_steps, info=f"round {e['round'] + 1}"
                    )
                elif e["event"] == "eval" and e["model"] == "dipaco" and e["round"] > 0:
                    metrics({**e, "model": f"DiLoCo-{replicas}"})

            diloco = train_diloco(prep, replicas, n_peers=n_peers, on_event=on_diloco)
            progress.update(bar, completed=total)

    rows = _results(prep, coordinator, baseline, diloco)
    write_json_atomic(run_dir / "results.json", {"rows": rows, "seconds": time.time() - t0})
    plot = plot_run(
        metrics.read(),
        run_dir / "loss_curves.png",
        title=f"dipaco demo: DiPaCo {topology.spec} vs dense and DiLoCo ({c.name} preset)",
    )
    console.print(results_table(rows))
    (run_dir / "results.md").write_text(results_markdown(rows) + "\n")
    console.print(f"run folder: {run_dir}  (metrics.jsonl, results.md, loss curves: {plot})")
    console.print(f"finished in {time.time() - t0:.0f} s")
    return 0


def _log_initial_eval(prep: PreparedRun, metrics: MetricsLog) -> None:
    if any(e["event"] == "eval" and e["round"] == 0 for e in metrics.read()):
        return
    initial = prep.config.build_topology().init_modules(prep.initial_state())
    result = evaluate_modules(prep, initial.__getitem__)
    models = ["dipaco", "dense"]
    if prep.config.baseline:
        models.append(f"DiLoCo-{prep.config.build_topology().num_paths}")
    for model in models:
        metrics(
            {
                "event": "eval",
                "model": model,
                "round": 0,
                "steps_per_path": prep.config.train.pretrain_steps,
                "ppl": result["ppl"],
                "loss": result["loss"],
            }
        )


def _results(
    prep: PreparedRun, coordinator, baseline: dict | None, diloco: dict | None = None
) -> list[dict]:
    c = prep.config
    topology = c.build_topology()
    dense_counts = Topology.parse("1", c.model.n_layers).parameter_counts(c.build_model_config())
    counts = topology.parameter_counts(c.build_model_config())
    per_step = c.train.batch_size * c.train.seq_len
    steps = c.total_steps
    final = evaluate_modules(prep, coordinator.store.params)

    def row(model: str, params: dict, tokens_seen: int, ppl: float) -> dict:
        return {
            "model": model,
            "params_per_path": params["per_path"],
            "total_params": params["total"],
            "steps_per_path": steps,
            "tokens_seen": tokens_seen,
            "ppl": ppl,
        }

    all_steps = c.train.pretrain_steps + topology.num_paths * c.train.rounds * c.train.inner_steps
    rows = [row(f"DiPaCo {topology.spec}", counts, per_step * all_steps, final["ppl"])]
    if baseline is not None:
        rows.append(row("dense (path-sized)", dense_counts, per_step * steps, baseline["ppl"]))
    if diloco is not None:
        name = f"DiLoCo-{topology.num_paths} (equal compute)"
        rows.append(row(name, dense_counts, diloco["tokens"], diloco["ppl"]))
    return rows


def cmd_demo(args: argparse.Namespace) -> int:
    config = choose_config(args.config, args.preset)
    run_dir = Path(args.run_dir)
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    return run_demo(run_dir, config, args.peers)


def cmd_eval(args: argparse.Namespace) -> int:
    from dipaco.run.export import open_run

    run = open_run(args.run_dir, remote=gatherer(args))
    run_dir, config, prep = run.prep.root, run.config, run.prep
    modules = run.params
    result = evaluate_modules(prep, modules)
    report: dict = {
        "ppl": result["ppl"],
        "loss": result["loss"],
        "tokens": result["tokens"],
        "per_path": {f"P{p}": v["ppl"] for p, v in result["per_path"].items()},
        "module_versions": {mid: run.version(mid) for mid in run.topology.module_ids()},
        "gathered": sorted(run.remote),
        "routing_phase": prep.routing.phase,
    }
    early = None
    if (run_dir / "early_stopping" / "best.json").exists():
        from dipaco.coordinator.early_stopping import EarlyStopping

        early = EarlyStopping(run_dir / "early_stopping")
        report["early_stopping_ppl"] = evaluate_modules(prep, modules, early=early)["ppl"]
    for w in config.eval.reroute_windows:
        rerouted = evaluate_modules(prep, modules, early=early, window=w)
        report[f"rerouted_every_{w}_ppl"] = rerouted["ppl"]
        if prep.routing.chunk_router is not None:
            learned = evaluate_modules(prep, modules, early=early, window=w, learned=True)
            report[f"rerouted_every_{w}_learned_ppl"] = learned["ppl"]
    if args.json:
        print(json.dumps(report), flush=True)
        return 0
    say(f"routed validation perplexity {report['ppl']:.2f} over {report['tokens']:,} tokens")
    say("per path: " + ", ".join(f"{p} {v:.2f}" for p, v in report["per_path"].items()))
    versions = sorted(set(report["module_versions"].values()))
    say(
        "modules at version "
        + "/".join(str(v) for v in versions)
        + (f" ({len(run.remote)} gathered from other owners)" if run.remote else "")
        + f", routing phase {report['routing_phase']}"
    )
    for key, value in report.items():
        if key.endswith("_ppl"):
            say(f"{key.removesuffix('_ppl').replace('_', ' ')}: perplexity {value:.2f}")
    return 0


def cmd_gather(args: argparse.Namespace) -> int:
    from dipaco.coordinator.gather import gather_run, remote_modules
    from dipaco.run.export import check_run_folder

    check_run_folder(Path(args.run_dir))
    if not (Path(args.run_dir) / "coordinator" / "coordinator.json").exists():
        raise DataError(
            f"{args.run_dir} has no coordinator state (coordinator/coordinator.json): the run "
            "was never started, so there is nothing to gather"
        )
    remote = remote_modules(args.run_dir)
    if not remote:
        say(f"{args.run_dir}: every module is the scheduler's own; nothing to gather")
        return 0
    gather_run(args.run_dir, owner_dirs=tuple(args.owner_dir), say=say)
    owners = sorted({r.owner for r in remote})
    say(
        f"{len(remote)} modules of {len(owners)} other owner(s) are in "
        f"{Path(args.run_dir) / 'gathered'} at their final versions"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    parser, sub = command_parser("dipaco", __doc__)
    demo = sub.add_parser(
        "demo", help="prepare, train DiPaCo with local peers and a dense baseline, compare"
    )
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--preset", default="demo", help="demo (about 10 minutes on 2 cores) or tiny")
    demo.add_argument("--config", help="a run config (TOML) instead of a preset")
    demo.add_argument("--peers", type=int, default=4, help="local peers (threads)")
    demo.add_argument(
        "--fresh", action="store_true", help="delete the run folder first instead of resuming"
    )
    demo.set_defaults(fn=cmd_demo)
    ev = sub.add_parser(
        "eval", help="routed validation perplexity of a run folder's current modules"
    )
    ev.add_argument("--run-dir", required=True)
    ev.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_owner_dir(ev)
    ev.set_defaults(fn=cmd_eval)
    ga = sub.add_parser(
        "gather",
        help="fetch the modules other owners trained into the scheduler's run folder",
    )
    ga.add_argument("--run-dir", required=True, help="the scheduler's run folder")
    add_owner_dir(ga)
    ga.set_defaults(fn=cmd_gather)
    add_status_command(sub)
    add_use_commands(sub)
    add_init_command(sub)
    dispatch(parser, argv)


if __name__ == "__main__":
    main()
