"""Usefulness per key: what the held-out check (heldout.check_heldout) makes of each scored
delta, and the score each key earns by them (:class:`KeyScores`, saved in key_scores.json)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dipaco.errors import CorruptFileError
from dipaco.fileio import write_json_atomic


@dataclass(frozen=True)
class Verdict:
    """What the usefulness score makes of one checked delta."""

    gain: float  # held-out loss before minus after (nats per token): positive is useful
    score: float  # the key's score with this check counted
    checks: int  # the key's checks, this one included
    trust: float  # the factor its delta's weight is multiplied by (0 < trust <= 1)
    refuse: str | None  # "worse-heldout", "low-score", "useless", "off-shard", or None
    # The gain over the typical gain of other keys' recent deltas (None: too few to compare)
    # and the weight factor it gave (part of ``trust``).
    relative: float | None = None
    useful: float = 1.0


MIN_TRUST = 0.1  # the least weight factor of an accepted delta (a weight must stay positive)
# Relative usefulness: a delta's gain against the typical gain (TYPICAL_QUANTILE of the gains
# of other keys' deltas trained in the USEFUL_ROUNDS rounds before its own, at least
# USEFUL_MIN_SEEN of them). A delta that gains USEFUL_FULL of the typical gain or more counts in
# full; below, its weight falls linearly to MIN_USEFUL at no gain.
# Measured in docs/security.md ("Lazy keys").
USEFUL_ROUNDS = 2
USEFUL_MIN_SEEN = 3
TYPICAL_QUANTILE = 0.75
USEFUL_FULL = 0.25
MIN_USEFUL = 0.02
# A delta below USELESS relative gain is useless; one from a key with at least USELESS_AFTER
# useless deltas, half or more of those judged, is refused ("low-score"): its task goes back to
# be trained.
USELESS = 0.1
USELESS_AFTER = 2
# A delta that gains less on its path's own held-out documents than on other paths' (its
# *specific* gain, own minus foreign, below 0) was likely trained on other data; a key with at
# least OFF_SHARD_AFTER such deltas, half or more of those compared, has each further one weighed
# MIN_USEFUL and refused once per path and round ("off-shard", counted as low-score). Measured in
# docs/security.md ("Lazy keys"): one honest delta in eight has a specific gain below 0.
OFF_SHARD_AFTER = 2
# ...and only in a run whose paths' deltas show it: where at least SPECIALISED of other keys'
# recent deltas gain more on their own path's documents than on others' (KeyScores.specialised).
SPECIALISED = 0.75


class KeyScores:
    """A usefulness score per key, kept across rounds: how much its deltas improve their paths.

    Every delta the held-out check scores gives a gain g = loss before - loss after on its path's
    held-out documents. A key's score is the running mean of its gains, the newest weighted
    ``decay`` (an exponential moving average starting at 0, so a new key starts neutral):

    - one delta with g < -tolerance is refused (``worse-heldout``): a sign-flipped or garbage
      delta, whichever key sends it (a fresh Sybil key included);
    - a key whose score is below -tolerance / 2 has every delta that does not improve its path
      (g <= 0) refused (``low-score``): a key that keeps sending mildly harmful deltas, each under
      the tolerance, is cut off; an honest delta (g > 0) still counts and lifts the score;
    - a key whose score is below -tolerance / 4 has its deltas' weights scaled down, linearly
      from 1 there to ``MIN_TRUST`` at the refusal line: they count less as trust drops. (Above
      -tolerance / 4 nothing changes: an honest key's rare slightly negative gain leaves the
      outer step exactly as it was.)

    Harmless but useless deltas (a small random step: g near 0, under every tolerance) are
    weighed by *relative usefulness*: r = g / the typical gain of other keys' deltas trained in
    the ``USEFUL_ROUNDS`` rounds before this one (``TYPICAL_QUANTILE`` of them), and the key's
    running mean of r (the same ``decay``, starting at 0). The delta's weight is multiplied by
    ``r / USEFUL_FULL``, clamped to [``MIN_USEFUL``, 1]: a delta that helps a quarter as much as
    others' typical one counts in full, one that helps nobody next to nothing, whatever its
    key did before (a key that alternates trained and useless deltas gets no credit for the
    useless ones). Other keys are the
    yardstick because gains shrink as a run converges and differ between corpora; earlier
    rounds' gains, because they are all in before a round's deltas come (with a quorum of 1),
    so that a delta's weight does not depend on the order in which its round's deltas arrive.
    A run's first round has no yardstick: its deltas count in full. A delta below ``USELESS``
    is useless; once a key has sent ``USELESS_AFTER`` of them and they are half or more of its
    judged deltas, each further one is refused (``useless``, counted as ``low-score``): it
    loses weight, then tasks, which go back to be trained by someone else. Once per key, path
    and round: a key that trains the task again gets the same delta (the same base, the same
    windows), which is let through at its low weight rather than refused for ever. An honest
    key's rare delta that happens to help little on the few documents scored only counts less.
    In a diverging run (``diverging``) nothing is refused as useless: nothing helps there.

    Deltas trained on other data than the path's shard (a key that never downloads its own):
    where the coordinator also measures each delta's gain on other paths' held-out documents
    (``foreign``), a delta that gains less on its own path's documents than on theirs counts
    against its key; once a key has ``OFF_SHARD_AFTER`` of them, half or more of those
    compared, each further one is weighed ``MIN_USEFUL`` and refused once per key, path and
    round (``off-shard``, counted as ``low-score``), as a useless one is.

    A refused delta's gain still counts in its key's score. Persisted (``key_scores.json``) so
    that a restarted coordinator remembers who it trusts.
    """

    def __init__(self, path: Path, tolerance: float, decay: float = 0.5) -> None:
        self.path = Path(path)
        self.tolerance = tolerance
        self.decay = decay
        self.scores: dict[str, tuple[float, int]] = {}  # key -> (score, checks)
        # key -> (running mean of its relative gains, deltas judged, useless ones among them)
        self.relative: dict[str, tuple[float, int, int]] = {}
        # (key, path, round) whose delta was refused as useless: the next is let through
        self._refused_useless: set[tuple[str, int | None, int]] = set()
        # key -> (deltas whose foreign gain was measured, those with a specific gain below 0)
        self.offshard: dict[str, tuple[int, int]] = {}
        # round -> [(key, gain, specific gain: own less foreign, NaN where not measured)]
        self.recent: dict[int, list[tuple[str, float, float]]] = {}
        # Per path, its held-out loss when first scored and now: a run whose paths score worse
        # than where they started, half of them or more, is diverging (``diverging``).
        self.paths: dict[int, tuple[float, float]] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            saved = json.loads(self.path.read_text())
            scores = {str(k): (float(v[0]), int(v[1])) for k, v in saved["scores"].items()}
            relative = {
                str(k): (float(v[0]), int(v[1]), int(v[2]))
                for k, v in saved.get("relative", {}).items()
            }
            recent = [
                (int(e[0]), str(e[1]), float(e[2]), float(e[3]) if len(e) > 3 else math.nan)
                for e in saved.get("recent", [])
            ]
            paths = {int(p): (float(a), float(b)) for p, (a, b) in saved.get("paths", {}).items()}
            offshard = {
                str(k): (int(v[0]), int(v[1])) for k, v in saved.get("offshard", {}).items()
            }
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise CorruptFileError(f"{self.path}: key scores are damaged ({exc})") from None
        values = [s for s, _ in scores.values()] + [v[0] for v in relative.values()]
        values += [g for _, _, g, _ in recent] + [x for pair in paths.values() for x in pair]
        values += [x for *_, x in recent if not math.isnan(x)]
        counts = [n for _, n in scores.values()] + [n for v in relative.values() for n in v[1:]]
        counts += [n for v in offshard.values() for n in v]
        if not all(map(math.isfinite, values)) or any(n < 0 for n in counts):
            raise CorruptFileError(f"{self.path}: key scores are damaged (not finite)")
        self.scores, self.relative, self.paths = scores, relative, paths
        self.offshard = offshard
        for r, k, g, x in recent:
            self.recent.setdefault(r, []).append((k, g, x))

    def save(self) -> None:
        write_json_atomic(
            self.path,
            {
                "scores": {k: [s, n] for k, (s, n) in sorted(self.scores.items())},
                "relative": {k: list(v) for k, v in sorted(self.relative.items())},
                "recent": [
                    [r, k, g] + ([] if math.isnan(x) else [x])
                    for r, gains in sorted(self.recent.items())
                    for k, g, x in gains
                ],
                "paths": {str(p): list(v) for p, v in sorted(self.paths.items())},
                "offshard": {k: list(v) for k, v in sorted(self.offshard.items())},
            },
        )

    def score(self, key: str) -> float:
        return self.scores.get(key, (0.0, 0))[0]

    def trust(self, key: str) -> float:
        s, t = self.score(key), self.tolerance
        if s >= -t / 4 or t <= 0:
            return 1.0
        return max(MIN_TRUST, 1.0 - (1.0 - MIN_TRUST) * (-s - t / 4) / (t / 4))

    def scored(self, path: int, loss: float) -> None:
        """Note the path's held-out loss as it is now (a check's ``before``)."""
        if math.isfinite(loss):
            self.paths[path] = (self.paths.get(path, (loss, loss))[0], loss)

    def diverging(self) -> bool:
        """Whether the run is diverging: half or more of the paths scored have a held-out loss
        now above where it was first scored by more than the tolerance. Then its honest deltas
        may copy one another (docs/security.md, "Copies"). Half, not one: in a run that trains,
        a path with few documents of its own can score worse than at its start while the
        modules it shares serve the other paths (seen on builtin:mixed)."""
        worse = sum(now > first + self.tolerance for first, now in self.paths.values())
        return worse > 0 and 2 * worse >= len(self.paths)

    def typical_gain(self, key: str, round_: int) -> float | None:
        """The yardstick of relative usefulness for a delta trained in round ``round_``: a high
        quantile of other keys' gains in the rounds before; None with too few of them, or when
        they gain nothing."""
        earlier = range(round_ - USEFUL_ROUNDS, round_)
        others = sorted(g for r in earlier for k, g, _ in self.recent.get(r, ()) if k != key)
        if len(others) < USEFUL_MIN_SEEN:
            return None
        typical = others[min(len(others) - 1, int(TYPICAL_QUANTILE * len(others)))]
        return typical if typical > 0 else None

    def specialised(self, key: str, round_: int) -> bool:
        """Whether other keys' deltas of the rounds before ``round_`` help their own paths'
        documents more than other paths' (``SPECIALISED`` of them, at least
        ``USEFUL_MIN_SEEN``): only then does a delta that does not tell anything. In a run
        whose shards do not differ (DiLoCo's random ones) about half of them do, by chance."""
        earlier = range(round_ - USEFUL_ROUNDS, round_)
        others = [
            x
            for r in earlier
            for k, _, x in self.recent.get(r, ())
            if k != key and not math.isnan(x)
        ]
        if len(others) < USEFUL_MIN_SEEN:
            return False
        return sum(x > 0 for x in others) >= SPECIALISED * len(others)

    def judge(
        self,
        key: str,
        before: float,
        after: float,
        round_: int = 0,
        path: int | None = None,
        foreign: float = math.nan,
        late: bool = False,
    ) -> Verdict:
        """Count one check of ``key``'s delta for ``path``, trained in round ``round_`` (its
        base version), and say what to do with it (call ``save`` after). The path's loss now
        (``before``) is noted first: in a diverging run nothing is refused as useless (nothing
        helps there, and a refused task would come back for ever). ``foreign``: the delta's
        gain on other paths' held-out documents, where measured (``OFF_SHARD_AFTER``).

        ``late``: the delta's base is older than the path's modules now, so ``after`` applies
        it to modules that moved on since. It is still refused if it would make the path worse
        (applied, it would), but that says nothing of its key: the check counts toward no
        score and the verdict's trust is the key's as it stands."""
        if path is not None:
            self.scored(path, before)
        gain = before - after if math.isfinite(before) and math.isfinite(after) else -math.inf
        old, n = self.scores.get(key, (0.0, 0))
        if late:
            worse = "worse-heldout" if not gain >= -self.tolerance else None
            return Verdict(gain, old, n, self.trust(key), worse)
        counted = max(gain, -10.0 * max(self.tolerance, 1e-3))  # one NaN does not sink a key
        score = (1.0 - self.decay) * old + self.decay * counted
        self.scores[key] = (score, n + 1)
        relative, useful, useless = None, 1.0, False
        typical = self.typical_gain(key, round_)
        if typical is not None:
            relative = max(-1.0, min(counted / typical, 1.0))
            mean, judged, wasted = self.relative.get(key, (0.0, 0, 0))
            mean = (1.0 - self.decay) * mean + self.decay * relative
            judged, wasted = judged + 1, wasted + (relative < USELESS)
            self.relative[key] = (mean, judged, wasted)
            useful = min(1.0, max(MIN_USEFUL, relative / USEFUL_FULL))
            useless = relative < USELESS and wasted >= USELESS_AFTER and 2 * wasted >= judged
        off_shard = False
        specific = gain - foreign if math.isfinite(foreign) and math.isfinite(gain) else math.nan
        if self.specialised(key, round_) and not math.isnan(specific):
            compared, off = self.offshard.get(key, (0, 0))
            below = specific < 0  # it helps other paths' documents more than its own
            compared, off = compared + 1, off + below
            self.offshard[key] = (compared, off)
            off_shard = below and off >= OFF_SHARD_AFTER and 2 * off >= compared
            if off_shard:
                useful = MIN_USEFUL
        if math.isfinite(gain):
            self.recent.setdefault(round_, []).append((key, gain, specific))
            for old_round in [r for r in self.recent if r < round_ - USEFUL_ROUNDS]:
                del self.recent[old_round]
            self._refused_useless = {e for e in self._refused_useless if e[2] >= round_ - 1}
        refuse = None
        if not gain >= -self.tolerance:
            refuse = "worse-heldout"
        elif gain <= 0 and score < -self.tolerance / 2:
            refuse = "low-score"
        elif (
            (useless or off_shard)
            and not self.diverging()
            and (key, path, round_) not in self._refused_useless
        ):
            refuse = "useless" if useless else "off-shard"
            self._refused_useless.add((key, path, round_))
        return Verdict(gain, score, n + 1, self.trust(key) * useful, refuse, relative, useful)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            k: {"score": s, "checks": n, "relative": self.relative.get(k, (0.0, 0, 0))[0]}
            for k, (s, n) in self.scores.items()
        }
