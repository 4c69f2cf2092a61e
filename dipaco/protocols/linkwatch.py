"""A link's outages told in a few lines: lost, still down (at growing intervals), back.

A process that keeps retrying a link that is down (a peer's heartbeats, claims and pushes while
its coordinator restarts, an owner's reports to the scheduler, a join waiting for its address)
would otherwise log every failed attempt, each with the transport's raw text. A ``LinkWatch``
turns the stream of failures and successes into one warning when the link is lost (which link,
since when, what the process does meanwhile), a reminder 30, 60, 120, 240 s... after the loss
(then every ``longest`` seconds), and one line when it answers again, at ``NOTICE`` (shown
without ``-v``, as the end of a warning should be). Each failure's raw text goes to DEBUG, and
with the lost line and the reminders to INFO (``-v``), collapsed to one line. ``gave_up`` makes
the error that ends the retries: what was tried, how often, for how long, the last error in a
few words, and what to check.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from dipaco.errors import TransportError

log = logging.getLogger(__name__)

NOTICE = 25  # between INFO and WARNING: a link that is back, shown without -v
logging.addLevelName(NOTICE, "NOTICE")

FIRST_REMINDER = 30.0  # seconds after the loss of the first "still unreachable" line
LONGEST = 600.0  # reminders double their distance from the loss, up to this many seconds apart

# What a transport error says, in a few words: (text it contains, lowercase; the gist). The
# first match wins, so the most telling come first.
GISTS = (
    ("connection refused", "connection refused"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("name or service not known", "unknown host"),
    ("connection reset", "connection reset"),
    ("mid-transfer", "connection lost mid-transfer"),
    ("closed the stream", "connection closed without a reply"),
    ("timed out", "timed out"),
    ("timeout", "timed out"),
    ("nothing moved", "timed out"),
    ("dial backoff", "dial failed"),
    ("failed to dial", "dial failed"),
    ("failed to connect to bootstrap peers", "nothing answered at that address"),
    ("daemon failed to start", "the hivemind daemon failed to start"),
    ("shut down", "the node is shut down"),
)


class GaveUp(TransportError):
    """A link's retries ended: the message says what was tried, for how long, and what to check."""


def one_line(text: object) -> str:
    """Text on one line (daemon errors come with indented continuation lines)."""
    return " ".join(str(text).split())


def gist(exc: BaseException | str) -> str:
    """What a transport error says, in a few words, without the transport's raw text."""
    text = one_line(exc)
    lowered = text.lower()
    for needle, said in GISTS:
        if needle in lowered:
            return said
    text = _PEER_ID.sub(lambda found: short_id(found.group()), text)
    return text if len(text) <= 80 else text[:77] + "..."


_PEER_ID = re.compile(r"\b(?:Qm|12D3Koo)\w{20,}")


def short_id(name: str) -> str:
    """A libp2p peer id shortened as the docs write it (``QmPLv6xD...``); other names as they
    are."""
    if len(name) > 20 and name[:2] in ("Qm", "12"):
        return name[:8] + "..."
    return name


def span(seconds: float) -> str:
    """A duration as a person reads it: ``42 s``, ``5 min``, ``4 min 10 s``."""
    whole = round(seconds)
    if whole < 120:
        return f"{whole} s"
    minutes, rest = divmod(whole, 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


class LinkWatch:
    """Failures and successes of one link, told as lost / still down / back lines.

    Safe to use from several threads (a peer's heartbeat thread and its main loop report on the
    same link).

    Args:
        what: the link, as the lines name it (``"the coordinator QmPLv6xD..."``).
        doing: what the process does while the link is down (``"keeps training; retrying every
            1 s"``); each failure may say it anew.
        who: a prefix for every line (``"peer alice: "``).
        check: what to do once the retries end, added to ``gave_up``'s error (``"Check the
            address with: dipaco-peer doctor ADDRESS"``).
        lost: the first line's start, with ``{what}`` and ``{time}`` (the loss's time of day);
            a link that never answered yet says ``"cannot reach {what} yet"``.
        logger: the logger of the part that watches (default: this module's): the lines go
            there, and each failure's raw text.
        tell: where the lines go instead, ``tell(level, line)`` (a join's ``on_wait``).
        clock, wall: monotonic and wall time (a test's fake clock).
    """

    def __init__(
        self,
        what: str,
        doing: str = "retrying",
        *,
        who: str = "",
        check: str = "",
        lost: str = "lost {what} at {time}",
        logger: logging.Logger | None = None,
        tell: Callable[[int, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        first_reminder: float = FIRST_REMINDER,
        longest: float = LONGEST,
    ) -> None:
        self.what, self.doing, self.who, self.check = what, doing, who, check
        self.lost = lost
        self._log = logger or log
        self._tell = tell or (lambda level, line: self._log.log(level, "%s", line))
        self._clock, self._wall = clock, wall
        self.first_reminder, self.longest = first_reminder, longest
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic time of the first failure
        self._down_wall = 0.0
        self._attempts = 0  # failed attempts since the loss
        self._next = 0.0  # seconds after the loss of the next reminder
        self._last = ""  # the last failure, in a few words
        self.outages = 0  # links lost so far (each told once)
        self.down_seconds = 0.0  # the outages' total length, those that ended

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, exc: BaseException | str, doing: str | None = None) -> None:
        """One failed attempt (``exc``: what the transport raised); ``doing``: what the process
        does now, if it changed."""
        raw = one_line(exc)
        self._log.debug("%s%s: %s", self.who, self.what, raw)
        with self._lock:
            if doing is not None:
                self.doing = doing
            now = self._clock()
            self._last = gist(exc)
            self._attempts += 1
            if self._down_since is None:
                self._down_since, self._down_wall = now, self._wall()
                self._next = self.first_reminder
                self.outages += 1
                lost = self.lost.format(what=self.what, time=self._clock_time())
                line = f"{self.who}{lost} ({self._last}); {self.doing}"
            elif now - self._down_since >= self._next:
                down = now - self._down_since
                self._next = min(2 * self._next, self._next + self.longest)
                line = (
                    f"{self.who}{self.what} still unreachable after {span(down)} "
                    f"(since {self._clock_time()}, {self._attempts} failed attempts; "
                    f"{self._last}); {self.doing}"
                )
            else:
                return
        self._tell(logging.WARNING, line)
        self._log.info("%s%s: the last error in full: %s", self.who, self.what, raw)

    def ok(self) -> None:
        """The link answered: one line if it was down."""
        with self._lock:
            if self._down_since is None:
                return
            down, attempts = self._clock() - self._down_since, self._attempts
            self._down_since, self._attempts = None, 0
            self.down_seconds += down
        plural = "s" * (attempts != 1)
        self._tell(
            NOTICE,
            f"{self.who}{self.what} is back after {span(down)} ({attempts} failed attempt{plural})",
        )

    def gave_up(self, exc: BaseException | str) -> GaveUp:
        """The error that ends the retries after ``exc``: what was tried, how often, for how
        long, the last error in a few words, and ``check``."""
        with self._lock:
            attempts = max(self._attempts, 1)
            down = 0.0 if self._down_since is None else self._clock() - self._down_since
            last = self._last or gist(exc)
        text = (
            f"gave up reaching {self.what} after {attempts} attempt{'s' * (attempts != 1)} "
            f"over {span(down)} (last error: {last})"
        )
        reason = getattr(exc, "reason", None)
        return GaveUp(
            text + (f". {self.check}" if self.check else ""),
            reason=reason if isinstance(reason, str) else None,
        )

    def _clock_time(self) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self._down_wall))
