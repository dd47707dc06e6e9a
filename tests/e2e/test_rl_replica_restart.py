"""`gyre rl` with one inference replica SIGKILLed mid-run: the launcher restarts it (as Kubernetes restarts the pod),
logging the crash in one line, and the run finishes every step, each trained once (it used to stop the whole run).
With `inference_restarts = 0` (or once the restarts are spent) the run stops with one line naming the key. A killed
trainer is not restarted: the run stops saying what killed it, and the same command resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gyre.events import read_events
from gyre.inference_process import parse_ready

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def launch(out: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gyre.cli", "rl", "@", str(ROOT / "configs/ci.toml"), "--output-dir", str(out)]
    return subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def trained(out: Path) -> list[int]:
    return [r["step"] for r in read_events(out / "events" / "trainer_steps.jsonl")]


def replica_pid(launcher: int, service: bytes = b"inference") -> int | None:
    """The pid of the launcher's `gyre inference` (or other `service`) child."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == launcher and service in argv and b"gyre.cli" in argv:
            return int(entry.name)
    return None


def kill_replica_mid_run(run: subprocess.Popen, out: Path, after_step: int, service: bytes = b"inference",
                         sig: int = signal.SIGKILL) -> int:  # fmt: skip
    """SIGKILL (or `sig`) the replica (or `service`) once `after_step` is trained (the run well under way); its pid."""
    deadline = time.monotonic() + 300
    while not trained(out) or max(trained(out)) < after_step:
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no training step within 300s"
        time.sleep(0.2)
    pid = replica_pid(run.pid, service)
    assert pid is not None
    os.kill(pid, sig)
    return pid


def test_a_killed_replica_is_restarted_and_the_run_finishes_every_step_once(tmp_path):
    out = tmp_path / "run"
    run = launch(out, "--max-steps", "8")
    try:
        killed = kill_replica_mid_run(run, out, after_step=2)
        console, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, err[-3000:]
    said = [line for line in console.splitlines() if "restarting it" in line]
    assert len(said) == 1, console[-3000:]
    assert said[0].startswith("inference was killed by SIGKILL; restarting it in 2s (restart 1 of 3"), said
    steps = trained(out)
    assert sorted(steps) == list(range(1, 9)), steps  # every step, none trained twice
    assert len({r["segment"] for r in read_events(out / "events" / "trainer_steps.jsonl")}) == 1  # one launch
    log = (out / "logs" / "inference.log").read_text()
    lives = [line for line in log.splitlines() if parse_ready(line)]
    assert len(lives) == 2, log[-2000:]  # the replica's log holds both lives
    assert replica_pid(run.pid) is None and killed  # nothing left behind


def test_without_restarts_a_killed_replica_stops_the_run_naming_the_key(tmp_path):
    out = tmp_path / "run"
    run = launch(out, "--max-steps", "8", "--inference-restarts", "0")
    try:
        kill_replica_mid_run(run, out, after_step=1)
        _, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    assert "gyre rl: run failed: inference was killed by SIGKILL (inference_restarts = 0); the run stops" in err, err


def test_a_killed_trainer_stops_the_run_saying_what_killed_it_and_the_same_command_resumes_it(tmp_path):
    # not restarted (a crashed trainer resumes with fresh optimizer state: the user's call); the message said
    # "trainer exited with status -9", neither the signal (the OOM killer's) nor that a re-run resumes
    out = tmp_path / "run"
    run = launch(out, "--max-steps", "6")
    try:
        kill_replica_mid_run(run, out, after_step=1, service=b"trainer")
        _, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    assert "gyre rl: run failed: trainer was killed by SIGKILL (out of memory? the kernel's OOM killer sends it: " \
           "dmesg); the same command resumes the run; last lines of " in err, err[-3000:]  # fmt: skip
    again = launch(out, "--max-steps", "6")
    _, err = again.communicate(timeout=400)
    assert again.returncode == 0, err[-3000:]
    assert sorted(trained(out)) == list(range(1, 7)), trained(out)  # every step once, over two launches


@pytest.mark.parametrize("service", ["orchestrator", "trainer"])
def test_a_service_stopped_alone_by_sigterm_stops_the_run_and_the_same_command_resumes_it(tmp_path, service):
    # SIGTERM is a clean stop (exit 0, as in a pod); the launcher took that exit for "finished" and waited for the
    # others forever: the trainer for batches no one would push, the orchestrator for weights no one would train
    out = tmp_path / "run"
    run = launch(out, "--max-steps", "6")
    try:
        kill_replica_mid_run(run, out, after_step=1, service=service.encode(), sig=signal.SIGTERM)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    said = f"gyre rl: run failed: {service} exited with status 0 before the run finished ("
    assert said in err and "was it sent SIGTERM or SIGINT? the same command resumes the run" in err, err[-3000:]
    short = err[err.index(said) + len(said) :].split(")")[0]
    assert short.startswith("ci: " + ("batch" if service == "orchestrator" else "step")), short
    if service == "trainer":
        return  # the resume after a stop is the same for both; once is enough
    again = launch(out, "--max-steps", "6")
    _, err = again.communicate(timeout=400)
    assert again.returncode == 0, err[-3000:]
    assert sorted(trained(out)) == list(range(1, 7)), trained(out)  # every step once, over two launches


def test_restarts_back_off_and_stop_the_run_once_spent_in_a_row(tmp_path, monkeypatch, capsys):
    # the restart policy alone, on a clock of its own: 2 s, then 4 s; a third exit in a row stops the run
    from types import SimpleNamespace

    from gyre.local import supervision

    now = [100.0]
    monkeypatch.setattr(supervision.time, "monotonic", lambda: now[0])
    log = tmp_path / "inference-1.log"
    log.write_text("boom\n")
    child = SimpleNamespace(name="inference-1", config=tmp_path / "inference-1.toml", log_path=log, tail=lambda: "boom")
    restarts = supervision.Restarts(2)
    assert restarts.due(child, -9) is None  # logged, backing off
    assert restarts.due(child, -9) is None  # still the same crash: not logged again
    now[0] += 2
    assert restarts.due(child, -9) == child.config
    assert restarts.due(child, 1) is None
    now[0] += 3.9
    assert restarts.due(child, 1) is None
    now[0] += 0.1
    assert restarts.due(child, 1) == child.config
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"inference-1 was killed by SIGKILL; restarting it in 2s (restart 1 of 2, inference_restarts; its log: {log})",
        f"inference-1 exited with status 1; restarting it in 4s (restart 2 of 2, inference_restarts; its log: {log})",
    ]
    stopped = r"^inference-1 exited with status 1 after 2 restarts \(inference_restarts = 2\); the run stops"
    with pytest.raises(supervision.RunFailed, match=stopped):
        restarts.due(child, 1)
    # up RESTART_RESET_S since its last restart: counted from 0 again
    restarts = supervision.Restarts(1)
    assert restarts.due(child, 1) is None
    now[0] += 2
    assert restarts.due(child, 1) == child.config
    now[0] += supervision.RESTART_RESET_S
    assert restarts.due(child, -9) is None  # restart 1 of 1 again, not the run's end
