"""UpdateWeights of the version a replica already serves (same step, same digest) is answered at once.

The relay retries an UpdateWeights that ran past its deadline (`relay.timeout_s`), but the backends finish a load
they began (the torch engine a swap it is copying in, vLLM the whole load): the version was served all the same, and
the retry loaded it again, a full load each time (on vLLM with generation paused), and past its deadline again for a
model that loads slowly. Real gRPC, the real torch engine; the engine's copy is held so the first call's deadline
passes while the version is being copied in, however loaded the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
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


class Held:
    """Replaces `backend.<method>` (run by the engine, off the event loop) with one that notes its argument and waits
    until the test lets it go."""

    def __init__(self, backend: TorchBackend, method: str, note):
        self.calls, self.entered, self.release = [], threading.Event(), threading.Event()
        original = getattr(backend, method)

        def held(arg):
            self.calls.append(note(arg))
            self.entered.set()
            self.release.wait(60)
            return original(arg)

        setattr(backend, method, held)


@contextlib.asynccontextmanager
async def timed_out_update(backend: TorchBackend, held: Held, published):
    """A control server over `backend`; an UpdateWeights of `published` whose caller gave up (its deadline passed
    while `held` held the load) has been made. Yields the stub and the request, for the retry."""
    server = ControlServer(backend, InferenceMetrics(f"control-retry-{id(held)}", backend), "tiny",
                           source=FolderSource())  # fmt: skip
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)
            request = inference_pb2.UpdateWeightsRequest(version=published.to_proto())
            first = asyncio.ensure_future(stub.UpdateWeights(request, timeout=1.0))
            await asyncio.to_thread(held.entered.wait, 60)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await first  # the load is held: the caller gives up while the engine loads the version
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            held.release.set()
            yield stub, request
    finally:
        held.release.set()
        await server.stop(0)
        await backend.shutdown()


def _copy_model(model):
    return lambda folder: [shutil.copy(f, folder / f.name) for f in model.iterdir()]


async def test_a_retry_of_an_update_applied_after_its_deadline_does_not_load_it_again(tiny_model, tmp_path):
    store = WeightStore(tmp_path / "weights")
    published = store.publish(1, _copy_model(tiny_model))
    backend = TorchBackend(tiny_model, threads=1)
    await backend.start()
    copies = Held(backend, "_copy_in", lambda swap: swap.version)  # the engine thread copies a version in
    async with timed_out_update(backend, copies, published) as (stub, request):
        retry = await stub.UpdateWeights(request, timeout=60)  # the relay's retry, same version
        assert retry.step == 1 and backend.version == 1
        assert copies.calls == [1], "the retry loaded the version served again"

        # the same step published again with other files (a rewound trainer) is loaded again
        def other_files(folder):
            _copy_model(tiny_model)(folder)
            (folder / "notes.txt").write_bytes(b"other files")

        republished = store.publish(1, other_files)
        assert republished.digest != published.digest
        request = inference_pb2.UpdateWeightsRequest(version=republished.to_proto())
        assert (await stub.UpdateWeights(request, timeout=60)).step == 1
        assert copies.calls == [1, 1]


async def test_a_load_slower_than_the_deadline_is_finished_not_started_again(tiny_model, tmp_path):
    """Audit: a version whose reading took longer than the caller's deadline was cut short (the torch backend reads it
    in a thread, which went on reading for nothing), and the relay's retry started it again from scratch: a replica
    that loads a version more slowly than `relay.timeout_s` never served it, and each try left one more read of the
    whole version running (on a GPU, one more copy of the weights on the device). The load now runs to its end, and
    the retry finds the version served. The read is held until the first call's deadline has passed."""
    published = WeightStore(tmp_path / "weights").publish(1, _copy_model(tiny_model))
    backend = TorchBackend(tiny_model, threads=1)
    await backend.start()
    reads = Held(backend, "_read_weights", lambda path: path.name)  # the engine reads the version's files
    async with timed_out_update(backend, reads, published) as (stub, request):
        retry = await stub.UpdateWeights(request, timeout=60)  # the relay's retry: waits for the load under way
        assert retry.step == 1 and backend.version == 1
        assert reads.calls == ["step_1"], "the retry read the version again"
