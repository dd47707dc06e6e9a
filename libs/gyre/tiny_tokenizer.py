"""The tokenizer `gyre model init` makes: a byte-level BPE trained on text generated here from the seed, with ChatML
special tokens and a chat template with Hermes/Qwen-style tools. Nothing is downloaded, and the same seed gives the
same tokenizer (byte-identical files).

The training text (`training_corpus`) mixes prose, numbers, arithmetic, letters, reversed strings and calculator
tool calls in JSON, so every built-in environment's text tokenises sensibly. The invariants the rest of Gyre relies
on (special token ids, `<tool_call>` kept by `skip_special_tokens`, the append-only template) are listed in
`gyre.model_init`'s docstring.

Importing this module never imports tokenizers or transformers; they are imported inside `build_tokenizer`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

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


# --- the training text ----------------------------------------------------------------------------------------

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
