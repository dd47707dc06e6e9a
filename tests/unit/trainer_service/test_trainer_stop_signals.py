"""gyre_trainer.stopping, which `gyre trainer` and `gyre sft` share: the first SIGTERM/SIGINT asks for a graceful stop,
a second Ctrl-C of a single process raises KeyboardInterrupt; SIGTERM, and SIGINT under torchrun, never do. A real
trainer stopped so, and its exact restart: tests/integration/trainer/test_trainer_exactly_once.py."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from gyre_trainer.stopping import StopSignals

log = logging.getLogger("gyre_trainer.test")


@pytest.fixture
def signals(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    made = []

    def make(on_stop=None, **kwargs) -> StopSignals:
        made.append(StopSignals(threading.Event(), log, on_stop, **kwargs).install())
        return made[-1]

    yield make
    for s in made:
        s.restore()


def test_a_second_ctrl_c_of_a_single_process_stops_at_once(signals, caplog):
    stopped = []
    s = signals(lambda: stopped.append(True))
    with caplog.at_level(logging.WARNING, logger="gyre_trainer.test"):
        os.kill(os.getpid(), signal.SIGINT)
    assert s.stop.is_set() and stopped == [True] and not s.forced.is_set()
    assert "SIGINT: stopping after the current step (Ctrl-C again stops at once)" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert s.forced.is_set() and stopped == [True]


def test_with_no_step_running_the_stop_does_not_promise_to_finish_one(signals, caplog):
    """A trainer waiting for its next batch (most of an async run) or loading its model has no current step: the line
    said "stopping after the current step" there too."""
    running = threading.Event()
    signals(step_running=running.is_set)
    with caplog.at_level(logging.WARNING, logger="gyre_trainer.test"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert "SIGTERM: stopping before the next step (none is running)" in caplog.text
    assert "after the current step" not in caplog.text


def test_sigterm_stays_graceful_however_often(signals):
    s = signals()
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGTERM)  # Kubernetes, `gyre rl`: never at once
    assert s.stop.is_set() and not s.forced.is_set()
    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C after it is still the user's "now"
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}])
def test_under_torchrun_a_second_ctrl_c_is_graceful_too(signals, monkeypatch, caplog, env):
    """torchrun forwards the terminal's Ctrl-C to workers that got it already: under `--nproc-per-node 1` one Ctrl-C
    reached the worker twice (WORLD_SIZE 1) and stopped it at once."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = signals()
    with caplog.at_level(logging.WARNING, logger="gyre_trainer.test"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert s.stop.is_set() and not s.forced.is_set()
    assert "SIGINT: stopping after the current step" in caplog.text and "again" not in caplog.text


def test_restore_puts_the_previous_handlers_back(signals):
    before = signal.getsignal(signal.SIGINT)
    signals().restore()
    assert signal.getsignal(signal.SIGINT) is before
