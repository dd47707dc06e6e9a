"""The token ids that end a model's turn: where inference stops and what SFT teaches the model to emit.

A model folder names them in up to three places, all honoured (the union): `generation_config.json`'s
`eos_token_id` (an int or a list: Llama 3 instruct lists `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`),
`config.json`'s, and the tokenizer's `eos_token`. transformers is imported inside the function.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def end_of_turn_ids(model_path: str | Path | None, tokenizer, config=None) -> frozenset[int]:
    """The union of the end-of-sequence ids of `model_path`'s generation config and config and of `tokenizer`.

    `config`: the model config when the caller already loaded it; `model_path` None: the tokenizer's only."""
    ids: set[int] = set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
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
