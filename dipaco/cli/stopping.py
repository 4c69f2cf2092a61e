"""How every command stops on Ctrl-C (SIGINT) or SIGTERM: within seconds, leaving no child behind.

:func:`install` (called by ``dispatch`` for every command) makes SIGTERM mean what Ctrl-C means.
The first signal runs the command's stop action in the main thread: by default a
``KeyboardInterrupt``, which the commands' ``finally`` blocks turn into an orderly stop; a command
that stops by itself (the peer) sets its own with :func:`on_stop`. Later signals are ignored: a
second Ctrl-C would cut that orderly stop short half-way.

CPython runs a signal handler in the main thread only, and only once the main thread's current
call returns; the kernel may hand a process's signal to any of its threads, and then the main
thread's blocking call is not interrupted. A lingering coordinator sleeping its ``--linger``
seconds slept on through Ctrl-C that way (the dashboard test's flake, under load). So a watcher
thread hears every signal at once through ``signal.set_wakeup_fd``, whichever thread caught it:

- if the main thread has not run the stop action within 0.2 s, the watcher sends the signal to
  the main thread itself (``pthread_kill``), which interrupts its blocking call;
- it arms a deadline: a process still alive ``grace`` seconds after the signal kills every
  process it started (:func:`dipaco.procs.kill_descendants`) and exits with 128 + the signal's
  number. What coordinators and peers keep is crash-safe (docs/reliability.md): cutting a slow
  stop short loses nothing acknowledged.

Exit codes, the same for every command: 0 when its work is done; 2 for an error it explains in
one line; 130 (``STOPPED``) when Ctrl-C or SIGTERM stopped it in order before its work was done
(a peer or node that left a run still going, a coordinator whose run had not finished: run the
same command to resume); 128 + the signal's number when the deadline above cut a slow stop short;
141 when its reader went away (a pipe into ``head``: see ``common.dispatch``). A coordinator
whose run finished (``mark_done``) exits 0 when a signal cuts its linger short.

:func:`finish` ends a stopped command's process at once (``os._exit``), after killing any child
left: interpreter shutdown joins non-daemon threads and thread pools, and a library's thread
blocked on a socket would hold the exit for as long as it stays blocked.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from dipaco.procs import STOPPED, kill_descendants

GRACE_SECONDS = 4.0  # after the first signal, the process ends by this deadline
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopper:
    """The signal handlers, the watcher thread and the deadline of one command's process."""

    def __init__(self, grace: float = GRACE_SECONDS) -> None:
        self.grace = grace
        self.action: Callable[[], None] | None = None  # None: raise KeyboardInterrupt
        self.heard = threading.Event()  # a stop signal arrived (set at once, by the watcher)
        self.handled = threading.Event()  # the main thread ran the stop action
        self.signum = 0
        self.done = False  # mark_done(): a stop signal now ends a finished command with 0
        self._main = threading.main_thread().ident
        self._deadline: threading.Timer | None = None
        self._arm_lock = threading.Lock()
        self._closing = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        self._watcher = threading.Thread(target=self._watch, name="dipaco-stop", daemon=True)
        self._watcher.start()

    def _handler(self, signum: int, _frame: object) -> None:
        if self.handled.is_set():
            return  # a second Ctrl-C: the stop is under way, and the deadline holds
        self.handled.set()
        self._arm(signum)
        if self.action is None:
            raise KeyboardInterrupt
        self.action()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if self._closing or not data:
                break
            for signum in data:
                if signum in SIGNALS and not self.heard.is_set():
                    self._arm(signum)
                    if not self.handled.wait(0.2):  # caught by another thread: wake the main one
                        try:
                            signal.pthread_kill(self._main, signum)
                        except (OSError, ValueError):
                            pass
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass

    def _arm(self, signum: int) -> None:
        with self._arm_lock:
            if self.heard.is_set():
                return
            self.signum = signum
            self.heard.set()
            self._deadline = threading.Timer(self.grace, self._expire)
            self._deadline.daemon = True
            self._deadline.start()

    def _expire(self) -> None:
        """The stop took longer than ``grace``: kill what this process started, and exit."""
        kids = kill_descendants(os.getpid())
        note = (
            f"\nstill stopping {self.grace:.0f} s after the signal: exiting now"
            + (f" (killed {len(kids)} child process(es))" if kids else "")
            + "; run the same command to resume\n"
        )
        writer = threading.Thread(target=_write_stderr, args=(note,), daemon=True)
        writer.start()
        writer.join(0.2)  # never wait on a stderr pipe nobody reads
        os._exit(128 + self.signum)

    def close(self) -> None:
        """Put back the handlers and wakeup descriptor found, and stop the watcher and deadline."""
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_fd)
        self._closing = True
        try:
            os.write(self._write, b"\0")  # the watcher wakes, sees _closing and closes the pipe
        except OSError:
            pass


def _write_stderr(text: str) -> None:
    try:
        os.write(2, text.encode())
    except OSError:
        pass


_current: Stopper | None = None


def install(grace: float = GRACE_SECONDS) -> Stopper | None:
    """Handle SIGINT and SIGTERM as this module says; None (nothing installed) outside the main
    thread, where Python cannot set signal handlers."""
    global _current
    if threading.current_thread() is not threading.main_thread():
        return None
    _current = Stopper(grace)
    return _current


def uninstall() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def on_stop(action: Callable[[], None] | None) -> None:
    """Run ``action`` in the main thread at the first SIGINT or SIGTERM, instead of raising
    ``KeyboardInterrupt`` (None puts that back). The deadline holds either way."""
    if _current is not None:
        _current.action = action


def requested() -> bool:
    """Whether a stop signal arrived: cleanup then keeps its waits short."""
    return _current is not None and _current.heard.is_set()


def mark_done() -> None:
    """The command's work is done (a coordinator whose run finished, lingering): a stop signal
    from now on ends it with 0, not ``STOPPED``."""
    if _current is not None:
        _current.done = True


def exit_code(code: int) -> int:
    """The rule every command follows (docs/operations.md, "Exit codes"): a command that a stop
    signal ended before its work was done exits ``STOPPED`` (130) once it stopped in order,
    whatever its body returned; an error keeps its own code (2); a finished command, 0."""
    if code == 0 and requested() and not _current.done:  # type: ignore[union-attr]
        return STOPPED
    return code


def finish(code: int) -> None:
    """End a command's process with ``exit_code(code)``. After a stop signal: kill any child
    left and exit at once, without interpreter shutdown (see the module's docstring); else
    ``sys.exit``."""
    code = exit_code(code)
    if requested() and threading.current_thread() is threading.main_thread():
        kill_descendants(os.getpid())
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    uninstall()
    sys.exit(code)
