"""The Flower app objects that ``flwr run`` loads: ``server_app`` and ``client_app``.

The ServerApp reads the run folder from the run config (``run-dir``) and builds the same
coordinator core as ``dipaco-coordinator start`` (it resumes from the folder after a restart);
the ClientApp reads the node's state folder from the node config (``state-dir``). Every message
starts a new ClientApp process, so this module imports nothing heavy: with a warm trainer (node
config ``trainer``, set by ``dipaco-peer join --flower``) the ClientApp only forwards bytes to
it; without one it imports dipaco's peer and trains itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from dipaco.errors import DipacoError

if TYPE_CHECKING:
    from dipaco.coordinator.core import Coordinator

log = logging.getLogger(__name__)


def serve(
    grid: Grid,
    run_dir: str | Path,
    *,
    evaluate: bool = True,
    stop: Callable[[], bool] = lambda: False,
    num_rounds: int | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    dashboard: str = "",
    dashboard_token: str = "",
) -> Coordinator:
    """Run a prepared run's rounds over ``grid`` until it finishes; returns its core.
    ``dashboard`` (HOST:PORT) serves the web dashboard from this process meanwhile."""
    from dipaco.config import read_run_config
    from dipaco.flower.strategy import DipacoStrategy
    from dipaco.prepare.pipeline import prepare
    from dipaco.run.factory import build_coordinator
    from dipaco.run.metrics_log import MetricsLog

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    prep = prepare(run_dir, config)
    core = build_coordinator(prep, MetricsLog(run_dir / "metrics.jsonl"), evaluate=evaluate)
    strategy = DipacoStrategy(
        core,
        config.flower,
        state_file=run_dir / "coordinator" / "flower_nodes.json",
        on_round=on_round,
    )
    server = None
    if dashboard:
        from dipaco.watch.server import Dashboard

        host, _, port = dashboard.rpartition(":")
        server = Dashboard(
            core, run_dir, host=host or "127.0.0.1", port=int(port), token=dashboard_token or None
        ).start()
        (run_dir / "coordinator" / "dashboard").write_text(server.url + "\n")
    try:
        strategy.start(grid, num_rounds=num_rounds, stop=stop)
    finally:
        if server is not None:
            server.stop()
    if core.failure:
        raise RuntimeError(core.failure)
    return core


def _logging() -> None:
    """dipaco's progress lines with timestamps; the HTTP client Flower uses stays quiet."""
    # The level is in the line: the coordinator's command shows warnings, and hides the
    # coordinator's INFO lines it prints from metrics.jsonl as events (cli/flower_serve.py).
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    from dipaco.fileio import write_json_atomic

    _logging()
    cfg: dict[str, Any] = dict(context.run_config)
    run_dir = Path(str(cfg["run-dir"]))
    core = serve(
        grid,
        run_dir,
        evaluate=bool(cfg.get("eval", True)),
        dashboard=str(cfg.get("dashboard", "")),
        dashboard_token=str(cfg.get("dashboard-token", "")),
    )
    core.after_round.drain(600)  # the last round's validation, logged before the app ends
    log.info("run %s finished: every module at version %d", core.run_id, core.round)
    # What `dipaco-coordinator start --transport flower` reads once `flwr run` has ended.
    write_json_atomic(
        run_dir / "flower" / "result.json",
        {"finished": core.finished, "round": core.round, "rounds": core.rounds},
    )


client_app = ClientApp()


def _answer(op: str, msg: Message, context: Context) -> Message:
    _logging()
    cfg = dict(context.node_config)
    if cfg.get("trainer"):
        from dipaco.flower import forward

        try:
            return Message(forward.ask(cfg, op, msg.content), reply_to=msg)
        except (OSError, EOFError, ValueError, AuthenticationError, DipacoError) as exc:
            log.warning(
                "the node's trainer at %s does not answer (%s); training in this process",
                cfg["trainer"],
                exc,
            )
    from dipaco.flower.client import answer

    return Message(answer(op, msg.content, cfg), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    return _answer("train", msg, context)


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    """``hello`` (the ServerApp learns the node's key), or ``finished`` (the run is over)."""
    from dipaco.flower import records as rec

    try:
        op = rec.meta_of(msg.content).get("op")
    except Exception:  # malformed: answered as a hello, which reports the problem
        op = None
    return _answer("finished" if op == "finished" else "hello", msg, context)
