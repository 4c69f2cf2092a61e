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

The scheduler's remembered tasks and attempt counts grow with the paths times the rounds that
can still take a delta (thousands at a few hundred peers), and comparing every entry at every
write was itself the largest cost of a 200-peer simulated run: those two sections are
:class:`MarkedTexts`, which the scheduler tells which entries it added or changed, so that a
write encodes those alone and joins the rest as kept.
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

    ``encode(key, value)`` gives an entry's text; the value is kept to compare the next one
    with, so it must not be an object its owner changes in place (pass a tuple). Entries not
    passed in a call are forgotten."""

    def __init__(self, encode: Callable[[Any, Any], str]) -> None:
        self.encode = encode
        self._kept: dict[Hashable, tuple[Any, str]] = {}
        self.encoded = 0  # entries encoded so far (tests)

    def texts(self, items: Iterable[tuple[Hashable, Any]]) -> list[str]:
        kept, now, out = self._kept, {}, []
        for key, value in items:
            hit = kept.get(key)
            if hit is None or hit[0] != value:
                hit = (value, self.encode(key, value))
                self.encoded += 1
            now[key] = hit
            out.append(hit[1])
        self._kept = now
        return out


class MarkedTexts:
    """The JSON texts of an insertion-ordered mapping's entries, encoded again only for the keys
    its owner marks (added, changed or removed) and kept in the mapping's order: a key is marked
    when it is added, so new texts follow the kept ones as new keys follow the old in the
    mapping. ``rebuilt()``: the mapping was replaced wholesale (pruned, restored), and the next
    ``joined`` encodes every entry."""

    def __init__(self, encode: Callable[[Any, Any], str]) -> None:
        self.encode = encode
        self._texts: dict[Hashable, str] = {}
        self._marked: dict[Hashable, None] = {}  # an ordered set: the order keys were marked
        self._whole = True
        self.encoded = 0  # entries encoded so far (tests)

    def mark(self, key: Hashable) -> None:
        self._marked[key] = None

    def rebuilt(self) -> None:
        self._whole = True

    def joined(self, mapping: dict[Any, Any]) -> str:
        """The entries' texts, comma-separated, in ``mapping``'s order."""
        if self._whole:
            self._texts = {k: self.encode(k, v) for k, v in mapping.items()}
            self.encoded += len(self._texts)
            self._whole = False
        else:
            for key in self._marked:
                if key in mapping:
                    self._texts[key] = self.encode(key, mapping[key])
                    self.encoded += 1
                else:
                    self._texts.pop(key, None)
        self._marked.clear()
        return ",".join(self._texts.values())


def _pair(key: Any, value: Any) -> str:
    return f"{dumps(key)}:{dumps(value)}"


class SchedulerTexts:
    """:meth:`Scheduler.snapshot` as JSON text, its long sections' entries kept."""

    def __init__(self) -> None:
        self.issued = MarkedTexts(
            lambda t, x: dumps([t, x.path, x.round, x.peer_id, x.steps, x.module_versions])
        )
        self.live = EntryTexts(lambda t, v: _pair(t, [round(v[0], 3), round(v[1], 3)]))
        self.attempts = MarkedTexts(lambda k, n: dumps([*k, n]))
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
        live = self.live.texts(sorted((t, (x.deadline, x.issued_at)) for t, x in leases.items()))
        pace = self.paces.texts((p, tuple(v)) for p, v in sorted(paces.items()))
        return json_object({
            "issued": "[" + self.issued.joined(issued) + "]",
            "clock": dumps(round(now, 3)),
            "live": "{" + ",".join(live) + "}",
            "attempts": "[" + self.attempts.joined(attempts) + "]",
            "durations": dumps([round(d, 3) for d in durations]),
            "paces": "{" + ",".join(pace) + "}",
        })  # fmt: skip
