"""Detokenization, token bytes and the per-choice rules (stop strings, alignment, tool-call hold-back)."""

from __future__ import annotations

import json

from gyre_inference.backend import TokenEvent
from gyre_inference.choice import Choice
from gyre_inference.text import IncrementalDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

TEXTS = ["Hello world, bye now.", "café naïve 東京 😀 → ok", "12+34=46\n\tx", ""]


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 1023), max_size=40))
def test_streamed_text_equals_decoding_everything_at_once(model_text, ids):
    decoder = IncrementalDecoder(model_text)
    streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert streamed == model_text.decode(ids)


def test_token_bytes_concatenate_to_the_utf8_of_the_text(model_text):
    for text in TEXTS:
        ids = model_text.encode(text)
        assert b"".join(bytes(model_text.token(i)[1]) for i in ids) == text.encode()


def _feed(choice: Choice, ids: list[int], versions=None, finish_last: str | None = "stop") -> list:
    deltas = []
    for n, token in enumerate(ids):
        version = versions[n] if versions else 0
        finish = finish_last if n == len(ids) - 1 else None
        deltas.append(choice.add(TokenEvent(token, -0.5 - n, version, (), finish)))
        if choice.done:
            break
    return deltas


def test_a_stop_string_cuts_the_text_but_every_sampled_token_stays_aligned(model_text):
    ids = model_text.encode("Hello world, bye now.")
    choice = Choice(0, model_text, stops=[", b"], parse_tools=False)
    deltas = _feed(choice, ids, finish_last=None)
    assert choice.text == "Hello world" and choice.finish_reason == "stop"
    # tokens up to and including the one that completed the stop string, each with its own log-prob
    assert len(choice.token_ids) == len(choice.logprobs) == len(deltas) <= len(ids)
    assert choice.token_ids == ids[: len(choice.token_ids)]
    assert choice.logprobs == [-0.5 - n for n in range(len(choice.token_ids))]
    assert ", b" in model_text.decode(choice.token_ids) and model_text.decode(choice.token_ids).startswith(choice.text)
    # what was streamed is exactly the final text (the stop string was never released)
    assert "".join(d.text for d in deltas) == "Hello world"
    assert [d.position for d in deltas] == list(range(len(deltas)))
    assert [d.finish_reason for d in deltas][-1] == "stop" and all(d.finish_reason is None for d in deltas[:-1])


def test_the_earliest_of_several_stop_strings_wins(model_text):
    choice = Choice(0, model_text, stops=["now", "wor"], parse_tools=False)
    _feed(choice, model_text.encode("Hello world, bye now."), finish_last=None)
    assert choice.text == "Hello "


def test_without_stops_the_end_token_finishes_and_is_kept(model_text):
    ids = model_text.encode("Hi there") + [2]  # <|im_end|>
    choice = Choice(0, model_text, stops=[], parse_tools=False)
    deltas = _feed(choice, ids)
    assert choice.text == "Hi there" and choice.token_ids == ids and choice.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "Hi there"


def test_versions_span_a_weight_swap(model_text):
    ids = model_text.encode("one two three")
    choice = Choice(0, model_text, stops=[], parse_tools=False)
    _feed(choice, ids, versions=[3] * (len(ids) - 2) + [4, 4], finish_last="length")
    assert choice.versions() == {"policy_version": 4, "policy_version_min": 3, "policy_version_max": 4}
    assert choice.finish_reason == "length"


def test_tool_call_text_is_held_back_then_returned_as_structured_calls(model_text):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = model_text.encode("Let me add.\n" + call) + [2]
    choice = Choice(0, model_text, stops=[], parse_tools=True)
    deltas = _feed(choice, ids)
    assert "".join(d.text for d in deltas) == "Let me add." == choice.text
    assert choice.finish_reason == "tool_calls" and deltas[-1].finish_reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in choice.tool_calls] == [{"a": 1}]
    assert choice.token_ids == ids


def test_truncated_tool_calls_keep_finish_reason_length(model_text):
    ids = model_text.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    choice = Choice(0, model_text, stops=[], parse_tools=True)
    _feed(choice, ids, finish_last="length")
    assert choice.finish_reason == "length" and choice.tool_calls


def test_malformed_tool_calls_are_released_as_content_at_the_end(model_text):
    text = '<tool_call>{"name": "f", "arguments": {]}</tool_call>'
    choice = Choice(0, model_text, stops=[], parse_tools=True)
    deltas = _feed(choice, model_text.encode(text) + [2])
    assert "".join(d.text for d in deltas) == text and choice.tool_calls == [] and choice.finish_reason == "stop"


# ---- streaming == non-streaming, whatever the token boundaries -------------------------------------------
class _Pieces:
    """A stand-in tokenizer whose token i is the text piece i: lets a test choose every token boundary."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>'
_FRAGMENTS = ["Sure.", "\n", "\n\n", " ", "ok <tool", "</tool_call>", "<tool_call>", _CALL, _CALL + "\n", "é😀", "STOP"]


@st.composite
def _splits(draw):
    """A model output built from fragments that stress the hold-back, and a random split into tokens."""
    text = "".join(draw(st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=6)))
    cut_after = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))  # per character
    pieces, start = [], 0
    for end, cut in enumerate(cut_after, 1):
        if cut or end == len(text):
            pieces.append(text[start:end])
            start = end
    return pieces


def _run(pieces: list[str], stops: list[str], finish: str, streamed: bool = True) -> tuple[str, str, list, str | None]:
    choice = Choice(0, _Pieces(pieces), stops=stops, parse_tools=True, streamed=streamed)
    streamed = "".join(d.text for d in _feed(choice, list(range(len(pieces))), finish_last=finish))
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice.tool_calls]
    return streamed, choice.text, calls, choice.finish_reason


@settings(max_examples=300, deadline=None)
@given(pieces=_splits(), stops=st.sampled_from([[], ["STOP"], ["\n\n"]]), finish=st.sampled_from(["stop", "length"]))
def test_streamed_content_and_tool_calls_equal_the_non_streamed_answer_for_any_split(pieces, stops, finish):
    streamed, text, calls, reason = _run(pieces, stops, finish)
    # what a streaming client concatenates is the non-streaming content ...
    assert streamed == text
    # ... and neither depends on where the token boundaries fell
    assert (text, calls, reason) == _run(["".join(pieces)], stops, finish)[1:]
    # ... nor on whether the text was decoded token by token (streaming) or once at the end (non-streaming)
    assert (text, calls, reason) == _run(pieces, stops, finish, streamed=False)[1:]


class _Counting:
    """The served model's text, counting how many times it decodes."""

    def __init__(self, text):
        self.text, self.decodes = text, 0

    def decode(self, ids: list[int]) -> str:
        self.decodes += 1
        return self.text.decode(ids)


def test_a_non_streamed_choice_without_stop_strings_decodes_once_at_the_end(model_text):
    ids = model_text.encode(TEXTS[1]) + [2]
    counting = _Counting(model_text)
    choice = Choice(0, counting, stops=[], parse_tools=False, streamed=False)
    deltas = _feed(choice, ids)
    assert choice.text == TEXTS[1] and choice.token_ids == ids and choice.finish_reason == "stop"
    assert [d.text for d in deltas[:-1]] == [""] * (len(ids) - 1) and deltas[-1].text == TEXTS[1]
    assert counting.decodes == 1  # a streamed choice decodes twice per token
    # stop strings are found as the text grows, so such a choice still decodes token by token
    with_stops = _Counting(model_text)
    stopped = Choice(0, with_stops, stops=["東京"], parse_tools=False, streamed=False)
    _feed(stopped, ids)
    assert stopped.text == "café naïve " and stopped.finish_reason == "stop" and with_stops.decodes > len(ids) // 2


def test_the_newline_before_a_tool_call_split_over_tokens_is_not_streamed():
    # the case found in the wild: `<tool_call>` arriving over several tokens after "Sure.\n"
    pieces = ["Sure.", "\n", "<", "tool", "_call", ">", _CALL.removeprefix("<tool_call>")]
    streamed, text, calls, reason = _run(pieces, [], "stop")
    assert streamed == text == "Sure." and reason == "tool_calls" and calls[0][0] == "add"


def test_text_parts_and_content_less_tool_calls_render_with_a_template_that_reads_strings(tiny_model, tmp_path):
    # OpenAI text parts ({"type": "text", "text": ...}, what many SDK wrappers send) went to the template as a
    # list: SmolLM2's (and Qwen's, Llama's) concatenate strings, so every such request was a 400
    import shutil
    from pathlib import Path

    from gyre_inference.text import ModelText

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    template = Path(__file__).parents[1] / "trainer_service" / "data" / "chat_templates" / "smollm2.jinja"
    (model / "chat_template.jinja").write_text(template.read_text())
    text = ModelText(model)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}]
    plain = [{"role": "user", "content": "What is\n2 + 2?"}]  # joined by newlines, as vLLM joins them
    assert text.chat_prompt(parts) == text.chat_prompt(plain)
    # the agent loop's next request: the assistant's tool call sent back without content (model_dump drops the
    # null) was a 400 "'dict object' has no attribute 'content'"; vLLM renders it as content ""
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    loop = [*plain, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    assert text.chat_prompt(loop) == text.chat_prompt([*plain, {**loop[1], "content": ""}, loop[2]])


def test_a_prompt_refused_as_too_long_logs_no_transformers_length_warning(tiny_model):
    # the server refuses it itself (context_length_exceeded); transformers also logged "Token indices sequence length
    # is longer than the specified maximum sequence length for this model ... will result in indexing errors", which
    # read like a bug in the server
    import asyncio

    import openai
    import pytest
    from http_app import StandInBackend, serve_app
    from support.logs import logged

    class NeverGenerates(StandInBackend):
        async def generate(self, prompt, params):
            raise AssertionError("a refused prompt was generated")
            yield

    long_text = "word " * 1200  # > 1024 tokens: over the tokenizer's model_max_length and the served context

    async def scenario():
        async with (
            serve_app(NeverGenerates(), tiny_model, "too-long") as url,
            openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client,
        ):
            refused = []
            for request in (
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_text}]),
                client.completions.create(model="tiny", prompt=long_text, max_tokens=2),
            ):
                with pytest.raises(openai.BadRequestError) as error:
                    await request
                refused.append(error.value.body["code"])
            return refused

    with logged("transformers") as lines:
        assert asyncio.run(scenario()) == ["context_length_exceeded"] * 2
    assert not [line for line in lines if "Token indices sequence length" in line], lines
