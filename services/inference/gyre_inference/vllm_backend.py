"""vLLM backend: vLLM's async engine (V1 `AsyncLLM`) behind the same Backend interface (install `gyre[vllm]`).

vLLM is imported lazily (only when this backend starts), so the module imports anywhere.

How it maps onto vLLM:
- generate: one vLLM request per sequence, prompt as token ids, DELTA outputs, no detokenization (the
  HTTP layer owns text). `ignore_eos=True` plus our own `stop_token_ids`, so exactly the HTTP layer's
  stop set applies. `logprobs=k` returns the sampled token's log-prob and the top k.
- structured outputs: a request's `Guide` becomes vLLM's `StructuredOutputsParams` (`structured_outputs`),
  and the engine runs vLLM's `guidance` backend, which is llguidance, the torch backend's grammar engine:
  the same guide accepts the same strings on both backends (JSON layout options travel inside the schema).
- log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. after temperature
  (T = 0 reports T = 1), like the torch backend. Difference: with top_p < 1 vLLM's processed
  log-probs are renormalised over the nucleus, the torch backend's are not (docs/inference.md).
  `prompt_logprobs` map onto vLLM's own field (raw logits, T = 1, the torch backend's rule) and go
  on the sequence's first event.
- weights: pause the scheduler keeping requests (`pause_generation(mode="keep")`), load the folder's
  safetensors in every worker through our worker extension (`model.load_weights`, which also
  re-shards for tensor parallelism), resume, then reset the prefix cache so no new prompt reuses KV
  blocks the old weights computed. `load_weights` copies tensor by tensor: a load that fails part way loads the
  weights served before back while still paused (`_load_back`), or stops the engine when that fails too (the service
  then exits 1, so that the replica is restarted and loads the newest version, see service.py). Requests
  in flight keep their KV cache, as with the torch backend.
- versions: a token is stamped with the version current when its output reaches us. Tokens cannot
  be computed while paused, and the new version is noted while paused (before the resume), so the stamp
  is exact up to outputs already in transit at pause time (vLLM flushes those during pause_generation).
  An update whose caller gives up (an UpdateWeights past its deadline) runs to its end: vLLM loads what
  it was sent anyway, and the version and adapter noted must match what it serves.
- LoRA adapters (`lora.max_loras` > 0 starts the engine with `enable_lora`, `max_loras`, and
  `max_lora_rank` = the smallest of vLLM's sizes >= `lora.max_rank`). An adapter version is a folder with
  `adapter_config.json`: of the served model itself (`update_weights`, `trainer.lora.publish = "adapter"`)
  or of a named adapter (`update_adapter`, multi-run: one per run, served under the run's name like vLLM's
  `--lora-modules` / `/v1/load_lora_adapter`; `/v1/models` lists each name with the model as parent; an
  unknown name is a 404). Each version becomes a `LoRARequest` with a new `lora_int_id` and a name holding
  that id (vLLM caches adapters by id and compares requests by name, so a reused one would keep serving
  the old tensors), registered with `add_lora` (loaded before the swap counts as done) and passed with
  every new request for that model name. A version update replaces only that name's adapter. vLLM binds
  an adapter to a request for its whole life, so a request started before a swap finishes with its
  adapter and its tokens carry that adapter's version; once no model name serves an adapter and no
  request of ours uses it, `remove_lora` drops it from vLLM's cache (ids are never reused). Adapters apply
  to the base weights: before the model's own adapter version after a full-weights version the base is
  reloaded, and full weights other than the base move a request off the model's own adapter onto them
  (`VLLMBackend._moved`). No pause and no prefix-cache reset: vLLM keys cached blocks by adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gyre.config.inference import vllm_lora_rank
from gyre.safetensors_io import read_header
from gyre.transport import FetchedWeights

from gyre_inference.backend import (
    NOT_A_VERSION,
    AdapterGoneError,
    Backend,
    BackendStoppedError,
    PromptLogprob,
    PromptLogprobs,
    SamplingParams,
    TokenEvent,
    WeightsIncompatibleError,
    WeightsLoadError,
    run_to_end,
)
from gyre_inference.structured import Guide

log = logging.getLogger(__name__)

EXTENSION = "gyre_inference.vllm_backend.GyreWorkerExtension"


def safetensors_layout(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of every *.safetensors file in `folder`, read from headers only."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsIncompatibleError(f"{folder} holds no *.safetensors files")
    for file in files:
        try:
            for name, entry in read_header(file).items():
                layout[name] = (entry["dtype"], tuple(entry["shape"]))
        except OSError as error:
            if not isinstance(error, NOT_A_VERSION):  # an I/O error on the volume: may pass (FAILED_PRECONDITION)
                raise
            raise WeightsIncompatibleError(f"{file}: not a readable safetensors file ({error})") from None
        except (ValueError, KeyError, TypeError) as error:  # SafetensorsError is a ValueError
            raise WeightsIncompatibleError(f"{file}: not a readable safetensors file ({error})") from None
    return layout


def check_same_layout(base: Path, new: Path) -> None:
    """New weights must have exactly the base checkpoint's tensor names and shapes (dtype may differ)."""
    expected, given = safetensors_layout(base), safetensors_layout(new)
    missing, unknown = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    if missing or unknown:
        raise WeightsIncompatibleError(f"{new}: missing tensors {missing[:5]}, unknown tensors {unknown[:5]}")
    for name, (_, shape) in given.items():
        if shape != expected[name][1]:
            raise WeightsIncompatibleError(f"{new}: {name} has shape {shape}, the model {expected[name][1]}")


def token_events(
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, Any]] | None,
    finish_reason: str | None,
    version: int,
    top_logprobs: int,
) -> list[TokenEvent]:
    """TokenEvents of one DELTA output of a vLLM request.

    `logprobs[i]` maps token id -> vLLM `Logprob` (`.logprob`, `.rank`, rank 1 = most likely) and holds
    the top-k plus the sampled token. `finish_reason` (set on the last delta) goes on its last token;
    "abort" is not a finish: the stream just ends.
    """
    events = []
    for i, token in enumerate(token_ids):
        entries = logprobs[i] if logprobs is not None else {}
        if token not in entries:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {token}")
        ranked = sorted(((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None), key=lambda x: x[0])
        top = tuple((t, float(lp)) for rank, t, lp in ranked if rank <= top_logprobs)
        last = i == len(token_ids) - 1
        reason = finish_reason if last and finish_reason in ("stop", "length") else None
        events.append(TokenEvent(int(token), float(entries[token].logprob), version, top, reason))
    return events


def prompt_entries(
    prompt: Sequence[int], prompt_logprobs: Sequence[Mapping[int, Any] | None] | None, k: int
) -> PromptLogprobs:
    """Our `PromptLogprobs` from vLLM's `RequestOutput.prompt_logprobs` (None first, then per prompt token a map
    token id -> `Logprob` holding that token and the top k). vLLM computes them from raw logits (T = 1) in every
    `logprobs_mode` we run with, the torch backend's rule too."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(prompt):
        raise RuntimeError(f"vLLM returned {len(prompt_logprobs or ())} prompt log-probs for {len(prompt)} tokens")
    entries: list[PromptLogprob | None] = [None]
    for token, ranked in zip(prompt[1:], prompt_logprobs[1:], strict=True):
        if not ranked or token not in ranked:
            raise RuntimeError(f"vLLM returned no prompt log-prob for prompt token {token}")
        top = sorted((e.rank, t, float(e.logprob)) for t, e in ranked.items() if e.rank is not None and e.rank <= k)
        entry = ranked[token]
        entries.append(PromptLogprob(float(entry.logprob), int(entry.rank), tuple((t, lp) for _, t, lp in top)))
    return tuple(entries)


def structured_outputs(guide: Guide) -> dict[str, Any]:
    """vLLM `StructuredOutputsParams` keyword arguments for `guide` (vLLM's guidance backend compiles them)."""
    if guide.kind in ("json", "json_object"):  # any object = the schema {"type": "object"}, with the layout options
        return {"json": guide.schema()}
    if guide.kind == "regex":
        return {"regex": guide.value}
    if guide.kind == "choice":
        return {"choice": list(guide.value)}
    return {"grammar": guide.value}


def adapter_rank(folder: Path, max_rank: int | None) -> int:
    """The rank of the PEFT adapter in `folder`, checked against what the engine was started for
    (`max_rank` None: LoRA is off)."""
    from gyre.lora import ADAPTER_CONFIG, config_scale

    if max_rank is None:
        raise WeightsIncompatibleError(
            f"{folder} is a LoRA adapter: start the vLLM backend with lora.max_loras >= 1 to serve adapters"
        )
    try:
        config = json.loads((Path(folder) / ADAPTER_CONFIG).read_bytes())
        config_scale(config)  # r and lora_alpha usable, no rsLoRA/DoRA (the trainer never writes those)
    except OSError as error:
        if not isinstance(error, NOT_A_VERSION):  # an I/O error on the volume: may pass (FAILED_PRECONDITION)
            raise
        raise WeightsIncompatibleError(f"{folder}: not a usable LoRA adapter ({error})") from None
    except ValueError as error:
        raise WeightsIncompatibleError(f"{folder}: not a usable LoRA adapter ({error})") from None
    if config["r"] > max_rank:
        raise WeightsIncompatibleError(f"{folder}: adapter rank {config['r']} exceeds lora.max_rank {max_rank}")
    return int(config["r"])


# What marks a failed vLLM adapter load as one that may pass, in its text. AsyncLLM's engine core runs in a process of
# its own and its client re-raises a failed call as a plain `Exception(f"Call to add_lora method failed: {error}")`
# (vllm/v1/engine/core_client.py `_process_utility_output`, core.py): the type is lost, the text is what reaches us.
# An OSError's "[Errno 5] Input/output error", torch's "CUDA out of memory", vLLM's "No adapter found" (its ValueError
# for a FileNotFoundError: a folder the volume does not show yet, or pruned under it) and a timeout's "timed out".
TRANSIENT_LOAD_TEXT = ("[errno", "out of memory", "no adapter found", "timed out")


def adapter_load_failure(path: Path, error: BaseException) -> Exception:
    """What vLLM's failure to load the adapter in `path` tells the relay.

    - BackendStoppedError: the engine died (vLLM's EngineDeadError): the replica is going down, UNAVAILABLE.
    - WeightsLoadError (FAILED_PRECONDITION, sent again): a reason that may pass, by type where the exception (or one
      it was raised from) still has it (OSError, TimeoutError, MemoryError, torch's OutOfMemoryError), else by its
      text (`TRANSIENT_LOAD_TEXT`, the engine core's relayed message).
    - WeightsIncompatibleError (INVALID_ARGUMENT, the run stops): anything else, i.e. vLLM's ValueError for an adapter
      that does not fit the model (target modules it cannot adapt, a rank over max_lora_rank, a bad config).
    Every one of them was wrapped as WeightsIncompatibleError, so a volume's I/O error mid-run stopped the run."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:  # the exception and those it was raised from
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    names = {type(e).__name__ for e in chain}
    if "EngineDeadError" in names:
        return BackendStoppedError(f"the vLLM engine died while loading the adapter in {path} ({error})")
    text = " ".join(str(e) for e in chain).lower()
    transient = (any(isinstance(e, OSError | MemoryError) for e in chain) or "OutOfMemoryError" in names
                 or any(marker in text for marker in TRANSIENT_LOAD_TEXT))  # fmt: skip
    if transient:
        return WeightsLoadError(f"{path}: vLLM could not load the adapter now ({error}); it may next time")
    return WeightsIncompatibleError(f"{path}: vLLM could not load the adapter ({error})")


class GyreWorkerExtension:
    """Mixed into vLLM's worker (engine arg `worker_extension_cls`); its methods run in every worker."""

    def gyre_load_weights(self, path: str) -> None:
        from safetensors import safe_open

        def tensors() -> Iterable[tuple[str, Any]]:
            for file in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        yield name, f.get_tensor(name)

        self.model_runner.model.load_weights(weights=tensors())


class VLLMBackend(Backend):
    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        adapters: tuple[str, ...] = (),
    ):
        if adapters and not max_loras:
            raise ValueError("named adapters need max_loras >= 1 (LoRA is off with 0)")
        self.model_path = Path(model_path)
        # Gyre's "auto" is bfloat16 on a GPU, what the trainer and the torch backend use; vLLM's own "auto" keeps a
        # float16 checkpoint in float16, so rollouts came from another dtype than the policy the trainer steps
        dtype = "bfloat16" if dtype == "auto" else dtype
        self._engine_kwargs = dict(
            model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs", max_logprobs=20,
            worker_extension_cls=EXTENSION,
        )  # fmt: skip
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank if max_loras else None  # None: LoRA off, adapters refused
        if max_loras:
            self._engine_kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(max_lora_rank),
                                       max_loras=max_loras)  # fmt: skip
        self._engine = None
        self._version = 0
        self._lora = None  # the LoRARequest of the model's own adapter version (None: full weights)
        # named adapters (multi-run): model name -> (newest LoRARequest or None before the first, its version)
        self._named: dict[str, tuple[Any, int]] = {name: (None, 0) for name in adapters}
        self._users: Counter[int] = Counter()  # lora_int_id -> our requests in flight with it
        self._lora_ids = itertools.count(1)  # vLLM wants ids > 0, one per adapter it should (re)load
        self._base_loaded = True  # the engine holds the base model's weights (what adapters apply to)
        self._full_path = self.model_path  # the folder of the full weights the engine holds (loaded back on a failure)
        self._moves = 0  # full-weights loads other than the base: requests on the model's own adapter move off it
        self._max_model_len = 0
        self._running = 0

    @property
    def ready(self) -> bool:
        return self._engine is not None

    @property
    def _live(self) -> Any:
        """The running engine. Once `shutdown()` ran it is None, and a request or control call that arrived during
        the stop got an AttributeError (a 500); it gets BackendStoppedError, as from the torch engine (a 503
        `not_ready` with Retry-After, or UNAVAILABLE on the control)."""
        if self._engine is None:
            raise BackendStoppedError("the vLLM engine is not running (stopped, or not started)")
        return self._engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def load_stats(self) -> tuple[int, int]:
        # vLLM's scheduler owns the queue; we know how many of our sequences are in flight.
        return self._running, 0

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig

        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:  # older layouts export the V1 engine under its legacy name
            from vllm import AsyncLLMEngine as AsyncLLM

        kwargs = {k: v for k, v in self._engine_kwargs.items() if v is not None}
        # llguidance, the torch backend's grammar engine (gyre_inference.structured)
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance")
        # requests carry a priority (the orchestrator's RL step), as in the torch engine; with vLLM's default
        # "fcfs" policy any priority but 0 is an error
        kwargs.setdefault("scheduling_policy", "priority")
        args = AsyncEngineArgs(**kwargs)
        self._engine = AsyncLLM.from_engine_args(args)
        self._max_model_len = self._engine.model_config.max_model_len

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        vllm_params = VLLMSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
            max_tokens=params.max_tokens, seed=params.seed,
            stop_token_ids=sorted(params.stop_token_ids), ignore_eos=True, logprobs=params.top_logprobs,
            detokenize=False, output_kind=RequestOutputKind.DELTA, min_tokens=params.min_tokens,
            logit_bias=dict(params.logit_bias) or None, prompt_logprobs=params.prompt_logprobs,
            repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            allowed_token_ids=None if params.allowed_token_ids is None else sorted(params.allowed_token_ids),
            bad_words=list(params.bad_words) or None,
            structured_outputs=None if params.guide is None else StructuredOutputsParams(
                **structured_outputs(params.guide)),
        )  # fmt: skip
        if params.adapter is None:
            lora, lora_version = self._lora, self._version  # an adapter stays with its request (see `_moved`)
        else:
            while True:
                if params.adapter not in self._named:
                    raise KeyError(f"no adapter named {params.adapter!r}")
                lora, lora_version = self._named[params.adapter]
                if lora is None or os.path.isdir(lora.lora_path):
                    break
                await self._check_still_held(params.adapter, lora)
                # a version of the name that arrived during the check replaced this adapter and may have dropped it
                # from vLLM (no request of ours used it yet): the request takes the new one
                if self._named.get(params.adapter, (None, 0))[0] is lora:
                    break
        moves = self._moves
        salted = {"cache_salt": params.cache_salt} if params.cache_salt is not None else {}  # vLLM's, on the prompt
        done: list[int] = []  # tokens handed out
        prompt_raw: list | None = []  # vLLM's prompt log-prob entries until they are handed out
        self._running += 1
        try:
            while True:
                stream = self._live.generate(
                    {"prompt_token_ids": [*prompt, *done], **salted},
                    vllm_params,
                    uuid.uuid4().hex,
                    lora_request=lora,
                    priority=params.priority,
                )
                if lora is not None:
                    self._users[lora.lora_int_id] += 1
                try:
                    async for output in stream:
                        if lora is not None and params.adapter is None and self._moves != moves:
                            break  # computed by the adapter on top of other weights: dropped, see `_moved`
                        completion = output.outputs[0]
                        finish = completion.finish_reason if output.finished else None
                        # full weights (own model, no adapter): stamped with the version serving at output time
                        version = lora_version if lora is not None or params.adapter is not None else self._version
                        events = token_events(completion.token_ids, completion.logprobs, finish, version,
                                              params.top_logprobs)  # fmt: skip
                        if params.prompt_logprobs is not None and prompt_raw is not None:
                            # DELTA outputs carry the prompt's entries as they are computed (a chunked prefill may
                            # spread them): gathered, and put on the sequence's first event
                            prompt_raw.extend(output.prompt_logprobs or ())
                            if events:
                                entries = prompt_entries(prompt, prompt_raw, params.prompt_logprobs)
                                events[0] = dataclasses.replace(events[0], prompt_logprobs=entries)
                                prompt_raw = None
                        for event in events:
                            done.append(event.token_id)
                            yield event
                        if output.finished:
                            return
                finally:
                    await stream.aclose()  # aborts the vLLM request when we stop early
                    if lora is not None:
                        self._users[lora.lora_int_id] -= 1
                        await self._release(lora)
                lora, vllm_params = None, self._moved(vllm_params, params, len(done))
                if prompt_raw is not None:  # the new request computes the prompt's log-probs again
                    prompt_raw = []
        finally:
            self._running -= 1

    def _moved(self, vllm_params: Any, params: SamplingParams, generated: int) -> Any:
        """The rest of a request that ran on the model's own adapter version when full weights other than the base
        were loaded: the adapter was trained against the base, so on the new weights it computes neither policy.
        The request goes on on the new weights without it, as on the torch backend (whose adapter versions are
        merged into the weights): its tokens so far become the prompt of a new vLLM request for the tokens left
        (vLLM's preemption by recomputation), stamped with the new version. vLLM binds an adapter to a request for
        its whole life, so the old request is aborted at its first output after the load, which is dropped. The
        base itself (a reload) keeps the adapter on, as a newer adapter version does."""
        if params.guide is not None and generated:
            # a grammar's state cannot be carried into a new request: it would start the output over
            raise RuntimeError("full weights were loaded under this request's adapter while it was constrained by a "
                               "structured output: it cannot go on without the adapter; retry it")  # fmt: skip
        changes: dict[str, Any] = {"max_tokens": params.max_tokens - generated,
                                   "min_tokens": max(0, params.min_tokens - generated)}  # fmt: skip
        if generated:  # handed out with the first token
            changes["prompt_logprobs"] = None
        return _with(vllm_params, changes)

    # ---- named adapters (multi-run) ---------------------------------------------------------------
    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(self._named)

    def adapter_version(self, name: str) -> int:
        return self._named[name][1]

    async def _check_still_held(self, name: str, lora: Any) -> None:
        """`name`'s folder is gone (its run ended, or its versions were pruned): fine while vLLM still holds the
        adapter; once vLLM's cache evicted it, it cannot be loaded back, so the name is forgotten and the
        request refused by name (404, as on the torch backend) instead of failing inside vLLM."""
        if lora.lora_int_id in await self._live.list_loras():
            return
        if self._named.get(name, (None, 0))[0] is lora:  # not already forgotten, nor updated meanwhile
            del self._named[name]
            await self._release(lora)
        raise AdapterGoneError(
            f"adapter {name!r} was evicted by vLLM and cannot be loaded back: {lora.lora_path} is gone"
        )

    async def update_adapter(self, name: str, weights: FetchedWeights) -> None:
        await run_to_end(self._update_adapter(name, weights), weights.step)

    async def _update_adapter(self, name: str, weights: FetchedWeights) -> None:
        path, version = weights.folder, weights.step
        # Any number of names: vLLM's own cache holds `max_loras` adapters, evicts the least recently used
        # idle one and loads an evicted adapter back from its folder when a request asks for it.
        await asyncio.to_thread(adapter_rank, Path(path), self.max_lora_rank)
        request = await self._add_lora(Path(path), f"{name}-{{id}}-step_{version}")
        previous, _ = self._named.get(name, (None, 0))
        self._named[name] = (request, version)
        if previous is not None:
            await self._release(previous)

    async def remove_adapter(self, name: str) -> None:
        request, _ = self._named.pop(name)  # KeyError: not served
        if request is not None:  # dropped from vLLM's cache once its last request ends (`_release`)
            await self._release(request)

    async def update_weights(self, weights: FetchedWeights) -> None:
        await run_to_end(self._update_weights(weights), weights.step)

    async def _update_weights(self, weights: FetchedWeights) -> None:
        from gyre.lora import ADAPTER_CONFIG

        path, version = Path(weights.folder), weights.step
        previous = self._lora
        if (path / ADAPTER_CONFIG).is_file():
            await asyncio.to_thread(adapter_rank, path, self.max_lora_rank)
            # registered before the base comes back: an adapter vLLM refuses leaves the served weights as they are
            lora = await self._add_lora(path, f"gyre-{{id}}-step_{version}")
            if self._base_loaded:
                self._lora, self._version = lora, version
            else:  # the engine serves a full-weights version: adapters apply to the base
                try:
                    await self._load_full(self.model_path, lambda: self._serve(lora, version, base=True))
                except BaseException:
                    await self._release(lora)
                    raise
        else:
            await asyncio.to_thread(check_same_layout, self.model_path, path)
            await self._load_full(path, lambda: self._serve(None, version, base=path == self.model_path))
        if previous is not None:
            await self._release(previous)

    def _serve(self, lora: Any, version: int, *, base: bool) -> None:
        if not base:  # requests on the model's own adapter must not go on with it on these weights (`_moved`)
            self._moves += 1
        self._lora, self._version, self._base_loaded = lora, version, base

    async def _load_full(self, path: Path, loaded: Callable[[], None]) -> None:
        """Load `path` in every worker while the scheduler is paused, and note what is served now (`loaded()`)
        before it resumes: every output of a step on the new weights is stamped with the new version (noted after
        the resume, outputs computed meanwhile were stamped with the old one, or with the full version when the base
        came back under an adapter)."""
        engine = self._live
        await self._pause()
        mixed = False  # the workers hold weights of no version: never resumed, the engine is stopped
        try:
            try:
                await engine.collective_rpc("gyre_load_weights", args=(str(path),))
            except Exception as error:
                mixed = not await self._load_back(engine, error)
                if mixed:
                    raise BackendStoppedError(
                        f"vLLM failed loading {path} ({error}) and then loading back {self._full_path}: its weights "
                        "are a mix of two versions, so the engine is stopped; the replica exits to be restarted"
                    ) from error
                raise WeightsLoadError(f"{path}: vLLM could not load the weights ({error}); the weights served before "
                                       "were loaded back, and the version may load next time") from error  # fmt: skip
            loaded()
            self._full_path = path
        finally:
            if mixed:
                await self.shutdown()
            else:
                await engine.resume_generation()  # the engine paused, even if a stop began meanwhile
        if await engine.reset_prefix_cache() is False:
            log.warning("vLLM kept prefix-cache blocks still in use: they were computed by the previous weights")

    async def _load_back(self, engine: Any, error: BaseException) -> bool:
        """After a failed `gyre_load_weights`: load the weights served before back in every worker (still paused);
        True once they are. `load_weights` copies tensor by tensor, so a load that failed part way (an I/O error on
        the volume mid-read, memory) left the workers holding a mix of the two versions, which went on serving under
        the old version's number: samples of no policy, tagged as one."""
        log.error("vLLM failed loading weights (%s): loading back %s, the weights served before", error,
                  self._full_path)  # fmt: skip
        try:
            await engine.collective_rpc("gyre_load_weights", args=(str(self._full_path),))
        except Exception as again:
            log.error("vLLM failed loading back %s too: %s", self._full_path, again)
            return False
        return True

    async def _add_lora(self, path: Path, name: str) -> Any:
        """A new LoRARequest for the (checked) adapter in `path`, loaded by vLLM: a fresh id, and `name`
        formatted with it."""
        from vllm.lora.request import LoRARequest

        engine = self._live  # a stopped engine is not an adapter vLLM refused
        lora_id = next(self._lora_ids)
        request = LoRARequest(lora_name=name.format(id=lora_id), lora_int_id=lora_id, lora_path=str(path))
        try:
            loaded = await engine.add_lora(request)
        except Exception as error:
            raise adapter_load_failure(path, error) from error
        if not loaded:
            raise WeightsIncompatibleError(f"{path}: vLLM did not load the adapter")
        return request

    async def _release(self, lora: Any) -> None:
        """Drop `lora` from vLLM's cache once no model name serves it and no request of ours uses it."""
        lora_id = lora.lora_int_id
        serving = {r.lora_int_id for r, _ in self._named.values() if r is not None}
        if self._lora is not None:
            serving.add(self._lora.lora_int_id)
        if self._users[lora_id] > 0 or lora_id in serving:
            return
        del self._users[lora_id]
        try:
            await self._live.remove_lora(lora_id)
        except Exception as error:  # only costs cache space: vLLM's LRU cache evicts it in time
            log.warning("vLLM could not drop adapter %s (%s): %s", lora.lora_name, lora_id, error)

    async def reload_base(self) -> None:
        await self.update_weights(FetchedWeights.local(self.model_path))

    async def _pause(self) -> None:
        try:
            await self._live.pause_generation(mode="keep", clear_cache=False)
        except TypeError:  # vLLM before pause modes: utility calls still run between engine steps
            log.warning("this vLLM cannot pause with requests kept; loading between engine steps instead")


def _with(vllm_params: Any, changes: dict[str, Any]) -> Any:
    """A copy of vLLM `SamplingParams` with `changes` (its `clone`, else a shallow copy)."""
    import copy

    clone = vllm_params.clone() if hasattr(vllm_params, "clone") else copy.copy(vllm_params)
    for key, value in changes.items():
        setattr(clone, key, value)
    return clone
