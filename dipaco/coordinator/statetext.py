"""coordinator.json's long sections as JSON text, each entry encoded once and kept while it is
the same.

coordinator.json is written for most requests (durable.py, group commit), under the
coordinator's lock, and a scheduler serving hundreds of peers keeps hundreds of entries in it:
every remembered task, every live lease, every peer's pace, every path-round's attempts and
the peer that trained it. Encoding them all again for every write was the largest single use
of the coordinator's interpreter lock with 256 simulated peers (bench/soak.py). Here an entry
is encoded when it first appears or when its value changed; a write compares each entry's
value with the kept one and joins the texts. The bytes are exactly those of
``dumps(whole)`` (a unit test compares them after every request of a run).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from dipaco.fileio import compact_json as dumps  # how coordinator.json is encoded


def json_object(texts: dict[str, str]) -> str:
    """A JSON object from its values' JSON texts: what ``dumps`` gives for the whole (keys
    sorted), byte for byte."""
    return "{" + ",".join(f"{dumps(k)}:{v}" for k, v in sorted(texts.items())) + "}"


class EntryTexts:
    """The JSON texts of a collection's entries, kept from one write to the next.

    ``encode(key, value)`` gives an entry's text; ``freeze(value)`` what is kept to compare
    the next value with (a copy of anything the owner changes in place: a value that is the
    live object would always equal itself). Entries not passed in a call are forgotten."""

    def __init__(
        self,
        encode: Callable[[Any, Any], str],
        freeze: Callable[[Any], Any] = lambda v: v,
    ) -> None:
        self.encode, self.freeze = encode, freeze
        self._kept: dict[Hashable, tuple[Any, str]] = {}
        self.encoded = 0  # entries encoded so far (tests)

    def texts(self, items: Iterable[tuple[Hashable, Any]]) -> list[str]:
        kept, now, out = self._kept, {}, []
        for key, value in items:
            hit = kept.get(key)
            if hit is None or hit[0] != value:
                hit = (self.freeze(value), self.encode(key, value))
                self.encoded += 1
            now[key] = hit
            out.append(hit[1])
        self._kept = now
        return out


def _pair(key: Any, value: Any) -> str:
    return f"{dumps(key)}:{dumps(value)}"


class SchedulerTexts:
    """:meth:`Scheduler.snapshot` as JSON text, its long sections' entries kept."""

    def __init__(self) -> None:
        self.issued = EntryTexts(lambda t, v: dumps([t, *v]), freeze=lambda v: (*v[:4], dict(v[4])))
        self.live = EntryTexts(lambda t, v: _pair(t, [round(v[0], 3), round(v[1], 3)]))
        self.attempts = EntryTexts(lambda k, n: dumps([*k, n]))
        self.paces = EntryTexts(lambda peer, pace: _pair(peer, [round(x, 4) for x in pace]))

    def text(
        self,
        issued: dict[str, Any],
        leases: dict[str, Any],
        attempts: dict[tuple[int, int], int],
        paces: dict[str, Any],
        durations: Iterable[float],
        now: float,
    ) -> str:
        """A scheduler's section from its parts (``Scheduler.snapshot_text``): the same bytes
        as ``dumps(Scheduler.snapshot())``."""
        tasks = self.issued.texts(
            (t, (x.path, x.round, x.peer_id, x.steps, x.module_versions)) for t, x in issued.items()
        )
        live = self.live.texts(sorted((t, (x.deadline, x.issued_at)) for t, x in leases.items()))
        pace = self.paces.texts((p, tuple(v)) for p, v in sorted(paces.items()))
        return json_object({
            "issued": "[" + ",".join(tasks) + "]",
            "clock": dumps(round(now, 3)),
            "live": "{" + ",".join(live) + "}",
            "attempts": "[" + ",".join(self.attempts.texts(attempts.items())) + "]",
            "durations": dumps([round(d, 3) for d in durations]),
            "paces": "{" + ",".join(pace) + "}",
        })  # fmt: skip


def trained_by_text(texts: EntryTexts, trained_by: dict[tuple[int, int], str]) -> str:
    """``core.book.trained_by`` as coordinator.json holds it: ``[[path, round, peer]]``, sorted."""
    return "[" + ",".join(texts.texts(sorted(trained_by.items()))) + "]"


def trained_by_texts() -> EntryTexts:
    return EntryTexts(lambda k, peer: dumps([*k, peer]))
