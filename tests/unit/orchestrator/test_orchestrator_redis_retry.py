"""The orchestrator's Redis calls ride out an outage (backoff, deadline) on a real redis-server.

Issue 17, defect 4: a push (XADD) while Redis restarted raised ConnectionError and ended the run.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from gyre.config import load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre.redis_server import EmbeddedRedis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def service(tmp_path, url: str, deadline_s: float = 30.0):
    """An orchestrator service (not started: only its Redis path is used); call inside an event loop."""
    from gyre_orchestrator.service import OrchestratorService

    cfg = load_config(
        OrchestratorConfig,
        [],
        output_dir=str(tmp_path),
        run_id="retry",
        redis={"url": url, "retry_deadline_s": deadline_s},
    )
    return OrchestratorService(cfg)


def test_defect_4_push_survives_a_redis_restart(tmp_path):
    server = EmbeddedRedis().start()
    port = server.port
    server.stop()  # the outage begins
    replacement = EmbeddedRedis(port=port)

    async def main():
        orch = service(tmp_path, f"redis://127.0.0.1:{port}/0")
        asyncio.get_running_loop().call_later(1.5, replacement.start)  # the retries run in a worker thread
        started = time.monotonic()
        entry = await orch._redis(lambda: orch.stream.push(1, b"payload"), "pushing batch 1")
        waited = time.monotonic() - started
        latest = orch.stream.latest_step()
        orch.redis.close()
        return entry, waited, latest

    try:
        entry, waited, latest = asyncio.run(main())
        assert entry and latest == 1
        assert waited >= 1.0  # it really waited for the new server
    finally:
        replacement.stop()


def test_gives_up_after_the_deadline_naming_what_it_was_doing(tmp_path):
    from gyre.net import free_port
    from gyre.redis_retry import RedisUnavailable

    async def main():
        orch = service(tmp_path, f"redis://127.0.0.1:{free_port()}/0", deadline_s=1.0)
        try:
            await orch._redis(lambda: orch.stream.push(3, b"x"), "pushing batch 3")
        finally:
            orch.redis.close()

    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="pushing batch 3"):
        asyncio.run(main())
    assert time.monotonic() - started < 5


def test_a_cancel_stops_the_retries_at_once(tmp_path):
    from gyre.net import free_port

    async def main():
        orch = service(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
        task = asyncio.create_task(orch._redis(lambda: orch.stream.latest_step(), "reading the stream"))
        await asyncio.sleep(1.0)
        cancelled = time.monotonic()
        task.cancel()  # what SIGTERM does in `gyre orchestrator`
        with pytest.raises(asyncio.CancelledError):
            await task
        orch.redis.close()
        return time.monotonic() - cancelled

    assert asyncio.run(main()) < 1.0


def test_redis_back_without_the_pending_batches_is_noticed(tmp_path):
    # Redis restarted without persistence while the orchestrator ran: batches 1..3 were pushed and not
    # trained yet. The trainer would wait for batch 1 forever; the orchestrator must start over.
    from gyre_orchestrator.stream_guard import StreamLost

    first = EmbeddedRedis().start()
    port = first.port

    async def main():
        orch = service(tmp_path, first.url)
        for step in (1, 2, 3):
            orch.stream.push(step, b"batch")
        orch.guard.seen = orch.guard.marks()  # what start() records
        orch.last_step = 3
        await orch.guard.check(orch.last_step)  # same server: nothing to do
        first.stop()
        second = EmbeddedRedis(port=port).start()  # same address, empty
        try:
            with pytest.raises(StreamLost, match=r"steps \[1, 2, 3\].*from step 1"):
                await orch.guard.check(orch.last_step)
        finally:
            orch.redis.close()
            second.stop()

    asyncio.run(main())


def test_redis_back_with_its_data_is_fine(tmp_path):
    data = tmp_path / "redis"
    first = EmbeddedRedis(data_dir=data).start()
    port = first.port

    async def main():
        orch = service(tmp_path, first.url)
        for step in (1, 2):
            orch.stream.push(step, b"batch")
        orch.guard.seen = orch.guard.marks()  # what start() records
        orch.last_step = 2
        first.stop()
        second = EmbeddedRedis(port=port, data_dir=data).start()
        try:
            await orch.guard.check(orch.last_step)  # restarted (new run id), but every batch is still there
            assert orch.guard.seen[0] == orch.redis.info("server")["run_id"]  # the new server, taken as seen
        finally:
            orch.redis.close()
            second.stop()

    asyncio.run(main())


def pushed(orch, step: int) -> None:
    """Push batch `step` and record it as the orchestrator's push path does."""
    from gyre.streams import stream_id

    orch.guard.pushed_id = orch.guard.untrained_ids[step] = stream_id(orch.stream.push(step, b"batch"))
    orch.last_step = step


def after_pushes(tmp_path, steps, then) -> None:
    """On a Redis of its own, a service that pushed `steps` and recorded the stream marks as start() does; then
    `await then(orch)`."""
    server = EmbeddedRedis().start()

    async def main():
        orch = service(tmp_path, server.url)
        try:
            for step in steps:
                pushed(orch, step)
            orch.guard.seen = orch.guard.marks()
            await then(orch)
        finally:
            orch.redis.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_stream_deleted_and_pushed_to_again_between_two_checks_is_noticed(tmp_path):
    # audit: DEL of the stream key, then our next push (which recreates the stream) before the 5 s watch looked:
    # the newest id was ours and the push count intact, so batches 1..3 were gone unnoticed and the trainer,
    # whose group was recreated on the new stream, waited for batch 1 forever
    from gyre_orchestrator.stream_guard import StreamLost

    async def then(orch):
        await orch.guard.check(orch.last_step)  # nothing lost yet
        orch.redis.delete(orch.stream.key)
        pushed(orch, 4)
        with pytest.raises(StreamLost, match=r"emptied .* steps \[1, 2, 3\].*from step 1"):
            await orch.guard.check(orch.last_step)

    after_pushes(tmp_path, (1, 2, 3), then)


def test_the_oldest_batch_dead_lettered_is_still_told_as_a_dead_letter(tmp_path):
    from gyre.streams import StepReader
    from gyre_orchestrator.stream_guard import StreamLost

    async def then(orch):
        reader = StepReader(orch.stream, "trainer-rank0")
        reader.reject(reader.next(block_ms=1000), "cannot read spilled payload")
        with pytest.raises(StreamLost, match=r"dead-lettered \(cannot read spilled payload\)") as e:
            await orch.guard.check(orch.last_step)
        assert e.value.rejected == "cannot read spilled payload"

    after_pushes(tmp_path, (1, 2), then)


def test_a_redis_that_evicts_when_full_is_reported_once_with_its_memory(tmp_path, caplog):
    """A managed Redis often evicts keys at maxmemory (allkeys-lru): full, it would delete batch streams. The
    orchestrator reads Redis's memory after each push (gyre_orchestrator_redis_memory_bytes) and warns once."""
    server = EmbeddedRedis().start()

    async def main():
        orch = service(tmp_path, server.url)
        orch.redis.config_set("maxmemory", str(64 << 20))
        orch.redis.config_set("maxmemory-policy", "allkeys-lru")
        for _ in range(2):
            await orch._redis(orch.guard.note_redis_memory, "reading redis memory")
        text = generate_latest(orch.metrics.registry).decode()
        orch.redis.config_set("maxmemory-policy", "noeviction")
        orch.redis.close()
        return text

    try:
        text = asyncio.run(main())
    finally:
        server.stop()
    memory = {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "gyre_orchestrator_redis_memory_bytes"}  # fmt: skip
    assert memory["max"] == 64 << 20 and 0 < memory["used"] < memory["max"], memory
    warned = [r.getMessage() for r in caplog.records if "evicts keys" in r.getMessage()]
    assert len(warned) == 1 and "allkeys-lru" in warned[0] and "noeviction" in warned[0], warned


def test_the_dead_letters_held_and_trimmed_are_exported(tmp_path):
    """The trainer keeps only the newest dead letters (gyre.streams.DEAD_MAXLEN; 1000 whole batches were up to
    8 GiB of a Redis that stops the run when full): the stream watch exports how many it holds and trimmed."""
    from gyre.streams import BatchStream, StepReader
    from gyre_orchestrator.stream_guard import StreamLost

    def dead_letters(orch) -> dict[str, float]:
        text = generate_latest(orch.metrics.registry).decode()
        return {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "gyre_orchestrator_dead_letters"}  # fmt: skip

    async def then(orch):
        assert dead_letters(orch) == {"held": 0, "trimmed": 0}  # from the start, before any dead letter
        trainer = BatchStream(orch.redis, orch.cfg.run_id, dead_maxlen=2)
        reader = StepReader(trainer, "trainer-rank0")
        for _ in range(5):
            reader.reject(reader.next(block_ms=1000), "cannot read spilled payload")
            with pytest.raises(StreamLost):
                await orch.guard.check(orch.last_step)
            pushed(orch, 1)  # generated again
        assert dead_letters(orch) == {"held": 2, "trimmed": 3}

    after_pushes(tmp_path, (1,), then)
