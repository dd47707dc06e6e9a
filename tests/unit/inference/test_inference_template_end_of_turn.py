"""A model whose chat template ends a turn with a token no config calls eos stops there.

A base model's ChatML template (Qwen2.5 base) ends each assistant turn with `<|im_end|>`, while its tokenizer's eos
and its generation config's only `eos_token_id` are `<|endoftext|>`. The server stopped only at the configs' ids, so
a reply that ended its turn ran on (made-up turns) to `max_tokens`, finish "length": the orchestrator took every
such sample as cut, and the next turn's prompt no longer extended it. Such a model here: the tiny model with both
configs' `eos_token_id` set to `<|endoftext|>` (the tokenizer's eos already is).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from gyre.eos import end_of_turn_ids
from http_app import serve_app


@pytest.fixture(scope="module")
def base_style_model(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("base-style") / "model"
    shutil.copytree(tiny_model, path)
    for name in ("generation_config.json", "config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = 0  # <|endoftext|>
        (path / name).write_text(json.dumps(config))
    return path


def test_the_templates_end_of_turn_token_ends_a_turn_where_no_config_names_it(base_style_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_style_model)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id == endoftext
    assert end_of_turn_ids(base_style_model, tokenizer) == {im_end, endoftext}
    assert end_of_turn_ids(None, tokenizer) == {im_end, endoftext}  # SFT's view of a tokenizer alone


def test_a_template_that_ends_turns_with_plain_text_adds_no_stop_token(base_style_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_style_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
    assert end_of_turn_ids(base_style_model, tokenizer) == {tokenizer.eos_token_id}


def test_the_server_stops_a_reply_at_the_templates_end_of_turn_token(base_style_model):
    from gyre_inference.torch_backend import TorchBackend
    from openai import OpenAI

    async def scenario():
        backend = TorchBackend(base_style_model, threads=1, max_batch_size=2)
        async with serve_app(backend, base_style_model, "template-end-of-turn") as base_url:

            def chat():
                with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                    return client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                        logit_bias={"2": 100},  # <|im_end|> first: the reply ends its turn at once
                        extra_body={"return_token_ids": True},
                    )  # fmt: skip

            return await asyncio.to_thread(chat)

    reply = asyncio.run(scenario())
    choice = reply.choices[0]
    assert (choice.finish_reason, reply.usage.completion_tokens) == ("stop", 1)
    assert choice.token_ids == [2] and choice.message.content == ""  # the stop token is sampled, not text
