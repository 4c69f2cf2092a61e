"""Crash clean-up for a hivemind node's forked DHT process and its ``p2pd`` daemon.

If a node's Python process dies (even by SIGKILL), its forked DHT process notices that its parent
changed, kills its own children (``p2pd``), removes the daemon's socket files and exits; ``p2pd``
is also started with ``PR_SET_PDEATHSIG`` so it dies with the DHT process. A daemon that failed to
start leaves a socket file nothing listens on; :func:`remove_stale_sockets` removes those.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hivemind.dht import DHT

from dipaco.procs import child_pids

PR_SET_PDEATHSIG = 1

# In the DHT process: unix socket files of the parent's P2P replica, removed if the parent dies.
_parent_files: list[str] = []


async def remember_parent_files(_dht: DHT, _node: Any, paths: list[str]) -> None:
    """Run in the DHT process (``dht.run_coroutine``): remember ``paths`` for the clean-up."""
    _parent_files.extend(paths)


def _watch_parent(parent_pid: int, interval: float, files: Callable[[], list[str]]) -> None:
    """Exit this process, killing its children and removing the daemon's socket files, as soon
    as ``parent_pid`` is no longer our parent."""
    while True:
        time.sleep(interval)
        if os.getppid() != parent_pid:
            for pid in child_pids(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for path in files():
                try:
                    os.remove(path)
                except OSError:
                    pass
            os._exit(0)


def _install_pdeathsig_for_subprocesses() -> None:
    """Make every subprocess that asyncio starts in this process die when this process dies.

    hivemind starts ``p2pd`` with ``asyncio.subprocess.create_subprocess_exec``; this wraps it (in
    the forked DHT process only) to add a ``preexec_fn`` calling ``prctl(PR_SET_PDEATHSIG,
    SIGKILL)``. The DHT process's loop runs on its main thread, which lives as long as the process,
    so the signal is not fired early by a thread exit.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    me = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != me:  # the parent died before prctl took effect
            os._exit(1)

    original = asyncio.subprocess.create_subprocess_exec

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", preexec)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def remove_stale_sockets(since: float) -> list[str]:
    """Remove hivemind daemon socket files made since ``since`` that nothing listens on: a
    daemon that failed to start (a dead bootstrap address, a bad multiaddr) leaves its file."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("hivemind-p2pd-*.sock"):
        try:
            if path.stat().st_mtime < since - 1.0:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(str(path))
        except ConnectionRefusedError:
            try:
                path.unlink()
                removed.append(str(path))
            except OSError:
                pass
        except OSError:  # gone already, or someone listens: not ours to remove
            continue
    return removed


class WatchedDHT(DHT):
    """A hivemind DHT whose process (and its p2pd) dies when the process that started it dies."""

    watch_interval = 0.5

    def run(self) -> None:
        _install_pdeathsig_for_subprocesses()
        threading.Thread(
            target=_watch_parent,
            args=(self._parent_pid, self.watch_interval, self._socket_files),
            name="dipaco-parent-watch",
            daemon=True,
        ).start()
        super().run()

    def _socket_files(self) -> list[str]:
        paths = list(_parent_files)
        p2p = getattr(getattr(self, "_node", None), "p2p", None)
        for maddr in (
            getattr(p2p, "_daemon_listen_maddr", None),
            getattr(p2p, "_client_listen_maddr", None),
        ):
            if maddr is None:
                continue
            try:
                paths.append(maddr["unix"])
            except Exception:  # no such attribute, or not a unix socket
                pass
        return paths
