"""`gyre model init`: a randomly initialised policy (tiny Llama presets, Qwen3-0.6B's shape, or any HF config) plus
its own byte-level BPE tokenizer.

Nothing is downloaded: the weights come from `torch.manual_seed(seed)` and the tokenizer is trained on
text this module generates from the same seed (prose, numbers, arithmetic, letters, reversed strings,
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
  deletes the `.tmp-*` folder (`sigterm_as_interrupt`).
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

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from gyre.config import Section, parse_or_exit
from gyre.runlock import running_holder
from gyre.safetensors_io import read_header

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# Trained first, so their ids are 0, 1, 2 in this order.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added after training at the top of the vocabulary, never split, kept by skip_special_tokens.
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END)
MIN_VOCAB_SIZE = 320

# Qwen2's pre-tokenizer split (GPT-4 style, digits one by one): single digits make arithmetic
# tokenisation regular (every number is its digits), which a tiny model can actually learn.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML with Hermes/Qwen-style tools. Messages: system/user/assistant/tool; `content` is a string,
# None, or a list of OpenAI text parts; assistant `tool_calls` may be OpenAI-shaped
# ({"function": {"name", "arguments": "<json string>"}}) or HF-shaped ({"name", "arguments": {...}}).
# The assistant's reply and its <|im_end|> sit inside {% generation %} so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly the tokens SFT trains on.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0, system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.start = 1 -%}
    {%- set ns.system = render_content(messages[0]['content']) -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nYou may call these functions. Their signatures, one per line:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call one, reply with a JSON object inside tags:\\n<tool_call>\\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif ns.start == 1 -%}
    {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
    {%- set content = render_content(message['content'] if 'content' in message else none) -%}
    {%- if message['role'] in ['system', 'user', 'tool'] -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- generation -%}
        {{- content -}}
        {%- for tool_call in message['tool_calls'] or [] -%}
            {%- set call = tool_call['function'] if 'function' in tool_call else tool_call -%}
            {%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n{"name": ' + (call['name'] | tojson) + ', "arguments": ' -}}
            {%- if call['arguments'] is string -%}{{- call['arguments'] -}}
            {%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>' -}}
        {%- endgeneration -%}
        {{- '\\n' -}}
    {%- else -%}
        {{- raise_exception('unknown chat role ' + message['role'] + ': use system, user, assistant or tool') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


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


def build_tokenizer(vocab_size: int, seed: int = 0, model_max_length: int = 1024):
    """Train the byte-level BPE on `training_corpus(seed)`; return a `PreTrainedTokenizerFast` with ChatML.

    Any byte string round-trips (byte-level alphabet), digits are always single tokens, and the vocabulary
    has at most `vocab_size` entries (exactly, when the corpus yields enough merges).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Merges are chosen by (count, pair) order, so training is deterministic for a given text.
    bpe.train_from_iterator(training_corpus(seed, num_lines=8 * vocab_size), trainer)
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


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


# --- corpus -----------------------------------------------------------------------------------------

# Common English words (plus task vocabulary); split at import so the list stays readable here.
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from or had by word
but what some we can out other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him two has look more day
could go come did number sound no most people my over know water than call first who may down side been now
find any new work part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line differ turn cause
much mean before move right boy old too same tell does set three want air well also play small end put home
read hand port large spell add even land here must big high such follow act why ask men change went light kind
off need house picture try us again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late run while press
close night real life few north open seem together next white children begin got walk example ease paper group
always music those both mark often letter until mile river car feet care second book carry took science eat
room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main enough
plain girl usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true during hundred
five remember step early hold west ground interest reach fast verb sing listen six table travel less morning
ten simple several vowel toward war lay against pattern slow center love person money serve appear road map
rain rule govern pull cold notice voice unit power town fine apple banana cherry grape lemon mango orange
peach pear plum kiwi melon berry sum total result answer reverse sort alphabetical order calculator expression
compute solve equal plus minus times divide product difference quotient remainder count letters characters
string text reply final correct
"""
_WORDS = tuple(_COMMON_WORDS.split())
_UNICODE_TEXT = "café naïve résumé über façade jalapeño Zürich São Paulo 東京 Москва Ελλάδα ☺ ✓ → ≤ ≥ ± × ÷ π 😀 🚀"
_UNICODE_WORDS = tuple(_UNICODE_TEXT.split())
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z"]
_ONSETS += ["bl", "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "sp", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "ng", "st", "nd", "ck", "ll", "th"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))


def _word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.75:
        return rng.choice(_WORDS)
    return _pseudo_word(rng) if roll < 0.97 else rng.choice(_UNICODE_WORDS)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 14))]
    for i in range(1, len(words) - 1):
        if rng.random() < 0.08:
            words[i] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!")


def _number(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        return str(rng.randint(0, 10 ** rng.randint(1, 6)))
    if roll < 0.8:
        return str(-rng.randint(1, 999))
    return f"{rng.uniform(-100, 1000):.{rng.randint(1, 3)}f}"


def _apply(a: int, op: str, b: int) -> float:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0}[op]


def _arithmetic(rng: random.Random) -> str:
    a, b, c = (rng.randint(0, 10 ** rng.randint(1, 4)) for _ in range(3))
    op = rng.choice("+-*")
    expression, value = rng.choice(
        [
            (f"{a} {op} {b}", _apply(a, op, b)),
            (f"({a} {op} {b}) + {c}", _apply(a, op, b) + c),
            (f"{a} * {b} - {c}", a * b - c),
            (f"{a}{op}{b}", _apply(a, op, b)),
        ]
    )
    return rng.choice(
        [
            f"{expression} = {value}",
            f"What is {expression}?\nThe answer is {value}.",
            f"Compute {expression}. Answer: \\boxed{{{value}}}",
            f"Solve: {expression}\n<answer>{value}</answer>",
        ]
    )


def _letters(rng: random.Random) -> str:
    words = sorted({_word(rng).strip(",") for _ in range(rng.randint(3, 8))})
    shuffled = rng.sample(words, len(words))
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 10))
    return rng.choice(
        [
            f"Sort these words alphabetically: {', '.join(shuffled)}\n{', '.join(words)}",
            f"Sort: {' '.join(shuffled)}\n<answer>{' '.join(words)}</answer>",
            " ".join(sorted(letters)) + "\n" + ", ".join(letters).upper() + "\n" + "".join(letters),
        ]
    )


def _reversed(rng: random.Random) -> str:
    text = " ".join(_word(rng) for _ in range(rng.randint(1, 6)))
    return rng.choice([f"Reverse the text: {text}\n{text[::-1]}", f"{text[::-1]}", f"<answer>{text[::-1]}</answer>"])


def _tool_call(rng: random.Random) -> str:
    a, b = rng.randint(0, 9999), rng.randint(1, 999)
    op = rng.choice("+-*/")
    expression = f"{a} {op} {b}"
    result = round(_apply(a, op, b), 4)
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
                "required": ["expression"],
            },
        },
    }
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return rng.choice(
        [
            json.dumps(schema),
            f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}",
            json.dumps({"result": result}),
            f"The calculator returned {result}, so the answer is {result}.",
            "# Tools\n<tools>\n" + json.dumps(schema) + "\n</tools>",
        ]
    )


def _chat_words(rng: random.Random) -> str:
    return rng.choice(
        [
            "system\nYou are a helpful assistant.",
            "user\n" + _sentence(rng),
            "assistant\n" + _sentence(rng),
            "tool\n" + json.dumps({"result": rng.randint(0, 999)}),
            "Think step by step, then give the final answer.",
            "  " + _sentence(rng) + "\n\n\t" + _sentence(rng),
        ]
    )


_GENERATORS = (
    (_sentence, 5),
    (_number, 1),
    (_arithmetic, 3),
    (_letters, 2),
    (_reversed, 2),
    (_tool_call, 2),
    (_chat_words, 1),
)


def training_corpus(seed: int, num_lines: int) -> Iterator[str]:
    """Yield `num_lines` deterministic lines of tokenizer training text (a pure function of the seed)."""
    rng = random.Random(seed)
    generators = [generator for generator, weight in _GENERATORS for _ in range(weight)]
    for _ in range(num_lines):
        yield rng.choice(generators)(rng)


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


def make_tokenizer_config_portable(path: Path) -> None:
    """Rewrite transformers-5-only keys to the names both transformers 4.56+ and 5 read.

    vLLM images may pin a transformers 4.x, which knows neither the `TokenizersBackend` class nor a list
    under `extra_special_tokens`; transformers 5 maps `PreTrainedTokenizerFast` and
    `additional_special_tokens` back to its own names, so the loaded tokenizer is the same.
    """
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def staging_path(output_dir: Path) -> Path:
    """A fresh `.tmp-*` name beside `output_dir`, chosen before the folder is made: the caller makes it inside its
    cleanup's try, so a Ctrl-C or SIGTERM at any instant leaves no folder behind (with mkdtemp one arriving between
    the folder's creation and the assignment left it, unnamed, for good)."""
    return output_dir.parent / f".tmp-{output_dir.name}-{uuid.uuid4().hex[:8]}"


def check_output_dir(output_dir: Path, overwrite: bool, how: str = "pass --overwrite to replace it") -> None:
    """FileExistsError unless a model may be written to `output_dir`: absent, empty, or (with `overwrite`) a model
    folder. `--overwrite` replaces the whole folder: on a run folder (`--output-dir outputs/demo`) or a project
    (`--output-dir .`) it deleted every checkpoint, or every file, there."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} is a file, not a folder: choose another --output-dir")
    if not (output_dir.is_dir() and any(output_dir.iterdir())):
        return
    if not overwrite:
        raise FileExistsError(f"{output_dir} already exists and is not empty; {how}")
    if not (output_dir / "config.json").is_file():
        raise FileExistsError(
            f"{output_dir} is not a model folder (no config.json): --overwrite replaces only a model folder; "
            "choose another --output-dir, or empty it yourself"
        )
    # a run's base model (`{run}/model`, gyre rl's default) replaced under its live services: replicas restarting
    # and the trainer's next resume would load a different model than the one the run started from
    for role in ("rl", "trainer", "orchestrator", "sft"):
        holder = running_holder(output_dir.parent, role)
        if holder is not None:
            raise FileExistsError(
                f"{output_dir} is the model of a running run: pid {holder.get('pid')} ({role}, "
                f"{holder.get('command', 'unknown command')}) uses {output_dir.parent}; stop it first, "
                "or choose another --output-dir"
            )


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt inside the block, as Ctrl-C does, so the clean-up of a half-written folder runs
    (`.tmp-*` staging, removed by `except BaseException`): its default action ended the process on the spot and left
    the folder, up to a model's size (only `gyre rl` removed them, from its own run folder). The `gyre` command prints
    one line for it and exits 130. Main thread only (elsewhere a no-op: signal handlers belong to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def publish_model_folder(staging: Path, output_dir: Path) -> None:
    """fsync every file, then swap `staging` in as `output_dir` (an old folder is removed only afterwards)."""
    for file in staging.iterdir():
        file.chmod(0o644)  # save_pretrained may leave 0600; other services' users read these
        with file.open("rb") as f:
            os.fsync(f.fileno())
    staging.chmod(0o755)  # staging is made 0700
    retired = None
    if output_dir.exists():
        retired = output_dir.with_name(f".old-{output_dir.name}-{os.getpid()}")
        output_dir.rename(retired)
    staging.rename(output_dir)
    directory = os.open(output_dir.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    if retired is not None:
        shutil.rmtree(retired)


if __name__ == "__main__":
    sys.exit(main())
