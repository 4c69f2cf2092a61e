"""Pushing a task's deltas: each module's delta to its owner, then ``TaskDone`` to the scheduler.

A module's delta is what it was fetched as minus what the task trained it to
(``module_deltas``; DiPaCo Algorithm 1, line 9). Deltas go out through the run's codec with
error feedback kept per path (the residual of what the codec dropped is added to the path's next
delta). Each owner gets one ``SubmitDelta`` with its modules, retried until acknowledged: an
owner that restarts keeps what it acknowledged, and acknowledges a retried delta again. When no
owner's acknowledgement told the scheduler the task is done, the peer says so itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from dipaco.config import NetworkSection
from dipaco.errors import RejectedError
from dipaco.faults import fault_point
from dipaco.peer.links import OwnerLinks
from dipaco.protocols import feedback
from dipaco.protocols import messages as m
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)

Tensors = dict[str, dict[str, torch.Tensor]]  # module id -> parameter name -> tensor
# Seconds a TaskDone may wait at the scheduler for the owners' reports (TaskDone.wait).
REPORT_WAIT = 2.0


def module_deltas(base: Tensors, trained: Tensors, in_place: bool = False) -> Tensors:
    """Each module's delta: its tensors as fetched (``base``) minus as trained, contiguous.
    ``in_place``: written over ``trained``'s tensors where they are contiguous float32 like
    ``base``'s (the path's parameters hold no second copy of it; they are spent)."""
    return {
        mid: {name: _delta(base[mid][name], trained[mid][name], in_place) for name in base[mid]}
        for mid in base
    }


def _delta(base: torch.Tensor, trained: torch.Tensor, in_place: bool) -> torch.Tensor:
    if (
        in_place
        and trained.is_contiguous()
        and trained.dtype == base.dtype == torch.float32
        and trained.shape == base.shape
        and trained.device == base.device
    ):
        return torch.sub(base, trained, out=trained)
    return (base - trained).contiguous()


def codec_settings(config: dict[str, Any]) -> tuple[float, float]:
    """The run's error-feedback decay and top-k density, from the Welcome config's ``run``
    section (fields this version does not know are a newer coordinator's business)."""
    said = config.get("run", {}).get("network", {})
    network = NetworkSection.model_validate(
        {k: v for k, v in said.items() if k in NetworkSection.model_fields}
    )
    return network.decay, network.topk_density


class Pusher:
    """Encodes a task's deltas (with error feedback) and pushes them until acknowledged."""

    def __init__(
        self,
        links: OwnerLinks,
        feedback: feedback.ErrorFeedback,
        peer_id: str,
        on_ack: Callable[[dict[str, Any]], None],
    ) -> None:
        self.links = links
        self.feedback = feedback
        self.peer_id = peer_id
        self.on_ack = on_ack

    def push(
        self,
        task: m.TaskOffer,
        delta: Tensors,
        tokens: int,
        losses: list[float],
        before_send: Callable[[], None] | None = None,
    ) -> None:
        """Each module's delta to its owner, until every owner has acknowledged; then TaskDone.

        ``before_send`` runs once the deltas are encoded (error-feedback residuals updated) and
        before anything is sent. Should the push fail, the residuals are as they were before.
        """
        wire, undo = self.encode(task, delta)
        try:
            if before_send is not None:
                before_send()
            self.send(task, wire, list(delta), tokens, losses)
        except BaseException:
            undo()  # nothing was sent for good: keep residuals
            raise

    def encode(self, task: m.TaskOffer, delta: Tensors) -> tuple[dict, Callable[[], None]]:
        """The deltas through the task's codec, the path's error-feedback residuals updated;
        and the function that puts the residuals back as they were (the send failed)."""
        codec = task.codec or "lossless"
        log.info(
            "peer %s: pushing the deltas of %s (%s) to %d owner(s)",
            self.peer_id,
            task.task_id,
            codec,
            len(self.links.by_owner(list(delta))),
        )
        key = f"P{task.path}"
        before = self.feedback.stream(key)
        wire = self.feedback.compress(
            codec, key, {f"{mid}/{n}": t for mid, ts in delta.items() for n, t in ts.items()}
        )
        return wire, lambda: self.feedback.set_stream(key, before)

    def send(
        self,
        task: m.TaskOffer,
        wire: dict,
        modules: list[str],
        tokens: int,
        losses: list[float],
    ) -> None:
        """The encoded deltas of ``modules`` to their owners until acknowledged; then TaskDone
        to the scheduler unless an owner's acknowledgement told it already."""
        fault_point("peer.send")
        links = self.links
        codec = task.codec or "lossless"
        remaining = list(modules)
        scheduler_done, acked, over = False, 0, None
        verdict = self._score(task, wire, tokens) if task.score_first else ""
        while remaining:
            owner, mids = next(iter(links.by_owner(remaining).items()))
            try:
                ack = links.ask(
                    owner,
                    functools.partial(  # a new message for each try
                        m.SubmitDelta,
                        peer_id=self.peer_id,
                        task_id=task.task_id,
                        path=task.path,
                        base_versions=task.module_versions,
                        tokens=tokens,
                        losses=losses,
                        tensors={k: v for k, v in wire.items() if k.partition("/")[0] in mids},
                        ticket=task.ticket,
                        codec=codec,
                        verdict=verdict,
                    ),
                    f"keeps the delta of {task.task_id}",
                )
            except RejectedError as exc:
                if exc.reason == Reason.FINISHED:
                    # This owner's modules made all their rounds (the delta is dropped): the
                    # path's other modules may still wait for their last one.
                    remaining, over = [mid for mid in remaining if mid not in mids], exc
                    continue
                if exc.reason != Reason.NOT_OWNER:
                    raise
                links.refresh()  # a module moved: regroup and push again
                continue
            remaining = [mid for mid in remaining if mid not in mids]
            if ack.dropped:
                log.info(
                    "peer %s: %s did not need %s's deltas (rounds closed or all made)",
                    self.peer_id,
                    ", ".join(ack.dropped),
                    task.task_id,
                )
            for mid in mids:
                if mid in ack.dropped:
                    continue
                acked += 1
                self.on_ack(
                    {
                        "module": mid,
                        "base_version": task.module_versions[mid],
                        "path": task.path,
                        "task": task.task_id,
                        "owner": owner,
                        "unacked": len(remaining),  # modules of the task still to push
                    }
                )
            scheduler_done |= ack.task_done
        if over is not None and not acked:
            raise over  # every module of the path had made all its rounds
        if not scheduler_done:
            self._task_done(task, tokens, losses, modules)

    def _score(self, task: m.TaskOffer, wire: dict, tokens: int) -> str:
        """The scheduler's signed verdict on the whole path's delta, which each owner of a path
        shared between coordinators admits its modules' deltas with (``TaskOffer.score_first``).
        A refusal (the delta makes its path worse, or its key's help nobody) is the push's."""
        log.info("peer %s: the scheduler scores %s's delta first", self.peer_id, task.task_id)
        reply = self.links.ask(
            self.links.scheduler_id,
            functools.partial(
                m.ScoreDelta,
                peer_id=self.peer_id,
                task_id=task.task_id,
                path=task.path,
                base_versions=task.module_versions,
                tokens=tokens,
                tensors=wire,
                ticket=task.ticket,
                codec=task.codec or "lossless",
            ),
            f"waits for the verdict on {task.task_id}",
        )
        return reply.verdict

    def _task_done(
        self, task: m.TaskOffer, tokens: int, losses: list[float], modules: list[str]
    ) -> None:
        self.links.patience.call(
            lambda: self.links.transport.request(
                m.TaskDone(
                    peer_id=self.peer_id,
                    task_id=task.task_id,
                    ticket=task.ticket,
                    tokens=tokens,
                    losses=losses,
                    modules=modules,
                    # a scheduler of protocol 1 knows no wait: it decodes a TaskDone without
                    wait=REPORT_WAIT if self.links.scheduler_protocol >= 2 else 0.0,
                )
            ),
            # The scheduler learns another owner's acknowledgement from its next report, and
            # waits for it a while (TaskDone.wait); a refusal after that is retried.
            reasons=(Reason.NOT_ACKED,),
        )
