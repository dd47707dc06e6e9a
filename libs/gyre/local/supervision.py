"""How `gyre rl` watches its children: which exit ends the run, how it is told, and when an inference process is
started again (`Restarts`, as the kubelet restarts a pod)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

from gyre.events import ORCHESTRATOR_STEPS, read_events
from gyre.inference_process import InferenceProcess
from gyre.local.progress import console
from gyre.local.runs import Run
from gyre.proc import Child
from gyre.runstate import committed_step

RESTART_BACKOFF_S = 2.0  # before the first restart of a crashed inference process; doubled for each next one
RESTART_RESET_S = 300.0  # an inference process up this long has its restarts counted from 0 again


class RunFailed(RuntimeError):
    """The run stops (exit 1): a child failed, or could not be started or kept running; the message says which."""


def exit_status(code: int) -> str:
    """An exit status as a person reads it: `status 1`, or the signal that killed it (`SIGKILL`)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"status {code}"


def unfinished(child: Child, trainer: Child, runs: list[Run], run_of: dict[str, Run]) -> str | None:
    """What `child`, a trainer or orchestrator that exited 0, left undone of its part of the run; None if nothing.

    Finished, the trainer has committed every run's `max_steps` and an orchestrator has pushed its run's last batch
    (it exits once the final weights are relayed, or after `final_weights_timeout_s`: the trainer may still be on it).
    """
    if child is trainer:
        short = [f"{run.name}: step {step} of {run.max_steps}" for run in runs
                 if (step := committed_step(run.output_dir)) < run.max_steps]  # fmt: skip
        return "; ".join(short) or None
    if (run := run_of.get(child.name)) is not None:  # an orchestrator (by its name): its run's
        # the newest record, not the highest step: after a rewind, older records of later steps remain
        pushed = next((r["step"] for r in reversed(read_events(run.output_dir / "events" / ORCHESTRATOR_STEPS))
                       if isinstance(r.get("step"), int)), 0)  # fmt: skip
        return None if pushed >= run.max_steps else f"{run.name}: batch {pushed} of {run.max_steps} pushed"
    return None


def how_it_stopped(code: int) -> str:
    """How a service that stopped the run ended, and what to do next (the run resumes where it stands)."""
    if code >= 0:
        return f"exited with status {code}; once its cause is fixed, the same command resumes the run"
    oom = " (out of memory? the kernel's OOM killer sends it: dmesg)" if code == -signal.SIGKILL else ""
    return f"was {exit_status(code)}{oom}; the same command resumes the run"


class Restarts:
    """When a crashed inference process starts again: up to `limit` restarts in a row, each after a backoff that
    doubles (RESTART_BACKOFF_S, 2x, 4x...); one that ran RESTART_RESET_S since its last start has its count reset,
    as the kubelet does for a pod. Only inference processes are restarted: they hold nothing but the weights the
    orchestrator's relay brings a restarted replica back up to (its status probe sees it on the base version). The
    trainer and the orchestrator are not: after a crash the trainer resumes from the published weights with fresh
    optimizer state (a silent change a person decides on, by running the same command again), and both exit by
    themselves only on what a restart repeats (a setup refused, a bug, out of memory) - docs/local.md."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count: dict[str, int] = {}
        self.started: dict[str, float] = {}  # when the process now running under a name was started
        self.at: dict[str, float] = {}  # when a crashed one starts again

    def due(self, child: InferenceProcess, code: int) -> Path | None:
        """The config to start `child` (exited with `code`) again from now; None while its backoff runs. Logs the
        crash in one line when it first sees it; RunFailed once it has been restarted `limit` times in a row."""
        name, now = child.name, time.monotonic()
        if name not in self.at:
            if now - self.started.get(name, now) >= RESTART_RESET_S:
                self.count[name] = 0
            n = self.count.get(name, 0) + 1
            if n > self.limit:
                after = f" after {self.limit} restarts" if self.limit else ""
                raise RunFailed(
                    f"{name} {'exited with' if code >= 0 else 'was'} {exit_status(code)}{after} (inference_restarts = "
                    f"{self.limit}); the run stops (the same command resumes it); last lines of {child.log_path}:\n"
                    f"{child.tail()}"
                )
            self.count[name], delay = n, RESTART_BACKOFF_S * 2 ** (n - 1)
            self.at[name] = now + delay
            how = f"{'exited with' if code >= 0 else 'was'} {exit_status(code)}"
            console(f"{name} {how}; restarting it in {delay:.0f}s (restart {n} of {self.limit}, inference_restarts; "
                    f"its log: {child.log_path})")  # fmt: skip
        if now < self.at[name]:
            return None
        del self.at[name]
        self.started[name] = now
        return child.config
