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


HI = [{"role": "user", "content": "hi"}]


def served_chat(model, run_id: str, **request):
    """`model` served in-process (torch backend) and asked `HI` once with the `openai` client (`request`: more
    keys of `chat.completions.create`, greedy; the server's token ids asked for)."""
    from gyre_inference.torch_backend import TorchBackend
    from openai import OpenAI

    async def scenario():
        backend = TorchBackend(model, threads=1, max_batch_size=2)
        async with serve_app(backend, model, run_id) as base_url:

            def chat():
                with OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                    return client.chat.completions.create(model="tiny", messages=HI, temperature=0, **request)

            return await asyncio.to_thread(chat)

    return asyncio.run(scenario())


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


def test_an_added_token_that_is_not_special_ends_a_turn_too(base_style_model):
    """A fine-tune that gave a base tokenizer ChatML's end as a plain added token (`add_tokens`, special false) ends
    each reply with that one id, which no config names: it was not counted (only special tokens were), and every
    reply ran on. A marker the tokenizer splits into several tokens stays no stop token (its first, `<`, is text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_style_model)
    tokenizer.add_tokens(["<|end_turn|>"])  # special=False
    end = tokenizer.convert_tokens_to_ids("<|end_turn|>")
    assert end not in tokenizer.all_special_ids and not tokenizer.added_tokens_decoder[end].special
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|end_turn|>\n{% endfor %}"
    assert end_of_turn_ids(base_style_model, tokenizer) == {tokenizer.eos_token_id, end}
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|end_of_it|>\n{% endfor %}"
    assert len(tokenizer.encode("<|end_of_it|>", add_special_tokens=False)) > 1
    assert end_of_turn_ids(base_style_model, tokenizer) == {tokenizer.eos_token_id}


def test_the_server_stops_a_reply_at_the_templates_end_of_turn_token(base_style_model):
    reply = served_chat(base_style_model, "template-end-of-turn", max_tokens=8, extra_body={"return_token_ids": True},
                        logit_bias={"2": 100})  # <|im_end|> first: the reply ends its turn at once  # fmt: skip
    choice = reply.choices[0]
    assert (choice.finish_reason, reply.usage.completion_tokens) == ("stop", 1)
    assert choice.token_ids == [2] and choice.message.content == ""  # the stop token is sampled, not text


# ---- a server that stops only at the configs' ids (`vllm serve`), asked by the orchestrator ----------------------

REPLY = "ok"  # what the taught model replies, then it runs on into a made-up user turn as a base model does


@pytest.fixture(scope="module")
def run_on_model(base_style_model, tmp_path_factory):
    """The base-style model taught to reply `REPLY`, end the turn with `<|im_end|>` and go on with another turn."""
    import torch
    from support.models import teach
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_style_model)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    reply = tokenizer.encode(f"{REPLY}<|im_end|>\n<|im_start|>user\nmore and more", add_special_tokens=False)
    ids = torch.tensor([prompt + reply])
    labels = torch.tensor([[-100] * len(prompt) + reply])
    path = teach(base_style_model, tmp_path_factory.mktemp("run-on") / "model", ids, labels, max_steps=600)
    for name in ("generation_config.json", "config.json"):  # as the base-style model's: <|endoftext|> alone
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = 0
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture
def like_vllm_serve(monkeypatch):
    """The server's own stops are the configs' and the tokenizer's eos alone, as vLLM's server's."""
    import gyre.eos

    monkeypatch.setattr(gyre.eos, "template_end_of_turn_id", lambda tokenizer: None)


def test_the_orchestrator_stops_a_reply_at_the_templates_end_where_the_server_would_not(run_on_model, like_vllm_serve):
    from gyre.envs import SamplingParams
    from gyre_inference.torch_backend import TorchBackend
    from gyre_orchestrator.client import InferenceClient, close_replica_clients
    from gyre_orchestrator.replicas import Endpoint, ReplicaSet

    async def scenario():
        backend = TorchBackend(run_on_model, threads=1, max_batch_size=2)
        async with serve_app(backend, run_on_model, "orchestrator-stop-ids") as base_url:
            replicas = ReplicaSet([Endpoint(base_url.removesuffix("/v1"), control="127.0.0.1:1")])
            client = InferenceClient(replicas, timeout_s=60)
            try:
                return await client.chat(HI, sampling=SamplingParams(temperature=0, max_tokens=12))
            finally:
                await close_replica_clients(list(replicas))

    # a client that sends no stop ids: the server alone decides
    plain = served_chat(run_on_model, "no-stop-ids", max_tokens=12, extra_body={"return_token_ids": True})
    turn = asyncio.run(scenario())
    # the server alone runs on past the end of the turn, as `vllm serve` does
    assert plain.choices[0].finish_reason == "length" and 2 in plain.choices[0].token_ids[:-1]
    # the orchestrator's request names <|im_end|> (2): the reply ends there, its stop token sampled, not text
    assert (turn.finish_reason, turn.text) == ("stop", REPLY)
    assert turn.completion_token_ids[-1] == 2 and 2 not in turn.completion_token_ids[:-1]


def test_a_request_stop_token_id_ends_a_choice_as_vllm_does(run_on_model, like_vllm_serve):
    """vLLM's `stop_token_ids` over HTTP with the `openai` client: the choice ends at the id (finish "stop",
    `stop_reason` the id), which stays in its token ids and, being special, out of its text."""
    extra = {"return_token_ids": True, "stop_token_ids": [2]}
    choice = served_chat(run_on_model, "request-stop-ids", max_tokens=12, extra_body=extra).choices[0]
    assert (choice.finish_reason, choice.stop_reason, choice.message.content) == ("stop", 2, REPLY)
    assert choice.token_ids[-1] == 2 and 2 not in choice.token_ids[:-1]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", 2),  # ChatML
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}", None),  # plain text
        ("{% for m in messages %}{{ m.role }}: {{ m.content }} <end>\n{% endfor %}", None),  # text of several tokens
    ],
    ids=["chatml", "blank-line", "several-tokens"],
)
def test_the_served_end_of_turn_probe_reads_the_templates_end_token(base_style_model, tmp_path, template, expected):
    """`gyre.eos.served_end_of_turn_id` over a real server's /tokenize and /detokenize agrees with the local probe."""
    import httpx
    from gyre.eos import served_end_of_turn_id
    from gyre_inference.torch_backend import TorchBackend
    from transformers import AutoTokenizer

    path = tmp_path / "model"
    shutil.copytree(base_style_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)

    async def scenario():
        backend = TorchBackend(path, threads=1, max_batch_size=1)
        async with (
            serve_app(backend, path, "served-probe") as base_url,
            httpx.AsyncClient(base_url=base_url.removesuffix("/v1")) as http,
        ):

            async def post(route, body):
                answer = await http.post(route, json=body)
                answer.raise_for_status()
                return answer.json()

            return await served_end_of_turn_id(post)

    assert asyncio.run(scenario()) == expected
    from gyre.eos import template_end_of_turn_id

    assert template_end_of_turn_id(AutoTokenizer.from_pretrained(path)) == expected
