"""`gyre model init`: a randomly initialised policy (tiny Llama presets, Qwen3-0.6B's shape, or any HF config) plus
its own byte-level BPE tokenizer.

Nothing is downloaded: the weights come from `torch.manual_seed(seed)` and the tokenizer is trained on
text generated from the same seed (`gyre.tiny_tokenizer`: prose, numbers, arithmetic, letters, reversed strings,
calculator tool calls in JSON), so every built-in environment's text tokenises sensibly.

    gyre model init --output-dir outputs/run/model --preset tiny --seed 0
    gyre model init --output-dir outputs/qwen3-shape --preset qwen3-0.6b     # GPU benchmarks
    gyre model init --output-dir outputs/m --config my-config.json           # any HF config.json

The folder holds what `AutoModelForCausalLM` / `AutoTokenizer` (and vLLM) load offline:
`config.json`, `generation_config.json`, `model.safetensors` (fp32; bf16 for qwen3-0.6b), `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`.

Invariants:
- Same (preset, seed, overrides) and same library versions -> byte-identical files.
- The folder appears complete or not at all (written under `.tmp-*`, fsynced, renamed); Ctrl-C or SIGTERM
  deletes the `.tmp-*` folder (`gyre.model_folder`).
- Special tokens: `<|endoftext|>` = id 0 is the tokenizer's eos and pad (document separator for packing
  and SFT), `<|im_start|>` = 1 and `<|im_end|>` = 2 delimit ChatML turns. The model config's and the
  generation config's `eos_token_id` is `<|im_end|>`, so generation stops at the end of the assistant's
  turn rather than running on into a made-up next turn. There is no BOS token (ChatML needs none).
- `<tool_call>` / `</tool_call>` are single tokens but not *special*: `decode(..., skip_special_tokens=True)`
  keeps them, so the tool-call parser still sees them in completions.
- `len(tokenizer) <= config.vocab_size` (equal for the Llama presets).
- The chat template is append-only: the prompt for turn k+1 starts with (prompt for turn k) + (the reply
  as sampled, ending in `<|im_end|>`), so multi-turn rollouts splice tokens without drift, provided a tool
  call is sampled in the canonical form the template re-renders:
  `<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>` (after the text and a `\n`, if any).
- Tool results use the ChatML `tool` role (`<|im_start|>tool\n...<|im_end|>`), not Qwen's user-wrapped form.

Importing this module never imports torch or transformers; they are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from gyre.config import Section, parse_or_exit
from gyre.model_folder import (
    check_output_dir,
    make_tokenizer_config_portable,
    publish_model_folder,
    sigterm_as_interrupt,
    staging_path,
)
from gyre.safetensors_io import read_header
from gyre.tiny_tokenizer import ENDOFTEXT, IM_END, MIN_VOCAB_SIZE, TOOL_TOKENS, build_tokenizer


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a random policy. Llama presets: head_dim = hidden_size / num_attention_heads (a multiple of
    8 for vLLM), untied embeddings. `tokenizer_vocab_size` (default: vocab_size) is the BPE's size, for
    shapes whose embedding table is far larger than a locally trained tokenizer needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    architecture: Literal["llama", "qwen3"] = "llama"
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    tokenizer_vocab_size: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"


PRESETS: dict[str, ModelPreset] = {
    # ~1.1M parameters: the CPU policy every test and local run uses.
    "tiny": ModelPreset(1024, 128, 4, 4, 4, 384, 1024),
    # ~3.8M: still CPU-fast; grouped-query attention like real policies.
    "small": ModelPreset(2048, 256, 4, 4, 2, 640, 2048),
    # ~19M: for GPU smoke runs.
    "medium": ModelPreset(4096, 384, 10, 6, 2, 1024, 2048),
    # 596M, the shape of Qwen3-0.6B (random weights, bf16, a 4096-token local BPE in a 151,936-row
    # embedding): reproduces the GPU figures of docs/benchmarks.md offline. Speed does not depend on
    # the weights being trained.
    "qwen3-0.6b": ModelPreset(
        151936, 1024, 28, 16, 8, 3072, 40960, "qwen3", 128, True, 1e6, tokenizer_vocab_size=4096, dtype="bfloat16"
    ),
}
PresetName = Literal["tiny", "small", "medium", "qwen3-0.6b"]


# A plain Section, not GyreSettings, so no GYRE_* env is read: `GYRE_OUTPUT_DIR` is a run's shared volume
# to every service, and honouring it here would drop model files into the run's root.
class ModelInitConfig(Section):
    """Create a tiny Llama policy and its byte-level BPE tokenizer (HF format, loads offline)."""

    output_dir: Path = Field(
        Path("outputs/run/model"), description="Model folder to create (must not exist or be empty)."
    )
    preset: PresetName = Field(
        "tiny",
        description="Model size: tiny (~1.1M params), small (~3.8M), medium (~19M) Llamas; qwen3-0.6b (596M, "
        "Qwen3-0.6B's shape in bf16, for GPU benchmarks).",
    )
    config: Path | None = Field(
        None,
        description="An HF config.json (any causal-LM architecture transformers knows) to build instead of "
        "a preset; its vocab_size must be >= 320. The tokenizer gets min(vocab_size, 4096) entries.",
    )
    seed: int = Field(0, ge=0, description="Seeds the weights and the tokenizer's training text.")
    vocab_size: int | None = Field(
        None, ge=MIN_VOCAB_SIZE, description="Override the preset's vocabulary size (tokenizer and embeddings)."
    )
    max_position_embeddings: int | None = Field(
        None, ge=16, description="Override the preset's context length (also the tokenizer's model_max_length)."
    )
    overwrite: bool = Field(
        False, description="Replace an existing model folder (one holding config.json) at output_dir."
    )


def init_model(
    output_dir: Path | str,
    preset: str = "tiny",
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int | None = None,
    overwrite: bool = False,
    config: Path | str | None = None,
) -> Path:
    """Create a random causal LM + trained BPE tokenizer in `output_dir`; return its resolved path.

    The shape is `preset`'s, or an HF `config` JSON's (then `vocab_size`/`max_position_embeddings`
    override its values). Raises ValueError for a bad preset, config or size and FileExistsError when
    `output_dir` is a file or a non-empty folder and `overwrite` is false; in both cases nothing on disk
    is touched.
    """
    shape = _resolve_shape(preset, vocab_size, max_position_embeddings)
    hf_config = _load_hf_config(config, vocab_size, max_position_embeddings) if config is not None else None
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    output_dir = Path(output_dir).resolve()
    check_output_dir(output_dir, overwrite, "pass overwrite=True (--overwrite)")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(output_dir)
    try:
        staging.mkdir(mode=0o700)
        if hf_config is not None:
            tokenizer_vocab, context = min(hf_config.vocab_size, 4096), hf_config.max_position_embeddings
        else:
            tokenizer_vocab, context = shape.tokenizer_vocab_size or shape.vocab_size, shape.max_position_embeddings
        tokenizer = build_tokenizer(tokenizer_vocab, seed, context)
        tokenizer.save_pretrained(staging)
        make_tokenizer_config_portable(staging / "tokenizer_config.json")
        _build_model(hf_config or _preset_config(shape, tokenizer), seed, tokenizer).save_pretrained(
            staging, safe_serialization=True
        )
        publish_model_folder(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def parameter_count(model_dir: Path | str) -> int:
    """Number of parameters stored in `model_dir`'s safetensors files, read from their headers (no torch)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        total += sum(math.prod(entry["shape"]) for entry in read_header(path).values())
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """`gyre model init [--output-dir D] [--preset P] [--seed S] [--vocab-size V] [--overwrite]`."""
    config = parse_or_exit(ModelInitConfig, None if argv is None else list(argv), prog="gyre model init")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a one-file "Writing model shards" bar is noise in a CLI
    try:
        with sigterm_as_interrupt():
            path = init_model(**config.model_dump())
    except (ValueError, FileExistsError) as error:
        print(f"gyre model init: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a folder that cannot be created or written, a --config that cannot be read
        print(f"gyre model init: error: {error}", file=sys.stderr)
        return 2
    config_json = json.loads((path / "config.json").read_text())
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_size = len(tokenizer_json["model"]["vocab"]) + len(TOOL_TOKENS)
    print(
        f"gyre model init: {config_json.get('model_type', 'llama')} ({config.config or config.preset}), "
        f"{parameter_count(path):,} parameters, "
        f"vocab {config_json['vocab_size']} (tokenizer {tokenizer_size}), "
        f"context {config_json['max_position_embeddings']}, seed {config.seed} -> {path}"
    )
    return 0


# --- model and files ---------------------------------------------------------------------------------


def _resolve_shape(preset: str, vocab_size: int | None, max_position_embeddings: int | None) -> ModelPreset:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = PRESETS[preset]
    if vocab_size is not None and vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    if max_position_embeddings is not None and max_position_embeddings < 16:
        raise ValueError(f"max_position_embeddings must be >= 16, got {max_position_embeddings}")
    return dataclasses.replace(
        shape,
        vocab_size=vocab_size or shape.vocab_size,
        max_position_embeddings=max_position_embeddings or shape.max_position_embeddings,
        tokenizer_vocab_size=None if vocab_size else shape.tokenizer_vocab_size,
    )


def _load_hf_config(path: Path | str, vocab_size: int | None, max_position_embeddings: int | None):
    """An HF config from a config.json, with the CLI's size overrides applied."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {path} is not a file (give the path of an HF config.json)")
    try:
        data = json.loads(path.read_text())
        config = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"config {path}: not an HF model config ({error})") from None
    config.vocab_size = vocab_size or config.vocab_size
    if max_position_embeddings:
        config.max_position_embeddings = max_position_embeddings
    if config.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"config {path}: vocab_size must be >= {MIN_VOCAB_SIZE}, got {config.vocab_size}")
    return config


def _preset_config(shape: ModelPreset, tokenizer=None):
    """The HF config of a preset; without a tokenizer its special token ids are unset (`preset_config`)."""
    from transformers import LlamaConfig, Qwen3Config

    ids = {"bos_token_id": None}
    if tokenizer is not None:
        ids.update(eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                   pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT))  # fmt: skip
    common = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        # Llama presets are untied: every parameter is its own tensor, which keeps weight sync and FSDP
        # sharding simple. The Qwen3 shape ties them, like the real Qwen3-0.6B.
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_theta": shape.rope_theta,
        "dtype": shape.dtype,
        **ids,
    }
    if shape.architecture == "qwen3":
        return Qwen3Config(head_dim=shape.head_dim, **common)
    return LlamaConfig(**common)


def _build_model(config, seed: int, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = im_end_id, pad_id, None
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    # fork_rng: seed the init without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=im_end_id, pad_token_id=pad_id)
    return model


def preset_config(preset: str):
    """The HF config of the model `gyre model init` makes of `preset` (its special token ids unset)."""
    return _preset_config(_resolve_shape(preset, None, None))


if __name__ == "__main__":
    sys.exit(main())
