"""The orchestrator's requests carry their batch as vLLM's `priority` (lower is served first), read off the wire
by a real uvicorn server: a view made for a batch sends it, a plain client sends none (the server's 0)."""

from __future__ import annotations

import asyncio
import json

import pytest
from gyre.envs import SamplingParams
from gyre.net import free_port
from gyre_orchestrator.bench import _echo_app
from gyre_orchestrator.client import InferenceClient
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.asgi import serving


def recording_app(bodies: list):
    """The orchestrator bench's echo server (a valid chat reply to any request), recording each request's body."""

    async def app(scope, receive, send):
        chunks = []

        async def recording():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        await _echo_app(scope, recording, send)
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            bodies.append(json.loads(b"".join(chunks)))

    return app


@pytest.mark.timeout(60)
def test_a_view_for_a_batch_sends_its_priority_and_shares_the_client():
    port, bodies = free_port(), []

    async def scenario():
        client = InferenceClient(ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")]), model="m")
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4)
        chat = [{"role": "user", "content": "hi"}]
        await client.for_version(0, priority=7).chat(chat, sampling=sampling)
        await client.for_version(0).chat(chat, sampling=sampling)
        await client.chat(chat, sampling=sampling)
        assert client.priority is None and client.stats["requests"] == 3  # views share the client's counts

    with serving(recording_app(bodies), port):
        asyncio.run(scenario())
    assert [body.get("priority") for body in bodies] == [7, None, None]


@pytest.mark.timeout(60)
def test_every_chat_request_pins_the_filters_and_penalty_a_server_would_fill_from_the_generation_config():
    # vLLM's server applies generation_config.json's top_k / min_p / repetition_penalty to a request that leaves them
    # out: a sample drawn through them is not the policy the trainer recomputes (log_softmax(logits / T))
    port, bodies = free_port(), []

    async def scenario():
        client = InferenceClient(ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")]), model="m")
        await client.chat([{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=0.7, max_tokens=4))

    with serving(recording_app(bodies), port):
        asyncio.run(scenario())
    assert {key: bodies[0].get(key) for key in ("temperature", "top_k", "min_p", "repetition_penalty")} == {
        "temperature": 0.7, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
    }  # fmt: skip
