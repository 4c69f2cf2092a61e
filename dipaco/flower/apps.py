"""The Flower app objects that ``flwr run`` loads: ``server_app`` and ``client_app``.

The ServerApp reads the run folder from the run config (``run-dir``) and builds the same
coordinator core as ``dipaco-coordinator start`` (it resumes from the folder after a restart);
the ClientApp reads the node's state folder from the node config (``state-dir``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from dipaco.config import load_config_dict
from dipaco.coordinator.core import Coordinator
from dipaco.fileio import write_json_atomic
from dipaco.flower.client import answer
from dipaco.flower.strategy import DipacoStrategy

log = logging.getLogger(__name__)


def serve(
    grid: Grid,
    run_dir: str | Path,
    *,
    evaluate: bool = True,
    stop: Callable[[], bool] = lambda: False,
    num_rounds: int | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> Coordinator:
    """Run a prepared run's rounds over ``grid`` until it finishes; returns its core."""
    from dipaco.coordinator.prepare import prepare
    from dipaco.coordinator.run import MetricsLog, build_coordinator

    run_dir = Path(run_dir)
    config_file = run_dir / "config.json"
    config = load_config_dict(json.loads(config_file.read_text()), origin=str(config_file))
    prep = prepare(run_dir, config)
    core = build_coordinator(prep, MetricsLog(run_dir / "metrics.jsonl"), evaluate=evaluate)
    strategy = DipacoStrategy(
        core,
        config.flower,
        state_file=run_dir / "coordinator" / "flower_nodes.json",
        on_round=on_round,
    )
    strategy.start(grid, num_rounds=num_rounds, stop=stop)
    if core.failure:
        raise RuntimeError(core.failure)
    return core


server_app = ServerApp()


def _logging() -> None:
    """dipaco's progress lines with timestamps; the HTTP client Flower uses stays quiet."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    _logging()
    cfg: dict[str, Any] = dict(context.run_config)
    run_dir = Path(str(cfg["run-dir"]))
    core = serve(grid, run_dir, evaluate=bool(cfg.get("eval", True)))
    log.info("run %s finished: every module at version %d", core.run_id, core.round)
    # What `dipaco-coordinator start --transport flower` reads once `flwr run` has ended.
    write_json_atomic(
        run_dir / "flower" / "result.json",
        {"finished": core.finished, "round": core.round, "rounds": core.rounds},
    )


client_app = ClientApp()


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    _logging()
    return Message(answer("train", msg.content, dict(context.node_config)), reply_to=msg)


@client_app.query()
def _hello(msg: Message, context: Context) -> Message:
    return Message(answer("hello", msg.content, dict(context.node_config)), reply_to=msg)
