"""A replica whose /v1/models answers no model list is a broken replica, not a crash.

Without `inference.model` set, the client asks each replica for its model's name. The openai SDK fails on a
body that is no model list (an HTML login page from a proxy, a JSON array) with an AttributeError from inside
its page model, and an entry without an id became the request's model `None`. Either is a `BadResponse`, so
the request moves to another replica as for any broken answer. A real uvicorn server answers here.
"""

from __future__ import annotations

import asyncio

import pytest
from gyre.net import free_port
from gyre_orchestrator.client import BadResponse, InferenceClient
from gyre_orchestrator.replicas import Endpoint, Replica, ReplicaSet
from support.asgi import serving

BODIES = {
    "an HTML page": (b"<html>sign in</html>", b"text/html"),
    "a JSON array": (b"[1, 2]", b"application/json"),
    "an entry without an id": (b'{"object": "list", "data": [{"object": "model"}]}', b"application/json"),
    "an empty list": (b'{"object": "list", "data": []}', b"application/json"),
}


def _app(body: bytes, content_type: bytes):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", list(BODIES))
def test_a_models_answer_that_is_no_model_list_is_a_bad_response_naming_the_replica(answer):
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def scenario():
        replica = Replica(Endpoint(url, control="127.0.0.1:1"))
        client = InferenceClient(ReplicaSet())
        openai_client = client._new_openai(replica)
        try:
            with pytest.raises(BadResponse, match=f"{url}/v1/models"):
                await client._model_name(replica, openai_client)
        finally:
            await openai_client.close()

    with serving(_app(*BODIES[answer]), port):
        asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_model_the_server_does_not_serve_names_inference_model():
    # the server's 404 said which model it serves, but not which setting sent the other one
    from gyre.envs import SamplingParams
    from gyre_orchestrator.client import InferenceError

    port = free_port()
    body = b'{"error": {"message": "The model `Qwen/Qwen3-0.6B` does not exist", "code": "model_not_found"}}'

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def scenario():
        client = InferenceClient(
            ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")]), model="Qwen/Qwen3-0.6B"
        )
        with pytest.raises(
            InferenceError, match=r"404 .*\(check inference.model = 'Qwen/Qwen3-0.6B' and inference.urls\)"
        ):
            await client.chat([{"role": "user", "content": "hi"}], sampling=SamplingParams(max_tokens=2))

    with serving(app, port):
        asyncio.run(scenario())
