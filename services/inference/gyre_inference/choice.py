"""One choice of a completion: the backend's tokens in, the text to release and the choice's record out.

A `Choice` detokenizes incrementally, applies stop strings (and `min_tokens`), holds back text that may
begin a stop string or a tool call, and parses tool calls at the end (chat with tools). The rules clients
rely on:

- Alignment: `token_ids[i]` and `logprobs[i]` (and the i-th log-prob entry) belong to the same sampled
  token, and these lists hold EVERY token the model sampled for the choice, in order, including the
  end-of-turn token (finish "stop" by token) and the token that completed a stop string. Only the
  text is cut: a stop string and whatever follows it in that last token are left out of `text`/`content`.
  So `decode(token_ids)` may extend past the text, never fall short of it.
- Versions: `policy_version_min`/`policy_version_max` are the oldest/newest weights version that
  computed a token of the choice (min < max when a weight swap happened mid-generation; the tokens
  after the swap were computed by the new weights on a KV cache the old ones wrote).
  `policy_version` = `policy_version_max` (the version when the choice finished). The
  `x-gyre-policy-version` header is the newest version in the response (non-streaming) or the
  version served when the stream started (streaming). Stream chunks carry `policy_version` of
  their tokens, and the finishing chunk of each choice also carries min/max.
- Seeds: choice i (counted per prompt) of a request with `seed` s samples with a generator seeded from
  (s, i), so the same request gives the same choices whatever else the server is doing, and a prompt
  in a batch gets the same choices as when sent alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from gyre_inference.backend import TokenEvent
from gyre_inference.text import IncrementalDecoder, ModelText
from gyre_inference.tools import TOOL_CALL_START, cut_call, parse_tool_calls


def choice_seed(seed: int, choice_index: int) -> int:
    """The generator seed of choice `choice_index` (per prompt) of a request with `seed`."""
    digest = hashlib.sha256(f"{seed}:{choice_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(slots=True)  # one per token: not frozen, which costs 5x to build
class Delta:
    """What one backend token changed in a choice: the token's position, the text released, the finish."""

    position: int  # index of the token in the choice's token_ids / logprobs
    text: str
    version: int
    finish_reason: str | None  # set on the choice's last token only


@dataclass
class Choice:
    """One choice's accumulated output; `add()` turns each backend token into the text to release now."""

    index: int
    text_codec: ModelText
    stops: list[str]
    parse_tools: bool
    prompt_index: int = 0
    min_tokens: int = 0  # stop strings count only from this many tokens on (vLLM's min_tokens)
    include_stop: bool = False  # keep the stop string that ended the choice in its text
    echo: str = ""  # text shown before the generated text (echo); not part of `text`
    # the request's own stop_token_ids (not the end-of-turn token): the one that ends the choice is its stop_reason
    stop_token_ids: frozenset[int] = frozenset()
    # a named tool_choice's function: a call max_tokens or a stop string cut short is still returned as that call
    forced_tool: str | None = None
    single_call: bool = False  # parallel_tool_calls false: only the first parsed call is returned (as vLLM)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    released: int = 0  # characters of `text` already handed out
    finish_reason: str | None = None
    # vLLM's stop_reason: the stop string or the request's stop token id that ended the choice; None for the
    # end-of-turn token, the length, or a grammar that completed
    stop_reason: str | int | None = None
    tool_calls: list = field(default_factory=list)
    version_min: int | None = None
    version_max: int | None = None
    prompt_logprobs: tuple | None = None  # the engine's PromptLogprobs when they were asked for
    # Its text is read as it grows (streaming; stop strings are searched in it anyway). A non-streaming choice
    # without stop strings needs its text only at the end: decoded once then, not twice per token (at 256 rows
    # per decode step, per-token detokenizing was a sixth of the event loop's time). Both give the same text.
    streamed: bool = True
    # echo with max_tokens 0 (completions): the prompt alone; the one token the engine samples is dropped
    echo_only: bool = False
    # vLLM's skip_special_tokens: false keeps special tokens in the text; `ends` (every stop token id, the end-of-turn
    # token included) then says which last token to leave out, as vLLM's detokenizer does
    skip_special: bool = True
    ends: frozenset[int] = frozenset()

    def __post_init__(self):
        self._decoder = IncrementalDecoder(self.text_codec, self.skip_special)
        self._decode = self.text_codec.decode if self.skip_special else self.text_codec.decode_prompt
        # A stop string (or the tool-call tag) may begin in text not yet complete: keep that much back. For
        # the tag, one character more: the newline before it is dropped from the content once calls parse,
        # so it must not be released while the tag after it is still partial.
        tag = len("\n" + TOOL_CALL_START) if self.parse_tools else 0
        longest = max([len(s) for s in self.stops] + [tag], default=0)
        self._holdback = max(longest - 1, 0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> Delta:
        position = len(self.token_ids)
        self.prompt_logprobs = self.prompt_logprobs or event.prompt_logprobs
        if self.echo_only:
            self.version_min = self.version_max = event.version
            self.finish_reason = "length"
            return Delta(position, "", event.version, self.finish_reason)
        self.token_ids.append(event.token_id)
        self.logprobs.append(event.logprob)
        self.top_logprobs.append(event.top_logprobs)
        self.version_min = event.version if self.version_min is None else min(self.version_min, event.version)
        self.version_max = event.version if self.version_max is None else max(self.version_max, event.version)
        # The stop token that ended the choice is not text (vLLM leaves it out unless include_stop_str_in_output):
        # skipped as a special token anyway, except with skip_special_tokens false ("<|im_end|>" ended every text).
        hidden = (not self.skip_special and event.finish_reason == "stop" and event.token_id in self.ends
                  and not self.include_stop)  # fmt: skip
        if self.streamed or self.stops:
            piece = "" if hidden else self._decoder.push(event.token_id)
            if event.finish_reason is not None:
                piece += self._decoder.flush()
        elif event.finish_reason is not None:
            piece = self._decode(self.token_ids[:-1] if hidden else self.token_ids)
        else:
            piece = ""
        searched_from = len(self.text)
        self.text += piece
        finish = event.finish_reason
        if self.stops and len(self.token_ids) >= self.min_tokens and self._cut_at_stop(searched_from):
            finish = "stop"
        if finish is None:
            end = len(self.text) - self._holdback
            if self.parse_tools and (tag := self.text.find(TOOL_CALL_START, self.released)) >= 0:
                end = min(end, tag - 1 if self.text[tag - 1 : tag] == "\n" else tag)
            return Delta(position, self._release(end), event.version, None)
        self.finish_reason = finish
        if event.finish_reason == "stop" and self.stop_reason is None and event.token_id in self.stop_token_ids:
            self.stop_reason = event.token_id
        if self.parse_tools:
            content, calls = parse_tool_calls(self.text)
            # a named call that max_tokens or a stop string cut short is still that call (vLLM returns a named
            # choice's whole output as the call's arguments), not its raw markup as content
            cut_short = finish == "length" or isinstance(self.stop_reason, str)
            if not calls and cut_short and self.forced_tool is not None:
                cut = cut_call(self.text, self.forced_tool)
                content, calls = None, [cut] if cut is not None else []
            if calls:
                self.tool_calls = [call.to_openai() for call in (calls[:1] if self.single_call else calls)]
                self.text = content or ""
                self.released = min(self.released, len(self.text))
                # A named tool_choice's call ends "stop", as on OpenAI and vLLM (vllm#25054): the client asked for that
                # call, so clients read message.tool_calls, not the finish; auto and required end "tool_calls".
                self.finish_reason = "tool_calls" if finish == "stop" and self.forced_tool is None else finish
        return Delta(position, self._release(len(self.text)), event.version, self.finish_reason)

    def _cut_at_stop(self, searched_from: int) -> bool:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, max(0, searched_from - len(s) + 1))) >= 0]
        if hits:
            start, stop = min(hits)
            self.text = self.text[: start + len(stop) if self.include_stop else start]
            self.stop_reason = stop
        return bool(hits)

    def _release(self, end: int) -> str:
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released : end], end
        return piece

    def versions(self) -> dict:
        return {
            "policy_version": self.version_max,
            "policy_version_min": self.version_min,
            "policy_version_max": self.version_max,
        }
