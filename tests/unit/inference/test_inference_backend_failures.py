"""A backend failure answers the same on every generation route: an engine that stopped (shutdown past its grace,
a crash) is a 503 `not_ready` that clients retry, a named adapter that is gone a 404 `model_not_found`. The
tokens-in route answered both with a 500 "internal error" (and logged a traceback) where the OpenAI routes did not.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from gyre_inference.backend import AdapterGoneError, BackendStoppedError, TokenEvent
from http_app import StandInBackend, serve_app


class FailingBackend(StandInBackend):
    """Fails every generation with `error` (what the engine raises into a sequence's stream)."""

    def __init__(self, error: Exception):
        self.error = error

    async def generate(self, prompt, params):
        raise self.error
        yield  # an async generator, as every backend's generate


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [(BackendStoppedError("the inference engine stopped"), 503, "not_ready"),
     (AdapterGoneError("adapter folder gone"), 404, "model_not_found")],
)  # fmt: skip
def test_every_generation_route_answers_a_backend_failure_alike(tiny_model, error, status, code):
    requests = {
        "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
        "/inference/v1/generate": {"model": "tiny", "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
    }

    async def scenario():
        async with serve_app(FailingBackend(error), tiny_model, "backend-failures") as base_url:
            root = base_url.removesuffix("/v1")
            async with httpx.AsyncClient(base_url=root, timeout=30) as http:
                answers = {route: await http.post(route, json=body) for route, body in requests.items()}
                stream = await http.post("/v1/completions", json={**requests["/v1/completions"], "stream": True})
                return answers, stream

    answers, stream = asyncio.run(scenario())
    for route, response in answers.items():
        assert response.status_code == status, (route, response.text)
        assert response.json()["error"]["code"] == code, (route, response.text)
        # a 503 tells clients when to retry (the openai SDK's own backoff is about 0.5 s, then 1 s)
        assert response.headers.get("retry-after") == ("1" if status == 503 else None), route
    # a stream has sent its 200 already: its error event carries the same error
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    assert stream.status_code == 200 and events[-1]["error"]["code"] == code, stream.text


class OneChoiceFails(StandInBackend):
    """The first sequence fails at once; every other one generates slowly and notes when its stream is closed."""

    def __init__(self):
        self.calls, self.closed = 0, []

    async def generate(self, prompt, params):
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(0.2)  # the others are generating by then
            raise RuntimeError("this sequence failed")
        try:
            for _ in range(params.max_tokens):
                await asyncio.sleep(0.05)
                yield TokenEvent(5, -1.0, 0)
        finally:
            self.closed.append(asyncio.get_running_loop().time())


@pytest.mark.parametrize("route", ["/v1/completions", "/inference/v1/generate"])
def test_when_one_choice_fails_the_request_s_other_choices_stop_generating(tiny_model, route):
    """n = 3, the first choice fails: the request answers its error, and the two others are aborted with it. They
    generated on for nobody until their max_tokens (asyncio.gather does not cancel the rest when one fails)."""
    backend = OneChoiceFails()
    body = {"model": "tiny", "n": 3, "max_tokens": 400} if route == "/v1/completions" else {}
    body = body or {"model": "tiny", "token_ids": [5, 6], "sampling_params": {"n": 3, "max_tokens": 400}}
    if route == "/v1/completions":
        body["prompt"] = "hi"

    async def scenario():
        async with serve_app(backend, tiny_model, "one-choice-fails") as base_url:
            http = httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=60)
            async with http:
                response = await http.post(route, json=body)
                answered = asyncio.get_running_loop().time()
                await asyncio.sleep(0.3)
                return response, answered, list(backend.closed)

    response, answered, closed = asyncio.run(scenario())
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error", response.text
    assert len(closed) == 2 and max(closed) < answered + 0.2, (closed, answered)  # not 400 x 50 ms later
