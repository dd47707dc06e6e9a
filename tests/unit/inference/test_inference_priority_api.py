"""vLLM's `priority` request field over real HTTP: every route takes it to the torch engine, whose queue admits
the lowest value first (the orchestrator sends a rollout's RL step)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gyre_inference.torch_backend import TorchBackend
from http_app import serve_app
from openai import BadRequestError, OpenAI

CHAT = [{"role": "user", "content": "hi"}]


def test_every_route_hands_the_priority_to_the_engine_and_refuses_a_bad_one(tiny_model):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=4)
    seen = []
    generate = backend.generate

    def spy(prompt, params):
        seen.append(params.priority)
        return generate(prompt, params)

    backend.generate = spy

    async def scenario():
        async with serve_app(backend, tiny_model, "priority") as base_url:

            def calls():
                with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
                    client.chat.completions.create(
                        model="tiny", messages=CHAT, max_tokens=2, extra_body={"priority": 3}
                    )
                    client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2, extra_body={"priority": -2})
                    client.responses.create(model="tiny", input="hi", max_output_tokens=16, extra_body={"priority": 4})
                    with pytest.raises(BadRequestError) as bad:
                        client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"priority": "high"})
                    assert bad.value.body["param"] == "priority"
                root = base_url.removesuffix("/v1")
                body = {"model": "tiny", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "priority": 9}
                assert httpx.post(f"{root}/inference/v1/generate", json=body, timeout=30).status_code == 200

            await asyncio.to_thread(calls)

    asyncio.run(scenario())
    assert seen == [0, 3, -2, -2, 4, 9]


def test_queued_requests_are_served_lowest_priority_first_whatever_their_arrival(tiny_model):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=1)
    finished = []  # in the order the engine ended them (seen on the event loop, where the server reads them)
    generate = backend.generate

    async def spy(prompt, params):
        async for event in generate(prompt, params):
            if event.finish_reason is not None:
                finished.append(params.priority)
            yield event

    backend.generate = spy

    async def scenario():
        async with serve_app(backend, tiny_model, "priority-order") as base_url:
            client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

            def ask(priority):
                client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"priority": priority})

            # the engine thread waits on its lock while the event loop (this thread: the lock is reentrant) queues
            # the three requests, in arrival order 2, 0, 1
            with backend._cond:
                calls = []
                for priority in (2, 0, 1):
                    calls.append(asyncio.create_task(asyncio.to_thread(ask, priority)))
                    for _ in range(500):
                        await asyncio.sleep(0.01)
                        if len(backend._waiting) == len(calls):
                            break
                    assert len(backend._waiting) == len(calls)
            await asyncio.gather(*calls)
            client.close()

    asyncio.run(scenario())
    assert finished == [0, 1, 2]
