"""SFT masks on real chat templates without `{% generation %}` markers (SmolLM2, Qwen2.5, Qwen3, Llama 3.1).

The templates in data/chat_templates are the models' own (see data/chat_templates/README.md); the tokenizer is
the tiny test tokenizer with each family's special tokens added, so each marker is one token as in the real
vocabularies. For every conversation the learned tokens are checked one by one: they are exactly the
tokens of each assistant turn up to and including its end-of-turn token, nothing else.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from gyre_trainer.sft_data import Conversation, SFTDataError, tokenize

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]  # fmt: skip
# family -> (special tokens to add, bos, the end-of-turn tokens inference stops at)
FAMILIES = {
    "smollm2": ([], None, ["<|im_end|>"]),
    "qwen2.5": ([], None, ["<|im_end|>"]),
    "qwen3": (["<think>", "</think>"], None, ["<|im_end|>"]),
    "llama3.1": (LLAMA_SPECIALS, "<|begin_of_text|>", ["<|eot_id|>", "<|eom_id|>"]),
}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Now say bye."},
    {"role": "assistant", "content": "Bye."},
]
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
TOOL_CHAT = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]  # fmt: skip
QWEN_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
# What each assistant turn must teach, written out by hand from each template's text.
EXPECTED = {
    ("smollm2", "chat"): ["Hello there!<|im_end|>", "Bye.<|im_end|>"],
    ("qwen2.5", "chat"): ["Hello there!<|im_end|>", "Bye.<|im_end|>"],
    # Qwen3 gives the turn after the last user message an (empty) thinking block: the model writes it too
    ("qwen3", "chat"): ["Hello there!<|im_end|>", "<think>\n\n</think>\n\nBye.<|im_end|>"],
    ("llama3.1", "chat"): ["Hello there!<|eot_id|>", "Bye.<|eot_id|>"],
    ("qwen2.5", "tools"): [QWEN_CALL, "It is 5.<|im_end|>"],
    ("qwen3", "tools"): [QWEN_CALL, "<think>\n\n</think>\n\nIt is 5.<|im_end|>"],
    ("llama3.1", "tools"): ['{"name": "calc", "parameters": {"expression": "2+3"}}<|eot_id|>', "It is 5.<|eot_id|>"],
}


@pytest.fixture(scope="module")
def family_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    def make(family: str):
        specials, bos, _ = FAMILIES[family]
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        tokenizer.add_special_tokens({"additional_special_tokens": specials} if specials else {})
        if bos:
            tokenizer.bos_token = bos
        tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
        return tokenizer

    return make


def learned_runs(ids: list[int], mask: list[bool], tokenizer) -> list[list[int]]:
    """Maximal runs of learned tokens."""
    runs, run = [], []
    for token, learned in zip(ids, mask, strict=True):
        if learned:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("family, kind", sorted(EXPECTED))
def test_only_assistant_tokens_and_their_end_of_turn_are_learned(family_tokenizer, family, kind):
    tokenizer = family_tokenizer(family)
    messages = copy.deepcopy(CHAT if kind == "chat" else TOOL_CHAT)
    tools = [CALC] if kind == "tools" else None
    end_ids = set(tokenizer.convert_tokens_to_ids(FAMILIES[family][2]))
    ids, mask = tokenize(Conversation(messages, tools), tokenizer, end_ids)

    # the ids are the template's own rendering, tokenised as apply_chat_template does
    rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    assert ids == list(rendered["input_ids"])
    runs = learned_runs(ids, mask, tokenizer)
    assert [tokenizer.decode(run) for run in runs] == EXPECTED[family, kind]
    # token by token: each run is the tokens right after the generation prompt of `messages[:i]`, through the
    # first end-of-turn token; everything else (system, user, tool output, headers, "\n" after it) is not learned
    starts = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(
                messages[:i], tools=tools, tokenize=False, add_generation_prompt=True
            )
            starts.append(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    expected = [False] * len(ids)
    for start in starts:
        t = start
        while ids[t] not in end_ids:
            expected[t] = True
            t += 1
        expected[t] = True
    assert mask == expected


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_message(family_tokenizer):
    tokenizer = family_tokenizer("smollm2")
    # marks the last message: rendering a prefix gives text the full conversation does not start with
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}{% if loop.last %}*{% endif %}: {{ m.content }}\n" \
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"  # fmt: skip
    with pytest.raises(SFTDataError, match="before message 2 differently"):
        tokenize(Conversation(copy.deepcopy(CHAT)), tokenizer, {0})


def test_a_turn_without_an_end_of_turn_token_is_learned_to_its_end(family_tokenizer):
    """...and a token spanning the prompt's end and the reply's start (" H" here) is learned."""
    tokenizer = family_tokenizer("smollm2")
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" \
        "{% if add_generation_prompt %}[assistant] {% endif %}"  # fmt: skip
    ids, mask = tokenize(Conversation(copy.deepcopy(CHAT)), tokenizer, {0})
    assert [tokenizer.decode(r) for r in learned_runs(ids, mask, tokenizer)] == [" Hello there!\n", " Bye.\n"]


OPENER = {"smollm2": "<|im_end|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3.1": "<|eot_id|>"}


@pytest.mark.parametrize("family", sorted(OPENER))
def test_a_chat_that_opens_with_the_assistant_learns_that_reply_not_the_default_system_prompt(family_tokenizer, family):
    """An opening assistant message had an empty prefix: SmolLM2, Qwen2.5 and Llama 3.1, which inject a default
    system prompt, taught that prompt (through its end-of-turn token) and not the assistant's greeting."""
    tokenizer = family_tokenizer(family)
    messages = [{"role": "assistant", "content": "How can I help?"}, *copy.deepcopy(CHAT[1:3])]
    end_ids = set(tokenizer.convert_tokens_to_ids(FAMILIES[family][2]))
    ids, mask = tokenize(Conversation(messages), tokenizer, end_ids)
    last = EXPECTED[family, "chat"][1].replace("Bye.", "Hello there!")  # Qwen3's thinking block: after the last user
    assert [tokenizer.decode(run) for run in learned_runs(ids, mask, tokenizer)] == [f"How can I help?{OPENER[family]}",
                                                                                       last]  # fmt: skip


def test_an_opening_assistant_turn_the_generation_prompt_cannot_locate_is_refused(family_tokenizer):
    tokenizer = family_tokenizer("smollm2")
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}" \
        "{% if add_generation_prompt %}>>> {% endif %}"  # fmt: skip
    with pytest.raises(SFTDataError, match="message 0"):
        tokenize(Conversation([{"role": "assistant", "content": "Hi"}, *copy.deepcopy(CHAT[1:3])]), tokenizer, {0})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_developer_turn_trains_on_the_text_inference_renders(family_tokenizer, family):
    # inference renders OpenAI's `developer` role as `system`; SFT rendered it as a turn of its own (SmolLM2 and
    # Qwen: a "developer" turn after the template's default system prompt), text the served model never sees
    tokenizer = family_tokenizer(family)
    developer = [{**CHAT[0], "role": "developer"}, *copy.deepcopy(CHAT[1:])]
    assert tokenize(Conversation(developer), tokenizer, {0}) == tokenize(
        Conversation(copy.deepcopy(CHAT)), tokenizer, {0}
    )


def test_tool_calls_a_template_does_not_render_are_refused_not_learned_as_an_empty_turn(family_tokenizer):
    # SmolLM2's template drops `tool_calls`: the tool-call turn rendered as "<|im_end|>" alone, so SFT on a tool
    # environment (`--data.env calculator`) taught the model to end its turn where it should call the tool
    with pytest.raises(SFTDataError, match=r"does not render the assistant's tool calls \(calc\)"):
        tokenize(Conversation(copy.deepcopy(TOOL_CHAT), [CALC]), family_tokenizer("smollm2"), {0})
    ids, mask = tokenize(Conversation(copy.deepcopy(TOOL_CHAT), [CALC]), family_tokenizer("qwen2.5"), {0})
    assert any(mask)  # a template that renders them is unaffected


# ChatML with `{% generation %}` around the reply's text alone: `<|im_end|>` is outside the block
CONTENT_ONLY_GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m.content }}{% endgeneration %}{{ '<|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_generation_marked_reply_learns_the_end_of_turn_token_its_block_leaves_out(family_tokenizer):
    """A template's `{% generation %}` mask that stops before the end-of-turn token taught every reply but never
    where it ends: a model fine-tuned on it never learned to stop (inference stops only at that token)."""
    tokenizer = family_tokenizer("smollm2")
    tokenizer.chat_template = CONTENT_ONLY_GENERATION
    end_ids = set(tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
    ids, mask = tokenize(Conversation(copy.deepcopy(CHAT)), tokenizer, end_ids)
    assert [tokenizer.decode(run) for run in learned_runs(ids, mask, tokenizer)] == EXPECTED["smollm2", "chat"]
    # a block that already holds its end-of-turn token keeps the template's mask as it is
    tokenizer.chat_template = CONTENT_ONLY_GENERATION.replace(
        "{{ m.content }}{% endgeneration %}{{ '<|im_end|>\\n' }}", "{{ m.content + '<|im_end|>' }}{% endgeneration %}\n"
    )
    ids, mask = tokenize(Conversation(copy.deepcopy(CHAT)), tokenizer, end_ids)
    assert [tokenizer.decode(run) for run in learned_runs(ids, mask, tokenizer)] == EXPECTED["smollm2", "chat"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_end_of_turn_ids_hold_the_token_each_template_ends_a_reply_with(family_tokenizer, family):
    """The ids SFT learns through and inference stops at (`gyre.eos`) come from the configs and the tokenizer's eos
    (here `<|endoftext|>` alone, as in a base model's) and from the chat template: a ChatML or Llama 3 reply ended
    with a token none of them named, and SFT learned the turns after it as part of the reply."""
    from gyre.eos import end_of_turn_ids

    tokenizer = family_tokenizer(family)
    assert tokenizer.eos_token == "<|endoftext|>"
    ends = end_of_turn_ids(None, tokenizer)
    assert ends == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(FAMILIES[family][2][0])}
    ids, mask = tokenize(Conversation(copy.deepcopy(CHAT)), tokenizer, ends)
    assert [tokenizer.decode(run) for run in learned_runs(ids, mask, tokenizer)] == EXPECTED[family, "chat"]
