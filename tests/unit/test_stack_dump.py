"""``kill -USR1 PID`` prints every thread's stack and the program goes on, however busy its
threads are (faulthandler's C handler, used before, crashed a coordinator doing this)."""

import signal
import subprocess
import sys
import time

# A program as busy as a coordinator under load: threads that make and drop frames and import
# all the time, the stack dump installed as every command installs it.
BUSY = """
import importlib, json, sys, threading, time
from dipaco.cli.common import dump_stacks_on_usr1
dump_stacks_on_usr1()
def churn():
    def deep(n):
        return 0 if n == 0 else deep(n - 1) + 1
    while True:
        deep(50)
        importlib.invalidate_caches()
        json.loads('{"a": [1, 2, 3]}')
for _ in range(6):
    threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


def test_many_stack_dumps_of_a_busy_program_leave_it_running(tmp_path):
    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", BUSY], stdout=subprocess.PIPE, stderr=sink, text=True
        )
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(300):  # faulthandler.register died within a few dozen of these
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.01)
        time.sleep(0.5)
        assert proc.poll() is None, f"the program died ({proc.returncode}) on a stack dump"
        dumps = err.read_text()
        assert dumps.count("Current thread") >= 20  # one per dump (signals in a burst merge)
        assert "in churn" in dumps and "in deep" in dumps  # and the other threads'
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
