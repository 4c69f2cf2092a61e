"""A thread that a test starts and that ends on an exception fails that test (tests/_threads.py),
where pytest alone would only warn and the test would stay green."""

from pathlib import Path

pytest_plugins = ["pytester"]

HOOK = Path(__file__).parents[1] / "_threads.py"


def test_a_thread_that_raises_fails_its_test_naming_the_thread_and_the_error(pytester):
    pytester.makeconftest(HOOK.read_text())
    pytester.makepyfile(
        """
        import threading

        def test_crash_in_a_thread():
            t = threading.Thread(target=lambda: 1 / 0, name="peer-7")
            t.start()
            t.join()

        def test_a_thread_that_ends_well():
            t = threading.Thread(target=lambda: None, name="peer-8")
            t.start()
            t.join()

        def test_an_expected_crash(thread_exceptions):
            t = threading.Thread(target=lambda: 1 / 0, name="peer-9")
            t.start()
            t.join()
            (name, exc), = thread_exceptions
            assert name == "peer-9" and isinstance(exc, ZeroDivisionError)
            thread_exceptions.clear()
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:xdist")
    # the body of the first test passed; its teardown is what fails it
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_crash_in_a_thread*",
         "*an exception ended thread peer-7: ZeroDivisionError: division by zero*"]
    )  # fmt: skip
    assert "peer-8" not in result.stdout.str() and "peer-9" not in result.stdout.str()
