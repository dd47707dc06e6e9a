"""Replicas that come and go mid-run, with real `gyre inference` replicas and a running orchestrator: one that comes
back (restarted, or added while it still loads its model) gets the current weights and rejoins as soon as it is
ready; one that discovery drops (scaled down) finishes the requests it holds.

Only replicas in rotation were probed: a restarting replica's cooldown doubled with every failed probe, and once
ready it sat out the rest of it before the relay noticed it and updated it; a replica added while loading refused
UpdateWeights (UNAVAILABLE, the model is not loaded yet) until the relay's retries were spent, then sat out a
cooldown. The cooldown here (60 s) is longer than a tiny model's restart, so the old code fails the deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from gyre.events import read_events
from gyre.inference_process import InferenceProcess
from gyre.net import free_port
from gyre.weights import WeightStore
from gyre_orchestrator.replicas import Endpoint
from gyre_orchestrator.service import OrchestratorService
from orchestrator_testlib import orchestrator_config, publish_weights
from support.inference import TEST_ENV

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

REJOIN_S = 15.0  # from its ready line to serving the current weights and answering requests again


def replica_process(model: Path, port: int, control: int, log_path: Path) -> InferenceProcess:
    """`gyre inference` on fixed ports (a restart comes back at the same address), started, not waited for."""
    process = InferenceProcess("--model.name", str(model), "--server.port", str(port), "--control.port", str(control),
                               "--engine.threads", "1", log_path=log_path)  # fmt: skip
    process.start(env=TEST_ENV, quiet=True)
    return process


async def until(condition, timeout: float, what: str, run: asyncio.Task) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert not run.done(), run
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def config(tmp_path, redis_url, run_id, replicas, **relay):
    # no trainer: the async bound lets the orchestrator generate ahead (every replica in rotation gets requests)
    return orchestrator_config(
        tmp_path, redis_url, run_id, replicas, max_steps=1000, max_async_level=50, batch_size=2,
        rollouts_per_example=2, sampling={"max_tokens": 8},
        inference={"failure_cooldown_s": 60.0}, relay={"poll_store_s": 0.2, **relay},
    )  # fmt: skip


async def rejoins(service, replica, ready_at: float, run: asyncio.Task) -> float:
    """Seconds from `ready_at` until `replica` serves weights version 1 and takes requests for it (`serves`: in
    rotation, its version confirmed since its failure)."""
    await until(lambda: replica.version == 1 and service.replicas.serves(replica, 1), 120,
                f"the replica never rejoined: {replica}", run)  # fmt: skip
    return time.monotonic() - ready_at


async def test_a_restarted_replica_gets_the_current_weights_and_rejoins_as_soon_as_it_is_ready(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    port, control = free_port(), free_port()
    first = replica_process(tiny_model, port, control, tmp_path / "first.log")
    back = None
    try:
        await asyncio.to_thread(first.wait_ready, 180)
        cfg = config(tmp_path, redis_url, unique_run_id, [replicas[0], first])
        service = OrchestratorService(cfg)
        run = asyncio.create_task(service.run())
        try:
            await until(lambda: service.last_step >= 1, 120, "no step pushed", run)
            await asyncio.to_thread(publish_weights, WeightStore(cfg.output_dir / "weights"), 1, tiny_model)
            await until(lambda: [r.version for r in service.replicas] == [1, 1], 60, "version 1 not relayed", run)
            replica = service.replicas.replicas[first.url]

            first.kill()  # a crash; it comes back at the same address on the base model
            await until(lambda: replica.failures >= 1, 30, "the dead replica was never noticed", run)
            back = replica_process(tiny_model, port, control, tmp_path / "back.log")
            await asyncio.to_thread(back.wait_ready, 180)
            seconds = await rejoins(service, replica, time.monotonic(), run)
            assert seconds < REJOIN_S, f"rejoined {seconds:.1f}s after it was ready"
            assert back.ready.version == 0  # it restarted on the base model: the relay brought it to version 1
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        updates = [e for e in read_events(service.relay_events.path) if e["replica"] == first.url]
        assert [e["step"] for e in updates if e["ok"]] == [1, 1], updates  # before the crash, and once it was back
    finally:
        for process in (first, back):
            if process is not None:
                process.kill()


async def test_a_replica_added_while_it_loads_its_model_rejoins_as_soon_as_it_is_ready(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    """Discovery (DNS, or a Kubernetes readiness probe on /health) can list a replica before its model is loaded.
    One retry (1 s of backoff) stands for a model that loads for longer than the relay's retries wait (7 s)."""
    cfg = config(tmp_path, redis_url, unique_run_id, [replicas[0]], retries=1)
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    port, control = free_port(), free_port()
    added = None
    try:
        await until(lambda: service.last_step >= 1, 120, "no step pushed", run)
        await asyncio.to_thread(publish_weights, WeightStore(cfg.output_dir / "weights"), 1, tiny_model)
        await until(lambda: [r.version for r in service.replicas] == [1], 60, "version 1 not relayed", run)

        added = replica_process(tiny_model, port, control, tmp_path / "added.log")
        url = f"http://127.0.0.1:{port}"
        service.discovery.apply([*service.discovery.endpoints, Endpoint(url=url, control=f"127.0.0.1:{control}")])
        await asyncio.to_thread(added.wait_ready, 180)
        seconds = await rejoins(service, service.replicas.replicas[url], time.monotonic(), run)
        assert seconds < REJOIN_S, f"rejoined {seconds:.1f}s after it was ready"
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if added is not None:
            added.kill()


async def test_a_replica_that_discovery_drops_finishes_its_requests_in_flight(
    tmp_path, redis_url, unique_run_id, replicas, caplog
):
    """A scale-down removes a pod from its Service while it still answers what it holds (its server drains them in
    its shutdown grace). Its clients were closed at once: all its requests in flight (32 here) were aborted, retried
    on the other replica (each using up one of its retries), and the replica was logged as failed."""
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=3, max_async_level=50,
                              batch_size=4, rollouts_per_example=4, sampling={"max_tokens": 64})  # fmt: skip
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    leaving = replicas[1].url
    await until(lambda: service.replicas.replicas and service.replicas.replicas[leaving].inflight > 0, 120,
                "no request reached the replica", run)  # fmt: skip
    replica = service.replicas.replicas[leaving]
    held = replica.inflight
    before = len(caplog.records)  # an earlier test's logging set-up may have let the INFO "replicas: ..." line in
    with caplog.at_level("WARNING", logger="gyre_orchestrator"):
        service.discovery.apply([e for e in service.discovery.endpoints if e.url != leaving])  # scaled down
        assert await asyncio.wait_for(run, timeout=200) == 0
    assert replica.requests >= held and service.client.stats["retries"] == 0  # it answered them, nothing was redone
    warnings = [r.getMessage() for r in caplog.records[before:] if r.levelno >= logging.WARNING]
    assert not [line for line in warnings if leaving in line]  # and it did not "fail"
    lines = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert [e["failed_rollouts"] for e in lines] == [0, 0, 0]
    assert not replica.clients.get("openai")  # its clients closed once it was done
