"""Everything between text and token ids: chat rendering, encoding, streaming detokenization, token bytes.

The prompt of a chat request is `encode(render_chat(messages, tools))`: the tokenizer's own chat
template renders text (tools included, as `apply_chat_template(..., tools=...)` does), which is then
tokenized without adding special tokens. POST /tokenize answers with exactly these ids, so a client
doing multi-turn token bookkeeping sees what the model saw.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from gyre.chat import TEMPLATE_ARGUMENTS, template_messages
from gyre.eos import end_of_turn_ids

from gyre_inference.errors import APIError


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


# `verbose` of the tokenizer's encode for prompts: False, because the server checks their length itself, against the
# context it serves (`context_length_exceeded`, a 400). Verbose, transformers logged "Token indices sequence length is
# longer than the specified maximum sequence length for this model ... will result in indexing errors" for a prompt the
# server then refused (nothing is indexed): noise that read like a bug. It is the only thing verbose changes here (its
# other warnings are about truncation and padding arguments, which these calls do not pass).
LENGTH_IS_CHECKED = False


class ModelText:
    """The served model's tokenizer plus the facts the API needs from its configs."""

    def __init__(self, model_path: str | Path):
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        # Token ids the model can embed (a prompt id beyond this would fail the whole batch's step).
        self.vocab_size: int = getattr(config, "vocab_size", None) or len(self.tokenizer)
        # Token ids that end a turn unless the request says ignore_eos (the same set SFT teaches).
        self.eos_token_ids = end_of_turn_ids(model_path, self.tokenizer, config)
        self._token_text: dict[int, tuple[str, list[int]]] = {}

    @functools.cached_property
    def grammars(self):
        """The structured-output grammar engine for this tokenizer (built at first use: about a second on a
        large vocabulary; call it from a worker thread)."""
        from gyre_inference.structured import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

    # ---- prompts --------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        from jinja2 import TemplateError

        messages = template_messages(messages)  # developer -> system, text parts -> text, as `gyre sft` renders
        template_kwargs = template_kwargs or {}
        if reserved := sorted(TEMPLATE_ARGUMENTS & set(template_kwargs)):
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)} (request fields do)",
                           param="chat_template_kwargs")  # fmt: skip
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise APIError(400, "continue_final_message needs an assistant message last", param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final_message, **template_kwargs,
            )  # fmt: skip
        except (TemplateError, ValueError, TypeError) as error:  # raise_exception (unknown role, ...), bad kwargs
            raise APIError(
                400, f"messages cannot be rendered by the chat template: {error}", param="messages"
            ) from None

    def encode(self, text: str, add_special_tokens: bool = False, param: str = "prompt") -> list[int]:
        """Token ids of `text`; a 400 naming `param` for text that is not Unicode (a lone surrogate)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=LENGTH_IS_CHECKED)
        except TypeError:  # the tokenizer's only word for a str it cannot take as UTF-8
            refuse_surrogates(text, param)
            raise
        finally:
            release_tokenizer_memory(len(text))

    def chat_prompt(self, messages, tools=None, add_generation_prompt: bool = True, **options) -> list[int]:
        """Token ids of the rendered chat; `options`: continue_final_message, template_kwargs, add_special_tokens."""
        add_special_tokens = options.pop("add_special_tokens", False)
        rendered = self.render_chat(messages, tools, add_generation_prompt, **options)
        try:
            return self.tokenizer.encode(rendered, add_special_tokens=add_special_tokens, verbose=LENGTH_IS_CHECKED)
        except TypeError:  # name the message (or tool) that holds the bad text, not a place in the rendered prompt
            refuse_surrogates(messages, "messages")
            refuse_surrogates(tools, "tools")
            refuse_surrogates(options.get("template_kwargs"), "chat_template_kwargs")
            refuse_surrogates(rendered, "messages")
            raise
        finally:
            release_tokenizer_memory(len(rendered))

    def token_strings(self, ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(ids)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of vocabulary (vocabulary size {self.vocab_size})",
                           param=param)  # fmt: skip
        return ids

    def bad_word_ids(self, words: list[str], param: str = "bad_words") -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of `bad_words`: each word (leading spaces stripped) alone, and after a space too when
        that spelling starts with another token and has as many (the word inside a text: " word" is one token
        where "word" is another), so that both are banned."""
        token_ids = []
        for i, word in enumerate(words):
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not alone:
                raise APIError(400, f"{param}.{i}: {word!r} has no token (only spaces)", param=param)
            token_ids.append(tuple(alone))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                token_ids.append(tuple(spaced))
        return tuple(token_ids)

    def decode(self, ids: list[int]) -> str:
        """Generated text: special tokens left out (vLLM's skip_special_tokens default for outputs)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_prompt(self, ids: list[int]) -> str:
        """A prompt's text as vLLM shows it (/detokenize, the echo of a token-id prompt): special tokens kept, so a
        rendered chat prompt reads with its role markers (`<|im_start|>user ...`), as the model saw it."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- per-token text (log-prob entries) ------------------------------------------------------
    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, utf-8 bytes) of one token as OpenAI's log-prob entries show it.

        Byte-level BPE tokens map back to their exact bytes (a token may hold part of a character; its
        text then shows U+FFFD, its bytes are exact). Other tokenizers: the token decoded on its own.
        """
        cached = self._token_text.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if piece is not None and all(ch in table for ch in piece):
                data = bytes(table[ch] for ch in piece)
            else:
                data = self.tokenizer.decode([token_id]).encode()
            cached = (data.decode("utf-8", errors="replace"), list(data))
            self._token_text[token_id] = cached
        return cached


class IncrementalDecoder:
    """Streaming detokenization (skip_special_tokens): text is released only once it is stable.

    Text is emitted per token from a window of recent ids, holding back while the window ends in an
    incomplete UTF-8 sequence, so concatenating every `push()` and the final `flush()` gives the same
    text as decoding all ids at once (for byte-level BPE; this is the TGI/vLLM scheme).
    """

    def __init__(self, text: ModelText, skip_special: bool = True):
        self._decode = text.decode if skip_special else text.decode_prompt
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this were already released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end shows as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


# Text at least this long is followed by a trim of the C heap (below).
RELEASE_AFTER_CHARS = 256 * 1024


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_tokenizer_memory(chars: int) -> None:
    """Give the memory of a large tokenization back to the system (call in the thread that tokenized).

    Why: the Rust tokenizer builds an `Encoding` of every token (ids, type ids, token strings, offsets,
    masks: ~250 bytes a token, ~500 MB for a 3.5 MB prompt) and frees it before `encode` returns, but into
    the glibc malloc arena of the worker thread that ran it; glibc returns only the top of the main arena to
    the system by itself, so each worker thread kept its peak for good (RSS +250-500 MB per such prompt, up
    to the number of threads; measured: 329 -> 1018 MB after four 3.5 MB prompts, 405 MB with this).
    `malloc_trim(0)` hands every arena's free pages back (~0.2 s after a 3.5 MB prompt, against ~10 s of
    tokenizing it), so it runs only after text of RELEASE_AFTER_CHARS or more.
    """
    if chars >= RELEASE_AFTER_CHARS and (trim := _malloc_trim()) is not None:
        trim(0)


def refuse_surrogates(value, param: str) -> None:
    """A 400 naming where in `value` (a string, or lists and dicts of them) text holds a lone UTF-16
    surrogate: JSON can carry one (`"\\ud800"`), Unicode text cannot, so no tokenizer can encode it. Clients
    produce them by cutting a string inside a surrogate pair (JavaScript's `String.slice` inside an emoji)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            bad = value[error.start].encode("unicode_escape").decode()
            raise APIError(
                400,
                f"{param}: the text holds a lone UTF-16 surrogate ({bad} at character "
                f"{error.start}), which is not valid Unicode and cannot be tokenized (was a "
                "string cut inside a surrogate pair, such as an emoji?)",
                param=param,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_surrogates(item, f"{param}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            refuse_surrogates(item, f"{param}.{i}")
