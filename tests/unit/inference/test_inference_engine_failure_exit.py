"""A replica whose engine stops on its own exits 1, so that it is restarted, instead of staying up and never ready.

The torch engine copies a version in tensor by tensor: failed part way, the model holds a mix of two versions and the
weights served before are gone. The engine went on serving that mix under the old version's number (samples of no
policy, tagged as one). It now stops, as the vLLM backend stops when loading back the weights served before fails
too, and the service, which then stayed up and not ready for ever (the relay waited for it, nothing restarted it),
exits 1: its pod is restarted on the base model and the relay sends it the newest version. The real service (HTTP,
gRPC, torch engine) in this process; the failure is a copy that stops half way, what a device error mid-copy leaves.
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
import torch
from gyre.config.inference import InferenceConfig
from gyre.net import free_port
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightStore
from gyre_inference.service import run_service

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def test_a_weights_copy_that_fails_part_way_stops_the_engine_and_the_replica_exits_1(
    tiny_model, tmp_path, monkeypatch
):
    def write(folder):
        for file in tiny_model.iterdir():
            shutil.copy(file, folder / file.name)

    published = WeightStore(tmp_path / "weights").publish(1, write)
    copy = torch._foreach_copy_

    def fails_half_way(targets, sources):
        half = len(targets) // 2
        copy(targets[:half], sources[:half])
        raise RuntimeError("device error mid-copy")

    monkeypatch.setattr(torch, "_foreach_copy_", fails_half_way)
    control = f"127.0.0.1:{free_port()}"
    config = InferenceConfig(model={"name": str(tiny_model)}, server={"port": 0},
                             control={"port": int(control.split(":")[1])}, engine={"threads": 1})  # fmt: skip
    service = asyncio.create_task(run_service(config))
    try:
        async with grpc.aio.insecure_channel(control) as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)
            while True:  # until the model is loaded
                assert not service.done(), service
                try:
                    status = await stub.GetStatus(inference_pb2.GetInferenceStatusRequest(), timeout=5)
                    if status.ready:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.2)
            request = inference_pb2.UpdateWeightsRequest(version=published.to_proto())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.UpdateWeights(request, timeout=60)
        # down, as a replica that stopped (the relay updates it once a probe finds it ready again, restarted)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "mix of two versions" in refused.value.details(), refused.value.details()
        assert await asyncio.wait_for(service, timeout=120) == 1
    finally:
        if not service.done():
            service.cancel()
            await asyncio.gather(service, return_exceptions=True)
