"""The orchestrator against two real inference processes, a real Redis and a simulated trainer.

The trainer side is simulated (it does not train) but real at every interface the orchestrator sees:
it reads the stream through the consumer group, decodes every batch, publishes weights with
`WeightStore` and calls `NotifyWeights` over gRPC; the replicas really load each version.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from gyre.events import EventLog, read_events
from gyre.net import free_port
from gyre.transport import FolderStore
from gyre.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from gyre.weights import WeightStore
from gyre_orchestrator.client import close_replica_clients
from gyre_orchestrator.relay import WeightRelay, WeightsRefused
from gyre_orchestrator.replicas import ReplicaSet, static_endpoints
from gyre_orchestrator.scheduler import VersionWatch
from gyre_orchestrator.service import OrchestratorService
from orchestrator_testlib import SimulatedTrainer, orchestrator_config, publish_weights
from prometheus_client import generate_latest

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def run_with_trainer(cfg, tiny_model, steps: int, train_s: float = 0.0):
    service = OrchestratorService(cfg)
    trainer = SimulatedTrainer(
        cfg.redis.url, cfg.run_id, cfg.output_dir, tiny_model, lambda: f"127.0.0.1:{service.server.port}", train_s
    )
    try:
        code, _ = await asyncio.wait_for(asyncio.gather(service.run(), trainer.run(steps)), timeout=240)
    finally:
        trainer.close()
    return service, trainer, code


async def test_batches_flow_weights_relay_and_the_bound_holds(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model, caplog
):
    caplog.set_level("INFO", logger="gyre_orchestrator.records")
    k, steps = 1, 4
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_steps=steps, max_async_level=k,
        final_weights_timeout_s=60, eval={"interval": 2, "num_examples": 2},
    )  # fmt: skip
    service, trainer, code = await run_with_trainer(cfg, tiny_model, steps, train_s=0.2)
    assert code == 0

    # batches landed in the stream, decoded, in order, each with 2 groups x 4 samples
    assert [b.step for b in trainer.batches] == [1, 2, 3, 4]
    for batch in trainer.batches:
        assert batch.num_samples == 8 and batch.temperature == cfg.sampling.temperature
        assert all(mb.num_tokens <= cfg.batch.seq_len for rank in batch.micro_batches for mb in rank)
        for sample in batch.samples:
            # the async bound, as recorded per sample
            assert sample["min_version"] >= batch.step - 1 - k
            assert sample["lag"] == batch.step - 1 - sample["min_version"] <= k
            assert sample["env"] == "reverse_text" and sample["num_loss_tokens"] >= 1
    assert len({s["task_id"] for b in trainer.batches for s in b.samples}) == 2 * steps  # no task twice

    # the final version was relayed to both replicas before the orchestrator exited
    assert [r.status().step for r in replicas] == [steps, steps]
    relay = read_events(cfg.output_dir / "events" / "weight_relay.jsonl")
    for version in range(1, steps + 1):
        ok = {e["replica"] for e in relay if e["step"] == version and e["ok"]}
        assert ok <= {r.url for r in replicas} and len(ok) >= 1
    assert {e["replica"] for e in relay if e["step"] == steps and e["ok"]} == {r.url for r in replicas}

    # both replicas served rollouts (load balancing)
    assert all(r.requests > 0 for r in service.replicas)

    # event log and metrics
    lines = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert [e["step"] for e in lines] == [1, 2, 3, 4]
    for e, batch in zip(lines, trainer.batches, strict=True):
        assert e["num_samples"] == 8 and e["min_version"] >= e["step"] - 1 - k and e["lag_max"] <= k
        assert e["num_tokens"] == sum(s["num_tokens"] for s in batch.samples)
        # what filtering cost this step: every generated group counted, the untrained tokens reported
        assert e["generated_groups"] == 2 + e["dropped_zero_signal"] <= 2 * cfg.advantage.oversample_limit
        trained = sum(s["num_loss_tokens"] for s in batch.samples)
        assert e["generated_tokens"] == trained + e["wasted_tokens"]
        assert e["waste_fraction"] == pytest.approx(e["wasted_tokens"] / e["generated_tokens"])
        assert e["tokens_per_s"] > 0  # throughput, as PRIME-RL logs it
    # the log line says what a PRIME-RL user watches: throughput and the off-policy lag (it had neither)
    pushed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pushed step")]
    assert len(pushed) == steps and all("off-policy lag" in m and " tokens/s" in m for m in pushed), pushed
    evals = read_events(cfg.output_dir / "events" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(e["k"] == 1 and e["num_examples"] == 2 and 0 <= e["pass_at_k"] <= 1 for e in evals)
    text = generate_latest(service.metrics.registry).decode()
    assert f'gyre_orchestrator_step{{run_id="{unique_run_id}"}} 4.0' in text
    assert f'gyre_orchestrator_samples_total{{run_id="{unique_run_id}"}} 32.0' in text
    assert f'gyre_orchestrator_max_async_level{{run_id="{unique_run_id}"}} 1.0' in text
    assert "gyre_orchestrator_replica_policy_version" in text and "gyre_orchestrator_policy_lag_steps_bucket" in text
    generated = sum(e["generated_tokens"] for e in lines)
    assert f'gyre_orchestrator_generated_completion_tokens_total{{run_id="{unique_run_id}"}} {generated}.0' in text


async def test_on_start_published_weights_are_relayed_before_rollouts(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=3, resume_step=-1)
    store = WeightStore(cfg.output_dir / "weights")
    for step in (1, 2):
        publish_weights(store, step, tiny_model)
    service = OrchestratorService(cfg)
    assert await asyncio.wait_for(service.run(), timeout=120) == 0
    # published versions were discovered: the next batch is 3, and it came from version 2
    trainer_view = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")
    assert [e["step"] for e in trainer_view] == [3]
    assert trainer_view[0]["min_version"] == 2
    assert [r.status().step for r in replicas] == [2, 2]
    assert store.in_use() == {2}


async def test_notify_weights_makes_both_replicas_serve_it(tmp_path, redis_url, unique_run_id, replicas, tiny_model):
    token = "s3cret"
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_steps=2, max_async_level=0,
        server={"port": 0, "control_token": token}, final_weights_timeout_s=120,
    )  # fmt: skip
    # the run ends only once version 2 is served, so the server is still up for GetStatus after step 2 is pushed
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    while service.server.port is None or service.last_step < 1:
        await asyncio.sleep(0.05)
    address = f"127.0.0.1:{service.server.port}"
    store = WeightStore(cfg.output_dir / "weights")
    published = publish_weights(store, 1, tiny_model)
    request = orchestrator_pb2.NotifyWeightsRequest(version=published.to_proto())
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.NotifyWeights(request, timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {token}"),)
        bad = orchestrator_pb2.NotifyWeightsRequest(version=replace(published, digest="0" * 64).to_proto())
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.NotifyWeights(bad, timeout=10, metadata=auth)
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for _ in range(2):  # idempotent
            reply = await stub.NotifyWeights(request, timeout=10, metadata=auth)
            assert reply.accepted and reply.latest_step == 1
        # health needs no token (Kubernetes probes send none) and says SERVING once started
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        while {r.url: r.version for r in service.replicas} != {r.url: 1 for r in replicas}:
            await asyncio.sleep(0.05)
        status = await stub.GetStatus(orchestrator_pb2.GetOrchestratorStatusRequest(), timeout=10, metadata=auth)
        assert status.latest_weights_step == 1 and list(status.in_use_steps) == [1]
        assert {(r.address, r.step, r.healthy) for r in status.replicas} == {(r.url, 1, True) for r in replicas}
        # step 2 (k=0) needs version 1: it is generated only once a replica serves it; the run then waits for
        # the final version 2, relayed like the first. Published once batch 2 is pushed, as a trainer does: weights 2
        # before that say the trainer trained step 2 from a batch pushed before, and batch 2 is not pushed (e817d57)
        while service.last_step < 2:
            await asyncio.sleep(0.05)
        final = publish_weights(store, 2, tiny_model)
        reply = await stub.NotifyWeights(orchestrator_pb2.NotifyWeightsRequest(version=final.to_proto()), timeout=10,
                                         metadata=auth)  # fmt: skip
        assert reply.accepted and reply.latest_step == 2
        assert await asyncio.wait_for(run, timeout=120) == 0
    assert [r.status().step for r in replicas] == [2, 2]
    batch2 = read_events(cfg.output_dir / "events" / "orchestrator_steps.jsonl")[-1]
    assert batch2["step"] == 2 and batch2["min_version"] == 1


async def test_relay_brings_back_a_replica_that_fell_back_to_the_base_model(tmp_path, replicas, tiny_model):
    store = WeightStore(tmp_path / "weights")
    publish_weights(store, 1, tiny_model)
    replica_set = ReplicaSet(static_endpoints([r.url for r in replicas], [r.control for r in replicas], 0))
    versions = VersionWatch(0)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        transport = FolderStore(store.root)
        relay = WeightRelay(replica_set, transport, versions, events=events, probe_interval_s=0.2, poll_store_s=0.2)
        try:
            await relay.start()  # finds version 1 on the volume by itself
            assert await relay.wait_served(1, timeout=60) and versions.value == 1
            replicas[0].reload_base()  # what a restarted replica looks like: the base model, version 0
            await until(
                lambda: [e["replica"] for e in read_events(events.path) if e["ok"]].count(replicas[0].url) >= 2,
                "the relay did not notice the regression",
            )
            assert [r.status().step for r in replicas] == [1, 1]
            assert store.in_use() == {1}
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_a_frozen_replica_s_probe_does_not_hold_back_the_other_replica_s_update(
    tmp_path, replicas, start_replica, tiny_model
):
    """The relay's loop awaited its status probes: a replica that does not answer (frozen: SIGSTOP) held the loop for
    the probe's timeout, and a new version reached the other replicas only after it (5 s late each time a frozen
    replica came back from its cooldown; here the timeout is 120 s). Probes now run beside the loop. The healthy
    replica has 60 s to load the version: far less than the frozen probe holds, however loaded the machine (it was
    15 s against 30 s)."""
    frozen = start_replica()
    store = WeightStore(tmp_path / "weights")
    replica_set = ReplicaSet(
        static_endpoints([replicas[0].url, frozen.url], [replicas[0].control, frozen.control], 0), cooldown_s=0.5
    )
    relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), probe_interval_s=0.2,
                        probe_timeout_s=120.0, poll_store_s=0.2)  # fmt: skip
    healthy = replica_set.replicas[replicas[0].url]
    try:
        await relay.start()
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)  # a probe of the frozen replica is under way, for 120 s
            publish_weights(store, 1, tiny_model)  # found by the store poll
            await until(lambda: healthy.version == 1, "the other replica waited for the frozen one", timeout=60)
            assert replicas[0].status().step == 1
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
    finally:
        await relay.stop()
        await close_replica_clients(list(replica_set))
        frozen.kill()


async def test_a_replica_restarted_on_the_base_model_is_not_taken_for_the_version_it_served(
    tmp_path, start_inference, tiny_model
):
    """Audit: a replica killed and restarted (the base model, version 0) came back into rotation when its cooldown
    ended still known to serve version 1: until the next probe, `wait_served(1)` said every replica served 1 (the
    final-weights wait exited on it), and rollouts of floor 1 went to it."""
    from support.inference import InferenceServer

    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    publish_weights(store, 1, tiny_model)
    replica_set = ReplicaSet(static_endpoints([replica.url], [replica.control], 0), cooldown_s=0.5)
    relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), probe_interval_s=3.0,
                        probe_timeout_s=1.0, poll_store_s=0.2)  # fmt: skip
    (known,) = list(replica_set)
    restarted = None
    try:
        await relay.start()
        assert await relay.wait_served(1, timeout=60) and known.version == 1
        port, control = replica.url.rsplit(":", 1)[1], replica.control.rsplit(":", 1)[1]
        replica.kill()
        await until(lambda: known.failures, "the relay did not notice the replica died")  # the next probe finds it gone
        restarted = await asyncio.to_thread(
            InferenceServer, tiny_model, "--server.port", port, "--control.port", control, log_dir=tmp_path
        )
        assert restarted.status().step == 0
        assert await relay.wait_served(1, timeout=60)
        assert restarted.status().step == 1  # said once it was so, not on the version known from before
        assert replica_set.eligible(1) == [known] and known.version == 1
    finally:
        await relay.stop()
        await close_replica_clients(list(replica_set))
        if restarted is not None:
            restarted.stop()


async def test_a_retried_update_sends_the_newest_version_not_the_one_it_first_tried(
    tmp_path, start_inference, tiny_model
):
    """Audit: `_update` read the target, then slept its backoff, then sent that target: a version published during
    the backoff was loaded only after the outdated one (for a large model, minutes of loading for nothing).

    No step waits on a clock: version 3 is learned the moment the updater yields after recording its failed try (in
    its backoff, where the old code had already read the target), and the only short deadline is that of the call to
    the frozen replica, which cannot answer whatever the machine's load. It was a 1 s deadline on every call and a
    3 s window to publish version 3 in: on a loaded CI machine loading a version took over 1 s, or publishing 3
    missed the window, and the calls were not the ones asserted."""
    import os
    import signal

    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    publish_weights(store, 1, tiny_model)
    replica_set = ReplicaSet(static_endpoints([replica.url], [replica.control], 0))
    loop = asyncio.get_running_loop()
    in_backoff = asyncio.Event()

    class FailureHook(EventLog):
        def append(self, record):
            record = super().append(record)
            if record["step"] == 2 and not record["ok"]:  # the first try failed; the updater goes on to its retry
                relay.timeout_s = 60.0  # the retry must succeed, however slowly the replica loads
                loop.call_soon(learn_version_3)  # runs once the updater yields: during its backoff
            return record

    def learn_version_3():
        publish_weights(store, 3, tiny_model)
        relay.poll_store()
        in_backoff.set()

    with FailureHook(tmp_path / "weight_relay.jsonl") as events:
        relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, timeout_s=60.0,
                            retries=2, backoff_s=1.0, probe_interval_s=600.0, poll_store_s=600.0)  # fmt: skip
        try:
            await relay.start()
            assert await relay.wait_served(1, timeout=120)
            relay.timeout_s = 1.0  # the frozen replica never answers: UpdateWeights(2) fails on this deadline
            os.killpg(replica.proc.pid, signal.SIGSTOP)
            try:
                publish_weights(store, 2, tiny_model)
                relay.poll_store()
                await asyncio.wait_for(in_backoff.wait(), timeout=120)
                assert relay.target.step == 3
            finally:
                os.killpg(replica.proc.pid, signal.SIGCONT)
            assert await relay.wait_served(3, timeout=120) and replica.status().step == 3
            calls = [(e["step"], e["ok"]) for e in read_events(events.path)]
            assert calls == [(1, True), (2, False), (3, True)], calls  # the retry went straight to 3
            # the failure names the setting: a replica slower to load than the deadline fails every retry alike
            (failed,) = [e for e in read_events(events.path) if not e["ok"]]
            assert "DEADLINE_EXCEEDED" in failed["error"] and "relay.timeout_s = 1 s" in failed["error"], failed
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_spilled_batches_are_deleted_once_trained(tmp_path, redis_url, unique_run_id, replicas, tiny_model):
    # audit: every payload above batch.inline_max_bytes (8 MiB: a real batch) stayed in {output_dir}/batches/
    # for good, one file per step, until the shared volume filled up
    k, steps = 1, 5
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, max_steps=steps, max_async_level=k,
        batch={"inline_max_bytes": 0}, final_weights_timeout_s=60,
    )  # fmt: skip
    service, trainer, code = await run_with_trainer(cfg, tiny_model, steps, train_s=0.2)
    assert code == 0 and [b.step for b in trainer.batches] == list(range(1, steps + 1))  # read from the files
    left = sorted(int(p.stem.split("_")[1]) for p in (cfg.output_dir / "batches").glob("step_*.bin"))
    # pushing step s waits for weights s-1-k, so by the last push the trainer had committed steps-1-k or more;
    # the files of the steps before that are gone, the rest (what a restarted trainer may still need) stay
    assert left and min(left) >= steps - 1 - k and max(left) == steps, left


async def until(condition, what, timeout: float = 30) -> None:
    """Wait until `condition()` holds; past `timeout` seconds fail saying `what` (a text, or a function giving one)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.05)


async def held(store: WeightStore, step: int, is_held: bool = True) -> None:
    """Wait until the relay declared version `step` held (`is_held`), or no longer held."""
    await until(lambda: (step in store.in_use()) == is_held, lambda: store.in_use())


async def test_a_version_a_replica_is_being_sent_is_not_pruned_when_a_newer_one_comes(
    tmp_path, start_inference, tiny_model
):
    """Audit: the relay held the versions replicas serve and its target, not one an UpdateWeights under way asks a
    replica to load. A version published while a replica loaded the one before moved the target on, and the trainer's
    pruning (`weights_keep_last = 1`) deleted the folder the replica was reading: its update failed and it served the
    old weights for one more round. The replica is frozen (SIGSTOP) while its update is under way, so the call is still
    in flight when the trainer publishes and prunes, however loaded the machine."""
    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    replica_set = ReplicaSet(static_endpoints([replica.url], [replica.control], 0))
    sent: list[int] = []
    sending = asyncio.Event()

    class Relay(WeightRelay):
        def _stub(self, r):  # notes each UpdateWeights as it goes out
            stub = super()._stub(r)
            call = stub.UpdateWeights

            def update(request, **kwargs):
                sent.append(request.version.step)
                sending.set()
                return call(request, **kwargs)

            stub.UpdateWeights = update
            return stub

    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        relay = Relay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, timeout_s=120.0,
                      retries=0, probe_interval_s=600.0, poll_store_s=600.0)  # fmt: skip
        try:
            await relay.start()
            os.killpg(replica.proc.pid, signal.SIGSTOP)
            try:
                relay.notify(publish_weights(store, 1, tiny_model))
                await asyncio.wait_for(sending.wait(), timeout=60)
                relay.notify(publish_weights(store, 2, tiny_model))  # the trainer's next step, while 1 is loaded
                await held(store, 2)  # the relay's loop has declared what it holds now
                store.prune(keep_last=1)  # what the trainer does after committing step 2
                assert store.steps() == [1, 2], "the version the replica is loading was pruned"
            finally:
                os.killpg(replica.proc.pid, signal.SIGCONT)
            assert await relay.wait_served(2, timeout=120) and replica.status().step == 2
            calls = [(e["step"], e["ok"]) for e in read_events(events.path)]
            assert sent == [1, 2] and calls == [(1, True), (2, True)], calls
            store.prune(keep_last=1)  # once served by none and sent to none, 1 goes
            assert store.steps() == [2]
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_a_version_whose_update_passed_its_deadline_stays_held_until_the_replica_reports(
    tmp_path, start_inference, tiny_model
):
    """Audit: the relay dropped its hold on a version once its UpdateWeights passed the deadline, while the replica
    (which finishes a load its caller gave up on) may still be reading it: a newer version moved the target on and the
    trainer's pruning deleted the folder under the replica. The replica is frozen (SIGSTOP) so the call cannot end
    before its deadline; the version stays held until the replica reports what it serves, then it goes."""
    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    replica_set = ReplicaSet(static_endpoints([replica.url], [replica.control], 0), cooldown_s=0.5)
    (known,) = list(replica_set)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, timeout_s=1.0,
                            retries=0, probe_interval_s=0.5, probe_timeout_s=0.5, poll_store_s=600.0)  # fmt: skip
        try:
            await relay.start()
            os.killpg(replica.proc.pid, signal.SIGSTOP)
            try:
                relay.notify(publish_weights(store, 1, tiny_model))
                await updated(relay, known)  # past its deadline: no answer
                (record,) = read_events(events.path)
                assert record["step"] == 1 and "DEADLINE_EXCEEDED" in record["error"], record
                relay.notify(publish_weights(store, 2, tiny_model))  # the trainer's next step
                await held(store, 2)  # the relay's loop has declared what it holds now
                store.prune(keep_last=1)  # what the trainer does after committing step 2
                assert store.steps() == [1, 2], "the version the replica may still be loading was pruned"
            finally:
                os.killpg(replica.proc.pid, signal.SIGCONT)
            assert await relay.wait_served(2, timeout=120) and replica.status().step == 2
            await held(store, 1, False)  # the replica's answer settled version 1: no longer held
            store.prune(keep_last=1)
            assert store.steps() == [2]
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_versions_sent_to_a_replica_that_is_down_are_not_held(tmp_path, start_inference, tiny_model):
    """A replica that is down (no process answers: UNAVAILABLE) loads nothing it is sent. Held like one past its
    deadline, every version published while it was down stayed held, and the trainer's pruning kept them all."""
    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    replica_set, known = beside_one_down(replica, cooldown_s=0.1)
    (down,) = [r for r in replica_set if r is not known]
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, retries=0,
                            probe_interval_s=0.2, poll_store_s=600.0)  # fmt: skip
        try:
            await relay.start()
            for step in (1, 2):
                relay.notify(publish_weights(store, step, tiny_model))
                await until(lambda step=step: any(e["replica"] == down.url and e["step"] == step
                                                  for e in read_events(events.path)),
                            lambda: read_events(events.path), timeout=60)  # fmt: skip
            # the replica that is up serves 2: nothing holds 1 for its sake
            await until(lambda: known.version == 2, lambda: known.version, timeout=60)
            await held(store, 1, False)
            store.prune(keep_last=1)
            assert store.steps() == [2]
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_a_replica_that_refuses_a_version_stays_in_rotation_on_its_own(tmp_path, start_inference, tiny_model):
    """Audit: a replica that answered UpdateWeights with FAILED_PRECONDITION (it checked the version and kept serving
    its own: here a volume that shows it the new folder late) was taken out of rotation like a dead one, so it
    generated nothing, not even for the batches its version may serve, until its cooldown ended. It now stays in
    rotation on its version and is sent the refused version again after a pause, which it then takes. The cooldown
    is long: the old code's replica would still be out when the test looks."""
    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    late = tmp_path / "late" / "step_1"  # where the replica's mount shows version 1, once it does
    replica_set = ReplicaSet(static_endpoints([replica.url], [replica.control], 0), cooldown_s=600.0)
    (known,) = list(replica_set)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        # the loop wakes each probe_interval_s: the refused version is sent again at the first wake after the pause
        relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, retries=1,
                            backoff_s=0.5, probe_interval_s=1.0, poll_store_s=600.0)  # fmt: skip
        try:
            await relay.start()
            relay.notify(replace(publish_weights(store, 1, tiny_model), locator=str(late)))
            await updated(relay, known)  # its two tries, refused
            assert [e["ok"] for e in read_events(events.path)] == [False, False]
            assert "FAILED_PRECONDITION" in read_events(events.path)[0]["error"]
            assert replica_set.in_rotation(known) and replica_set.eligible(0) == [known] and known.version == 0
            shutil.copytree(store.path(1), late)  # the volume shows it now: the next send, after the pause, loads it
            assert await relay.wait_served(1, timeout=60) and replica.status().step == 1
            assert relay.failure is None  # a refusal worth retrying never ends the run
        finally:
            await relay.stop()
            await close_replica_clients(list(replica_set))


def unfit(tiny_model):
    """A version no replica of `tiny_model` can load: its files plus a tensor the model does not have."""
    import numpy as np
    from safetensors.numpy import save_file

    def write(folder):
        for file in tiny_model.iterdir():
            shutil.copy(file, folder / file.name)
        save_file({"not.a.weight": np.zeros(2, dtype=np.float32)}, str(folder / "extra.safetensors"))

    return write


def beside_one_down(replica, cooldown_s: float = 600.0):
    """A replica set of `replica` and one that does not answer (down: it may serve any model once up); returns the
    set and `replica`'s entry."""
    down = free_port()
    endpoints = static_endpoints([replica.url, f"http://127.0.0.1:{down}"], [replica.control, f"127.0.0.1:{down}"], 0)
    replica_set = ReplicaSet(endpoints, cooldown_s=cooldown_s, max_cooldown_s=cooldown_s)
    return replica_set, replica_set.replicas[replica.url]


async def updated(relay, replica) -> None:
    """Wait for the relay's loop to start an update of `replica`, then for that update to end."""
    await until(lambda: relay._updaters.get(replica.url) is not None, "no update of the replica started", timeout=60)
    await asyncio.wait_for(asyncio.shield(relay._updaters[replica.url]), timeout=60)


def refusal_relay(replica_set, store, events) -> tuple[WeightRelay, asyncio.Task]:
    """A relay that retries quickly, with the task of its `failed()` (which raises when the run must end)."""
    relay = WeightRelay(replica_set, FolderStore(store.root), VersionWatch(0), events=events, retries=2,
                        backoff_s=0.2, probe_interval_s=0.2, poll_store_s=600.0)  # fmt: skip
    return relay, asyncio.create_task(relay.failed())


async def test_weights_a_replica_refuses_for_good_end_the_run_at_once(tmp_path, start_inference, tiny_model):
    """Weights that do not fit the served model (the trainer trains another model) are refused for good
    (INVALID_ARGUMENT): sent once, not retried, and the relay fails (`failed()`, which ends the run) at once, although
    another replica (here one that is down) might take them: replicas serve one policy, so one that can never load it
    ends the run. The relay sends nothing more, not even a newer version."""
    replica = start_inference()
    store = WeightStore(tmp_path / "weights")
    replica_set, known = beside_one_down(replica)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        relay, failed = refusal_relay(replica_set, store, events)
        try:
            await relay.start()
            relay.notify(store.publish(1, unfit(tiny_model)))
            with pytest.raises(WeightsRefused) as refused:
                await asyncio.wait_for(failed, timeout=60)
            message = str(refused.value)
            assert replica.url in message and "version 1" in message and "not.a.weight" in message
            assert "model.name" in message
            relay.notify(publish_weights(store, 2, tiny_model))  # the run ended: not sent
            await asyncio.sleep(1.5)  # the relay's loop wakes every 0.2 s; the refusal's pause (0.8 s) is over too
            (record,) = read_events(events.path)  # one try, never again
            assert not record["ok"] and "INVALID_ARGUMENT" in record["error"] and replica.status().step == 0
        finally:
            failed.cancel()
            await relay.stop()
            await close_replica_clients(list(replica_set))


def other_shape_model(tmp_path_factory):
    """The tiny preset with another vocabulary: a model whose replicas cannot load the tiny model's weights."""
    from gyre.model_init import init_model

    path = tmp_path_factory.getbasetemp() / "tiny-model-vocab-384"
    if not (path / "config.json").exists():
        init_model(path, preset="tiny", seed=0, vocab_size=384)
    return path


async def test_one_replica_s_refusal_for_good_stops_the_run_though_another_took_the_version(
    tmp_path, tmp_path_factory, start_inference, tiny_model
):
    """Two replicas, one of which serves another model (a deployment that pins the wrong model.name): it refuses
    version 1 for good while the other loads it. The old relay stopped the run only when EVERY replica refused; here
    it kept the refusing replica in rotation on version 0 and sent it version 1 again after every pause, for ever, so
    the run served two policies (or waited for it at the async bound). The run now stops, naming the replica and why."""
    good, bad = start_inference(), start_inference(model=other_shape_model(tmp_path_factory))
    store = WeightStore(tmp_path / "weights")
    replica_set = ReplicaSet(static_endpoints([good.url, bad.url], [good.control, bad.control], 0), cooldown_s=600.0)
    with EventLog(tmp_path / "weight_relay.jsonl") as events:
        relay, failed = refusal_relay(replica_set, store, events)
        try:
            await relay.start()
            relay.notify(publish_weights(store, 1, tiny_model))
            with pytest.raises(WeightsRefused) as refused:
                await asyncio.wait_for(failed, timeout=60)
            message = str(refused.value)
            assert f"inference replica {bad.url} refused weights version 1 for good" in message
            assert "has shape" in message and "model.name" in message and good.url not in message
            await asyncio.sleep(1.5)  # past the refusal's pause (0.8 s): the old relay sent version 1 again by now
            to_bad = [e for e in read_events(events.path) if e["replica"] == bad.url]
            assert len(to_bad) == 1 and "INVALID_ARGUMENT" in to_bad[0]["error"] and bad.status().step == 0
        finally:
            failed.cancel()
            await relay.stop()
            await close_replica_clients(list(replica_set))


async def test_a_run_whose_weights_every_replica_refuses_stops_with_the_reason(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    """End to end in the orchestrator: the run raises WeightsRefused (`gyre orchestrator` exits 1 with its one-line
    message) instead of waiting for ever for replicas to serve version 1."""
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, max_steps=3, max_async_level=0)
    service = OrchestratorService(cfg)
    run = asyncio.create_task(service.run())
    while service.last_step < 1:  # batch 1 is pushed; batch 2 (k=0) needs version 1
        assert not run.done(), run
        await asyncio.sleep(0.05)
    service.relay.notify(WeightStore(cfg.output_dir / "weights").publish(1, unfit(tiny_model)))
    with pytest.raises(WeightsRefused, match="inference replica http://\\S+ refused weights version 1 for good"):
        await asyncio.wait_for(run, timeout=120)
    assert service.last_step == 1
