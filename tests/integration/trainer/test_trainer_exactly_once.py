"""Exactly-once training across crashes: real Redis, a trainer subprocess killed with SIGKILL, restarts.

Every run checkpoints every step (`ckpt.interval=1`), so besides "each step trained once, in order"
the final weights must equal an uninterrupted run's bit for bit (deterministic mode, one thread).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch
from gyre.events import TRAINER_STEPS, latest_per_step, read_events
from gyre.runstate import CHECKPOINT_COMPLETE
from gyre.steps import StepEntries
from gyre.streams import BatchStream
from gyre.weights import WeightStore
from trainer_testlib import (
    child_env,
    kill_group,
    load_weights,
    push_batches,
    start_trainer,
    trained_steps,
    trainer_args,
    wait_for_steps,
)

STEPS = 6
pytestmark = pytest.mark.slow


def run_to_end(argv, log, env=None, timeout=180, max_file_bytes=None) -> int:
    proc = start_trainer(argv, log, env, max_file_bytes)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_group(proc)


@pytest.fixture(scope="module")
def baseline(tiny_model, redis_url, tmp_path_factory):
    """The output folder of a run that trains steps 1..STEPS without interruption."""
    out = tmp_path_factory.mktemp("uninterrupted")
    stream = BatchStream(redis_url, "exactly-once-baseline")
    stream.redis.delete(stream.key)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, out, redis_url, "exactly-once-baseline", STEPS, **{"ckpt.interval": 1})
    assert run_to_end(argv, out / "trainer.log") == 0, (out / "trainer.log").read_text()
    assert trained_steps(out) == list(range(1, STEPS + 1))
    return out


@pytest.fixture(scope="module")
def uninterrupted(baseline):
    """Final weights of the uninterrupted run."""
    return load_weights(baseline / "weights" / f"step_{STEPS}")


def step_numbers(out) -> list[tuple]:
    """(step, loss, grad_norm, lr) of every logged step: what each step trained from and the schedule it used."""
    records = latest_per_step(read_events(out / "events" / TRAINER_STEPS))
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def assert_same_weights(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs from the uninterrupted run"


def assert_exactly_once(out, stream) -> None:
    assert trained_steps(out) == list(range(1, STEPS + 1))  # every step once, in order
    assert stream.pending().count == 0  # and every batch acked


def crashed_at(point, tiny_model, redis_url, run_id, out):
    """Steps 1..STEPS pushed and a trainer (`ckpt.interval = 1`) run until it SIGKILLs itself at `point`;
    returns (stream, argv, log) to go on with."""
    stream = BatchStream(redis_url, run_id)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, out, redis_url, run_id, STEPS, **{"ckpt.interval": 1})
    log = out / "trainer.log"
    env = {**child_env(), "GYRE_TRAINER_CRASH_AT": point}
    assert run_to_end(argv, log, env) == -signal.SIGKILL, log.read_text()[-3000:]
    return stream, argv, log


def test_sigkill_mid_run_then_restart(tiny_model, redis_url, unique_run_id, tmp_path, uninterrupted):
    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, STEPS, **{"ckpt.interval": 1})
    log = tmp_path / "trainer.log"
    proc = start_trainer(argv, log)
    try:
        done = wait_for_steps(tmp_path, 2, proc, timeout=120)
        assert proc.poll() is None, f"trainer exited early after {done}: {log.read_text()[-3000:]}"
    finally:
        kill_group(proc, signal.SIGKILL)  # wherever it is in step 3: training, checkpointing, publishing...
    assert proc.returncode == -signal.SIGKILL
    killed_after = trained_steps(tmp_path)
    assert killed_after == list(range(1, len(killed_after) + 1)) and len(killed_after) < STEPS

    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path, stream)
    assert_same_weights(load_weights(tmp_path / "weights" / f"step_{STEPS}"), uninterrupted)


def test_crash_in_every_commit_window(tiny_model, redis_url, unique_run_id, tmp_path, uninterrupted, baseline):
    """Die at each point between training a step and acking it; the restarted trainer must neither
    lose nor repeat a step (see gyre_trainer.checkpoint.plan_resume for the reasoning per window)."""
    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, STEPS, **{"ckpt.interval": 1})
    log = tmp_path / "trainer.log"
    # mid_step: inside the optimizer step (parameters updated in memory, the LR schedule not advanced);
    # mid_*: inside the two writes, the checkpoint's shards or the version's weights file on disk, not committed;
    # after_ack of the last step: everything done but the notification, the restart has nothing left to train
    windows = ["mid_step:2", "after_train:2", "mid_checkpoint:2", "mid_publish:2", "after_checkpoint:3",
               "after_publish:4", "after_log:5", "after_ack:6"]  # fmt: skip
    checkpoints = StepEntries(tmp_path / "checkpoints/trainer", marker=CHECKPOINT_COMPLETE)
    weights = WeightStore(tmp_path / "weights")
    partial = None  # the half-written folder the previous crash left, which the next start must name and skip
    for point in windows:
        env = {**child_env(), "GYRE_TRAINER_CRASH_AT": point}
        before = log.stat().st_size if log.exists() else 0
        assert run_to_end(argv, log, env) == -signal.SIGKILL, f"no crash at {point}: {log.read_text()[-3000:]}"
        started = log.read_text()[before:]
        if partial is not None:
            folder, resumed_from = partial
            assert f"ignoring {folder}: a save cut short by a crash before its commit, never loaded; resuming from " \
                   f"{resumed_from}" in started, started[-3000:]  # fmt: skip
            assert f"loaded checkpoint step {resumed_from.split()[-1]} " in started
        partial = None
        if point.startswith("mid_") and point != "mid_step:2":  # the half-written folder, under a name no reader lists
            root = tmp_path / ("checkpoints/trainer" if point == "mid_checkpoint:2" else "weights")
            folder = next(p for p in sorted(root.iterdir()) if p.name.startswith(".tmp-step_2"))
            assert weights.latest() == 1 and checkpoints.latest() == 2 - (point == "mid_checkpoint:2"), point
            partial = folder, f"checkpoint step {checkpoints.latest()}"
    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path, stream)
    assert_same_weights(load_weights(tmp_path / "weights" / f"step_{STEPS}"), uninterrupted)
    # the step counters agree: the LR schedule advanced once per step (not for the update mid_step cut short)
    scheduler = torch.load(tmp_path / f"checkpoints/trainer/step_{STEPS}/scheduler.pt", weights_only=True)
    assert scheduler["last_epoch"] == STEPS
    assert step_numbers(tmp_path) == step_numbers(baseline)


def test_sigterm_mid_run_checkpoints_the_last_step_and_the_restart_resumes_it_exactly(
    tiny_model, redis_url, unique_run_id, tmp_path, uninterrupted
):
    """A preempted pod (eviction, drain: SIGTERM) with no `ckpt.interval`: the trainer finishes its step, checkpoints
    it (`ckpt.on_stop`) and exits 0; the restart loads that checkpoint (not published weights with fresh optimizer
    moments), trains every step once and ends bit for bit where an uninterrupted run does."""
    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, STEPS)
    log = tmp_path / "trainer.log"
    proc = start_trainer(argv, log)
    try:
        done = wait_for_steps(tmp_path, 2, proc, timeout=120)
        assert proc.poll() is None, f"trainer exited early after {done}: {log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)  # wherever it is in step 3: it finishes that step first
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_group(proc)
    stopped_after = trained_steps(tmp_path)
    assert stopped_after == list(range(1, len(stopped_after) + 1)) and len(stopped_after) < STEPS
    last = stopped_after[-1]
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints/trainer").iterdir())
    assert checkpoints == [f"step_{last}"]  # the stop's checkpoint, complete (no .tmp- left), and only it
    first_run = log.read_text()
    assert f"stopping: checkpointing step {last} first (ckpt.on_stop)" in first_run

    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    resumed = log.read_text()[len(first_run) :]
    assert f"loaded checkpoint step {last}" in resumed and "not bit-exact" not in resumed
    assert_exactly_once(tmp_path, stream)
    assert_same_weights(load_weights(tmp_path / "weights" / f"step_{STEPS}"), uninterrupted)


def test_a_full_volume_at_a_checkpoint_stops_the_trainer_with_the_reason_and_the_restart_resumes_exactly(
    tiny_model, redis_url, unique_run_id, tmp_path, uninterrupted
):
    """The volume fills up while checkpoint 2 is written (a 1 MiB file-size limit on the second start). The trainer
    stops (exit 1) with one error line naming the step, the folder and the free space (it died of an unreported
    DCP BaseException: no 'trainer failed', "unexpected pos 704 vs 598"); checkpoint 1 and weights 1 are intact and
    nothing half-written is left. With room again the restart trains every step once, ending bit for bit where an
    uninterrupted run does."""
    stream, argv, log = crashed_at("after_ack:1", tiny_model, redis_url, unique_run_id, tmp_path)
    before = log.stat().st_size
    assert run_to_end(argv, log, max_file_bytes=1 << 20) == 1, log.read_text()[-3000:]
    failed = log.read_text()[before:]
    assert "ERROR trainer gyre_trainer: trainer failed" in failed
    assert f"CheckpointError: saving checkpoint step 2 into {tmp_path / 'checkpoints/trainer'} failed" in failed
    assert "MiB free of" in failed and "the complete checkpoints [1] are intact" in failed
    assert sorted(p.name for p in (tmp_path / "checkpoints/trainer").iterdir()) == ["step_1"]
    assert WeightStore(tmp_path / "weights").steps() == [1] and trained_steps(tmp_path) == [1]

    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path, stream)
    assert_same_weights(load_weights(tmp_path / "weights" / f"step_{STEPS}"), uninterrupted)


def test_a_checkpoint_damaged_on_the_volume_stops_the_restart_with_what_to_do_and_that_works(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    """Not a crash window (a committed checkpoint is complete), but what a crash-loop looks like to a user: checkpoint
    2's shard cut short on the volume after its commit. The restart stops (exit 1) naming the folder and saying what
    moving it away resumes from (published weights 2 with checkpoint 1's moments); done so, the run finishes with
    every step trained once. It is not skipped automatically: a damaged volume is worth a look."""
    stream, argv, log = crashed_at("after_ack:2", tiny_model, redis_url, unique_run_id, tmp_path)
    folder = tmp_path / "checkpoints/trainer/step_2"
    shard = next((folder / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = log.stat().st_size
    assert run_to_end(argv, log) == 1, log.read_text()[-3000:]
    failed = log.read_text()[before:]
    assert f"checkpoint step 2 at {folder} is unreadable" in failed
    assert f"To resume without it, move {folder} out of {folder.parent}: the run then resumes after step 2 from " \
           "published weights step 2 and checkpoint step 1" in failed  # fmt: skip
    assert trained_steps(tmp_path) == [1, 2]

    folder.rename(tmp_path / "damaged-step_2")
    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path, stream)


def test_a_second_ctrl_c_stops_the_trainer_mid_step_at_once_and_the_restart_trains_that_step_once(
    tiny_model, redis_url, unique_run_id, tmp_path, uninterrupted
):
    """The first Ctrl-C of a single process asks for the graceful stop (finish the step, checkpoint it: long on a
    big model) and says a second one stops at once; the second, while step 3 is held after its training
    (`GYRE_TRAINER_HOLD_AT`), stops it there with exit 130 (it was ignored: the trainer went on). Step 3's Redis
    entry is not acked, so the restart trains it again, once, ending bit for bit where an uninterrupted run does."""
    stream = BatchStream(redis_url, unique_run_id)
    push_batches(stream, range(1, STEPS + 1))
    argv = trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, STEPS, **{"ckpt.interval": 1})
    log = tmp_path / "trainer.log"
    proc = start_trainer(argv, log, {**child_env(), "GYRE_TRAINER_HOLD_AT": "after_train:3"})
    try:
        wait_for_log(log, "fault injection: holding at after_train of step 3", proc)
        proc.send_signal(signal.SIGINT)
        wait_for_log(log, "SIGINT: stopping after the current step (Ctrl-C again stops at once)", proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_group(proc)
    first_run = log.read_text()
    assert "gyre trainer: interrupted at once; the same command resumes after the newest committed step" in first_run
    assert "Traceback" not in first_run, first_run[-3000:]
    assert trained_steps(tmp_path) == [1, 2]  # step 3 trained in memory only: neither checkpointed nor published
    assert stream.pending().count == STEPS - 2  # its entry (and those read ahead with it), not acked

    assert run_to_end(argv, log) == 0, log.read_text()[-3000:]
    assert_exactly_once(tmp_path, stream)
    assert_same_weights(load_weights(tmp_path / "weights" / f"step_{STEPS}"), uninterrupted)


def wait_for_log(log, text: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"trainer exited before {text!r}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout:.0f}s: {log.read_text()[-3000:]}"
        time.sleep(0.05)
