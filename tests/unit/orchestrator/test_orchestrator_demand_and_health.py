"""What the orchestrator reports beyond throughput: its demand on the replicas (what inference autoscaling
follows) and each batch's learning health (response length, truncation, rubric scores).

Demand is measured against a real uvicorn server that holds every request until the test lets it answer.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
from gyre.envs import SamplingParams
from gyre.net import free_port
from gyre_orchestrator.client import InferenceClient
from gyre_orchestrator.records import batch_health
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.asgi import serving

CHAT = {
    "id": "c", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 2],
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"},
                 "token_ids": [5], "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
                 "policy_version_min": 0, "policy_version_max": 0}],
}  # fmt: skip


def held_app(gate: threading.Event, arrived: list):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/tokenize":  # no tokenizer here: the client's end-of-turn probe is refused at once
            await send({"type": "http.response.start", "status": 404, "headers": []})
            return await send({"type": "http.response.body", "body": b""})
        arrived.append(scope["path"])
        await asyncio.to_thread(gate.wait)
        body = json.dumps(CHAT).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.timeout(60)
def test_demand_counts_requests_in_flight_and_queued_behind_the_concurrency_bound():
    port, gate, arrived = free_port(), threading.Event(), []

    async def scenario():
        replicas = ReplicaSet([Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1:1")])
        client = InferenceClient(replicas, model="m", max_concurrency=2)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4)
        assert client.demand == {"inflight": 0, "queued": 0}
        chats = [asyncio.create_task(client.for_version(0).chat([{"role": "user", "content": "hi"}],
                                                                sampling=sampling)) for _ in range(5)]  # fmt: skip
        while len(arrived) < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # nothing more goes out while the first two are held
        held = dict(client.demand)
        gate.set()
        turns = await asyncio.gather(*chats)
        await replicas.replicas[f"http://127.0.0.1:{port}"].clients["openai"][0].close()
        return held, dict(client.demand), turns

    try:
        with serving(held_app(gate, arrived), port):
            held, after, turns = asyncio.run(scenario())
    finally:
        gate.set()
    assert held == {"inflight": 2, "queued": 3}  # the views share one count (for_version)
    assert after == {"inflight": 0, "queued": 0} and len(turns) == 5 and len(arrived) == 5


def test_batch_health_of_a_batch():
    def sample(tokens: int, stop: str, **scores: float):
        return SimpleNamespace(rollout=SimpleNamespace(num_completion_tokens=tokens, stop_reason=stop),
                               score=SimpleNamespace(per_function=scores))  # fmt: skip

    stops = ["drift"] * 2 + ["done"] * 14 + ["length"] * 4
    samples = [sample(10 * (i + 1), stops[i], correct=float(i % 2), format=1.0) for i in range(20)]
    health = batch_health(samples)
    assert health["response_length_mean"] == 105.0
    assert health["response_length_p95"] == pytest.approx(190.5)  # numpy's linear interpolation
    assert health["truncated_ratio"] == 0.2  # 4 of 20 hit the length limit (not turn budgets or drift)
    assert health["drift_ratio"] == 0.1  # 2 of 20 cut where a later turn's prompt did not extend the sequence
    assert health["rubric_scores"] == {"correct": 0.5, "format": 1.0}
    assert batch_health([]) == {"response_length_mean": 0.0, "response_length_p95": 0.0, "truncated_ratio": 0.0,
                                "drift_ratio": 0.0, "rubric_scores": {}}  # fmt: skip
