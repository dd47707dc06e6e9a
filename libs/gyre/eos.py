"""The token ids that end a model's turn: where inference stops and what SFT teaches the model to emit.

A model folder names them in up to three places, all honoured (the union): `generation_config.json`'s
`eos_token_id` (an int or a list: Llama 3 instruct lists `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`),
`config.json`'s, and the tokenizer's `eos_token`. A fourth is the chat template itself: the special token it
writes right after an assistant's reply (`<|im_end|>` in ChatML) ends the turn too, even where no config names
it. A base model's ChatML template (Qwen2.5 base: eos and the generation config's only id `<|endoftext|>`) never
stopped at `<|im_end|>`: every reply ran on into made-up turns up to `max_tokens`, and SFT learned the next user
turn as part of the reply. vLLM's own server stops only at the first three (its `update_from_generation_config`);
both of Gyre's backends stop at this set (the vLLM one with `ignore_eos` and these ids as its stop ids).
transformers is imported inside the function.

A client of a server it cannot load the tokenizer of (the orchestrator against `vllm serve`) asks the server for the
template's end of turn instead (`served_end_of_turn_id`, over vLLM's `/tokenize` and `/detokenize`) and sends it as
the request's `stop_token_ids`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

# A reply no template rewrites (no whitespace to strip, no markup to escape): what follows it is the turn's end.
_PROBE_REPLY = "gyreprobereply"


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def template_end_of_turn_id(tokenizer) -> int | None:
    """The special or added token `tokenizer`'s chat template writes right after an assistant's reply, if any.

    A user turn and an assistant reply are rendered; the first token after the reply (leading whitespace skipped:
    Llama 2 writes ` </s>`) counts only when it is one of the tokenizer's special tokens or a token added to its
    vocabulary (`add_tokens`, special or not: a fine-tune that gave a base tokenizer ChatML's `<|im_end|>` as a plain
    added token never stopped there), so a template that ends a turn with plain text (`\\n\\n`) adds nothing, nor
    does a marker the tokenizer splits into several tokens (`<end>`: no one id ends it, and its first, `<`, would end
    every reply that writes one). A template that cannot render the probe adds nothing either."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 - a template's raise_exception (needs a system turn, ...) or a Jinja error
        return None
    at = text.rfind(_PROBE_REPLY) if isinstance(text, str) else -1
    if at < 0:
        return None
    after = tokenizer.encode(text[at + len(_PROBE_REPLY) :].lstrip(), add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}))  # added tokens, special or not
    return after[0] if after and after[0] in special else None


async def served_end_of_turn_id(post: Callable[[str, dict], Awaitable[dict]]) -> int | None:
    """The token a server's chat template writes right after an assistant's reply, asked of the server itself.

    `post(path, body)`: the JSON answer of the server's `path` (vLLM's and Gyre's `/tokenize`, `/detokenize`). The
    probe chat is rendered twice, with the reply ended (the template's end of turn after it) and left open
    (`continue_final_message`); the first token of the difference that is not whitespace counts when it is the whole
    first word of that end, so a marker of several tokens (`<end>` as `<`, `end`, `>`) or none (`\\n\\n`) adds
    nothing. Without the tokenizer the special flag cannot be read: a one-token plain-text end would count."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
    ended = (await post("/tokenize", {"messages": chat, "add_generation_prompt": False}))["tokens"]
    open_ = await post("/tokenize", {"messages": chat, "add_generation_prompt": False, "continue_final_message": True})
    head = open_["tokens"]
    if ended[: len(head)] != head:
        return None  # the reply's last token merged with the end: no token of its own
    tail = ended[len(head) :]
    end = (await post("/detokenize", {"tokens": tail}))["prompt"] if tail else ""
    words = end.split()
    for token in tail:
        text = (await post("/detokenize", {"tokens": [token]}))["prompt"]
        if text.strip():
            return token if words and text.strip() == words[0] else None
    return None


def end_of_turn_ids(model_path: str | Path | None, tokenizer, config=None) -> frozenset[int]:
    """The union of the end-of-sequence ids of `model_path`'s generation config and config, of `tokenizer` and
    of its chat template's end of an assistant turn.

    `config`: the model config when the caller already loaded it; `model_path` None: the tokenizer's only."""
    ids: set[int] = set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    if (template_end := template_end_of_turn_id(tokenizer)) is not None:
        ids.add(template_end)
    if model_path is None:
        return frozenset(ids)
    from transformers import AutoConfig, GenerationConfig

    with contextlib.suppress(OSError):  # no generation_config.json
        ids.update(_as_ids(GenerationConfig.from_pretrained(model_path).eos_token_id))
    if config is None:
        try:
            config = AutoConfig.from_pretrained(model_path)
        except (OSError, ValueError):
            config = None
    ids.update(_as_ids(getattr(config, "eos_token_id", None)))
    return frozenset(ids)
