"""Structured outputs: what a request constrains its output to, and how the engine enforces it.

Three pieces, each with one job:

- `Guide`: WHAT the output must match (a JSON schema, any JSON object, a regex, one of fixed strings, a
  Lark/GBNF grammar), backend-neutral. The HTTP layer builds it from `response_format`, vLLM's
  `structured_outputs` / `guided_*` fields and `tool_choice` (tool_calls.py). The vLLM backend hands it
  to vLLM's own structured outputs; the torch backend gets a `Constraint` compiled from it.
- `Constraint`: the per-sequence grammar matcher the torch engine drives (the xgrammar-style interface,
  so an xgrammar `GrammarMatcher` satisfies it too). Per decode step the engine asks every constrained
  row to fill its row of ONE host bitmask, copies that bitmask to the device once and masks the logits
  of those rows there (inside its sampler, `sampling.sample`), samples, then tells each matcher the token
  it got. Free rows are untouched, so a batch mixing constrained and free rows is still one decode step.
- `GrammarCompiler`: the grammar engine, llguidance (docs/dependencies.md says why that one). Compiles a
  Guide once per distinct guide (a grammar error is a 400 naming the field) and hands out fresh matchers.

Log-probs: the masked logits ARE the distribution sampled from, so a constrained token's reported
log-prob is `log_softmax(masked_logits / T)[token]`, renormalised over the tokens the grammar allowed
(docs/inference.md, "Structured outputs", says what the trainer does with such tokens).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

GuideKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# JSON is generated with fixed separators (", " and ": ", as json.dumps and the chat templates' tojson
# write it) and no other whitespace: a model, above all a small or untrained one, cannot loop on whitespace.
# The options travel inside the schema (llguidance's "x-guidance" key), so the vLLM backend, which runs
# the same engine, accepts exactly the same strings.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def with_json_options(schema: dict) -> dict:
    """`schema` with the JSON layout options above (a schema's own "x-guidance" options win)."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


class GuideError(ValueError):
    """A guide the grammar engine refuses (an invalid schema, regex or grammar); the API answers 400."""


def check_schema(schema: dict, *, enforced: bool) -> None:
    """GuideError when `schema` is not a valid JSON schema. `enforced`: it will constrain generation, so
    keywords the grammar engine cannot enforce (`not`, `if`, `uniqueItems`, ...) are refused too; otherwise
    (a tool the model may or may not call) only what is invalid is."""
    text = json.dumps(schema, sort_keys=True)
    key = (hashlib.sha256(text.encode()).digest(), enforced)  # not the text: 256 schemas of 4 MiB would stay
    with _SCHEMA_LOCK:
        known = key in _SCHEMA_ERRORS
        error = _SCHEMA_ERRORS.get(key)
    if not known:
        error = _schema_error(schema, enforced)
        with _SCHEMA_LOCK:
            _SCHEMA_ERRORS[key] = error
            while len(_SCHEMA_ERRORS) > 256:  # the same tools come with every turn of a rollout
                _SCHEMA_ERRORS.popitem(last=False)
    if error:
        raise GuideError(error)


_SCHEMA_ERRORS: OrderedDict[tuple[bytes, bool], str | None] = OrderedDict()  # checked schemas (oldest first)
_SCHEMA_LOCK = threading.Lock()


def _schema_error(schema: dict, enforced: bool) -> str | None:
    import llguidance

    options = {**(schema.get("x-guidance") or {}), **({} if enforced else {"lenient": True})}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": options})
    except (ValueError, TypeError) as error:
        return str(error)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error.strip() or None


@dataclass(frozen=True)
class Guide:
    """What one request's output must match.

    `value` by kind: "json": the JSON schema (a dict); "json_object": None (any JSON object); "regex": the
    pattern; "choice": a tuple of strings; "grammar": a Lark grammar (llguidance's dialect, which also
    embeds JSON schemas with `%json {...}`) or a GBNF one. `param` names the request field it came from,
    for error messages.
    """

    kind: GuideKind
    value: Any = None
    param: str = "response_format"

    def schema(self) -> dict:
        """The JSON schema of a "json" / "json_object" guide, with the layout options (JSON_OPTIONS)."""
        return with_json_options(self.value if self.kind == "json" else {"type": "object"})

    def key(self) -> str:
        """A canonical text of the guide (the compile cache's key)."""
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"


@runtime_checkable
class Constraint(Protocol):
    """One sequence's grammar state, driven by the engine thread (never shared between sequences).

    Per decode step the engine calls `fill_next_token_bitmask(bitmask, index)` (write row `index` of the
    host int32 bitmask [rows, ceil(vocab / 32)]: bit j of word w set = token 32 * w + j allowed), samples
    from the masked logits, then `accept_token(token)`. Once `is_terminated()` the sequence is complete
    (the grammar accepted its end-of-sequence token) and the engine finishes it with reason "stop".
    """

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...


def bitmask_words(vocab_size: int) -> int:
    """Words of a bitmask row: one bit per token of the logits, 32 to an int32."""
    return (vocab_size + 31) // 32


# ---- the grammar engine: llguidance ------------------------------------------------------------------
class _Matcher:
    """An llguidance `LLMatcher` behind the `Constraint` interface."""

    __slots__ = ("_matcher", "_eos", "_terminated")

    def __init__(self, matcher, eos: frozenset[int]):
        self._matcher, self._eos, self._terminated = matcher, eos, False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        if bitmask.dtype != _int32() or not row.is_contiguous() or row.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous int32 host tensor")
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept_token(self, token_id: int) -> bool:
        accepted = self._matcher.consume_token(token_id)
        # the grammar's end (an end-of-sequence token), or a matcher that can go no further
        self._terminated = token_id in self._eos or not accepted or self._matcher.is_error()
        return accepted

    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def _int32():
    import torch

    return torch.int32


class _PlainText:
    """The tokenizer as llguidance's `TokenizerWrapper` wants it, except that text is encoded as plain text:
    the text of an added token (`<tool_call>`, `<|im_end|>`) becomes ordinary pieces, never that token.

    llguidance treats every added token as special (its bytes are a marker no text matches; a grammar names
    it as `<tool_call>` in Lark), but `llguidance.hf.from_tokenizer` tokenizes the grammar's forced text with
    the full HF tokenizer, which turns such text into the added token. A grammar literal holding that text
    (a regex `a<tool_call>b`, a JSON enum) was then forced onto a token the matcher refuses: the sequence
    ended with "stop" in the middle of the literal. Encoding with the added tokens left out keeps both sides
    of llguidance consistent, so the literal is generated in full as ordinary pieces.
    """

    def __init__(self, tokenizer, full, vocab_size: int, eos: list[int]):
        import tokenizers

        data = json.loads(tokenizer.backend_tokenizer.to_str())
        data["added_tokens"] = []  # the added tokens' ids stay in `tokens`; only encoding text ignores them
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(data))
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self.tokens = [full.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if full.is_special_token(i)]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance probes for bytes support and then sends str
        return self._plain.encode(text, add_special_tokens=False).ids


def _llguidance_tokenizer(tokenizer, vocab_size: int, eos: list[int]):
    """llguidance's tokenizer of a fast HF `tokenizer`: its token table, text encoded by `_PlainText`."""
    import llguidance
    import llguidance.hf

    full = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_PlainText(tokenizer, full, full.vocab_size, eos))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles guides for one tokenizer; thread-safe (compiles run in worker threads).

    `vocab_size` is the model's logits width (it may exceed the tokenizer's); `eos_token_ids` are the
    tokens that end a sequence, which the grammar allows exactly where the output is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        import llguidance

        self._llguidance = llguidance
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer = _llguidance_tokenizer(tokenizer, vocab_size, sorted(self.eos_token_ids))
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # guide key -> pristine matcher (LRU)

    def grammar(self, guide: Guide) -> str:
        """llguidance's grammar of `guide` (GuideError when the guide is not valid)."""
        llg = self._llguidance
        try:
            if guide.kind in ("json", "json_object"):
                return llg.LLMatcher.grammar_from_json_schema(guide.schema())
            if guide.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(guide.value)
            if guide.kind == "choice":
                return llg.grammar_from("choice", list(guide.value))
            return llg.grammar_from("grammar", guide.value)
        except (ValueError, TypeError) as error:
            raise GuideError(str(error)) from None

    def _pristine(self, guide: Guide):
        """The compiled matcher of `guide` at its start, compiled once per distinct guide (LRU of 128)."""
        key = guide.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = self.grammar(guide)
        error = self._llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GuideError(error.strip())
        matcher = self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > 128:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, guide: Guide) -> None:
        """Compile `guide` (cached): GuideError when the grammar engine refuses it."""
        self._pristine(guide)

    def matcher(self, guide: Guide) -> Constraint:
        """A fresh matcher of `guide` at its start."""
        pristine = self._pristine(guide)
        with self._lock:
            return _Matcher(pristine.deep_copy(), self.eos_token_ids)
