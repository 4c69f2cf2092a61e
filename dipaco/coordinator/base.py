"""The coordinator's state and the small queries every part of it asks: which modules it owns,
their versions, the rounds done; and counting a refusal. The operations live in the parts (see
core.py) and act on this state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dipaco.config import SchedulerSection, SecuritySection, ValidationSection
from dipaco.coordinator.access import AccessPolicy
from dipaco.coordinator.copies import AUTO_COSINE, DeltaCopies
from dipaco.coordinator.durable import Journal
from dipaco.coordinator.gate import Gate
from dipaco.coordinator.keyscores import KeyScores
from dipaco.coordinator.outer import OuterSettings, for_sharing
from dipaco.coordinator.polls import LongPolls
from dipaco.coordinator.records import Phase, ReportedModule
from dipaco.coordinator.refusals import Refusals
from dipaco.coordinator.roster import Roster
from dipaco.coordinator.round_book import RoundBook
from dipaco.coordinator.routing_phases import RoutingPhases
from dipaco.coordinator.scheduler import DeadlinePolicy, Scheduler
from dipaco.coordinator.serial import Serial
from dipaco.coordinator.steps import ModuleSteps
from dipaco.coordinator.store import ModuleStore
from dipaco.coordinator.store_open import PendingDelta
from dipaco.coordinator.tickets import SchedulerKeys
from dipaco.coordinator.validation import NormTracker
from dipaco.coordinator.verdicts import Verdicts
from dipaco.model.topology import Topology
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)

# Rounds whose after-round work (validation, held-out scoring) may wait while an earlier one runs;
# beyond that the oldest waiting round is skipped (serial.py).
ROUND_BACKLOG = 2
# The key of the request being handled, set by the service (service.py) for the operation it
# runs: a context variable, so each server thread sees its own request's caller. None outside a
# request, and for in-process calls without a key (the local transport's tests, the ticker).
_CALLER: ContextVar[str | None] = ContextVar("dipaco_caller", default=None)


@contextmanager
def acting_for(key: str | None) -> Iterator[None]:
    """Run the ``with`` block as the request of ``key``: quotas, ticket keys, robust-aggregation
    votes and ban counts are charged to it."""
    token = _CALLER.set(key)
    try:
        yield
    finally:
        _CALLER.reset(token)


class CoordinatorBase:
    journal: Journal  # coordinator.json reads every part: made by core.Coordinator.__init__

    def __init__(
        self,
        root: str | Path,
        topology: Topology,
        *,
        rounds: int,
        inner_steps: int,
        step_offset: int,
        total_steps: int,
        seed: int,
        outer: OuterSettings,
        lease_seconds: float,
        run_id: str,
        peer_config: dict[str, Any],
        shard_tokens: list[int] | None = None,
        on_round: Callable[[int], None] | None = None,
        metrics: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulerSection | None = None,
        owner_id: str = "local",
        identity: auth.Identity | None = None,
        scheduler_key: str | None = None,
        security: SecuritySection | None = None,
        is_scheduler: bool = True,
        codec: str = "lossless",
        files: dict[str, Path] | None = None,
        phase_rounds: list[int] | tuple[int, ...] = (),
        validation: ValidationSection | None = None,
        heldout_loss: Callable[[int, dict[str, dict[str, torch.Tensor]]], float] | None = None,
        foreign_loss: Callable[[int, dict[str, dict[str, torch.Tensor]]], float] | None = None,
        eval_note: Callable[[], str | None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.topology = topology
        self.rounds, self.inner_steps = rounds, inner_steps
        self.step_offset, self.total_steps, self.seed = step_offset, total_steps, seed
        self.outer = outer
        self.run_id = run_id
        self.peer_config = {**peer_config, "owner_id": owner_id}
        # Outer-step weights: each path's shard size (paper eq. 2-3); without it, trained tokens.
        self.shard_tokens = shard_tokens
        self.on_round, self.metrics = on_round, metrics or (lambda event: None)
        self.policy = policy or SchedulerSection(lease_seconds=lease_seconds)
        self.store = ModuleStore(self.root)
        p = self.policy
        deadline = DeadlinePolicy(
            p.deadline_mads, p.deadline_slack, p.deadline_floor, p.min_observations,
            p.min_step_fraction,
        )  # fmt: skip
        # The role is what a coordinator is made of: the scheduler leases tasks; an owner has
        # none (``is_scheduler``).
        self.scheduler = Scheduler(lease_seconds, clock, deadline) if is_scheduler else None
        # The lock serialises the short state transitions only. Decoding, checking and the durable
        # write of a delta run outside it (admission.py), and so does a module's outer step
        # (rounds.py): ``steps`` (steps.py) names the modules being stepped, whose new deltas
        # wait, and reserves (module, base version, path) for a delta between its checks and
        # its commit, so that two of one path never race.
        self.lock = threading.RLock()
        self.steps = ModuleSteps(self.lock)
        # Claims and TaskDones that wait, and who polled in vain lately (polls.py).
        self.polls = LongPolls(self.lock, clock=clock)
        self.clock = clock
        self.roster = Roster(clock)  # the peers as seen (roster.py)
        self.epoch = 0
        self.finished_event = threading.Event()
        # What follows a round and takes long (the per-round validation) runs here, outside
        # the lock; finished_event is set through it, after the last round's (serial.py).
        # At most ROUND_BACKLOG rounds' work waits (each holds its round's tensors).
        self.after_round = Serial("dipaco-after-round", max_waiting=ROUND_BACKLOG)
        self.failure: str | None = None  # set when the run cannot go on (finished_event too)
        # Ownership: module id -> owner id. The scheduler knows every module's owner; an owner
        # that is not the scheduler lists only its own modules.
        self.owner_id, self.codec = owner_id, codec
        # Our Ed25519 key signs replies, tickets, releases and the manifest; the scheduler's key
        # is the one whose tickets an owner accepts (our own, on the scheduler).
        self.identity = identity or auth.Identity.load_or_create(self.root / "signing.key")
        current = self.identity.public_key if is_scheduler else scheduler_key
        if current is None:
            raise ValueError("a module owner needs the scheduler's public key (scheduler_key)")
        # The scheduler's keys, current and retired, and the rotations between (rotation.py).
        self.keys = SchedulerKeys(current)
        self.security = security or SecuritySection()
        self.access = AccessPolicy(
            self.root,
            self.security,
            self_keys=(self.identity.public_key, self.scheduler_key),
            metrics=self.metrics,
            clock=clock,
        )
        # Every refusal, counted once (refusals.py).
        self.refusals = Refusals(self.lock, self.access, _CALLER.get)
        # Requests come in through the gate (gate.py): request slots, replay guard, size limit.
        # Requests do their CPU and disk work (the envelope, decoding, a delta's checks and
        # write, a module fetch) a few at once (service.py); the others queue, each woken
        # once. One runs Python while another waits on the disk; more only hand the
        # interpreter lock and the coordinator's lock back and forth: with 64 peers at once,
        # over a thousand thread switches per delta, which doubled the coordinator's CPU per
        # delta (bench/soak.py).
        self.gate = Gate(self.security.clock_skew_seconds)
        self.owner_keys: dict[str, str] = {owner_id: self.identity.public_key}
        if is_scheduler:
            self.peer_config["coordinator_key"] = self.identity.public_key
        self.owners: dict[str, str] = {}
        self.addresses: dict[str, list[str]] = {}  # owner id -> how peers reach it
        self.remote: dict[str, ReportedModule] = {}  # other owners' modules, from their reports
        # scheduler: remote modules it holds a checked copy of at their final version (gathered
        # after the run); owner: what the scheduler's last ReportAck said of ours
        self.gathered: set[str] = set()
        # scheduler: fetches other owners' current modules (module ids -> tensors) for the
        # per-round evaluation; None: not possible on this transport
        self.fetch_remote: Callable[[list[str]], dict[str, dict[str, torch.Tensor]]] | None = None
        self._eval_note = eval_note  # why there is no per-round validation, if there is none
        self.owner_seen: dict[str, float] = {}  # other owners: when they last reported
        self.standbys: dict[str, float] = {}  # standby schedulers: when they last synced
        self.handing: dict[str, tuple[str, float]] = {}  # module -> (new owner, since)
        # Done, overdue and trained path-rounds, the last round announced (round_book.py).
        self.book = RoundBook()
        self.files = files or {}
        # Routing phases (DiPaCo Algorithm 1, line 2; phases.py): which shards a task trains on.
        first = Phase("shards", shard_tokens) if is_scheduler else None
        self.phases = RoutingPhases(self.root, phase_rounds, first)
        self.changed = threading.Event()  # set on every change an owner must report
        # Trust in a delta's content (validation.py): its norm against the module's recent ones,
        # and (optional) the path's held-out loss with it, from ``heldout_loss(path, modules)``.
        self.validation = validation or ValidationSection()
        v = self.validation
        self.norms = NormTracker(
            self.root / "validation.json",
            mode=v.norm_check,
            mads=v.norm_mads,
            ratio=v.norm_ratio,
            min_observations=v.min_observations,
            max_norm=v.max_norm,
            window=v.norm_window,
        )
        # The held-out check ("auto": when anyone may join) needs a scorer to run.
        on = v.heldout_check
        if on == "auto":
            on = self.security.join == "open"
        self.heldout_loss = heldout_loss if on else None
        # The path's loss on other paths' documents (optional): a delta trained on its own shard
        # helps its own documents more (heldout.check_heldout).
        self.foreign_loss = foreign_loss if on else None
        # Copies of earlier deltas refused ("auto": with the held-out check, which tells a
        # diverging run, whose copies are let through: admission.check_content).
        cosine = v.copy_cosine
        if cosine == "auto":
            cosine = AUTO_COSINE if self.heldout_loss is not None else None
        self.copies = DeltaCopies(cosine)
        self.key_scores = KeyScores(self.root / "key_scores.json", v.heldout_tolerance)
        # Verdicts on whole paths for their several owners (the scheduler's; scoring.py).
        self.verdicts = Verdicts()
        # "auto" aggregation where the run scores deltas: the modules whose every delta is
        # scored take the paper's mean, the others the robust combiner (outer_settings_of).
        self.checked_mean = v.aggregation == "auto" and bool(on) and outer.aggregation != "mean"

    @property
    def scheduler_key(self) -> str:
        """The scheduler's key now (``keys.current``)."""
        return self.keys.current

    def owned_modules(self) -> list[str]:
        return [mid for mid in self.topology.module_ids() if self.owners.get(mid) == self.owner_id]

    def owns(self, mid: str) -> bool:
        return self.owners.get(mid) == self.owner_id

    def version(self, mid: str) -> int | None:
        """A module's version; None for another owner's module not yet reported."""
        if self.owns(mid):
            return self.store.version(mid)
        info = self.remote.get(mid)
        return info.version if info else None

    def reported(self, mid: str) -> set[int]:
        if self.owns(mid):
            return set(self.store.modules[mid].pending)
        info = self.remote.get(mid)
        return set(info.pending) if info else set()

    def reported_ahead(self, mid: str) -> set[int]:
        """The paths whose deltas for the module's next step are held already (overlap)."""
        if self.owns(mid):
            return set(self.store.modules[mid].ahead)
        info = self.remote.get(mid)
        return set(info.ahead) if info else set()

    def weight(self, path: int, base_round: int) -> float | None:
        """A path's outer-step weight for a task of ``base_round``: its shard's tokens in the
        routing phase it trains on (paper eq. 2-3); None without shard sizes."""
        tokens = self.phases.tokens(base_round) or self.shard_tokens
        return float(tokens[path]) if tokens else None

    @property
    def eval_note(self) -> str | None:
        """Why there is no per-round validation, if there is none (the after-round work's)."""
        return None if self._eval_note is None else self._eval_note()

    def set_remote_fetcher(
        self, fetch: Callable[[list[str]], dict[str, dict[str, torch.Tensor]]]
    ) -> None:
        """How the scheduler fetches other owners' current modules (module ids -> tensors) for
        the per-round evaluation: the transport's, given once it serves."""
        self.fetch_remote = fetch

    def reachable_at(self, addresses: list[str]) -> None:
        """How peers reach this coordinator (its node's addresses, or a relay's): what
        GetOwners and its reports tell them. Wakes the reporter, which tells the scheduler."""
        with self.lock:
            self.addresses[self.owner_id] = list(addresses)
        self.changed.set()

    def set_security(self, security: SecuritySection) -> None:
        """New security settings for the coordinator and its access policy (a local run's task
        quota, a bench's ban budget), before it serves."""
        self.security = security
        self.access.use(security)

    def voter_of(self, req: m.SubmitDelta | m.ScoreDelta) -> str:
        """Whose vote a delta is in a robust combiner: the key that signed it (a peer id for an
        unsigned local transport). One key holding many paths of a module is one vote."""
        return self._caller or req.peer_id

    @property
    def is_scheduler(self) -> bool:
        """Whether this coordinator leases tasks (it has a scheduler), or only owns modules."""
        return self.scheduler is not None

    def need_scheduler(self, who: str) -> Scheduler:
        """The scheduler, for ``who``'s request; refused unless this coordinator leases tasks."""
        if self.scheduler is None:
            self.refusals.refuse(
                who, Reason.NOT_SCHEDULER, "this coordinator owns modules but does not lease tasks"
            )
        assert self.scheduler is not None  # refuse raises
        return self.scheduler

    def outer_settings_of(self, mid: str, included: Sequence[PendingDelta] = ()) -> OuterSettings:
        """The outer step of ``mid`` (averaging ``included``): ``outer`` at the module's lr by its
        sharing count (if ``lr_by_sharing`` names one), except that with ``checked_mean`` (the
        "auto" aggregation of an open run with the held-out check on) a module whose every path
        this coordinator scores, or whose every delta of this step came with the scheduler's
        verdict on its whole path (scoring.py), takes the plain mean: each delta was judged on
        its own already, and the mean costs honest runs nothing (docs/security.md has both
        measured)."""
        paths = self.topology.paths_through(mid)
        settings = for_sharing(self.outer, len(paths))
        scored_here = self.heldout_loss is not None and all(
            self.owns(x) for p in paths for x in self.topology.path_modules(p)
        )
        scored_whole = bool(included) and all(d.scored for d in included)
        if self.checked_mean and (scored_here or scored_whole):
            return replace(settings, aggregation="mean")
        return settings

    def path_round(self, path: int) -> int:
        return min(self.version(mid) or 0 for mid in self.topology.path_modules(path))

    @property
    def round(self) -> int:
        """Rounds completed by every module (that this coordinator knows of)."""
        mids = self.topology.module_ids() if self.is_scheduler else self.owned_modules()
        return min((self.version(mid) or 0 for mid in mids), default=0)

    @property
    def finished(self) -> bool:
        return self.round >= self.rounds

    def fail(self, reason: str) -> None:
        """The run cannot go on: ``reason`` is its failure, and it ends (``finished_event``)."""
        with self.lock:
            self.failure = reason
            self.finished_event.set()

    def _work_changed(self) -> None:
        """Something that may open a path happened (the caller holds the lock): wake the
        deltas waiting for a step to end, and one claim that waits for a path (the one that
        leases a path wakes the next: tasks.wait_for_work); every claim once the run ends."""
        self.steps.wake()
        self.polls.changed(everyone=self.finished)

    @property
    def _caller(self) -> str | None:
        """The key of the request being handled (:func:`acting_for`), if any."""
        return _CALLER.get()

    @property
    def rejections(self) -> Counter[str]:
        """Refusals by reason (``refusals.by_reason``; read it, count through ``refusals``)."""
        return self.refusals.by_reason

    @property
    def rejections_by_peer(self) -> dict[str, Counter[str]]:
        return self.refusals.by_peer
