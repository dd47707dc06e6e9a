"""The relay rolls replicas back exactly when the trainer rewinds (two real inference processes).

A rewinding trainer (`ckpt.resume_step = s`) deletes the weights versions newer than `s`
(`WeightStore.discard_after`, what `gyre_trainer` does), republishes `s` and announces it. The
replicas refuse an older version unless `UpdateWeights` carries `rollback` (checked first, on a real
server), so the relay must set it then, and only then: a late announcement of an old step while the
newer versions are still published must not move anything.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from gyre.events import EventLog, read_events
from gyre.transport import FolderStore
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightStore
from gyre_orchestrator.client import close_replica_clients
from gyre_orchestrator.relay import WeightRelay
from gyre_orchestrator.replicas import ReplicaSet, static_endpoints
from gyre_orchestrator.scheduler import VersionWatch
from orchestrator_testlib import publish_weights

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


def _relay(replicas, store: WeightStore, events: EventLog) -> tuple[WeightRelay, ReplicaSet]:
    replica_set = ReplicaSet(static_endpoints([r.url for r in replicas], [r.control for r in replicas], 0))
    relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events,
                        probe_interval_s=0.2, poll_store_s=0.2, retries=0)  # fmt: skip
    return relay, replica_set


@contextlib.asynccontextmanager
async def _running(replicas, store: WeightStore, events: EventLog):
    """A started relay over `store`, stopped (and its gRPC channels closed) on exit."""
    relay, replica_set = _relay(replicas, store, events)
    try:
        await relay.start()
        yield relay
    finally:
        await relay.stop()
        await close_replica_clients(list(replica_set))


async def _served(replicas, step: int, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while [r.status().step for r in replicas] != [step] * len(replicas):
        assert asyncio.get_running_loop().time() < deadline, [r.status().step for r in replicas]
        await asyncio.sleep(0.1)


async def test_relay_rolls_replicas_back_when_the_trainer_rewinds(tmp_path, replicas, tiny_model):
    store = WeightStore(tmp_path / "weights")
    for step in (1, 2, 3):
        publish_weights(store, step, tiny_model)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        async with _running(replicas, store, events) as relay:
            assert await relay.wait_served(3, timeout=60)

            # the real server refuses going back without the flag (a late retry must not roll back)
            with grpc.insecure_channel(replicas[0].control) as channel, pytest.raises(grpc.RpcError) as refused:
                inference_pb2_grpc.InferenceControlStub(channel).UpdateWeights(
                    inference_pb2.UpdateWeightsRequest(version=store.version(1).to_proto()), timeout=60
                )
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert replicas[0].status().step == 3

            # a late announcement of step 1 while 2 and 3 are still published: nothing moves
            assert relay.notify(store.version(1)) is False
            await asyncio.sleep(1.0)
            assert relay.latest_step == 3 and [r.status().step for r in replicas] == [3, 3]

            # the trainer rewinds to 1: versions 2 and 3 are deleted, 1 is republished and announced
            assert store.discard_after(1) == [2, 3]
            publish_weights(store, 1, tiny_model)
            assert relay.notify(store.version(1)) is True
            await _served(replicas, 1)
            assert relay.latest_step == 1
            # the replicas answer before the relay has handled both replies and rewritten its in-use
            # record: wait for the record (it must drop the abandoned 3), not for a fixed moment
            deadline = asyncio.get_running_loop().time() + 30
            while store.in_use() != {1}:
                assert asyncio.get_running_loop().time() < deadline, store.in_use()
                await asyncio.sleep(0.1)
            rollbacks = [e for e in read_events(events.path) if e["step"] == 1]
            assert {e["replica"] for e in rollbacks if e["ok"]} == {r.url for r in replicas}

            # training goes on from there: step 2 of the new branch is an ordinary forward update
            publish_weights(store, 2, tiny_model)
            assert relay.notify(store.version(2)) is True
            await _served(replicas, 2)


async def test_a_relay_started_after_a_rewind_rolls_back_replicas_serving_an_abandoned_version(
    tmp_path, replicas, tiny_model
):
    """The whole run restarted with `--ckpt.resume-step`: the inference pods kept serving the newest
    version of the old branch, which the store no longer holds; the new relay finds that by itself."""
    store = WeightStore(tmp_path / "weights")
    for step in (1, 2):
        publish_weights(store, step, tiny_model)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        async with _running(replicas, store, events) as relay:
            assert await relay.wait_served(2, timeout=60)
        store.discard_after(1)  # the rewinding trainer, while no relay runs
        async with _running(replicas, store, events) as relay:
            await _served(replicas, 1)
            assert relay.latest_step == 1


async def test_a_rewind_to_the_base_model_reloads_every_replica(tmp_path, replicas, tiny_model):
    """`ckpt.resume_step = 0` deletes every version: a running relay (it sees the empty store when it
    polls) and a relay started afterwards both bring the replicas back to version 0 (ReloadWeights), and
    the abandoned version never becomes the policy version rollouts are tagged with."""
    store = WeightStore(tmp_path / "weights")
    publish_weights(store, 1, tiny_model)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        async with _running(replicas, store, events) as relay:
            assert await relay.wait_served(1, timeout=60)
            assert store.discard_after(0) == [1]  # the rewinding trainer
            await _served(replicas, 0)
            assert relay.target is None and relay.latest_step == 0
            deadline = asyncio.get_running_loop().time() + 30  # the relay logs a reply after the replica answered
            while [e["step"] for e in read_events(events.path) if e["ok"]][-2:] != [0, 0]:
                assert asyncio.get_running_loop().time() < deadline, read_events(events.path)
                await asyncio.sleep(0.1)

        publish_weights(store, 1, tiny_model)  # the old branch again, served, then rewound with no relay
        async with _running(replicas, store, events) as relay:
            assert await relay.wait_served(1, timeout=60)
        store.discard_after(0)
        async with _running(replicas, store, events) as relay:
            assert relay.target is None
            await _served(replicas, 0)
            relay.reconcile()
            assert relay.versions.value == 0  # replicas served version 1 when the relay started: not this run's


async def test_a_rewinding_orchestrator_relays_nothing_until_the_trainer_deleted_the_abandoned_versions(
    tmp_path, redis_url, unique_run_id, monkeypatch
):
    """Rewind to step 1 of a run that published 1..3. An orchestrator that starts before the trainer has deleted 2 and
    3 (the trainer does so as it starts, after loading its model; in Kubernetes both pods start at once) relayed 3,
    the abandoned policy, to the replicas and generated the rewound run's first batches from it. It now waits for
    the deletion (no replica is needed to see what it would relay)."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre_orchestrator import resume as resume_module
    from gyre_orchestrator import service as service_module
    from gyre_orchestrator.progress import Progress, ProgressStore

    out = tmp_path / "run"
    store = WeightStore(out / "weights")
    for step in (1, 2, 3):
        store.publish(step, lambda folder, step=step: (folder / "weights.bin").write_bytes(bytes([step]) * 64))
    ProgressStore(out / "checkpoints" / "orchestrator").save(Progress(step=1, task_index=8))
    cfg = load_config(OrchestratorConfig, [], run_id=unique_run_id, output_dir=str(out), redis={"url": redis_url},
                      resume_step=1, server={"port": 0}, metrics={"port": 0}, relay={"timeout_s": 0.2},
                      inference={"urls": ["http://127.0.0.1:9"], "control_urls": ["127.0.0.1:9"]})  # fmt: skip
    service = service_module.OrchestratorService(cfg)
    start = asyncio.create_task(service.start())
    try:
        await asyncio.sleep(1.5)
        assert service.relay.target is None and not start.done()  # before: version 3 was the relay's target
        store.discard_after(1)  # the rewinding trainer
        await asyncio.wait_for(start, timeout=30)
        assert service.relay.target.step == 1 and service.scheduler.next_close == 2
        # a trainer that was never rewound: the orchestrator goes on after REWIND_WAIT_S, as it did without waiting
        store.publish(2, lambda folder: (folder / "weights.bin").write_bytes(b"2" * 64))
        monkeypatch.setattr(resume_module, "REWIND_WAIT_S", 0.3)
        # 0.3 s here against 600 s unpatched: a generous ceiling (it was 5 s) still tells them apart
        await asyncio.wait_for(resume_module.await_trainer_rewind(service.transport, 1, poll_s=0.05), timeout=60)
    finally:
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        await service.close()


async def test_a_rewind_deletes_the_abandoned_progress_checkpoints(tmp_path, redis_url, unique_run_id):
    """A run that pushed steps 1..5 (progress checkpoints 3, 4, 5 kept) rewound to the base model: the abandoned 3..5
    stayed the newest checkpoints, so retention deleted the rewound run's checkpoint 1 as soon as it was written (a
    later rewind to the trainer's checkpoint 1 was refused for want of it) and a restart resumed from step 5's task
    position and counters. The rewind deletes them with the stream's batches after the step."""
    from gyre.config import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre_orchestrator.progress import Progress, ProgressStore, resume_point
    from gyre_orchestrator.service import OrchestratorService

    out = tmp_path / "run"
    for step in (3, 4, 5):
        ProgressStore(out / "checkpoints" / "orchestrator").save(Progress(step=step, task_index=8 * step))
    cfg = load_config(OrchestratorConfig, [], run_id=unique_run_id, output_dir=str(out), redis={"url": redis_url},
                      resume_step=0, ckpt_interval=1, ckpt_keep_last=3, server={"port": 0}, metrics={"port": 0},
                      relay={"timeout_s": 0.2},
                      inference={"urls": ["http://127.0.0.1:9"], "control_urls": ["127.0.0.1:9"]})  # fmt: skip
    service = OrchestratorService(cfg)
    try:
        await asyncio.wait_for(service.start(), timeout=30)
        assert service.scheduler.next_close == 1
        service.progress.save(Progress(step=1, task_index=8))  # what pushing the rewound run's step 1 writes
        assert service.progress.steps() == [1]
        assert resume_point(None, service.progress, committed=1, stream_steps=[]).task_index == 8  # a restart
    finally:
        await service.close()
