"""A weights update that the engine's stop overtakes is UNAVAILABLE, not an internal error.

UpdateWeights checks that the model is loaded, then fetches the version (seconds for a real model) and swaps it
in. A SIGTERM in between stops the engine, and the swap raises BackendStoppedError: the control answered INTERNAL
and logged it at ERROR with a traceback, for a normal stop. UNAVAILABLE is what the weight relay reads as "down:
update it once its status probe says it is ready" (and what it gets from a replica not loaded yet). Real gRPC, the
real torch engine; the fetch is held in that window.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading

import grpc
import pytest
from gyre.transport import FolderSource
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightStore
from gyre_inference.control import ControlServer
from gyre_inference.metrics import InferenceMetrics
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio


class HeldSource(FolderSource):
    """The folder transport, with each fetch held until the test lets it go."""

    def __init__(self):
        super().__init__()
        self.fetching, self.release = threading.Event(), threading.Event()

    def fetch(self, version):
        self.fetching.set()
        self.release.wait(60)
        return super().fetch(version)


async def test_an_update_overtaken_by_the_engine_stop_is_unavailable(tiny_model, tmp_path, caplog):
    store = WeightStore(tmp_path / "weights")

    def write(folder):
        for file in tiny_model.iterdir():
            shutil.copy(file, folder / file.name)

    published = store.publish(2, write)
    backend = TorchBackend(tiny_model, threads=1)
    await backend.start()
    source = HeldSource()
    server = ControlServer(backend, InferenceMetrics("control-stop", backend), "tiny", source=source)
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)
            request = inference_pb2.UpdateWeightsRequest(version=published.to_proto())
            update = asyncio.ensure_future(stub.UpdateWeights(request, timeout=60))
            await asyncio.to_thread(source.fetching.wait, 60)  # past the "loaded?" check, fetching
            await backend.shutdown()  # the service's stop, on SIGTERM
            source.release.set()
            with caplog.at_level(logging.WARNING), pytest.raises(grpc.aio.AioRpcError) as refused:
                await update
    finally:
        source.release.set()
        await server.stop(0)
        await backend.shutdown()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert "weights step 2" in refused.value.details() and "still serving version 0" in refused.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
