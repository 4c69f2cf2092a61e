"""The gate, a part of the coordinator that owns how requests come in (``core.gate``): the
request slots (a few requests do their CPU and disk work at once, docs/reliability.md "Request
slots"), the replay guard, and the largest request it accepts. service.py opens each envelope
through it; key admission and refusal counts are the access policy's and ``Refusals``'.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

from dipaco.errors import ConfigError
from dipaco.protocols import auth

# Requests whose CPU and disk work runs at once (service.py); DIPACO_REQUEST_SLOTS overrides.
REQUEST_SLOTS = 2


def request_slots() -> int:
    """How many requests work at once: ``DIPACO_REQUEST_SLOTS`` (a positive whole number), else
    REQUEST_SLOTS."""
    text = os.environ.get("DIPACO_REQUEST_SLOTS", "").strip()
    if not text:
        return REQUEST_SLOTS
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"DIPACO_REQUEST_SLOTS must be a whole number from 1 on, not {text!r}")
    return int(text)


class RequestSlot:
    """A request's hold on one of the coordinator's request slots (``Gate.slots``): taken
    for the request's CPU and disk work, given back before it waits for anything another
    request or an outer step may hold. ``take`` and ``give`` may each repeat."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self.slots, self.held = slots, False

    def take(self) -> None:
        if not self.held:
            self.slots.acquire()
            self.held = True

    def give(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


_SLOT: ContextVar[RequestSlot | None] = ContextVar("dipaco_request_slot", default=None)


@contextmanager
def holding_slot(slots: threading.BoundedSemaphore) -> Iterator[RequestSlot]:
    """Run the ``with`` block as a request with its slot: the request's own if the block runs
    within one (every part of a request holds at most one slot, or two requests could each
    hold one and wait for another), else a new one (not yet taken). Given back at the end."""
    current = _SLOT.get()
    if current is not None:
        try:
            yield current
        finally:
            current.give()
        return
    slot = RequestSlot(slots)
    token = _SLOT.set(slot)
    try:
        yield slot
    finally:
        _SLOT.reset(token)
        slot.give()


def request_slot(slots: threading.BoundedSemaphore) -> RequestSlot:
    """The slot of the request being handled, or a new one (a caller outside any request)."""
    return _SLOT.get() or RequestSlot(slots)


class Gate:
    """``slots``: the request slots (``request_slots()``); ``guard``: replays refused within
    ``clock_skew`` seconds; ``max_request_bytes``: no request may be larger (``size_for``)."""

    def __init__(self, clock_skew: float) -> None:
        self.slots = threading.BoundedSemaphore(request_slots())
        self.guard = auth.ReplayGuard(clock_skew)
        self.max_request_bytes = 64 << 20

    def size_for(self, owned_bytes: int) -> None:
        """No request may be larger than two copies of everything this coordinator owns (a
        delta is one path's share of it, in float32 or less) plus room for the header: bigger
        ones are refused before they are decoded."""
        self.max_request_bytes = 2 * owned_bytes + (16 << 20)

    def holding(self) -> AbstractContextManager[RequestSlot]:
        """The request's slot (``holding_slot``) for the ``with`` block."""
        return holding_slot(self.slots)

    def slot(self) -> RequestSlot:
        """The slot of the request being handled, or a new one (``request_slot``)."""
        return request_slot(self.slots)
