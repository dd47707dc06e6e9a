"""Failure handling: a replica killed mid-step, and an orchestrator process stopped and restarted."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from gyre.events import latest_per_step, read_events
from gyre.rollouts import read_dump
from gyre.streams import BatchStream
from gyre_orchestrator.service import OrchestratorService
from orchestrator_testlib import orchestrator_config

pytestmark = pytest.mark.timeout(300)


@pytest.mark.asyncio
async def test_killing_a_replica_mid_step_does_not_fail_the_step(
    tmp_path, redis_url, unique_run_id, replicas, start_replica
):
    doomed = start_replica()
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, [replicas[0], doomed], max_steps=2, batch_size=4,
        rollouts_per_example=4, sampling={"max_tokens": 32},
    )  # fmt: skip
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    while not (service.replicas.replicas and service.replicas.replicas[doomed.url].inflight > 0):
        assert not run.done(), run
        await asyncio.sleep(0.001)
    doomed.kill()  # SIGKILL while it holds requests of step 1
    assert service.last_step == 0
    assert await asyncio.wait_for(run, timeout=120) == 0

    steps = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert [e["step"] for e in steps] == [1, 2]
    assert all(e["num_samples"] == 16 for e in steps)  # nothing lost: every group completed
    dead = service.replicas.replicas[doomed.url]
    # one outage counts once, however many in-flight requests it broke (probes after the cooldown add more)
    assert 1 <= dead.failures <= 3 and dead.last_error
    assert service.client.stats["retries"] >= 1  # the interrupted requests moved to the survivor


@pytest.mark.asyncio
async def test_a_frozen_replica_s_requests_move_to_the_other_and_it_rejoins_when_it_wakes(
    tmp_path, redis_url, unique_run_id, replicas, start_replica
):
    """A replica that stops answering without closing its connections (SIGSTOP here; a hung GPU or a network
    partition in a cluster): its status probe fails within seconds, but the requests in flight on it waited for
    `inference.timeout_s` (300 s), holding their step back while the other replica idled. Now they are retried on
    the other replica at once, the run goes on, and the replica serves again once it wakes."""
    frozen = start_replica()
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, [replicas[0], frozen], max_steps=1000, max_async_level=50,
        batch_size=4, rollouts_per_example=4, sampling={"max_tokens": 32}, inference={"timeout_s": 300},
    )  # fmt: skip
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    try:
        while not (service.replicas.replicas and service.replicas.replicas[frozen.url].inflight > 0):
            assert not run.done(), run
            await asyncio.sleep(0.001)
        stuck = service.last_step + 1  # a step with requests on the replica about to freeze
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60  # the probe fails after 5 s; the old code waited 300 s
            while service.last_step < stuck + 1:
                assert not run.done(), run
                assert time.monotonic() < deadline, f"step {stuck} waited for the frozen replica"
                await asyncio.sleep(0.05)
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        replica = service.replicas.replicas[frozen.url]
        assert replica.failures >= 1 and "GetStatus" in replica.last_error
        answered = replica.requests
        deadline = time.monotonic() + 60
        while not (replica.requests > answered and service.replicas.in_rotation(replica)):  # it rejoined
            assert not run.done(), run
            assert time.monotonic() < deadline, f"the replica never served again: {replica}"
            await asyncio.sleep(0.05)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        frozen.kill()
    steps = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert [e["step"] for e in steps] == list(range(1, len(steps) + 1))
    assert all(e["num_samples"] == 16 for e in steps)  # nothing lost: every abandoned request was retried
    assert service.client.stats["retries"] >= 1


def stream_steps(redis_url: str, run_id: str) -> list:
    stream = BatchStream(redis_url, run_id)
    try:
        return [stream._entry(i, f) for i, f in stream.redis.xrange(stream.key)]
    finally:
        stream.redis.close()


def orchestrator_cmd(cfg_path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", "orchestrator", "@", str(cfg_path), *args]


def test_resume_continues_at_the_right_step(tmp_path, redis_url, unique_run_id, replicas):
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, ckpt_interval=1, max_steps=1000,
        batch_size=2, rollouts_per_example=2,
    )  # fmt: skip
    cfg_path = tmp_path / "orchestrator.toml"
    from gyre.config import to_toml

    cfg_path.write_text(to_toml(cfg))
    log1 = open(tmp_path / "run1.log", "w")  # noqa: SIM115
    first = subprocess.Popen(orchestrator_cmd(cfg_path), stdout=log1, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(stream_steps(redis_url, unique_run_id)) < 3:  # pushed: a step's event line comes first
            assert first.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0  # a clean stop (not finished: see the steps below)
    finally:
        if first.poll() is None:
            first.kill()
        log1.close()
    pushed = [e.step for e in stream_steps(redis_url, unique_run_id)]
    assert pushed == list(range(1, len(pushed) + 1)) and len(pushed) >= 3
    last = pushed[-1]
    # a crash between pushing a batch and checkpointing it: the stream is ahead of the checkpoints
    # (SIGTERM can land in that window by itself; otherwise drop the newest checkpoint to make it so)
    ckpt_dir = cfg.output_dir / "checkpoints" / "orchestrator"
    newest = max(int(p.stem.split("_")[1]) for p in ckpt_dir.glob("step_*.json"))
    if newest == last:
        (ckpt_dir / f"step_{newest}.json").unlink()
    assert max(int(p.stem.split("_")[1]) for p in ckpt_dir.glob("step_*.json")) < last

    second = subprocess.run(
        orchestrator_cmd(cfg_path, "--resume-step", "-1", "--max-steps", str(last + 2)),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    entries = stream_steps(redis_url, unique_run_id)
    assert [e.step for e in entries] == list(range(1, last + 3))  # nothing repeated, nothing skipped
    tasks = [s["task_id"] for e in entries for s in e.decode().samples]
    assert len(tasks) == 2 * len(set(tasks))  # 2 samples per task, no task used in two groups
    assert f"starting at step {last + 1}" in second.stderr
    progress = json.loads((cfg.output_dir / "checkpoints" / "orchestrator" / f"step_{last + 2}.json").read_text())
    assert progress["step"] == last + 2 and progress["counters"]["total_samples"] > 0
    # what the positions index into is recorded, and a restart with another task seed (a `helm upgrade` that changed
    # it) is refused before anything is pushed, naming the key: it went on at the same index of other tasks
    assert (progress["seed"], progress["env"]) == (cfg.seed, cfg.model_dump(mode="json")["env"])
    third = subprocess.run(
        orchestrator_cmd(cfg_path, "--seed", str(cfg.seed + 1), "--max-steps", str(last + 4)),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert third.returncode == 2 and "seed: the run's progress checkpoint" in third.stderr, third.stderr[-3000:]
    assert [e.step for e in stream_steps(redis_url, unique_run_id)] == list(range(1, last + 3))


def wait_for_pushes(redis_url: str, run_id: str, n: int, proc, log_path) -> None:
    deadline = time.monotonic() + 120
    while len(stream_steps(redis_url, run_id)) < n:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def signalled(cfg, sig, before) -> tuple:
    """`gyre orchestrator` on `cfg` as a process, `before(proc, log_path)`, then `sig`: it must exit 0.
    (the config file, the process's log)."""
    from gyre.config import to_toml

    cfg_path = cfg.output_dir.parent / "orchestrator.toml"
    cfg_path.write_text(to_toml(cfg))
    log_path = cfg.output_dir.parent / "run1.log"
    with open(log_path, "w") as log1:
        proc = subprocess.Popen(orchestrator_cmd(cfg_path), stdout=log1, stderr=subprocess.STDOUT)
        try:
            before(proc, log_path)
            proc.send_signal(sig)
            assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return cfg_path, log_path.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_orchestrator_stops_cleanly_saves_its_progress_and_a_restart_goes_on(
    tmp_path, redis_url, unique_run_id, replicas, sig
):
    """SIGTERM (a pod's stop, `docker stop`, the Docker smoke) or SIGINT (Ctrl-C): the orchestrator exited 143 while
    the trainer and inference exit 0 after a clean stop, and its newest progress checkpoint could be up to
    ckpt_interval - 1 steps behind what it had pushed. Now it exits 0, with a progress checkpoint of the last step
    pushed, and a restart continues at the next step, no step or task repeated."""
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, ckpt_interval=5,
                              max_steps=1000, batch_size=2, rollouts_per_example=2)  # fmt: skip
    cfg_path, log = signalled(cfg, sig, lambda proc, log_path: wait_for_pushes(redis_url, unique_run_id, 3, proc,
                                                                                log_path))  # fmt: skip
    assert f"stopped by signal ({sig.name})" in log
    pushed = [e.step for e in stream_steps(redis_url, unique_run_id)]
    assert pushed == list(range(1, len(pushed) + 1)) and len(pushed) >= 3
    last = pushed[-1]
    ckpt_dir = cfg.output_dir / "checkpoints" / "orchestrator"
    saved = json.loads((ckpt_dir / f"step_{last}.json").read_text())  # the last step pushed, whatever the interval
    indices = [s["task_index"] for e in stream_steps(redis_url, unique_run_id) for s in e.decode().samples]
    assert saved["step"] == last and saved["cursors"]["reverse_text"] > max(indices)
    assert saved["counters"]["total_samples"] == len(indices)  # every pushed sample (a step may close short)

    second = subprocess.run(orchestrator_cmd(cfg_path, "--max-steps", str(last + 2)), capture_output=True, text=True,
                            timeout=180)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"starting at step {last + 1}" in second.stderr
    # what a step is, said at start (PRIME-RL's batch_size counts samples, Gyre's tasks)
    assert "a step: 2 tasks x 2 samples = 4 samples (batch_size counts tasks)" in second.stderr
    entries = stream_steps(redis_url, unique_run_id)
    assert [e.step for e in entries] == list(range(1, last + 3))  # nothing repeated, nothing skipped
    tasks = [s["task_id"] for e in entries for s in e.decode().samples]
    assert len(tasks) == 2 * len(set(tasks))  # 2 samples per task, no task used in two groups


def test_sigterm_while_redis_is_gone_mid_push_exits_0_and_a_restart_replays_the_batch(tmp_path, unique_run_id,
                                                                                       replicas):  # fmt: skip
    """`helm uninstall` SIGTERMs every pod at once: Redis exits at once, and an orchestrator caught pushing a batch
    then retried the push until the stop's grace ran out, and exited 143 some 10 s later (the container smoke's
    orchestrator, while trainer and inference exited 0). Now a push that finds Redis unavailable under a stop is
    left to the resume rule: the process exits 0, and a restart against the same Redis (its append-only file)
    generates that batch again, nothing skipped, nothing repeated."""
    from gyre.redis_server import EmbeddedRedis

    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    port = server.port
    try:
        cfg = orchestrator_config(tmp_path, server.url, unique_run_id, replicas, max_async_level=50, ckpt_interval=1,
                                  max_steps=1000, batch_size=2, rollouts_per_example=2)  # fmt: skip

        def redis_gone_mid_push(proc, log_path):
            wait_for_pushes(server.url, unique_run_id, 2, proc, log_path)
            server.stop()  # Redis goes first (it stops in 0.2 s); the next batch's push finds it gone
            deadline = time.monotonic() + 120
            # the push's calls: XADD, counting it, reading Redis's memory (whichever the outage caught)
            while not re.search(r"unavailable during (pushing batch|counting the push|reading redis memory)",
                                log_path.read_text()):  # fmt: skip
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)

        cfg_path, log = signalled(cfg, signal.SIGTERM, redis_gone_mid_push)
        assert "stopped by signal (SIGTERM)" in log and "at once" not in log, log[-3000:]
        server = EmbeddedRedis(port=port, data_dir=tmp_path / "redis").start()  # back with what it had
        pushed = [e.step for e in stream_steps(server.url, unique_run_id)]
        assert pushed == list(range(1, len(pushed) + 1)) and len(pushed) >= 2
        last = pushed[-1]
        second = subprocess.run(orchestrator_cmd(cfg_path, "--max-steps", str(last + 2)), capture_output=True,
                                text=True, timeout=180)  # fmt: skip
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"starting at step {last + 1}" in second.stderr
        entries = stream_steps(server.url, unique_run_id)
        assert [e.step for e in entries] == list(range(1, last + 3))  # the abandoned batch generated again
        tasks = [s["task_id"] for e in entries for s in e.decode().samples]
        assert len(tasks) == 2 * len(set(tasks))  # no task used in two groups
    finally:
        server.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("grace", [30.0, 0.5])
async def test_a_stop_during_a_push_lets_the_push_finish_within_its_grace(
    tmp_path, redis_url, unique_run_id, replicas, grace
):
    """A stop that lands while batch 2 is being pushed (held in XADD here): the push completes and its progress is
    saved before the run ends (the batch's rollouts were not thrown away); one that outlasts the grace is cut
    short, says so, and saves no checkpoint of a step it did not account (the resume rule goes by the stream)."""
    import threading

    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, ckpt_interval=5,
                              max_steps=1000, batch_size=2, rollouts_per_example=2)  # fmt: skip
    service = OrchestratorService(cfg)
    real_push, entered, release = service.stream.push, threading.Event(), threading.Event()

    def held_push(step, *args, **kwargs):
        if step == 2:
            entered.set()
            release.wait(60)
        return real_push(step, *args, **kwargs)

    service.stream.push = held_push
    run = asyncio.create_task(service.run())
    try:
        while not entered.is_set():
            assert not run.done(), run
            await asyncio.sleep(0.01)
        service.stop("SIGTERM", push_grace_s=grace)
        if grace < 1:  # cut short once its grace is over, the push still held (a fixed 1 s wait failed under load)
            await asyncio.wait({run}, timeout=30)
            assert run.done()
        else:
            await asyncio.sleep(1.0)
            assert not run.done()  # the push goes on, within its grace
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, timeout=60)
    finally:
        release.set()
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    ckpts = sorted(int(p.stem.split("_")[1]) for p in (cfg.output_dir / "checkpoints" / "orchestrator").glob("*.json"))
    if grace > 1:
        assert not service.stop_cut_short and service.last_step == 2
        assert [e.step for e in stream_steps(redis_url, unique_run_id)] == [1, 2] and ckpts == [2]
    else:
        assert service.stop_cut_short and ckpts == []  # no checkpoint beside a push whose outcome is unknown


@pytest.mark.asyncio
async def test_a_rewind_to_a_step_the_trainer_kept_finds_its_progress_checkpoint(
    tmp_path, redis_url, unique_run_id, replicas
):
    """The trainer keeps its checkpoint of step 1 (for good: ckpt.keep_interval) while the orchestrator keeps its newest
    progress checkpoint only (ckpt_keep_last = 1): a rewind to 1 failed at the orchestrator's start ("no orchestrator
    progress checkpoint of step 1"). Now the progress of every step the trainer holds a checkpoint of is kept."""
    from gyre.runstate import CHECKPOINT_COMPLETE, TRAINER_CHECKPOINTS

    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, max_steps=4,
                              ckpt_interval=1, ckpt_keep_last=1, batch_size=2, rollouts_per_example=2)  # fmt: skip
    first = OrchestratorService(cfg)
    real_save = first.progress.save

    def save_then_trainer_checkpoints(progress):  # the trainer's checkpoint of step 1 appears once step 1 is pushed
        path = real_save(progress)
        if progress.step == 1:
            folder = cfg.output_dir / TRAINER_CHECKPOINTS / "step_1"
            folder.mkdir(parents=True)
            (folder / CHECKPOINT_COMPLETE).write_text("{}")
        return path

    first.progress.save = save_then_trainer_checkpoints
    assert await asyncio.wait_for(first.run(), timeout=120) == 0
    assert first.progress.steps() == [1, 4]
    rewound = OrchestratorService(cfg.model_copy(update={"max_steps": 2, "resume_step": 1}))
    assert await asyncio.wait_for(rewound.run(), timeout=120) == 0
    assert [e.step for e in stream_steps(redis_url, unique_run_id)] == [1, 2]  # steps 2..4 deleted, 2 generated anew


class KilledAfterPush(Exception):
    """Stands in for a SIGKILL that lands right after a batch reached Redis."""


@pytest.mark.asyncio
async def test_a_kill_right_after_a_push_leaves_the_pushed_step_its_event_line_and_rollout_dump(
    tmp_path, redis_url, unique_run_id, replicas
):
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_async_level=50, max_steps=2,
                              batch_size=2, rollouts_per_example=2, rollouts={"interval": 1})  # fmt: skip
    first = OrchestratorService(cfg)
    real_push = first.stream.push

    def push_then_die(step, *args, **kwargs):
        entry = real_push(step, *args, **kwargs)
        if step == 2:
            raise KilledAfterPush
        return entry

    first.stream.push = push_then_die
    with pytest.raises(KilledAfterPush):
        await asyncio.wait_for(first.run(), timeout=120)
    assert [e.step for e in stream_steps(redis_url, unique_run_id)] == [1, 2]

    resumed = OrchestratorService(cfg.model_copy(update={"max_steps": 3, "resume_step": -1}))
    assert await asyncio.wait_for(resumed.run(), timeout=120) == 0
    assert [e.step for e in stream_steps(redis_url, unique_run_id)] == [1, 2, 3]  # step 2 was not pushed again
    lines = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    # every pushed step has its line (written before the push; the resumed run started at step 3)
    assert [e["step"] for e in latest_per_step(lines)] == [1, 2, 3]
    # and its rollout dump, of the samples it pushed: written after the push, a kill in between (seen with gyre
    # services killed -9 at random moments) left a trained step without one
    for entry in stream_steps(redis_url, unique_run_id):
        pushed = sorted(s["task_id"] for s in entry.decode().samples)
        assert sorted(r["task_id"] for r in read_dump(cfg.output_dir, entry.step)) == pushed, entry.step


@pytest.mark.asyncio
async def test_a_junk_newest_entry_does_not_stop_the_orchestrator_from_starting(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    # audit: the resume scan decoded the newest entry's field names as UTF-8 itself; one that was not raised
    # UnicodeDecodeError and the orchestrator could not start (a crash loop on Kubernetes)
    from orchestrator_testlib import first_batch

    stream = BatchStream(redis_url, unique_run_id)
    stream.redis.xadd(stream.key, {b"\xff": b"x", "step": "x", "schema": "1", "payload": b"junk"})
    stream.redis.close()
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=1)
    batch = await first_batch(cfg, tiny_model)
    assert batch.step == 1


def broken_reward(completion, info) -> float:
    """A user's reward function with a bug: the rows have no 'difficulty' column."""
    return float(info["difficulty"] > 1)


@pytest.mark.asyncio
async def test_a_reward_function_that_raises_is_reported_not_silently_zero(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, caplog
):
    # The rubric scores such a function 0 so the step goes on; that 0 was all anyone saw: every group had equal
    # rewards, was dropped as zero-signal, and the exception was nowhere (no log line, no count).
    from gyre.envs import load_environment
    from orchestrator_testlib import first_batch

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": f"{i}w"}) + "\n" for i in range(8)))
    env = {"name": "dataset", "args": {"path": str(data), "reward": f"{__name__}:broken_reward", "num_eval": 2}}
    assert load_environment(env["name"], **env["args"]).rubric.names == ["broken_reward"]
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=1,
                              advantage={"drop_zero_signal": False})  # fmt: skip
    with caplog.at_level("WARNING", logger="gyre_orchestrator.service"):
        batch = await first_batch(cfg, tiny_model)
    assert batch.num_samples == 8 and all(s["reward"] == 0.0 for s in batch.samples)
    warnings = [r.getMessage() for r in caplog.records if "broken_reward" in r.getMessage()]
    assert len(warnings) == 1 and "KeyError: 'difficulty'" in warnings[0]  # once, with the exception, not per sample
    (record,) = read_events(tmp_path / "run/events/orchestrator_steps.jsonl")
    assert record["reward_errors"] == {"broken_reward": 8}
    # and each sample's line in the rollout dump says why it scored 0 (its `details`)
    dumped = read_dump(cfg.output_dir, 1)
    assert len(dumped) == 8
    assert all(r["details"] == {"reward_errors": {"broken_reward": "KeyError: 'difficulty'"}} for r in dumped)


@pytest.mark.asyncio
async def test_batches_after_a_dead_lettered_step_are_deleted_before_their_steps_are_generated_again(
    tmp_path, redis_url, unique_run_id
):
    """The trainer dead-lettered batch 2 while 3 and 4 were already in the stream. The orchestrator starts over at
    step 2 and pushes 3 and 4 again, but the old 3 and 4 stayed: the trainer trained those (the oldest entry of a
    step wins) while the event log and the rollout dumps described the new ones (and a spilled step's file, written
    again, no longer matched the old entry's digest). They are deleted before anything is generated."""
    from gyre.batch import MicroBatch, TrainBatch
    from gyre.codec import encode_batch
    from gyre.weights import WeightStore

    def batch(step: int) -> bytes:
        mb = MicroBatch.from_samples([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "advantages": [0.0, 1.0, 1.0],
                                       "inference_logprobs": [0.0, -0.1, -0.2], "sample_index": 0}])  # fmt: skip
        return encode_batch(TrainBatch(step=step, micro_batches=[[mb]], samples=[{"task_index": 10 * step}],
                                       num_loss_tokens=2, num_samples=1))  # fmt: skip

    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, [], inference={"urls": [], "control_urls": []})
    WeightStore(cfg.output_dir / "weights").publish(1, lambda folder: (folder / "w.bin").write_bytes(b"1"))
    stream = BatchStream(redis_url, unique_run_id)
    try:
        for step in (1, 2, 3, 4):
            stream.push(step, batch(step))
        stream.dead_letter(next(e for e in stream.read("trainer") if e.step == 2), "spilled file missing")
        service = OrchestratorService(cfg)
        try:
            point = await service._resume_point()
        finally:
            service.redis.close()
        assert (point.start_step, point.task_index) == (2, 41)  # tasks after the deleted batches' too
        assert stream.steps_after(1) == []  # before: [4, 3]
    finally:
        stream.redis.delete(stream.key, stream.dead_key)
        stream.redis.close()


@pytest.mark.asyncio
async def test_a_restarted_orchestrator_continues_the_cumulative_counts_of_its_step_lines(
    tmp_path, redis_url, unique_run_id, replicas
):
    # The cumulative counts of orchestrator_steps.jsonl (reward_errors, scoring_failures, signals) restarted at 0 with
    # the process, so a resumed run's plots dropped to 0 at every restart; and the run's totals (PRIME-RL's
    # progress/total_samples and total_tokens, the x-axis of its plots) were not logged at all
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": f"{i}w"}) + "\n" for i in range(32)))
    env = {"name": "dataset", "args": {"path": str(data), "reward": f"{__name__}:broken_reward", "num_eval": 2}}
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=2, max_async_level=50,
                              ckpt_interval=1, advantage={"drop_zero_signal": False})  # fmt: skip
    assert await asyncio.wait_for(OrchestratorService(cfg).run(), timeout=120) == 0
    starting = OrchestratorService(cfg.model_copy(update={"max_steps": 3, "resume_step": -1}))
    try:  # before its first push, gyre_orchestrator_step says where the run stands (the series was absent)
        await asyncio.wait_for(starting.start(), timeout=60)
        assert starting.metrics.registry.get_sample_value("gyre_orchestrator_step", {"run_id": cfg.run_id}) == 2
    finally:
        await starting.close()
    resumed = OrchestratorService(cfg.model_copy(update={"max_steps": 3, "resume_step": -1}))
    assert await asyncio.wait_for(resumed.run(), timeout=120) == 0
    lines = latest_per_step(read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl"))
    assert [e["step"] for e in lines] == [1, 2, 3]
    # every rollout scored counts (those generated ahead for the next steps too): the resumed run's step 3 adds its 8
    # samples at least to what step 2's line said
    errors = [e["reward_errors"]["broken_reward"] for e in lines]
    assert 8 <= errors[0] <= errors[1] and errors[2] >= errors[1] + 8, errors
    assert [e["total_samples"] for e in lines] == [8, 16, 24]
    assert [e["total_tokens"] for e in lines] == list(np.cumsum([e["num_tokens"] for e in lines]))
    assert [e["total_generated_groups"] for e in lines] == list(np.cumsum([e["generated_groups"] for e in lines]))

    # a rewind to step 2 continues from step 2's line, not from the abandoned step 3's
    rewound = OrchestratorService(cfg.model_copy(update={"max_steps": 3, "resume_step": 2}))
    assert await asyncio.wait_for(rewound.run(), timeout=120) == 0
    lines = latest_per_step(read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl"))
    assert lines[-1]["reward_errors"]["broken_reward"] >= errors[1] + 8 and lines[-1]["total_samples"] == 24
