"""The trainer tests' process helpers end everything a test started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainer_testlib import kill_group

# a parent that starts a child in a session of its own, as torchrun starts its workers, then waits
SPAWNER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended (its parent died unreaped)
    except FileNotFoundError:
        return False


def test_kill_group_also_ends_children_in_sessions_of_their_own():
    """torchrun's workers run in their own sessions: a torchrun killed at a test's timeout left them training."""
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    child = int(proc.stdout.readline())
    try:
        assert alive(child)
        kill_group(proc)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the worker in its own session outlived kill_group"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        proc.stdout.close()
