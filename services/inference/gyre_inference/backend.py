"""The small interface every generation backend implements (torch and vLLM), and what crosses it.

A backend turns prompt token ids plus sampling parameters into a stream of sampled tokens, each with
its log-prob and the weights version that produced it; it can swap weights from a folder and go back
to the base model. Everything text-shaped (chat templates, detokenization, stop strings, tool calls)
lives in the HTTP layer, so both backends share it and behave the same.

Log-prob rule (both backends, see docs/inference.md): `TokenEvent.logprob` is
`log_softmax(logits / T)[token]` where T is the request's temperature (T = 1 when T = 0, i.e.
greedy). top_p restricts which tokens can be sampled but does NOT renormalise the reported log-prob,
so it equals what the trainer computes with `log_softmax(logits / T)`. (vLLM's processed log-probs
are renormalised over the nucleus when top_p < 1; the vLLM backend documents that difference.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gyre.transport import FetchedWeights

if TYPE_CHECKING:
    from gyre_inference.engine_stats import EngineStats
    from gyre_inference.structured import Constraint, Guide

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence (one choice of a request).

    Invariants (checked by the HTTP layer before a request reaches a backend):
    `0 <= temperature`, `0 < top_p <= 1`, `max_tokens >= 1`, `0 <= top_logprobs <= 20`,
    `prompt_logprobs` None or in [0, 20], and
    `len(prompt) + max_tokens <= backend.max_model_len`.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # vLLM's top_k (0 = off; else at most the vocabulary size) and min_p (0 = off, in [0, 1]): like top_p they decide
    # which tokens may be drawn and are not renormalised into the reported log-prob.
    top_k: int = 0
    min_p: float = 0.0
    # Seed of this sequence's random stream; None = drawn from the engine's own seeded RNG.
    # Same seed + same prompt + same params + same weights => same tokens, whatever else is batched.
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Number of most likely alternatives to report per token (0 = only the sampled token's log-prob).
    top_logprobs: int = 0
    # Named LoRA adapter to sample with (multi-run: the run's model name); None = the served model itself.
    adapter: str | None = None
    # (token id, bias) pairs added to the logits before sampling (ids < vocabulary size). The reported
    # log-probs are then those of the biased distribution, which is what was sampled from.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The stop token ids cannot be sampled before this many tokens (their logits are -inf until then).
    min_tokens: int = 0
    # Structured outputs (gyre_inference.structured): what the output must match. Backends that constrain
    # decoding themselves (vLLM) take this; the torch engine drives `constraint` instead.
    guide: Guide | None = None
    # The torch engine's per-sequence grammar matcher of `guide` (built by the HTTP layer when
    # `Backend.uses_constraints`; stateful, one per sequence). Each decode step its row of the logits is
    # masked to the tokens it allows (before temperature / top-p), then it accepts the sampled token; once
    # it is terminated the sequence finishes with "stop". Reported log-probs are those of the masked
    # distribution, which is the one sampled from.
    constraint: Constraint | None = field(default=None, compare=False, repr=False)
    # vLLM's prompt_logprobs: None = not computed; k >= 0 = the log-prob of every prompt token given the ones
    # before it (the first has none), plus its k most likely alternatives. Raw model log-probs, log_softmax(logits)
    # whatever the temperature (as vLLM). Computed from the prefill's logits and put on the first TokenEvent.
    prompt_logprobs: int | None = None
    # The caller reads the sequence only once it ends (a non-streaming choice without stop strings; vLLM's
    # RequestOutputKind.FINAL_ONLY): a backend may hand its events over in one piece at the end instead of one
    # by one, sparing the event loop a wake-up per token. Errors and cancellation still end it at once.
    final_only: bool = False
    # vLLM's penalties, with vLLM's semantics (sampling.Penalties): a token of the prompt or the output so far has its
    # logit divided by repetition_penalty when positive, multiplied by it otherwise; then frequency_penalty times its
    # count in the output, and presence_penalty once if it is there, are subtracted. Applied after logit_bias and
    # before the temperature; the reported log-probs are those of the penalised distribution (the one sampled from).
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM's allowed_token_ids: only these tokens may be sampled (the others' logits are -inf, before the biases, the
    # penalties and the temperature, as vLLM; a structured output's mask applies on top). None = every token.
    allowed_token_ids: frozenset[int] | None = None
    # vLLM's bad_words, tokenized as vLLM does (`bad_word_ids`, each word alone and after a space): the last token of
    # one may not be sampled right after the others (a one-token word: never). `bad_words` keeps the strings for
    # backends that tokenize them themselves (vLLM).
    bad_words: tuple[str, ...] = ()
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: the prefix cache shares blocks only between requests of the same salt (None: the unsalted
    # ones), so a tenant cannot learn from timing what another's prompts held.
    cache_salt: str | None = None
    # vLLM's request priority: lower is scheduled earlier (admission; preemption takes the highest value first).
    # The orchestrator sends a rollout's RL step, so a backlog of requests never delays an older batch.
    priority: int = 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (the torch engine samples such a sequence on its eager path)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-prob given the tokens before it (an entry of vLLM's `prompt_logprobs`)."""

    logprob: float
    rank: int  # of the token in that distribution: 1 = the most likely
    top: tuple[tuple[int, float], ...] = ()  # the `prompt_logprobs` most likely (token id, log-prob), best first


#: `prompt_logprobs` of a sequence: one entry per prompt token, None for the first (nothing precedes it).
PromptLogprobs = tuple[PromptLogprob | None, ...]


@dataclass(slots=True)  # not frozen: the engine makes one per row per step, and a frozen one costs 5x to build
class TokenEvent:
    """One sampled token.

    `version` is the weights version that computed this token's logits. `finish_reason` is set on the
    sequence's last token: "stop" (a stop token id was sampled; it is this token), "length" (max_tokens
    reached). A sequence aborted by the caller simply ends without a final event. `prompt_logprobs` is set on
    a sequence's first event when its params asked for them (`SamplingParams.prompt_logprobs`), else None.
    """

    token_id: int
    logprob: float
    version: int
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # time.monotonic() when it was sampled, where its delivery is delayed (the first event of a final-only
    # sequence): the time to first token is measured from it; None = now.
    sampled_at: float | None = None


class BackendStoppedError(RuntimeError):
    """The engine is not running (not started, shutting down, or stopped) so it cannot take this call."""


class AdapterGoneError(KeyError):
    """A named adapter that can no longer be served (evicted, and its folder is gone: the run ended or its
    versions were pruned). The backend forgets the name; the API answers 404, as for a name never served."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


class WeightsIncompatibleError(ValueError):
    """A weights folder cannot be loaded into the served model (missing/unknown tensors, wrong shapes)."""


# OSErrors that say a folder does not hold what a version should (a file missing, a folder where a file should be): not
# a usable version, like a malformed file (WeightsIncompatibleError). Any other OSError (an I/O error on the volume, a
# timeout) says nothing of the version and may pass.
NOT_A_VERSION = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


class WeightsLoadError(RuntimeError):
    """A weights folder could not be loaded now for a reason that may pass (an I/O error on the shared volume, a
    timeout, memory another load still held, a folder the volume shows late): the old weights keep serving and the
    update is worth sending again, unlike `WeightsIncompatibleError`."""


class AdapterSlotsBusyError(WeightsIncompatibleError):
    """Every named-adapter slot serves queued or running requests: a new name cannot be loaded now (an
    UpdateWeights is refused; a request for an evicted name waits for a slot, as vLLM's scheduler does)."""


class Backend(ABC):
    """Generation engine behind the HTTP API and the gRPC control server.

    Lifecycle: construct (cheap) -> `await start()` (loads the model; `ready` becomes True) ->
    `generate(...)` any number of times concurrently -> `await shutdown()`.
    """

    name: str
    # True: the HTTP layer gives each constrained sequence a `SamplingParams.constraint` to drive (torch);
    # False: the backend enforces `SamplingParams.guide` itself (vLLM's structured outputs).
    uses_constraints: bool = False

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the model is loaded and generate() may be called."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Weights version served now (0 = base model)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""

    @abstractmethod
    def load_stats(self) -> tuple[int, int]:
        """(running, waiting) sequences right now."""

    def engine_stats(self) -> EngineStats | None:
        """The engine's counters and gauges now (the torch backend; None where the engine reports its own, as
        vLLM does)."""
        return None

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop generating; sequences still in flight end (their streams stop)."""

    @abstractmethod
    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Stream the tokens of one sequence. Closing the iterator early aborts the sequence."""

    @abstractmethod
    async def update_weights(self, weights: FetchedWeights) -> None:
        """Serve `weights` (what the replica's `WeightSource` fetched: for the folder transport a verified HF
        folder, or a PEFT adapter folder to apply to the base) as version `weights.step` from the next decode
        step.

        Sequences in flight continue on the new weights (their KV cache, computed by the old
        weights, is kept). Raises WeightsIncompatibleError (old weights keep serving) when they
        do not fit the model. The source verified them first.
        """

    @abstractmethod
    async def reload_base(self) -> None:
        """Serve the base model's weights again, as version 0."""

    # ---- named adapters (multi-run: one per run, served under the run's model name) ---------------
    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Adapters servable by name now (a name with no version yet serves the base model)."""
        return ()

    def adapter_version(self, name: str) -> int:
        """Weights version adapter `name` serves (0 = none yet); KeyError if unknown."""
        raise KeyError(name)

    def adapter_for(self, model: str | None, model_id: str) -> str | None:
        """The named adapter a request's `model` field asks for: None = the served model itself (`model_id`,
        or no model given); KeyError when this backend serves no such name."""
        if model is None or model == model_id:
            return None
        if model in self.adapter_names:
            return model
        raise KeyError(model)

    async def update_adapter(self, name: str, weights: FetchedWeights) -> None:
        """Serve the PEFT adapter `weights` (fetched by the source) as adapter `name` at version `weights.step`
        (a new name takes a free slot)."""
        raise WeightsIncompatibleError(f"the {self.name} backend serves no named adapters")

    async def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (`POST /v1/unload_lora_adapter`): new requests for it are refused as for a name
        never served; its queued and running requests finish on it. KeyError if `name` is not served."""
        raise KeyError(name)


async def wait_out(future: asyncio.Future) -> BaseException | None:
    """Wait for `future` to end through any cancellation of the caller, who re-raises its own afterwards; its error
    (None: it succeeded or was cancelled). A weight update its caller gave up on (an UpdateWeights past its deadline)
    while the engine loads it runs to its end this way, so the version noted always matches the weights served."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(future)
    return None if future.cancelled() else future.exception()


async def run_to_end(update: Coroutine, version: int) -> None:
    """Run a weight update to its end even when its caller gives up (an UpdateWeights past its deadline), then re-raise
    the cancellation: vLLM loads what it was sent whatever our side does, and a load cut short was started again by
    the relay's retry, from scratch (a version slower to load than the deadline never got served, and every try left a
    read of the whole version running in a thread). The version and adapter noted match what is served."""
    task = asyncio.ensure_future(update)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if await wait_out(task) is None and not task.cancelled():
            logging.getLogger(__name__).warning("weights version %d was applied after its caller gave up", version)
        raise
