"""A request that reaches the torch engine while it stops is answered, never left in a queue nobody reads.

The engine thread takes its last look at the queue (the requests it strands get BackendStoppedError), then frees
its batch and ends. `generate` checked only that the thread was alive: a request queued in between (one whose
adapter had just been loaded back, or any request that passed the check) sat in the queue of a stopped engine, and
its HTTP request waited until uvicorn cut it. The window is driven here by holding the engine thread in it.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from gyre_inference.backend import BackendStoppedError, SamplingParams
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_request_queued_while_the_engine_stops_gets_backend_stopped(tiny_model):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=4)
    await backend.start()
    past_last_look, release = threading.Event(), threading.Event()
    reset = backend._batch.reset

    def held_reset() -> None:  # the engine thread's last call, after it handed out the requests it strands
        past_last_look.set()
        release.wait()
        reset()

    backend._batch.reset = held_reset
    stopping = asyncio.create_task(backend.shutdown())
    await asyncio.to_thread(past_last_look.wait)
    assert backend.ready  # the thread is alive: the request gets past the readiness check

    async def first_event():
        async for event in backend.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)):
            return event

    request = asyncio.create_task(first_event())
    await _turns(3)
    release.set()
    await stopping
    await _turns(3)
    assert request.done(), "a request queued on a stopping engine is never answered"
    with pytest.raises(BackendStoppedError):
        request.result()
