"""What follows each round on the scheduler's box: validation, early stopping, and the
discriminative routing phases (started at their rounds, or when the held-out loss stops
improving). An object that owns this state, given to the coordinator as its ``on_round``
(``factory.build_coordinator``).

``on_round`` runs under the coordinator's lock as a round closes; what takes long runs after
it, in order, outside the lock, on the coordinator's ``after_round`` thread (serial.py); a
phase's work runs on a thread of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import torch

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.early_stopping import EarlyStopping
from dipaco.errors import ConfigError, DipacoError
from dipaco.fileio import write_json_atomic
from dipaco.prepare.folder import PreparedRun
from dipaco.prepare.phases import discriminative_phase
from dipaco.run.evaluate import (
    evaluate_modules,
    heldout_losses,
    path_loader,
    track_early_stopping,
)
from dipaco.run.manifest import phase_files
from dipaco.run.metrics_log import MetricsLog

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]

# In the coordinator's folder: the last round whose after-round work (validation, held-out
# scoring) finished, so that a restart runs the work a stop cut off (``resume``).
AFTER_ROUND_FILE = "after_round.json"
# The per-round validation's tries at fetching other owners' modules before it skips a round.
FETCH_TRIES = 3


class RoundWork:
    """The after-round work of the prepared run ``prep`` (see the module docstring);
    ``evaluate``: validate each round (``--no-eval`` turns it off); ``device`` runs the
    evaluation, held-out measurements and routing phases. ``attach`` gives it its coordinator,
    made with ``on_round`` (when ``needed``)."""

    def __init__(
        self, prep: PreparedRun, metrics: MetricsLog, *, evaluate: bool, device: str
    ) -> None:
        c = prep.config
        self.prep, self.metrics, self.device = prep, metrics, device
        self.validate = evaluate and c.eval.every_round
        self.early = EarlyStopping(prep.root / "early_stopping") if c.eval.early_stopping else None
        self.done_file = prep.root / "coordinator" / AFTER_ROUND_FILE
        self.phase_rounds = sorted(c.routing.discriminative_after)  # given in the config
        self.plateau = c.routing.discriminative_plateau
        self.last_loss: dict[int, float] = {}  # phase -> the paths' mean held-out loss, last round
        self.running: dict[int, threading.Thread] = {}  # phases whose work started
        self.said: set[str] = set()  # notes logged once
        self.module_ids = c.build_topology().module_ids()
        self.coordinator: Coordinator | None = None
        # Why there is no per-round validation, if there is none: the coordinator's status
        # reads it (``Coordinator(eval_note=lambda: work.eval_note)``).
        self.eval_note: str | None = None
        if not self.validate:
            self.eval_note = (
                "no per-round validation: the coordinator was started with --no-eval"
                if not evaluate
                else "no per-round validation: eval.every_round is off in the run config"
            )

    @property
    def needed(self) -> bool:
        """Whether anything follows a round at all (else the coordinator gets no ``on_round``)."""
        return bool(self.validate or self.early or self.phase_rounds or self.plateau)

    def attach(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    @property
    def co(self) -> Coordinator:
        if self.coordinator is None:
            raise RuntimeError("RoundWork used before its coordinator was attached")
        return self.coordinator

    # ---- at a (re)start -------------------------------------------------------------------
    def resume(self) -> None:
        """At a restart: the round work of the round the modules are at, if it never finished
        (the process stopped after the round closed and before its work ran, on a thread that
        a stop does not wait for; only the last round's versions are still there to score),
        and the routing phases whose round (or decision) passed before their shards were
        written."""
        try:
            done = json.loads(self.done_file.read_text()).get("round", 0)
        except (OSError, ValueError, AttributeError):  # none yet (a new run, or one from before)
            done = 0
        co = self.co
        with co.lock:
            rnd = co.round
            if co.on_round is not None and 0 < rnd and (not isinstance(done, int) or done < rnd):
                log.info("round %d's validation and scoring did not finish: running them now", rnd)
                co.on_round(rnd)  # as when it closed: queued, outside the lock
                if co.finished:  # the run's end is said after its last round's work
                    co.finished_event.clear()
                    co.after_round.then(co.finished_event.set)
        for k, after in enumerate(co.phases.rounds, start=1):
            decided = after not in self.phase_rounds  # started when decided, a round before
            if co.round >= after - decided:
                self.start_phase(k)

    # ---- as a round closes ----------------------------------------------------------------
    def on_round(self, rnd: int) -> None:
        """Under the coordinator's lock as the round closes. What takes long runs after it, in
        order, outside the lock, on this round's versions of our modules: the dict of each
        holds them (a later step writes new tensors while another reference to these exists).
        With other owners the validation fetches their modules; held-out scoring (early
        stopping, the plateau rule) needs every module here."""
        co = self.co
        whole = all(co.owns(mid) for mid in co.owners)
        scored = (self.early is not None or self.plateau > 0) and whole
        if self.validate or scored:
            own = {mid: co.store.params(mid) for mid in co.owned_modules()}
            co.after_round.submit(
                lambda: self.after_round(rnd, own, scored), on_skip=lambda: self.skipped(rnd)
            )
        for k, after in enumerate(co.phases.rounds, start=1):
            if rnd >= after:
                self.start_phase(k)

    def skipped(self, rnd: int) -> None:
        """A round whose validation and held-out scoring never started: later rounds came in
        while earlier ones were still being evaluated (serial.py's backlog)."""
        log.warning(
            "round %d is not validated or scored: the evaluation of earlier rounds is slower "
            "than the rounds (set eval.max_docs lower, or eval.every_round off)",
            rnd,
        )
        self.metrics({"event": "round_work_skipped", "round": rnd})

    def after_round(self, rnd: int, own: dict[str, Tensors], scored: bool) -> None:
        self.round_work(rnd, own, scored)
        try:  # done: a restart does not run it again (resume)
            write_json_atomic(self.done_file, {"round": rnd})
        except OSError as exc:
            log.error("cannot save %s: %s", self.done_file, exc)

    def round_work(self, rnd: int, own: dict[str, Tensors], scored: bool) -> None:
        losses = None
        if self.early is not None and scored:
            losses = track_early_stopping(self.prep, self.early, own.__getitem__, rnd, self.device)
            self.metrics(
                {"event": "heldout", "round": rnd, "losses": {str(p): v for p, v in losses.items()}}
            )
        if self.plateau > 0 and scored:
            # The decision's first round is one no task has been issued for yet
            # (phases.schedule_phase): the rounds trained meanwhile keep their shards.
            self.decide_phase(rnd, losses, own.__getitem__)
        if self.validate:
            modules = self.whole_model(own)  # with other owners: their modules fetched now
            if modules is not None:
                self.evaluate_round(rnd, modules)

    def evaluate_round(self, rnd: int, modules: Callable[[str], Tensors]) -> None:
        c = self.prep.config
        result = evaluate_modules(self.prep, modules, device=self.device)
        self.metrics(
            {
                "event": "eval",
                "model": "dipaco",
                "round": rnd,
                "steps_per_path": c.train.pretrain_steps + rnd * c.train.inner_steps,
                "ppl": result["ppl"],
                "loss": result["loss"],
                "per_path": {str(p): v["ppl"] for p, v in result["per_path"].items()},
            }
        )

    def whole_model(self, own: dict[str, Tensors]) -> Callable[[str], Tensors] | None:
        """Every module's tensors: ``own``, this coordinator's, and (fetched from their owners
        now) the others'; None when the others cannot be fetched now."""
        co = self.co
        others = [mid for mid in self.module_ids if mid not in own]
        if not others:
            return own.__getitem__
        if co.fetch_remote is None:
            self.note(
                "no per-round validation: other coordinators own modules and this transport "
                "cannot fetch them; `dipaco eval --run-dir` after the run gathers them"
            )
            return None
        for attempt in range(FETCH_TRIES):  # a busy owner or a dropped stream: try again
            try:
                remote = co.fetch_remote(others)
                break
            except DipacoError as exc:
                if attempt + 1 == FETCH_TRIES:
                    self.note(
                        f"per-round validation skipped: cannot fetch other owners' modules ({exc})"
                    )
                    return None
                log.info("per-round validation: fetching other owners' modules again (%s)", exc)
                time.sleep(1.0)
        self.eval_note = None
        return lambda mid: remote[mid] if mid in remote else own[mid]

    def note(self, text: str) -> None:
        """Why there is no per-round validation: in the status, and logged once."""
        self.eval_note = text
        if text not in self.said:
            self.said.add(text)
            log.warning("%s", text)

    # ---- routing phases -------------------------------------------------------------------
    def decide_phase(
        self, rnd: int, losses: dict[int, float] | None, modules: Callable[[str], Tensors]
    ) -> None:
        """Start a phase once the held-out loss of the current shards stops improving."""
        co = self.co
        phase = co.phases.of(rnd)
        if len(co.phases.rounds) >= self.prep.config.routing.discriminative_phases:
            return
        if phase != self.prep.routing.phase or phase not in co.phases.ready:
            return  # the current shards' phase is not the one trained on yet
        if losses is None:
            losses = heldout_losses(self.prep, modules, self.device)
            self.metrics(
                {"event": "heldout", "round": rnd, "losses": {str(p): v for p, v in losses.items()}}
            )
        if not losses:
            return
        mean = sum(losses.values()) / len(losses)
        before, self.last_loss[phase] = self.last_loss.get(phase), mean
        if before is None or before - mean >= self.plateau * before:
            return
        decided = co.schedule_phase()
        if decided is not None:
            k, after = decided
            self.metrics(
                {
                    "event": "plateau",
                    "round": rnd,
                    "heldout_loss": mean,
                    "previous": before,
                    "phase": k,
                    "after_round": after,
                }
            )
            self.start_phase(k)

    def start_phase(self, phase: int) -> None:
        """Run a discriminative phase in the background; its tasks open when it is ready.
        Called as a round closes and from the plateau rule's scoring: the lock keeps the two
        from starting one phase twice."""
        co = self.co
        with co.lock:
            if phase in self.running or phase in co.phases.ready:
                return
            self.running[phase] = threading.Thread(
                target=self.phase_work, args=(phase,), name=f"routing-phase-{phase}", daemon=True
            )
        self.running[phase].start()

    def phase_work(self, phase: int) -> None:
        """A discriminative phase: score, label, fit the router, re-shard; then open it."""
        co, prep = self.co, self.prep
        try:
            t0 = time.monotonic()
            others = [m for m in self.module_ids if not co.owns(m)]
            if others:
                raise ConfigError(
                    f"a discriminative phase scores every path, but modules {others} belong "
                    f"to other owners; run phases with the scheduler owning every module"
                )
            routing = discriminative_phase(
                prep,
                phase,
                path_loader(prep, co.store.params, device=self.device),
                stage=lambda s: self.metrics({"event": "stage", "stage": s}),
                device=self.device,
            )
            tokens = routing.stats["shards"]["train"]["tokens"]
            co.add_phase(phase, routing.prefix, tokens, phase_files(prep, phase))
            self.metrics(
                {
                    "event": "routing_phase",
                    "phase": phase,
                    "seconds": round(time.monotonic() - t0, 2),
                    "label_counts": routing.stats.get("label_counts"),
                    "label_accuracy": routing.stats.get("label_accuracy"),
                    "shard_tokens": tokens,
                }
            )
        except Exception as exc:  # the run cannot go on without its shards: say why
            log.exception("routing phase %d failed", phase)
            self.metrics({"event": "routing_phase_failed", "phase": phase, "error": str(exc)})
            co.fail(f"routing phase {phase} failed: {exc}")
