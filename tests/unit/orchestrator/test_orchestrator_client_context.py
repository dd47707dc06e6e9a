"""A conversation past the model's context is told apart from other refusals (a real uvicorn server answering as
vLLM does: a 400 whose message names the maximum context length, without Gyre's `context_length_exceeded` code)."""

from __future__ import annotations

import asyncio
import json

import pytest
from gyre.envs import ContextLengthExceeded, SamplingParams
from gyre.net import free_port
from gyre_orchestrator.client import InferenceClient, InferenceError, close_replica_clients
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.asgi import serving

VLLM_OVERFLOW = (
    "'max_tokens' or 'max_completion_tokens' is too large: 64. This model's maximum context length is 128 tokens "
    "and your request has 100 input tokens (64 > 128 - 100)."
)


def _app(message: str):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        error = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})

    return app


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("message", "overflow"), [(VLLM_OVERFLOW, True), ("tool 'x' is not defined", False)])
def test_a_context_overflow_is_its_own_error(message, overflow):
    port = free_port()

    async def scenario():
        replicas = ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", control="127.0.0.1:1")])
        client = InferenceClient(replicas, model="m", retries=0)
        try:
            with pytest.raises(InferenceError) as caught:
                await client.chat([{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=64))
        finally:
            await close_replica_clients(list(replicas))
        assert isinstance(caught.value, ContextLengthExceeded) is overflow
        assert "400" in str(caught.value)

    with serving(_app(message), port):
        asyncio.run(scenario())
