"""Named fault points, for the fault-injection harness (``tests/faults/``, ``bench/faults.py``).

Code that must survive a crash marks the instants where one would hurt most with
``fault_point("outer_step.params_written")``. Normally that is a no-op: the environment variable
``DIPACO_FAULTS`` is read once, and when it is unset every call returns at once. When it is set,
it lists rules, separated by ``;`` or ``,``::

    DIPACO_FAULTS="outer_step.params_written=kill"            # SIGKILL at the first hit
    DIPACO_FAULTS="atomic.before_rename=kill@3"               # ... at the 3rd hit
    DIPACO_FAULTS="atomic.write=enospc@if:/tmp/run/diskfull"  # ENOSPC while that file exists
    DIPACO_FAULTS="submit.before_ack=sleep:2@2-4"             # sleep 2 s at hits 2, 3 and 4

Actions: ``kill`` (SIGKILL this process: no cleanup, no flush, like a power cut for the
process), ``enospc`` (raise ``OSError(ENOSPC)``, a full disk), ``sleep:SECONDS``, ``corrupt``
(``fault_point`` returns True: the caller damages what it is about to send). When: ``N``
(the Nth hit only), ``N-M``, ``N-`` (from the Nth on), ``if:PATH`` (while PATH exists, so a
harness can fill and free the "disk" from outside); without ``@`` the first hit for ``kill``,
every hit otherwise. Each fault that fires is appended as a JSON line to ``DIPACO_FAULTS_LOG``
(when set) before it acts, so a harness can count the faults it injected.

``now()`` is the wall clock this process believes in: ``time.time()`` plus
``DIPACO_CLOCK_SKEW`` seconds, so a harness can give a peer a skewed clock. Code that stamps
messages with wall-clock time (signed requests) should use it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from dataclasses import dataclass

# The fault points compiled into dipaco, for the harness to choose from (documentation only: any
# name may be used).
POINTS = {
    "atomic.write": "AtomicFile.write: a write to a temporary file (enospc: the disk is full)",
    "atomic.before_rename": "AtomicFile.commit: data fsynced, not yet renamed into place",
    "outer_step.params_written": "ModuleStore.outer_step: v+1 written, momentum not yet",
    "outer_step.momentum_written": "ModuleStore.outer_step: v+1 and m(v+1) written, head not yet",
    "outer_step.committed": "ModuleStore.outer_step: head.json moved to v+1, old files still there",
    "submit.before_ack": "Coordinator.submit: the deltas are durable, the ack not yet sent",
    "peer.before_push": "Peer: the task is trained, its deltas not yet pushed",
    "peer.send": "Pusher.send: the deltas encoded, not yet sent (sleep: a slow uplink)",
    "peer.fetch": "fetch_modules: the task's modules not yet asked for (sleep: a slow downlink)",
    "peer.inner_step": "PathTrainer.stepped: an inner step done, the stop not yet checked",
    "flower.train": "Flower node: a train message received, not yet trained (sleep: it hangs)",
    "flower.reply": "Flower node: the signed delta made, not yet sent (corrupt: damaged on the way)",
}


@dataclass
class Rule:
    point: str
    action: str  # kill | enospc | sleep
    seconds: float = 0.0
    first: int = 1
    last: int | None = 1  # None: no upper bound
    trigger: str | None = None  # fire only while this path exists

    def due(self, hit: int) -> bool:
        if self.trigger is not None:
            return os.path.exists(self.trigger)
        return hit >= self.first and (self.last is None or hit <= self.last)


_rules: dict[str, list[Rule]] | None = None
_hits: dict[str, int] = {}
_skew: float | None = None


def parse(spec: str) -> dict[str, list[Rule]]:
    """Rules by point from a ``DIPACO_FAULTS`` value; a malformed rule is a ValueError."""
    rules: dict[str, list[Rule]] = {}
    for item in spec.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        point, sep, rest = item.partition("=")
        if not sep or not point:
            raise ValueError(f"DIPACO_FAULTS: {item!r} is not point=action[@when]")
        action, _, when = rest.partition("@")
        name, _, arg = action.partition(":")
        if name not in ("kill", "enospc", "sleep", "corrupt"):
            raise ValueError(f"DIPACO_FAULTS: unknown action {action!r} in {item!r}")
        rule = Rule(point.strip(), name, float(arg) if name == "sleep" and arg else 0.0)
        if not when:
            rule.last = 1 if name == "kill" else None
        elif when.startswith("if:"):
            rule.trigger = when[3:]
        elif "-" in when:
            lo, _, hi = when.partition("-")
            rule.first, rule.last = int(lo), int(hi) if hi else None
        else:
            rule.first = rule.last = int(when)
        rules.setdefault(rule.point, []).append(rule)
    return rules


def reset() -> None:
    """Read the environment again (tests that change ``DIPACO_FAULTS`` in-process)."""
    global _rules, _skew
    _rules, _skew = None, None
    _hits.clear()


def fault_point(name: str) -> bool:
    """Fire the fault ``DIPACO_FAULTS`` sets for this point and hit, if any (usually none);
    True when a ``corrupt`` rule fired (the caller damages what it sends)."""
    global _rules
    if _rules is None:
        _rules = parse(os.environ.get("DIPACO_FAULTS", ""))
    if not _rules or name not in _rules:
        return False
    hit = _hits[name] = _hits.get(name, 0) + 1
    corrupt = False
    for rule in _rules[name]:
        if rule.due(hit):
            _fire(rule, hit)
            corrupt |= rule.action == "corrupt"
    return corrupt


def _fire(rule: Rule, hit: int) -> None:
    log = os.environ.get("DIPACO_FAULTS_LOG")
    if log:
        record = {"time": time.time(), "pid": os.getpid(), "point": rule.point, "hit": hit}
        with open(log, "a") as f:
            f.write(json.dumps(record | {"action": rule.action}) + "\n")
    if rule.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is asynchronous; never carry on past the fault point
    elif rule.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {rule.point})")
    elif rule.action == "sleep":
        time.sleep(rule.seconds)


def now() -> float:
    """Wall-clock seconds as this process sees them: ``time.time()`` + ``DIPACO_CLOCK_SKEW``."""
    global _skew
    if _skew is None:
        _skew = float(os.environ.get("DIPACO_CLOCK_SKEW", "0") or 0)
    return time.time() + _skew
