"""Redis restarts empty (no persistence) under a running orchestrator: it notices that batches the
trainer still needs are gone and starts over from the resume rule, so they are pushed again.

Issue 17: the trainer used to wait forever for a batch the new Redis never saw.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
from gyre.events import read_events
from gyre.redis_server import EmbeddedRedis
from gyre.streams import BatchStream
from orchestrator_testlib import orchestrator_config

pytestmark = pytest.mark.timeout(300)


def launch(cfg, tmp_path):
    """`gyre orchestrator` in its own process (it restarts itself in-process on StreamLost); log in orchestrator.log."""
    from gyre.config import to_toml

    cfg_path = tmp_path / "orchestrator.toml"
    cfg_path.write_text(to_toml(cfg))
    log = open(tmp_path / "orchestrator.log", "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "gyre.cli", "orchestrator", "@", str(cfg_path)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log


@contextlib.contextmanager
def orchestrating(cfg, tmp_path, redis_url: str, run_id: str):
    """`launch(cfg)` on the shared test Redis, with the run's stream; on exit the process is killed if it still
    runs, and the run's stream and dead letters are deleted."""
    proc, log = launch(cfg, tmp_path)
    stream = BatchStream(redis_url, run_id)
    try:
        yield proc, stream
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        stream.redis.delete(stream.key, stream.dead_key)
        stream.redis.close()


def wait_for_pushes(proc, events, n: int, tmp_path) -> None:
    """Until the orchestrator logged `n` pushed steps (it must stay up meanwhile)."""
    deadline = time.monotonic() + 120
    while len(read_events(events)) < n:
        assert proc.poll() is None, (tmp_path / "orchestrator.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def stream_steps(stream) -> list[int]:
    return [stream._entry(i, f).step for i, f in stream.redis.xrange(stream.key)]


def test_batches_lost_by_a_redis_restart_are_pushed_again(tmp_path, unique_run_id, replicas):
    redis = EmbeddedRedis().start()  # our own server: this test restarts it
    port, n = redis.port, 6
    # no trainer: after the last push it waits (final_weights_timeout_s) for weights that never come,
    # which is when a trainer would be waiting for batches the new Redis does not have
    cfg = orchestrator_config(
        tmp_path, redis.url, unique_run_id, replicas, max_async_level=50, max_steps=n, final_weights_timeout_s=20
    )
    proc, log = launch(cfg, tmp_path)
    events = cfg.output_dir / "events" / "orchestrator_steps.jsonl"
    try:
        wait_for_pushes(proc, events, n, tmp_path)
        redis.stop()  # batches 1..n are gone with it; no trainer has read them
        redis = EmbeddedRedis(port=port).start()
        assert proc.wait(180) == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        stream = BatchStream(redis.url, unique_run_id)
        steps = stream_steps(stream)
        stream.redis.close()
        redis.stop()
    text = (tmp_path / "orchestrator.log").read_text()
    assert "starting over from step 1" in text
    assert set(steps) == set(range(1, n + 1)), steps  # every step is in the new server's stream


def test_a_batch_the_trainer_dead_letters_is_generated_again(tmp_path, redis_url, unique_run_id, replicas):
    # audit: the dead-lettered entry (e.g. its spill file was lost) stayed in the stream and counted as pushed,
    # so no orchestrator, running or restarted, generated its step again, and the trainer waited forever
    from gyre.streams import StepReader

    n = 3
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, max_steps=n, final_weights_timeout_s=8
    )
    with orchestrating(cfg, tmp_path, redis_url, unique_run_id) as (proc, stream):
        reader = StepReader(stream, "trainer-rank0")  # what the trainer does with an entry it cannot train
        entry = None
        deadline = time.monotonic() + 120
        while entry is None or entry.step != 1:
            assert proc.poll() is None, (tmp_path / "orchestrator.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            entry = reader.next(block_ms=200)
        reader.reject(entry, "cannot read spilled payload: No such file or directory")
        assert proc.wait(180) == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
        steps = stream_steps(stream)
    text = (tmp_path / "orchestrator.log").read_text()
    assert "the trainer dead-lettered" in text and "starting over from step 1" in text, text[-3000:]
    assert 1 in steps and set(steps) == set(range(1, n + 1)), steps  # step 1 is in the stream again


def test_a_batch_the_trainer_always_rejects_stops_the_orchestrator_with_the_reason(
    tmp_path, redis_url, unique_run_id, replicas
):
    # a rejection that regenerating cannot cure (e.g. a trainer with another data-parallel size) must not loop
    # forever, filling the dead-letter stream with payloads: after a few tries the orchestrator fails, saying why
    from gyre.streams import StepReader

    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_async_level=0, max_steps=2)
    with orchestrating(cfg, tmp_path, redis_url, unique_run_id) as (proc, stream):
        reader = StepReader(stream, "trainer-rank0")
        deadline = time.monotonic() + 200
        while proc.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "orchestrator.log").read_text()[-3000:]
            entry = reader.next(block_ms=200)
            if entry is not None:
                reader.reject(entry, "batch is split for 1 ranks, but the trainer runs 2")
        dead = len(stream.dead_letters())
    text = (tmp_path / "orchestrator.log").read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "the trainer rejected batch 1 3 times" in text and "split for 1 ranks, but the trainer runs 2" in text
    assert dead == 3


def test_a_stream_deleted_under_a_running_redis_is_pushed_again(tmp_path, redis_url, unique_run_id, replicas):
    # audit: FLUSHALL, FLUSHDB, a DEL or an eviction (maxmemory-policy allkeys-*) leaves Redis's run_id as it
    # was, so the watch never looked: the trainer waited for batches that were gone and the run hung
    n = 3
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, max_steps=n, final_weights_timeout_s=10
    )
    events = cfg.output_dir / "events" / "orchestrator_steps.jsonl"
    with orchestrating(cfg, tmp_path, redis_url, unique_run_id) as (proc, stream):
        wait_for_pushes(proc, events, n, tmp_path)
        stream.redis.delete(stream.key)
        stream.ensure_group()  # what a waiting trainer does when its group is gone: an empty stream again
        assert proc.wait(180) == 0, (tmp_path / "orchestrator.log").read_text()[-3000:]
        steps = stream_steps(stream)
    text = (tmp_path / "orchestrator.log").read_text()
    assert "starting over from step 1" in text, text[-3000:]
    assert set(steps) == set(range(1, n + 1)), steps


def test_a_lost_step_the_trainer_trains_meanwhile_is_not_pushed_again(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    """The stream is lost (Redis restarted empty, FLUSHALL) while the trainer trains step 1 from the batch it read
    before: the orchestrator starts over from step 1, the trainer publishes step 1 meanwhile. The batch generated
    again for it was pushed anyway and its event line replaced the first: the trainer skipped it as a replay, so the
    run's records described a batch nobody trained (a real model's step takes minutes: Redis restarts mid-step). Now
    a step committed by the time its batch is ready is not pushed, and its line stays the trained batch's."""
    import os
    import signal

    from gyre.streams import StepReader
    from gyre.weights import WeightStore
    from orchestrator_testlib import publish_weights

    n = 3
    cfg = orchestrator_config(  # a slower generation of the lost step than the publish below (a trainer's commit)
        tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, max_steps=n, final_weights_timeout_s=60,
        batch_size=4, sampling={"max_tokens": 48},
    )  # fmt: skip
    events = cfg.output_dir / "events" / "orchestrator_steps.jsonl"
    log_path = tmp_path / "orchestrator.log"
    with orchestrating(cfg, tmp_path, redis_url, unique_run_id) as (proc, stream):
        wait_for_pushes(proc, events, n, tmp_path)
        trained = StepReader(stream, "trainer-rank0").next(block_ms=5000).decode()  # the trainer's step 1
        assert trained.step == 1
        stream.redis.delete(stream.key)  # what a Redis restarted without its data leaves
        stream.ensure_group()  # the waiting trainer's group again
        deadline = time.monotonic() + 60
        # the restart in the process after "starting over from step 1": its resume rule said step 1 (not committed)
        while log_path.read_text().count("starting at step 1 (") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # the trainer's commit of step 1 lands while its batch is generated again
        try:
            publish_weights(WeightStore(cfg.output_dir / "weights"), 1, tiny_model)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert 1 not in stream_steps(stream), "pushed before the commit: the machine was too slow to test this"
        deadline = time.monotonic() + 120
        while 3 not in stream_steps(stream):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        steps = stream_steps(stream)
    text = log_path.read_text()
    assert steps == [2, 3], steps
    assert "step 1 was trained from the batch pushed before the stream was lost" in text, text[-3000:]
    newest = {r["step"]: r for r in read_events(events)}
    assert newest[1]["num_tokens"] == sum(mb.num_tokens for rank in trained.micro_batches for mb in rank)
