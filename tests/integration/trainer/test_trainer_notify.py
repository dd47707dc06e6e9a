"""Weights out, end to end: a trainer subprocess on a real Redis publishes every step, a real gRPC
orchestrator hears about each one, malformed entries are dead-lettered, and a down orchestrator
never hurts the trainer."""

from __future__ import annotations

import signal
import time
import urllib.request

import grpc
import pytest
import torch
from gyre.net import free_port
from gyre.streams import BatchStream
from gyre.v1 import trainer_pb2, trainer_pb2_grpc
from gyre.weights import WeightStore, WeightsVersion
from gyre_trainer.publish import WeightsNotifier
from trainer_testlib import (
    RecordingOrchestrator,
    child_env,
    encode_batch,
    kill_group,
    make_batch,
    start_trainer,
    trained_steps,
    trainer_args,
    wait_for_steps,
)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def fake_version(tmp_path, step: int) -> WeightsVersion:
    return WeightsVersion(step, f"{step:064x}", "folder", str(tmp_path / f"step_{step}"))


def test_notifier_delivers_every_version_in_order_with_token(tmp_path):
    orchestrator = RecordingOrchestrator(token="s3cret")
    notifier = WeightsNotifier(orchestrator.address, timeout_s=2, control_token="s3cret")
    try:
        for step in (1, 2, 3):
            notifier.notify(fake_version(tmp_path, step))
        assert notifier.flush(timeout=10)
        assert orchestrator.calls == [(s, str(tmp_path / f"step_{s}"), f"{s:064x}") for s in (1, 2, 3)]
        assert notifier.delivered == [1, 2, 3]
    finally:
        notifier.close()
        orchestrator.stop()


def test_down_orchestrator_delays_notifications_and_never_raises(tmp_path):
    port = free_port()
    notifier = WeightsNotifier(f"127.0.0.1:{port}", timeout_s=0.5, retry_initial_s=0.1, retry_max_s=0.4)
    try:
        start = time.monotonic()
        notifier.notify(fake_version(tmp_path, 1))
        notifier.notify(fake_version(tmp_path, 2))
        assert time.monotonic() - start < 0.1  # notify() never blocks the training loop
        wait_until(lambda: notifier.failures >= 3, what="retries")
        assert notifier.delivered == []
        orchestrator = RecordingOrchestrator(port=port)  # the orchestrator comes (back) up
        try:
            wait_until(lambda: notifier.delivered, what="delivery after the orchestrator came up")
            # version 1 kept failing while version 2 waited: only the newest matters, 1 was dropped
            assert orchestrator.steps() == [2]
        finally:
            orchestrator.stop()
    finally:
        start = time.monotonic()
        notifier.close(timeout=1.0)
        assert time.monotonic() - start < 5


def test_an_orchestrator_not_up_yet_is_info_until_it_lasts(tmp_path, caplog):
    # every `gyre rl` re-run printed 4-5 "NotifyWeights step N ... failed (attempt k, UNAVAILABLE)" warnings: the
    # resumed trainer re-notifies its step before the launcher starts the orchestrator (after the replicas)
    import logging

    caplog.set_level(logging.INFO, logger="gyre_trainer.publish")
    for quiet_s, level in ((30.0, logging.INFO), (0.0, logging.WARNING)):
        caplog.clear()
        notifier = WeightsNotifier(f"127.0.0.1:{free_port()}", timeout_s=0.5, retry_initial_s=0.05,
                                   retry_max_s=0.1, quiet_unavailable_s=quiet_s)  # fmt: skip
        try:
            notifier.notify(fake_version(tmp_path, 1))
            wait_until(lambda notifier=notifier: notifier.failures >= 2, what="retries")
            notifier.notify(fake_version(tmp_path, 2))  # a newer version replaces the waiting one: normal course
            wait_until(lambda: any("dropping notification of step 1" in r.getMessage() for r in caplog.records),
                       what="step 1 dropped")  # fmt: skip
        finally:
            notifier.close(timeout=0.1)
        failed = [r for r in caplog.records if "NotifyWeights step 1" in r.getMessage()]
        assert failed and {r.levelno for r in failed} == {level}
        assert {r.levelno for r in caplog.records if "dropping notification" in r.getMessage()} == {logging.INFO}


@pytest.mark.slow
def test_trainer_publishes_notifies_and_dead_letters(tiny_model, redis_url, unique_run_id, tmp_path):
    from transformers import AutoModelForCausalLM

    stream = BatchStream(redis_url, unique_run_id)
    stream.push(1, encode_batch(make_batch(1)))
    stream.redis.xadd(stream.key, {"step": "2", "schema": "1", "payload": b"not msgpack"})
    stream.push(2, encode_batch(make_batch(2, ranks=2, rows_per_rank=1)))  # split for 2 ranks
    stream.push(2, encode_batch(make_batch(2)))
    stream.push(3, encode_batch(make_batch(3)), path_threshold=64, spill_dir=tmp_path / "out" / "batches")

    orchestrator = RecordingOrchestrator()
    grpc_port, metrics_port = free_port(), free_port()
    argv = trainer_args(tiny_model, tmp_path / "out", redis_url, unique_run_id, max_steps=None)
    argv = [a for a in argv if a not in ("--max-steps", "None")]
    argv += ["--orchestrator.address", orchestrator.address, "--server.port", str(grpc_port)]
    argv += ["--metrics.port", str(metrics_port)]
    proc = start_trainer(argv, tmp_path / "trainer.log")
    try:
        assert wait_for_steps(tmp_path / "out", 3, proc, timeout=120) == [1, 2, 3], (
            tmp_path / "trainer.log"
        ).read_text()
        wait_until(lambda: orchestrator.steps() == [1, 2, 3], what="NotifyWeights of steps 1..3")

        store = WeightStore(tmp_path / "out" / "weights")
        for step, path, digest in orchestrator.calls:
            assert path == str(store.path(step))
            store.verify(step, digest)  # the digest announced is the manifest's

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            status = trainer_pb2_grpc.TrainerStub(channel).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
        assert (status.step, status.world_size) == (3, 1)
        assert status.tokens == sum(make_batch(s).num_tokens for s in (1, 2, 3))
        runs = [(r.name, r.step, r.tokens, r.finished) for r in status.runs]
        assert runs == [(unique_run_id, 3, status.tokens, False)]  # a single run: one line, named by run_id

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert f'gyre_trainer_step{{run_id="{unique_run_id}"}} 3.0' in text
        assert f'gyre_trainer_rejected_batches_total{{run_id="{unique_run_id}"}} 2.0' in text

        reasons = sorted(d.fields["reason"].decode() for d in stream.dead_letters())
        assert len(reasons) == 2
        assert "not a msgpack document" in reasons[1] and "split for 2 ranks" in reasons[0]
        assert stream.pending().count == 0

        proc.send_signal(signal.SIGTERM)  # graceful: the waiting trainer leaves cleanly
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            kill_group(proc)
        orchestrator.stop()
        stream.redis.close()

    assert trained_steps(tmp_path / "out") == [1, 2, 3]
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    trained = AutoModelForCausalLM.from_pretrained(store.path(3))
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert len(moved) == len(list(base.parameters()))  # every parameter was trained


def test_a_trainer_killed_after_its_ack_announces_that_version_when_it_restarts(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    """The last crash window: step 2 published, logged and acked, its NotifyWeights not delivered (the orchestrator
    was down) when the trainer is SIGKILLed. The restarted trainer trains nothing twice and announces version 2
    before training step 3: the orchestrator hears of every version in order, none missed."""
    stream = BatchStream(redis_url, unique_run_id)
    ids = {step: stream.push(step, encode_batch(make_batch(step))) for step in (1, 2, 3)}
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    argv = trainer_args(tiny_model, out, redis_url, unique_run_id, max_steps=3)
    down = ["--orchestrator.address", f"127.0.0.1:{free_port()}"]  # nothing listens there
    proc = start_trainer(argv + down, log, {**child_env(), "GYRE_TRAINER_CRASH_AT": "after_ack:2"})
    try:
        assert proc.wait(timeout=180) == -signal.SIGKILL, log.read_text()[-3000:]
        pending = stream.pending()  # step 2 committed and acked; step 3 read ahead, pending
        assert trained_steps(out) == [1, 2] and (pending.count, pending.min_id) == (1, ids[3])

        orchestrator = RecordingOrchestrator()
        proc = start_trainer(argv + ["--orchestrator.address", orchestrator.address], log)
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        wait_until(lambda: orchestrator.steps() == [2, 3], what="NotifyWeights of steps 2, 3")
        orchestrator.stop()
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert trained_steps(out) == [1, 2, 3] and stream.pending().count == 0
    stream.redis.close()
