"""The workers of `gyre_trainer.torchrun` die with it, also when it is SIGKILLed.

torchrun starts each worker in a session of its own, so a SIGKILL of torchrun's process group (`gyre rl`'s second
Ctrl-C, or the end of its stop timeout) left every rank running without it: orphaned trainers that kept their GPU
memory and retried a Redis the launcher had stopped, for ever, beside the next launch of the same run. Here the
worker is the real `gyre trainer` entry point with its training replaced by a wait.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading

from gyre.proc import Child

WORKER = """
import os, signal, sys
import gyre_trainer.service

def run(cfg, **_):  # the trainer's work: wait for ever
    print(f"worker pid {os.getpid()}", flush=True)
    while True:
        signal.pause()

gyre_trainer.service.run = run
from gyre_trainer.main import main

sys.exit(main(["--model.name", sys.argv[1], "--output-dir", sys.argv[2]]))
"""


def test_a_sigkilled_torchrun_takes_its_workers_with_it(tmp_path, tiny_model):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started, pids = threading.Event(), []

    def watch(line: str) -> None:
        if line.startswith("worker pid "):
            pids.append(int(line.split()[-1]))
            started.set()

    argv = [sys.executable, "-m", "gyre_trainer.torchrun", "--standalone", "--nproc-per-node", "1", str(script),
            str(tiny_model), str(tmp_path / "out")]  # fmt: skip
    torchrun = Child("trainer", argv, tmp_path / "torchrun.log", on_line=watch)
    torchrun.start(quiet=True)
    try:
        assert started.wait(180), torchrun.tail()
        worker = os.pidfd_open(pids[0])  # readable once the worker has exited, child of ours or not
        assert select.select([worker], [], [], 0)[0] == []  # alive while torchrun is
        torchrun.kill()  # what `gyre rl` does to a service's process group on a second Ctrl-C
        gone, _, _ = select.select([worker], [], [], 30)
        assert gone, "the worker outlived its torchrun"
    finally:
        torchrun.kill()
        for pid in pids:  # an orphan of the old code: not left behind by the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
