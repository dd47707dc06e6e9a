"""Streaming usage (`stream_options.continuous_usage_stats`) when tokens arrive in bursts.

The torch engine hands tokens to the event loop in coalesced callbacks, so on a busy machine a choice can
receive several tokens before the stream writes the chunk of the first one. Each chunk's usage must count
the tokens up to that chunk's token, not the tokens the choice holds when the chunk is written (the flaky
`test_stream_options_usage_variants[completions]` saw two chunks both reporting 5). `BurstBackend`
delivers every token of a sequence at once, which is that busy case made certain.
"""

from __future__ import annotations

import asyncio

import pytest
from gyre_inference.backend import TokenEvent
from http_app import StandInBackend, serve_app


class BurstBackend(StandInBackend):
    """Yields all of a sequence's tokens back to back, without giving the event loop a turn in between."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    async def generate(self, prompt, params):
        for i, token in enumerate(self.tokens[: params.max_tokens]):
            last = i == min(len(self.tokens), params.max_tokens) - 1
            yield TokenEvent(token, -0.5, 0, finish_reason="length" if last else None)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_counts_the_tokens_up_to_each_chunk(tiny_model, model_text, kind):
    from openai import OpenAI

    # tokens that each release text (no partial characters), so every token gets its own chunk
    tokens = model_text.encode(" one two three four five six")[:6]

    async def scenario():
        async with serve_app(BurstBackend(tokens), tiny_model, "stream-usage") as base_url:
            options = {"include_usage": True, "continuous_usage_stats": True}

            def stream():
                with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                    common = dict(model="tiny", max_tokens=6, stream=True, stream_options=options)
                    if kind == "chat":
                        return list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                                                   **common))  # fmt: skip
                    return list(client.completions.create(prompt="hi", **common))

            return await asyncio.to_thread(stream)

    chunks = asyncio.run(scenario())
    token_chunks = [c for c in chunks if c.choices and (c.choices[0].finish_reason or _text(kind, c))]
    assert [c.usage.completion_tokens for c in token_chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def _text(kind, chunk) -> str:
    choice = chunk.choices[0]
    return (choice.delta.content if kind == "chat" else choice.text) or ""
