"""UpdateWeights of the version a replica already serves (same step, same digest) is answered at once.

The relay retries an UpdateWeights that ran past its deadline (`relay.timeout_s`), but the backends finish a load
they began (the torch engine a swap it is copying in, vLLM the whole load): the version was served all the same, and
the retry loaded it again, a full load each time (on vLLM with generation paused), and past its deadline again for a
model that loads slowly. Real gRPC, the real torch engine; the engine's copy is held so the first call's deadline
passes while the version is being copied in, however loaded the machine.
"""

from __future__ import annotations

import asyncio
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


async def test_a_retry_of_an_update_applied_after_its_deadline_does_not_load_it_again(tiny_model, tmp_path):
    store = WeightStore(tmp_path / "weights")

    def write(folder, extra: bytes = b""):
        for file in tiny_model.iterdir():
            shutil.copy(file, folder / file.name)
        if extra:
            (folder / "notes.txt").write_bytes(extra)

    published = store.publish(1, write)
    backend = TorchBackend(tiny_model, threads=1)
    await backend.start()
    copying, release, copies = threading.Event(), threading.Event(), []
    copy_in = backend._copy_in

    def held_copy(swap):  # the engine thread copies a version in: held until the test lets it go
        copies.append(swap.version)
        copying.set()
        release.wait(60)
        copy_in(swap)

    backend._copy_in = held_copy
    server = ControlServer(backend, InferenceMetrics("control-retry", backend), "tiny", source=FolderSource())
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)
            request = inference_pb2.UpdateWeightsRequest(version=published.to_proto())
            first = asyncio.ensure_future(stub.UpdateWeights(request, timeout=1.0))
            await asyncio.to_thread(copying.wait, 60)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await first  # the copy is held: the caller gives up while the engine copies the version in
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
            retry = await stub.UpdateWeights(request, timeout=60)  # the relay's retry, same version
            assert retry.step == 1 and backend.version == 1
            assert copies == [1], "the retry loaded the version served again"
            # the same step published again with other files (a rewound trainer) is loaded again
            republished = store.publish(1, lambda folder: write(folder, b"other files"))
            assert republished.digest != published.digest
            request = inference_pb2.UpdateWeightsRequest(version=republished.to_proto())
            assert (await stub.UpdateWeights(request, timeout=60)).step == 1
            assert copies == [1, 1]
    finally:
        release.set()
        await server.stop(0)
        await backend.shutdown()


async def test_a_load_slower_than_the_deadline_is_finished_not_started_again(tiny_model, tmp_path):
    """Audit: a version whose reading took longer than the caller's deadline was cut short (the torch backend reads it
    in a thread, which went on reading for nothing), and the relay's retry started it again from scratch: a replica
    that loads a version more slowly than `relay.timeout_s` never served it, and each try left one more read of the
    whole version running (on a GPU, one more copy of the weights on the device). The load now runs to its end, and
    the retry finds the version served. The read is held until the first call's deadline has passed."""
    store = WeightStore(tmp_path / "weights")
    published = store.publish(1, lambda folder: [shutil.copy(f, folder / f.name) for f in tiny_model.iterdir()])
    backend = TorchBackend(tiny_model, threads=1)
    await backend.start()
    reading, release, reads = threading.Event(), threading.Event(), []
    read_weights = backend._read_weights

    def held_read(path):  # the engine reads the version's files: held until the test lets it go
        reads.append(path.name)
        reading.set()
        release.wait(60)
        return read_weights(path)

    backend._read_weights = held_read
    server = ControlServer(backend, InferenceMetrics("control-slow-load", backend), "tiny", source=FolderSource())
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)
            request = inference_pb2.UpdateWeightsRequest(version=published.to_proto())
            first = asyncio.ensure_future(stub.UpdateWeights(request, timeout=1.0))
            await asyncio.to_thread(reading.wait, 60)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await first
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
            retry = await stub.UpdateWeights(request, timeout=60)  # the relay's retry: waits for the load under way
            assert retry.step == 1 and backend.version == 1
            assert reads == ["step_1"], "the retry read the version again"
    finally:
        release.set()
        await server.stop(0)
        await backend.shutdown()
