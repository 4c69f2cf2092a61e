"""An exception that ends a thread fails the test that started the thread (pytest alone only
warns, and ``filterwarnings`` cannot make that warning an error): a peer thread that crashes
while another peer finishes the run must not leave its test green.

The ``thread_exceptions`` fixture is autouse (tests/conftest.py imports it). A test that expects
a thread to fail takes the fixture and removes what it expected from it: ``(thread name,
exception)`` pairs, in the order they were raised.
"""

import threading
import traceback

import pytest


@pytest.fixture(autouse=True)
def thread_exceptions():
    """The exceptions that ended threads started during this test; any left at its teardown
    fail it. Threads that were running before the test are not its own: their exceptions go
    to the hook that was there (pytest's warning)."""
    seen: list[tuple[str, BaseException]] = []
    before = set(threading.enumerate())
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread in before or args.exc_value is None:
            previous(args)
            return
        seen.append((args.thread.name if args.thread else "<unknown>", args.exc_value))

    threading.excepthook = hook
    try:
        yield seen
    finally:
        threading.excepthook = previous
    if seen:
        said = "; ".join(f"thread {name}: {type(exc).__name__}: {exc}" for name, exc in seen)
        stacks = "\n".join("".join(traceback.format_exception(exc)) for _, exc in seen)
        pytest.fail(f"an exception ended {said}\n\n{stacks}", pytrace=False)
