"""Helpers of the inference integration tests: the tool model (real servers: `support.inference`)."""

from __future__ import annotations

from pathlib import Path

from support.models import teach

# A tiny model fine-tuned (in the fixture, ~100 steps) to answer TOOL_MESSAGES with TOOL_ANSWER under greedy
# decoding, so tool-call parsing is tested on text the model really generates.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
TOOL_MESSAGES = [{"role": "user", "content": "What is 1 plus 2?"}]
TOOL_ANSWER = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


def make_tool_model(tmp_path_factory, base: Path) -> Path:
    """The tiny model `base` taught (`support.models.teach`) to answer TOOL_MESSAGES with TOOL_ANSWER under greedy
    decoding, by a margin of one logit per token."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = tokenizer.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(TOOL_ANSWER, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    return teach(base, tmp_path_factory.getbasetemp() / "inference-tool-model", ids, labels, margin=1.0, max_steps=400)
