"""Flower programs as processes: their environment, their process groups, their logs.

Every program is started in its own process group with an environment from :func:`flower_env`,
which keeps Flower offline (no telemetry, no update check, no ``uv sync``) and away from
``~/.flwr``. Stopping one signals its group and the groups of all its descendants: Flower starts
SuperExec in a session of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TextIO

from dipaco.errors import ConfigError, TransportError
from dipaco.procs import descendants, free_port  # noqa: F401 - deploy's public face

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def flower_env(home: Path) -> dict[str, str]:
    """The environment for every Flower program: offline, quiet, and confined to ``home``.

    Children inherit it: SuperExec and the ``flwr-serverapp``/``flwr-clientapp`` processes get
    the environment of the SuperLink/SuperNode that launched them, so extra variables (for
    example ``DIPACO_*``) set here reach the apps.
    """
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(Path(home).resolve()),
            "FLWR_TELEMETRY_ENABLED": "0",  # default posts events to telemetry.flower.ai
            "FLWR_DISABLE_UPDATE_CHECK": "1",  # default queries the Flower API for new versions
            # Same as --disable-runtime-dependency-installation: no `uv sync` of app deps.
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",  # logs reach our log files as they happen
        }
    )
    # SuperLink/SuperNode launch `flower-superexec`, `flwr-serverapp` and `flwr-clientapp` by
    # bare name, so the scripts' folder must be on PATH even when the venv is not activated.
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "flower-superexec").exists():
        path = env.get("PATH", "")
        if path.split(os.pathsep)[0] != str(bin_dir):
            env["PATH"] = str(bin_dir) + (os.pathsep + path if path else "")
    for key in ("FLWR_TRACING_ENABLED", "FLWR_ENABLE_EVENT_LOG"):
        env.pop(key, None)
    return env


def strip_ansi(text: str) -> str:
    """Flower colours its log lines unconditionally; tests and messages want plain text."""
    return _ANSI.sub("", text)


def flower_bin(name: str) -> str:
    """Flower's console scripts, taken from this interpreter's environment first."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    from shutil import which

    found = which(name)
    if found is None:
        raise ConfigError(f"{name} not found next to {sys.executable} or on PATH; install flwr")
    return found


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = strip_ansi(path.read_text(errors="replace"))
    return "\n".join(text.splitlines()[-lines:])


def _pgids(pids: Sequence[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            out.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    return out


def _signal_groups(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _groups_alive(pgids: set[int]) -> bool:
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process's group and the groups of all its descendants (Flower's SuperExec
    detaches into a session of its own)."""
    _signal_groups(_pgids([pid, *descendants(pid)]) | {pid}, sig)


def tree_groups(pid: int) -> set[int]:
    """The process groups of ``pid`` and of all its descendants."""
    return _pgids([pid, *descendants(pid)]) | {pid}


def stop_groups(pgids: set[int], grace: float, poll: Callable[[], object] = lambda: None) -> None:
    """Wait up to ``grace`` seconds for the groups to end (they were told to), then SIGKILL
    what is left of them; ``poll`` (a child's ``Popen.poll``) reaps the child meanwhile."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _groups_alive(pgids):
        time.sleep(0.05)
        poll()  # a reaped child's group is gone
    if _groups_alive(pgids):
        _signal_groups(pgids, signal.SIGKILL)


class FlowerProcess:
    """A Flower program in its own process group, logging to a file."""

    name = "flower"

    def __init__(self, home: Path, log_file: Path | None, env: Mapping[str, str] | None) -> None:
        self.home = Path(home)
        self.log_file = Path(log_file) if log_file is not None else None
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: TextIO | None = None
        self._pgids: set[int] = set()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        if self.proc is not None:
            raise TransportError(f"{self.name} already started")
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = self._command()
        env = flower_env(self.home)
        env.update(self.extra_env)
        log_path = self.log_file or self.home / f"{self.name}.log"
        self.log_file = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115  (closed in stop/wait)
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as err:
            self._log.close()
            raise TransportError(f"cannot start {cmd[0]}: {err}") from err
        self._pgids = {self.proc.pid}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_file, lines)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _collect_groups(self) -> set[int]:
        """Our group plus the groups of every descendant (SuperExec detaches into its own)."""
        if self.proc is not None and self.proc.poll() is None:
            self._pgids |= _pgids(descendants(self.proc.pid))
        return set(self._pgids)

    def groups(self) -> set[int]:
        """The process groups this program and its descendants run in, as of now."""
        return self._collect_groups() if self.proc is not None else set()

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every group of this program and its descendants."""
        if self.proc is not None:
            _signal_groups(self._collect_groups(), sig)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to every group we started, SIGKILL whatever survives ``grace`` seconds."""
        if self.proc is None:
            return None
        groups = self._collect_groups()
        _signal_groups(groups, signal.SIGTERM)
        stop_groups(groups, grace, self.proc.poll)
        return self._reap()

    def kill(self) -> int | None:
        """SIGKILL to the whole process group(s) at once: a crash, as tests want it."""
        if self.proc is None:
            return None
        _signal_groups(self._collect_groups(), signal.SIGKILL)
        return self._reap()

    def _reap(self) -> int | None:
        assert self.proc is not None
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
