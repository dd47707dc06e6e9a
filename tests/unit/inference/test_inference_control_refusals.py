"""UpdateWeights tells a refusal worth retrying from one for good, which is what the weight relay acts on: busy
adapter slots (every slot runs requests) are FAILED_PRECONDITION, the relay sends the version again after a pause;
an adapter that does not fit the model is INVALID_ARGUMENT, and a relay any replica answers so stops the run
(services/orchestrator/gyre_orchestrator/relay.py). Real gRPC, the real torch engine and PEFT adapter folders."""

from __future__ import annotations

import errno
import shutil

import grpc
import pytest
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightStore
from gyre_inference.backend import SamplingParams
from gyre_inference.control import ControlServer
from gyre_inference.metrics import InferenceMetrics
from gyre_inference.torch_backend import TorchBackend
from test_inference_lora_adapter import PROMPT, write_adapter
from test_inference_runtime_lora import LONG, adapter_of_another_model

pytestmark = pytest.mark.asyncio


async def test_busy_adapter_slots_are_worth_a_retry_and_an_adapter_that_does_not_fit_is_refused_for_good(
    tiny_model, tmp_path
):
    store = WeightStore(tmp_path / "weights")

    def publish(step, make):
        source = tmp_path / f"adapter_{step}"
        make(tiny_model, source)
        return store.publish(step, lambda folder: [shutil.copy(f, folder / f.name) for f in source.iterdir()])

    fits = publish(1, lambda model, folder: write_adapter(model, folder, seed=1))
    other = publish(2, lambda model, folder: write_adapter(model, folder, seed=2))
    unfit = publish(3, adapter_of_another_model)
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=4, max_adapters=1, max_lora_rank=4)
    await backend.start()
    server = ControlServer(backend, InferenceMetrics("control-refusals", backend), "tiny")
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceControlStub(channel)

            async def update(version, model):
                request = inference_pb2.UpdateWeightsRequest(version=version.to_proto(), model=model)
                return await stub.UpdateWeights(request, timeout=60)

            assert (await update(fits, "a")).step == 1
            running = backend.generate(PROMPT, SamplingParams(max_tokens=LONG, temperature=1.0, seed=3, adapter="a"))
            await running.__anext__()  # a's request runs: the one slot is busy
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await update(other, "b")
            assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION, busy.value.details()
            assert "lora.max_loras" in busy.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as unfit_refused:
                await update(unfit, "a")
            assert unfit_refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, unfit_refused.value.details()
            assert "still serving version 1" in unfit_refused.value.details()
            await running.aclose()
    finally:
        await server.stop(0)
        await backend.shutdown()


async def test_an_io_error_reading_an_adapter_is_no_refusal_for_good(tiny_model, tmp_path):
    """The torch backend read an adapter folder and wrapped an OSError as WeightsIncompatibleError, INVALID_ARGUMENT,
    which stops the run: an I/O error on the shared volume says nothing of whether the adapter fits. It is now the
    OSError, FAILED_PRECONDITION (the relay sends the version again). A real I/O error: the config is a link to
    /proc/self/mem, whose read fails with EIO. A missing config is still no adapter (WeightsIncompatibleError)."""
    from gyre.lora import ADAPTER_CONFIG
    from gyre_inference.adapters import read_adapter_folder
    from gyre_inference.backend import WeightsIncompatibleError
    from test_inference_lora_adapter import write_adapter

    folder = tmp_path / "adapter"
    write_adapter(tiny_model, folder, seed=1)
    read_adapter_folder(folder)  # readable as written
    (folder / ADAPTER_CONFIG).unlink()
    with pytest.raises(WeightsIncompatibleError, match="not a usable LoRA adapter"):
        read_adapter_folder(folder)
    (folder / ADAPTER_CONFIG).symlink_to("/proc/self/mem")
    with pytest.raises(OSError) as error:
        read_adapter_folder(folder)
    assert error.value.errno == errno.EIO and not isinstance(error.value, WeightsIncompatibleError)
