"""Shared by the process tests: wait for something a child process does, with a clear failure."""

import time


def wait_for(predicate, timeout, what):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
