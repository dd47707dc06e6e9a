"""SIGTERM/SIGINT of `gyre trainer` and `gyre sft`: the first asks for a graceful stop, a second Ctrl-C stops at once.

The first signal sets the process's stop event: the loop finishes its step and checkpoints it (`ckpt.on_stop`).
On a big model that takes long, so a second Ctrl-C of a single process raises KeyboardInterrupt where the process
is (the command exits 130, as PRIME-RL's under torchrun): what it had not committed (a step's Redis entry not
acked, a checkpoint not renamed into place) is trained or saved again by the restart. SIGTERM stays graceful
however often it comes (Kubernetes, `gyre rl`), and so does SIGINT under torchrun: it forwards the terminal's
Ctrl-C to workers that got it already, and bounds their stop with its own --shutdown-timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable


def single_process() -> bool:
    """Not a torchrun worker. WORLD_SIZE alone is 1 under `torchrun --nproc-per-node 1` too, whose worker gets
    one Ctrl-C twice (the terminal's and torchrun's), which must not stop it at once."""
    return os.environ.get("WORLD_SIZE", "1") == "1" and "TORCHELASTIC_RUN_ID" not in os.environ


class StopSignals:
    """Installs the handlers (`install`) and puts the previous ones back (`restore`: in-process runs, tests).

    `stop`: set by the first signal; `on_stop`: called then too; `forced`: set by the second Ctrl-C, for the
    callers to tell a KeyboardInterrupt that torch re-raised as its own error (a checkpoint save) from a failure.
    `step_running` says whether a step is under way, so the first signal's line says what the stop waits for: a
    trainer waiting for its next batch, or loading its model, has no "current step" to finish.
    """

    def __init__(self, stop: threading.Event, log: logging.Logger, on_stop: Callable[[], None] | None = None,
                 step_running: Callable[[], bool] = lambda: True):  # fmt: skip
        self.stop, self.log, self.on_stop, self.step_running = stop, log, on_stop, step_running
        self.forced = threading.Event()
        self.single = single_process()
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        if self.stop.is_set():
            if self.single and signum == signal.SIGINT:
                self.forced.set()
                raise KeyboardInterrupt
            return
        self.stop.set()
        if self.on_stop is not None:
            self.on_stop()
        again = " (Ctrl-C again stops at once)" if self.single else ""
        when = "after the current step" if self.step_running() else "before the next step (none is running)"
        self.log.warning("%s: stopping %s%s", signal.Signals(signum).name, when, again)

    def install(self) -> StopSignals:
        self.stop.clear()
        self.forced.clear()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
