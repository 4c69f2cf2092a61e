"""Who may talk to a coordinator: allow-list or open joining, quotas, rate limits and bans.

Two files in the coordinator's folder:

* ``access.json``, the operator's (``dipaco-coordinator allow|revoke``)::

      {"allowed": {KEY: {"note", "added"}}, "owners": {KEY: {...}}, "revoked": {KEY: {...}}}

  Re-read whenever it changes, so that a key allowed or revoked takes effect while the run goes
  on. A revoked key is refused in every join mode.
* ``peers.json``, the coordinator's: which key each peer id belongs to (a peer id, once used,
  stays with its key), and the banned keys with why.

Every request is admitted here first (:meth:`AccessPolicy.admit`): banned and revoked keys, keys
not on the allow-list (``security.join = "allow-list"``), and keys over their rate (a token bucket
per key) are refused with a reason. Rejections for hostile reasons are counted per key
(:meth:`offence`); ``security.ban_after`` of them ban the key for good (until an operator lifts it
with ``dipaco-coordinator allow``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dipaco.config import SecuritySection
from dipaco.errors import RejectedError
from dipaco.fileio import write_json_atomic
from dipaco.protocols.auth import check_public_key, fingerprint
from dipaco.protocols.limits import KeyBuckets
from dipaco.protocols.reasons import Reason

log = logging.getLogger(__name__)

ACCESS_FILE, PEERS_FILE = "access.json", "peers.json"
# Keys whose request rate is remembered (the most recently seen): an open run's callers can make
# keys at will, and a bucket for every key ever seen would grow without end.
RATE_KEYS = 65536

# Reasons that an honest peer never earns: a key collecting enough of them is banned. Others
# (stale, handover, finished, rate-limited, clock-skew...) happen to honest peers on bad links,
# and a replay proves nothing about its signer: anyone who captured a request can resend it.
HOSTILE = frozenset(
    {
        "bad-signature",
        "bad-envelope",
        "unsigned",
        "bad-message",
        "bad-ticket",
        "not-your-task",
        "unknown-task",
        "wrong-path",
        "wrong-base",
        "wrong-shape",
        "wrong-dtype",
        "wrong-tensors",
        "bad-encoding",
        "bad-codec",
        "bad-tokens",
        "non-finite",
        "huge-norm",
        "copied",
        "worse-heldout",
        "identity-mismatch",
        "unknown-module",
        "bad-proof",
    }
)


def read_access(root: Path) -> dict[str, dict[str, Any]]:
    file = Path(root) / ACCESS_FILE
    if not file.exists():
        return {"allowed": {}, "owners": {}, "revoked": {}}
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    out = {}
    for section in ("allowed", "owners", "revoked"):
        entries = data.get(section, {})
        if not isinstance(entries, dict):
            raise ValueError(f"{section!r} is not an object")
        for key in entries:
            check_public_key(key)
        out[section] = entries
    return out


def change_access(root: Path, key: str, *, allow: bool, owner: bool = False, note: str = "") -> str:
    """Allow (as a peer or a module owner) or revoke ``key``; what changed, in words.

    Allowing a key also lifts its ban and its revocation. A running coordinator reads the changed
    file at its next request.
    """
    check_public_key(key)
    root = Path(root)
    data = read_access(root)
    entry = {"note": note, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if allow:
        data["owners" if owner else "allowed"][key] = entry
        data["revoked"].pop(key, None)
        what = f"allowed {fingerprint(key)} as {'a module owner' if owner else 'a peer'}"
    else:
        data["allowed"].pop(key, None)
        data["owners"].pop(key, None)
        data["revoked"][key] = entry
        what = f"revoked {fingerprint(key)}"
    write_json_atomic(root / ACCESS_FILE, data)
    return what


class AccessPolicy:
    def __init__(
        self,
        root: str | Path,
        settings: SecuritySection | None = None,
        *,
        self_keys: tuple[str, ...] = (),
        metrics: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self._access_file = str(self.root / ACCESS_FILE)
        self.settings = settings or SecuritySection()
        self.self_keys = set(self_keys)  # this coordinator (and its scheduler): always admitted
        self.metrics = metrics or (lambda event: None)
        self.clock = clock
        self.lock = threading.Lock()
        self.access: dict[str, dict[str, Any]] = {"allowed": {}, "owners": {}, "revoked": {}}
        self._mtime: float | None = None
        self.names: dict[str, str] = {}  # peer id -> key
        self._ids: dict[str, list[str]] = {}  # key -> its peer ids (names, the other way)
        self.banned: dict[str, dict[str, Any]] = {}
        self.offences: Counter[str] = Counter()
        self._buckets = KeyBuckets(
            self.settings.requests_per_second, self.settings.burst, RATE_KEYS, clock=clock
        )
        self._load_peers()
        self.reload()

    def use(self, settings: SecuritySection) -> None:
        """Take new settings (before the coordinator serves: the rate limit starts afresh)."""
        self.settings = settings
        self._buckets = KeyBuckets(
            settings.requests_per_second, settings.burst, RATE_KEYS, clock=self.clock
        )

    # ---- files --------------------------------------------------------------------------------
    def _load_peers(self) -> None:
        file = self.root / PEERS_FILE
        if not file.exists():
            return
        try:
            data = json.loads(file.read_text())
            self.names = {str(k): str(v) for k, v in data.get("names", {}).items()}
            self._ids = {}
            for name, key in self.names.items():
                self._ids.setdefault(key, []).append(name)
            self.banned = dict(data.get("banned", {}))
        except (ValueError, AttributeError) as exc:
            # Losing the bindings only means peer ids are bound afresh; say so, do not stop.
            log.error("%s is unreadable (%s); peer bindings start empty", file, exc)

    def _save_peers(self) -> None:
        write_json_atomic(self.root / PEERS_FILE, {"names": self.names, "banned": self.banned})

    def reload(self) -> None:
        """Re-read access.json if it changed; a broken file keeps the last good one in force."""
        file = self._access_file  # a string: stat'ed at every request (pathlib is slow)
        try:
            mtime = os.stat(file).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime:
            return
        try:
            access = read_access(self.root)
        except (ValueError, OSError) as exc:
            log.error("%s: cannot use it (%s); keeping the previous access list", file, exc)
            self._mtime = mtime
            return
        with self.lock:
            self.access, self._mtime = access, mtime
            # An allow newer than a ban lifts it (the operator forgave the key).
            for key, entry in {**access["allowed"], **access["owners"]}.items():
                ban = self.banned.get(key)
                if ban is not None and str(entry.get("at", "")) > str(ban.get("at", "")):
                    del self.banned[key]
                    log.warning("key %s allowed again: its ban is lifted", fingerprint(key))
                    self.offences.pop(key, None)
                    self._save_peers()
        log.info(
            "access list: %d peers, %d owners, %d revoked",
            len(access["allowed"]),
            len(access["owners"]),
            len(access["revoked"]),
        )

    # ---- checks -------------------------------------------------------------------------------
    def is_owner(self, key: str) -> bool:
        return key in self.self_keys or key in self.access["owners"]

    def admit(self, key: str) -> None:
        """Refuse ``key`` (RejectedError with its reason) unless it may send a request now."""
        if key in self.self_keys:
            return
        short = fingerprint(key)
        if key in self.access["revoked"]:
            raise RejectedError(f"key {short} was revoked by the operator", reason=Reason.REVOKED)
        if key in self.banned:
            raise RejectedError(
                f"key {short} is banned: {self.banned[key].get('reason', '')}", reason=Reason.BANNED
            )
        if (
            self.settings.join == "allow-list"
            and key not in self.access["allowed"]
            and key not in self.access["owners"]
        ):
            raise RejectedError(
                f"this run admits listed keys only; ask its operator to run: "
                f"dipaco-coordinator allow {key}",
                reason=Reason.UNKNOWN_PEER,
            )
        if self._buckets.take(key) is None:
            raise RejectedError(
                f"key {short} sends more than {self.settings.requests_per_second:g} requests/s "
                f"(burst {self.settings.burst}); slow down",
                reason=Reason.RATE_LIMITED,
            )

    def bind(self, name: str, key: str) -> None:
        """Peer id ``name`` belongs to ``key`` from its first use on; another key may not use it."""
        with self.lock:
            owner = self.names.get(name)
            if owner == key:
                return
            if owner is not None:
                raise RejectedError(
                    f"peer id {name!r} belongs to key {fingerprint(owner)}, not "
                    f"{fingerprint(key)}; pick another --peer-id",
                    reason=Reason.IDENTITY_MISMATCH,
                )
            used = len(self._ids.get(key, ()))
            if key not in self.self_keys and used >= self.settings.max_names_per_key:
                raise RejectedError(
                    f"key {fingerprint(key)} already uses {used} peer ids "
                    f"(at most {self.settings.max_names_per_key})",
                    reason=Reason.QUOTA,
                )
            self.names[name] = key
            self._ids.setdefault(key, []).append(name)
            self._save_peers()

    def ids_of(self, key: str) -> list[str]:
        """The peer ids bound to ``key`` (at most ``security.max_names_per_key``)."""
        with self.lock:
            return list(self._ids.get(key, ()))

    def offence(self, key: str | None, reason: str) -> None:
        """Count a hostile rejection against ``key``; ban it at ``security.ban_after``."""
        if key is None or reason not in HOSTILE or key in self.self_keys:
            return
        with self.lock:
            self.offences[key] += 1
            limit = self.settings.ban_after
            if not limit or self.offences[key] < limit or key in self.banned:
                return
            self.banned[key] = {
                "reason": f"{self.offences[key]} hostile requests (last: {reason})",
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            self._save_peers()
        log.warning("banned key %s after %d hostile requests", fingerprint(key), limit)
        self.metrics({"event": "banned", "key": key, "offences": self.offences[key]})

    def summary(self) -> dict[str, Any]:
        return {
            "join": self.settings.join,
            "allowed": len(self.access["allowed"]),
            "owners": len(self.access["owners"]),
            "revoked": len(self.access["revoked"]),
            "banned": {fingerprint(k): v for k, v in self.banned.items()},
            "offences": {fingerprint(k): n for k, n in self.offences.items()},
        }
