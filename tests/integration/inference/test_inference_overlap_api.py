"""The torch engine's overlapped decode loop behind the real HTTP API: `gyre inference --engine.overlap true`
(forced on on CPU) answers seeded requests token for token, log-prob for log-prob, as the shared server with
the synchronous loop (the CPU default), also while requests arrive and finish at different steps."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

PROMPTS = [[1, 705, 201, 74, 75, 2, 201, 1, 739, 201], [5, 6, 7], list(range(30, 70))]


@pytest.mark.asyncio
async def test_an_overlapping_server_answers_as_the_synchronous_one(start_server, server, tool_model, model_id):
    overlapping = start_server("--engine.max-model-len", "256", "--run-id", "api-tests-overlap",
                               "--engine.overlap", "true", model_path=tool_model)  # fmt: skip

    async def answers(url: str):
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:

            async def ask(prompt, seed, delay, stop=(), temperature=1.0):
                await asyncio.sleep(delay)  # arrivals while the others decode: admissions mid-run
                r = await client.completions.create(
                    model=model_id, prompt=prompt, seed=seed, n=3, max_tokens=12 + 5 * seed, logprobs=2,
                    temperature=temperature, extra_body={"return_token_ids": True, "stop_token_ids": list(stop)},
                )  # fmt: skip
                return [(c.model_extra["token_ids"], c.logprobs.token_logprobs, c.finish_reason) for c in r.choices]

            return await asyncio.gather(
                ask(PROMPTS[0], 1, 0.0),
                ask(PROMPTS[1], 2, 0.05, stop=range(3, 1024, 17)),  # rows stop at different steps
                ask(PROMPTS[2], 3, 0.1, temperature=0.7),
            )

    plain, ahead = await answers(server.base_url), await answers(overlapping.base_url)
    assert "decode loop overlapped" in overlapping.log_path.read_text()
    assert "decode loop synchronous" in server.log_path.read_text()
    assert {reason for request in plain for _, _, reason in request} == {"stop", "length"}
    for request, other in zip(plain, ahead, strict=True):
        for (tokens, logprobs, reason), (tokens2, logprobs2, reason2) in zip(request, other, strict=True):
            assert (tokens, reason) == (tokens2, reason2)
            assert logprobs == pytest.approx(logprobs2, abs=1e-5)
