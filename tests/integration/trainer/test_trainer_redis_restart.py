"""Redis restarted under a running trainer: with its data (append-only file, as `gyre rl` and the chart run it)
and without (a Redis that lost everything). The trainer waits for Redis, resumes reading, and trains every step
once, in order: never a step twice, never past a missing one.

Each test runs its own redis-server on a fixed port (the trainer keeps its `redis.url`), SIGKILLs it mid-run
(a crashed pod: no shutdown save) and starts it again on that port.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from gyre.net import free_port
from gyre.redis_server import EmbeddedRedis
from gyre.streams import BatchStream
from trainer_testlib import (
    encode_batch,
    kill_group,
    make_batch,
    push_batches,
    start_trainer,
    trained_steps,
    wait_for_steps,
)
from trainer_testlib import trainer_args as base_args

pytestmark = pytest.mark.slow
RUN = "redis-restart"
STEPS = 6


def crash(redis: EmbeddedRedis) -> None:
    """SIGKILL the server (no save on the way out), as a node or OOM kill does."""
    proc = redis.proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    redis.stop()  # forget the process, remove its scratch folder


def trainer_args(tiny_model, out, url):
    return base_args(tiny_model, out, url, RUN, STEPS)


def test_redis_restarted_with_its_append_only_file_mid_run(tiny_model, tmp_path):
    port, data = free_port(), tmp_path / "redis"
    redis = EmbeddedRedis(port=port, data_dir=data).start()
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    proc = None
    try:
        stream = BatchStream(redis.url, RUN)
        push_batches(stream, range(1, 4))
        # no wait for the fsync: Redis writes the append-only file before it answers, so a SIGKILL of the server loses
        # nothing (appendfsync everysec: only a node crash can lose the last second)
        proc = start_trainer(trainer_args(tiny_model, out, redis.url), log)
        wait_for_steps(out, 2, proc, timeout=120)
        crash(redis)
        time.sleep(2)
        assert proc.poll() is None, log.read_text()[-3000:]  # waiting for Redis, not dead
        redis = EmbeddedRedis(port=port, data_dir=data).start()
        stream = BatchStream(redis.url, RUN)
        assert [e.step for e in stream.dead_letters()] == [] and stream.length() == 3  # the entries survived
        push_batches(stream, range(4, STEPS + 1))
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert trained_steps(out) == list(range(1, STEPS + 1))  # every step once, in order
        assert stream.pending().count == 0
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        redis.stop()


def test_redis_restarted_empty_mid_run_the_trainer_waits_for_the_missing_step(tiny_model, tmp_path):
    """Redis comes back without the stream (no persistence): steps 1..3 were trained and acked, the orchestrator
    pushes again from what it knows. Step 4 is missing while 5 and 6 are there, and an old step 2 comes again: the
    trainer recreates its consumer group, trains neither 5 nor 6 before 4 (no gap), skips 2, and says why it waits."""
    port = free_port()
    redis = EmbeddedRedis(port=port).start()  # no data_dir: nothing survives a restart
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    proc = None
    try:
        push_batches(BatchStream(redis.url, RUN), range(1, 4))
        proc = start_trainer(trainer_args(tiny_model, out, redis.url), log)
        wait_for_steps(out, 3, proc, timeout=120)
        crash(redis)
        redis = EmbeddedRedis(port=port).start()
        stream = BatchStream(redis.url, RUN)
        assert stream.length() == 0
        push_batches(stream, (5, 6))
        # the line that says the trainer has read both 5 and 6 (it reconnects to Redis on a backoff first: seconds,
        # more on a loaded machine, where a fixed 8 s wait ran out before it and the asserts below failed)
        deadline = time.monotonic() + 120
        while "waiting for step 4: steps [5, 6] are in the stream but 4 is not" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # a trainer that would train past the missing step has had time to
        assert proc.poll() is None, log.read_text()[-3000:]
        assert trained_steps(out) == [1, 2, 3]  # neither 5 nor 6 trained past the missing 4
        text = log.read_text()
        assert (
            f"Redis lost the batch stream gyre:{RUN}:batches (restarted without its data, flushed or deleted): "
            "waiting for step 4, which the orchestrator pushes again; steps up to 3 are trained"
        ) in text
        assert "waiting for step 4: steps [5, 6] are in the stream but 4 is not" in text
        stream.push(2, encode_batch(make_batch(2)))  # a stale re-push of a trained step
        stream.push(4, encode_batch(make_batch(4)))
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert trained_steps(out) == list(range(1, STEPS + 1))  # every step once, in order
        assert "skipping replayed step 2" in log.read_text()
        assert stream.pending().count == 0
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        redis.stop()
