"""What a model's config says before any weight is loaded: the context it is served with and its modules.

`gyre rl` checks settings against them before anything starts (a completion budget the context cannot hold, a LoRA
target that names no layer); the inference backends serve the same context (`served_context`).
"""

from __future__ import annotations

from typing import Any


def served_context(config: Any, requested: int | None) -> int:
    """The context a model is served with: `engine.max_model_len` (`requested`) or else the model config's
    `max_position_embeddings` (the positions it was trained for), never more. Never the tokenizer's
    `model_max_length`: a tokenizer without a limit (a GGUF's, most hub ones) says 1e30, transformers'
    VERY_LARGE_INTEGER."""
    limit = getattr(config, "max_position_embeddings", None) or requested
    if limit is None:
        raise ValueError("the model config has no max_position_embeddings: set engine.max_model_len")
    if requested is not None and requested > limit:
        raise ValueError(f"engine.max_model_len {requested} exceeds the model's context {limit} "
                         "(its config's max_position_embeddings)")  # fmt: skip
    return requested or limit


def model_config(name: str | None = None, preset: str | None = None) -> Any:
    """The HF config of model `name` (a folder or hub id), or of the model `gyre model init` makes of `preset`."""
    from gyre.model_init import preset_config

    if preset:
        return preset_config(preset)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name)


def model_skeleton(config: Any):
    """The modules of the model `config` describes, on the meta device: no weights are read and no memory is taken,
    so a launch checks the names settings give (LoRA's target_modules) in a second."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
