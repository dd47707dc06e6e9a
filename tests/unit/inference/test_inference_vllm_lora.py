"""vLLM backend, LoRA adapters (the model's own adapter versions, and named adapters: one per run in
multi-run): our calls checked against vLLM's signatures with a stand-in engine.

Why a stand-in: vLLM needs a CUDA GPU and cannot even be installed on the CPU machines that run this suite.
`StandInAsyncLLM` and the other stand-ins below carry the signatures of the vLLM entry points the backend
calls, as read from vLLM's source (`vllm/v1/engine/async_llm.py`: `generate(..., *, lora_request=None,
...)`, `add_lora(lora_request) -> bool`; `vllm/lora/request.py`: `LoRARequest(lora_name, lora_int_id,
lora_path)`, id > 0, path required; `vllm/config/lora.py`: `max_lora_rank` one of
1/8/16/32/64/128/256/320/512, `max_loras >= 1`). Every call is bound to those signatures, so a wrong
keyword or a missing argument fails here. Where vllm imports (a GPU machine), `test_stand_ins_match_vllm`
checks the stand-ins against the real classes, so they cannot drift silently.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import errno
import inspect
import json
import os
import shutil
import sys
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import pytest
from gyre.config.inference import VLLM_LORA_RANKS, InferenceConfig
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams, WeightsIncompatibleError


# ---- stand-ins with vLLM's signatures ----------------------------------------------------------------
@dataclass
class StandInEngineArgs:
    """The AsyncEngineArgs fields the backend sets (an unknown keyword fails, as with vLLM's dataclass)."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    enable_prefix_caching: bool | None = None
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    worker_extension_cls: str = ""
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    structured_outputs_config: object = None
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        assert self.scheduling_policy in ("fcfs", "priority"), self.scheduling_policy
        if self.enable_lora and (self.max_lora_rank not in VLLM_LORA_RANKS or self.max_loras < 1):
            raise ValueError("vLLM's LoRAConfig refuses this rank / max_loras")


@dataclass
class StandInLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"

    # vLLM's LoRARequest compares and hashes by lora_name only (vllm/lora/request.py)
    def __eq__(self, other):
        return isinstance(other, StandInLoRARequest) and self.lora_name == other.lora_name

    def __hash__(self):
        return hash(self.lora_name)


class StandInOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def standin_sampling_params(*, n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=16, seed=None,
                            stop_token_ids=None,
                            ignore_eos=False, logprobs=None, detokenize=True, output_kind=None, min_tokens=0,
                            logit_bias=None, prompt_logprobs=None, structured_outputs=None, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, allowed_token_ids=None,
                            bad_words=None):  # fmt: skip
    return SimpleNamespace(
        max_tokens=max_tokens,
        allowed_token_ids=allowed_token_ids,
        bad_words=bad_words,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
        penalties=(repetition_penalty, presence_penalty, frequency_penalty),
    )


@dataclass
class StandInStructuredOutputsParams:
    """vllm/sampling_params.py `StructuredOutputsParams`: exactly one constraint (json, regex, choice, grammar,
    json_object, structural_tag) plus options."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [self.json, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag]
        if sum(value is not None for value in given) != 1:
            raise ValueError("You must use exactly one kind of structured outputs constraint")


@dataclass
class StandInStructuredOutputsConfig:
    """vllm/config/structured_outputs.py `StructuredOutputsConfig` (the fields the backend sets)."""

    backend: str = "auto"

    def __post_init__(self):
        assert self.backend in ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"), self.backend


Logprob = SimpleNamespace


class StandInAsyncLLM:
    """Records every call; generate emits one token per step until told to stop (see `step`)."""

    def __init__(self, args: StandInEngineArgs):
        self.args = args
        self.model_config = SimpleNamespace(max_model_len=64)
        self.calls: list[tuple[str, dict]] = []
        self.loras: dict[int, StandInLoRARequest] = {}  # what vLLM holds (`list_loras`)
        self.evicted: dict[int, StandInLoRARequest] = {}  # dropped by vLLM's LRU cache: loaded back from the path
        self.steps = asyncio.Queue()
        self.auto = False  # True: generate needs no `steps` (one token per event-loop turn)
        self.running: collections.Counter = collections.Counter()  # lora id (None: no adapter) -> requests

    def _record(self, method, *args, **kwargs):
        bound = inspect.signature(getattr(StandInAsyncLLM, method)).bind(self, *args, **kwargs)
        self.calls.append((method, {k: v for k, v in bound.arguments.items() if k != "self"}))

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None):
        return cls(engine_args)

    async def generate(self, prompt, sampling_params, request_id, *, prompt_text=None, lora_request=None,
                       tokenization_kwargs=None, trace_headers=None, priority=0, data_parallel_rank=None):  # fmt: skip
        self._record("generate", prompt, sampling_params, request_id, lora_request=lora_request, priority=priority)
        if priority != 0 and self.args.scheduling_policy != "priority":  # vLLM's processor refuses it so
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            if lora_request.lora_int_id not in self.evicted:
                raise AssertionError("a request named an adapter vLLM no longer holds (never added, or removed)")
            if not Path(lora_request.lora_path).is_dir():  # vLLM's worker fails to load it back
                raise RuntimeError(f"Loading lora {lora_request.lora_name} failed: No adapter found for "
                                   f"{lora_request.lora_path}")  # fmt: skip
            self.loras[lora_request.lora_int_id] = self.evicted.pop(lora_request.lora_int_id)
        lora_id = lora_request.lora_int_id if lora_request is not None else None
        self.running[lora_id] += 1
        try:
            for i in range(sampling_params.max_tokens):
                await (asyncio.sleep(0) if self.auto else self.steps.get())
                last = i == sampling_params.max_tokens - 1
                token = 10 + i
                yield SimpleNamespace(
                    finished=last,
                    outputs=[SimpleNamespace(token_ids=[token], logprobs=[{token: Logprob(logprob=-0.5, rank=1)}],
                                             finish_reason="length" if last else None)],
                    prompt_logprobs=self._prompt_logprobs(prompt, sampling_params) if i == 0 else None,
                )  # fmt: skip
        finally:
            self.running[lora_id] -= 1

    @staticmethod
    def _prompt_logprobs(prompt, sampling_params):
        """vLLM's `RequestOutput.prompt_logprobs` (on the first DELTA output): None, then per prompt token its
        Logprob and the top k; here token t has log-prob -t/10 and rank 3, the top k are ids 0..k-1."""
        k = sampling_params.prompt_logprobs
        if k is None:
            return None
        entries = [None]
        for token in prompt["prompt_token_ids"][1:]:
            ranked = {alt: Logprob(logprob=-0.01 * (alt + 1), rank=alt + 1) for alt in range(k)}
            entries.append({**ranked, token: Logprob(logprob=-token / 10, rank=3)})
        return entries

    async def add_lora(self, lora_request) -> bool:
        self._record("add_lora", lora_request)
        if lora_request.lora_int_id in self.loras or lora_request in self.loras.values():
            raise AssertionError(f"{lora_request}: id or name reused, vLLM would serve the cached adapter")
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id) -> bool:
        self._record("remove_lora", lora_id)
        if self.running[lora_id]:
            raise AssertionError(f"adapter {lora_id} removed while {self.running[lora_id]} requests still use it")
        self.evicted.pop(lora_id, None)
        return self.loras.pop(lora_id, None) is not None

    async def list_loras(self) -> set[int]:
        self._record("list_loras")
        return set(self.loras)

    def evict(self, lora_id: int) -> None:
        """What vLLM's LRU adapter cache does to an idle adapter when it needs the room (not an API call)."""
        assert not self.running[lora_id]
        self.evicted[lora_id] = self.loras.pop(lora_id)

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache=True):
        self._record("pause_generation", mode=mode, clear_cache=clear_cache)

    async def resume_generation(self):
        self._record("resume_generation")

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._record("collective_rpc", method, args=args)

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        self._record("reset_prefix_cache")
        return True

    def shutdown(self, timeout=None):
        pass

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def last(self, method: str) -> dict:
        return [c for name, c in self.calls if name == method][-1]

    def removed(self) -> list[int]:
        return [c["lora_id"] for name, c in self.calls if name == "remove_lora"]


@pytest.fixture
def standin_vllm(monkeypatch):
    """Install the stand-ins as the `vllm` modules the backend imports."""
    modules = {
        "vllm": {"AsyncEngineArgs": StandInEngineArgs, "SamplingParams": standin_sampling_params},
        "vllm.sampling_params": {"RequestOutputKind": StandInOutputKind,
                                 "StructuredOutputsParams": StandInStructuredOutputsParams},
        "vllm.config": {"StructuredOutputsConfig": StandInStructuredOutputsConfig},
        "vllm.v1": {}, "vllm.v1.engine": {}, "vllm.v1.engine.async_llm": {"AsyncLLM": StandInAsyncLLM},
        "vllm.lora": {}, "vllm.lora.request": {"LoRARequest": StandInLoRARequest},
    }  # fmt: skip
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


def adapter_folder(root: Path, name: str, rank: int = 8) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / ADAPTER_FILE).write_bytes(b"vLLM reads the tensors; the backend only reads the config")
    config = adapter_config(rank, 2.0 * rank, 0.0, ["q_proj", "v_proj"], "base")
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    return folder


def run(coro):
    return asyncio.run(coro)


def test_a_request_priority_reaches_vllm_with_priority_scheduling_on(standin_vllm, tiny_model):
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model)
        await backend.start()
        engine = backend._engine
        engine.auto = True
        assert engine.args.scheduling_policy == "priority"  # with "fcfs", vLLM refuses any priority but 0
        events = [e async for e in backend.generate([1, 2], SamplingParams(max_tokens=2, priority=7))]
        assert len(events) == 2 and engine.last("generate")["priority"] == 7
        # vLLM's penalties go to vLLM as they are (it applies them, and reports processed log-probs)
        params = SamplingParams(max_tokens=1, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.7)
        [_ async for _ in backend.generate([1, 2], params)]
        assert engine.last("generate")["sampling_params"].penalties == (1.2, -0.5, 0.7)
        # allowed_token_ids and bad_words too (vLLM tokenizes the words itself, as ModelText.bad_word_ids mirrors)
        params = SamplingParams(max_tokens=1, allowed_token_ids=frozenset({9, 3}), bad_words=("a b", "c"),
                                bad_word_ids=((1, 2), (3,)))  # fmt: skip
        [_ async for _ in backend.generate([1, 2], params)]
        sent = engine.last("generate")["sampling_params"]
        assert sent.allowed_token_ids == [3, 9] and sent.bad_words == ["a b", "c"]
        assert "cache_salt" not in engine.last("generate")["prompt"]  # unsalted: vLLM's prompt as before
        [_ async for _ in backend.generate([1, 2], SamplingParams(max_tokens=1, cache_salt="tenant"))]
        assert engine.last("generate")["prompt"] == {"prompt_token_ids": [1, 2], "cache_salt": "tenant"}  # vLLM's place
        await backend.shutdown()

    run(scenario())


def test_requests_and_updates_after_the_engine_stopped_are_refused_as_stopped(standin_vllm, tiny_model, tmp_path):
    """A request or weights update that reaches the vLLM backend once `shutdown()` ran (the service's stop, while
    uvicorn and the control server still answer) gets BackendStoppedError, as from the torch engine: a 503
    `not_ready` with Retry-After, UNAVAILABLE on the control. It was an AttributeError on None: a 500, and an adapter
    update said vLLM could not load the adapter."""
    from gyre_inference.backend import BackendStoppedError
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=1, max_lora_rank=16)
        await backend.start()
        await backend.shutdown()
        with pytest.raises(BackendStoppedError):
            [_ async for _ in backend.generate([1, 2], SamplingParams(max_tokens=1))]
        full = tmp_path / "step_2"
        shutil.copytree(tiny_model, full)
        for weights in (FetchedWeights.local(full, 2), FetchedWeights.local(adapter_folder(tmp_path, "step_3"), 3)):
            with pytest.raises(BackendStoppedError):
                await backend.update_weights(weights)
        assert backend.version == 0

    run(scenario())


# ---- the model's own adapter versions ---------------------------------------------------------------
def test_adapter_versions_become_lora_requests_with_a_new_id_each(standin_vllm, tiny_model, tmp_path):
    from gyre_inference.vllm_backend import VLLMBackend

    v1, v2 = adapter_folder(tmp_path, "step_1"), adapter_folder(tmp_path, "step_2")

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=16)
        await backend.start()
        engine = backend._engine
        args = engine.args
        assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, 16, 2)

        await backend.update_weights(FetchedWeights.local(v1, 1))
        first = engine.last("add_lora")["lora_request"]
        assert engine.names() == ["add_lora"]  # no pause, no weight reload: vLLM applies the adapter per request
        assert (first.lora_int_id, first.lora_path) == (1, str(v1)) and backend.version == 1

        params = SamplingParams(max_tokens=4, temperature=1.0)
        early = backend.generate([1, 2, 3], params)
        engine.steps.put_nowait(None)
        events = [await early.__anext__()]
        assert engine.last("generate")["lora_request"] is first

        await backend.update_weights(FetchedWeights.local(v2, 2))
        second = engine.last("add_lora")["lora_request"]
        assert second.lora_int_id == 2 and second.lora_path == str(v2) and second.lora_name != first.lora_name
        assert engine.removed() == []  # the early request still runs on the first adapter
        late = backend.generate([4, 5], params)
        for _ in range(8):
            engine.steps.put_nowait(None)
        events += [e async for e in early]
        assert engine.removed() == [1]  # its last request ended: vLLM drops it from its cache
        late_events = [e async for e in late]
        assert engine.last("generate")["lora_request"] is second
        # a request keeps the adapter it started with to the end, and its tokens say so
        assert [e.version for e in events] == [1, 1, 1, 1] and {e.version for e in late_events} == {2}

        # a full-weights version: requests go without an adapter; the next adapter first brings back the base
        full = tmp_path / "step_3"
        shutil.copytree(tiny_model, full)
        await backend.update_weights(FetchedWeights.local(full, 3))
        assert engine.removed() == [1, 2] and engine.loras == {}
        generate = backend.generate([1], SamplingParams(max_tokens=1))
        engine.steps.put_nowait(None)
        assert [e.version async for e in generate] == [3] and engine.last("generate")["lora_request"] is None
        del engine.calls[:]
        await backend.update_weights(FetchedWeights.local(v1, 4))
        rpc = [c for name, c in engine.calls if name == "collective_rpc"]
        assert [c["args"] for c in rpc] == [(str(tiny_model),)], "the base is reloaded under the adapter"
        assert engine.last("add_lora")["lora_request"].lora_int_id == 3  # a re-served folder still gets a new id
        await backend.shutdown()

    run(scenario())


def test_adapters_need_lora_enabled_and_a_rank_that_fits(standin_vllm, tiny_model, tmp_path):
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        plain = VLLMBackend(tiny_model)
        await plain.start()
        assert plain._engine.args.enable_lora is False
        with pytest.raises(WeightsIncompatibleError, match="lora.max_loras >= 1"):
            await plain.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "a"), 1))
        with pytest.raises(WeightsIncompatibleError, match="lora.max_loras >= 1"):
            await plain.update_adapter("run-a", FetchedWeights.local(tmp_path / "a", 1))
        assert plain.adapter_names == ()
        small = VLLMBackend(tiny_model, max_loras=1, max_lora_rank=4)
        await small.start()
        assert small._engine.args.max_lora_rank == 8  # the smallest of vLLM's sizes that holds rank 4
        with pytest.raises(WeightsIncompatibleError, match="rank 8 exceeds lora.max_rank 4"):
            await small.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "b", rank=8), 1))
        broken = adapter_folder(tmp_path, "c")
        (broken / ADAPTER_CONFIG).write_text('{"r": 0, "lora_alpha": 1}')
        with pytest.raises(WeightsIncompatibleError, match="not a usable LoRA adapter"):
            await small.update_weights(FetchedWeights.local(broken, 1))
        assert plain._engine.calls == small._engine.calls == [] and small.version == 0  # nothing reached vLLM

        async def refuse(lora_request):
            raise ValueError("target module lm_head is not supported")

        small._engine.add_lora = refuse
        with pytest.raises(WeightsIncompatibleError, match="vLLM could not load the adapter .*lm_head"):
            await small.update_adapter("run-a", FetchedWeights.local(adapter_folder(tmp_path, "d", rank=4), 1))
        assert small.adapter_names == ()

    run(scenario())


async def _collect(stream):
    return [event async for event in stream]


def test_a_full_version_is_stamped_from_its_first_step_and_survives_its_caller_giving_up(
    standin_vllm, tiny_model, tmp_path
):
    """Tokens a step computes on new weights carry the new version, and an UpdateWeights cancelled while vLLM loads
    is applied whole. Before, the version was noted only after the scheduler resumed and the prefix cache was reset,
    so outputs of the first steps on the new weights were stamped with the old version; and a call cancelled during
    the load left the model's previous adapter in use, applied on top of the new full weights, under its version."""
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=16)
        await backend.start()
        engine = backend._engine
        full = tmp_path / "step_2"
        shutil.copytree(tiny_model, full)

        # a step runs as soon as the scheduler resumes, before the prefix cache reset returns
        resume, reset = engine.resume_generation, engine.reset_prefix_cache

        async def resume_and_step():
            await resume()
            engine.steps.put_nowait(None)

        async def slow_reset(**kwargs):
            await asyncio.sleep(0.05)
            return await reset(**kwargs)

        engine.resume_generation, engine.reset_prefix_cache = resume_and_step, slow_reset
        engine.steps.put_nowait(None)
        reading = asyncio.create_task(_collect(backend.generate([1, 2], SamplingParams(max_tokens=2))))
        await asyncio.sleep(0.05)  # its first token is read
        await backend.update_weights(FetchedWeights.local(full, 2))
        assert [e.version for e in await reading] == [0, 2]
        engine.resume_generation, engine.reset_prefix_cache = resume, reset

        # the model's adapter version 3, then full version 4 whose caller gives up while vLLM loads it
        await backend.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "step_3"), 3))
        loading, release = asyncio.Event(), asyncio.Event()
        rpc = engine.collective_rpc

        async def slow_rpc(method, timeout=None, args=(), kwargs=None):
            await rpc(method, timeout=timeout, args=args, kwargs=kwargs)  # vLLM loads it whatever the caller does
            loading.set()
            await release.wait()

        engine.collective_rpc = slow_rpc
        update = asyncio.create_task(backend.update_weights(FetchedWeights.local(full, 4)))
        await loading.wait()
        update.cancel()
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await update
        engine.auto = True
        events = [e async for e in backend.generate([1], SamplingParams(max_tokens=1))]
        assert engine.last("generate")["lora_request"] is None  # the full weights alone, no adapter on top
        assert backend.version == 4 and [e.version for e in events] == [4]
        await backend.shutdown()

    run(scenario())


# ---- named adapters: one per run ---------------------------------------------------------------------
def test_each_run_name_serves_its_own_newest_adapter(standin_vllm, tiny_model, tmp_path):
    """Multi-run: a request for run r's name uses r's newest LoRARequest; r's update replaces only r's adapter,
    requests in flight finish on the old one, which leaves vLLM's cache when its last request ends."""
    from gyre_inference.vllm_backend import VLLMBackend

    folders = {name: adapter_folder(tmp_path, name) for name in ("a5", "b7", "a6", "a7", "big")}

    async def tokens(backend, adapter, n=2):
        stream = backend.generate([1, 2], SamplingParams(max_tokens=n, adapter=adapter))
        for _ in range(n):
            backend._engine.steps.put_nowait(None)
        return [e async for e in stream]

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=8, adapters=("run-a",))
        await backend.start()
        engine = backend._engine
        assert backend.adapter_names == ("run-a",) and backend.adapter_version("run-a") == 0
        # a declared name before its first version: the base model, version 0
        assert {e.version for e in await tokens(backend, "run-a")} == {0}
        assert engine.last("generate")["lora_request"] is None

        await backend.update_adapter("run-a", FetchedWeights.local(folders["a5"], 5))
        await backend.update_adapter("run-b", FetchedWeights.local(folders["b7"], 7))  # a new name takes the free place
        assert backend.adapter_names == ("run-a", "run-b") and backend.version == 0
        assert (backend.adapter_version("run-a"), backend.adapter_version("run-b")) == (5, 7)
        a5, b7 = (c["lora_request"] for name, c in engine.calls if name == "add_lora")
        assert (a5.lora_int_id, a5.lora_path) == (1, str(folders["a5"]))
        assert (b7.lora_int_id, b7.lora_path) == (2, str(folders["b7"]))
        assert a5.lora_name.startswith("run-a-") and b7.lora_name.startswith("run-b-")

        # each name's requests carry its own adapter and version; the model itself has none
        for name, lora, version in [("run-a", a5, 5), ("run-b", b7, 7), (None, None, 0)]:
            assert {e.version for e in await tokens(backend, name)} == {version}
            assert engine.last("generate")["lora_request"] is lora, name

        # run a's update while one of its requests is in flight: b untouched, the request ends on a5
        early = backend.generate([3], SamplingParams(max_tokens=3, adapter="run-a"))
        engine.steps.put_nowait(None)
        first = await early.__anext__()
        await backend.update_adapter("run-a", FetchedWeights.local(folders["a6"], 6))
        a6 = engine.last("add_lora")["lora_request"]
        assert a6.lora_int_id == 3 and backend._named["run-b"] == (b7, 7)
        assert engine.removed() == [] and set(engine.loras) == {1, 2, 3}
        assert engine.last("generate")["lora_request"] is a5
        assert {e.version for e in await tokens(backend, "run-a")} == {6}
        assert engine.last("generate")["lora_request"] is a6
        engine.steps.put_nowait(None)
        engine.steps.put_nowait(None)
        assert [first.version] + [e.version async for e in early] == [5, 5, 5]
        assert engine.removed() == [1] and set(engine.loras) == {2, 3}  # a5's last request ended

        # no request in flight: the previous adapter is dropped at once; ids are never reused
        await backend.update_adapter("run-a", FetchedWeights.local(folders["a7"], 7))
        assert engine.last("add_lora")["lora_request"].lora_int_id == 4
        assert engine.removed() == [1, 3] and set(engine.loras) == {2, 4}
        # a retry of the same step: a new id and name
        await backend.update_adapter("run-a", FetchedWeights.local(folders["a7"], 7))
        assert engine.last("add_lora")["lora_request"].lora_int_id == 5
        assert engine.removed() == [1, 3, 4] and set(engine.loras) == {2, 5}

        # refused: a rank over lora.max_rank, an unknown name; nothing changes
        before = dict(backend._named)
        (folders["big"] / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(16, 32, 0.0, ["q_proj"], "base")))
        with pytest.raises(WeightsIncompatibleError, match="exceeds lora.max_rank 8"):
            await backend.update_adapter("run-b", FetchedWeights.local(folders["big"], 8))
        with pytest.raises(KeyError, match="run-c"):
            await tokens(backend, "run-c")
        assert backend._named == before and set(engine.loras) == {2, 5}

        # more names than max_loras (2): accepted; vLLM's cache evicts idle adapters and loads them back
        await backend.update_adapter("run-c", FetchedWeights.local(folders["a5"], 1))
        assert backend.adapter_names == ("run-a", "run-b", "run-c") and backend.adapter_version("run-c") == 1
        await backend.shutdown()

    run(scenario())


def test_an_unloaded_name_is_refused_and_leaves_vllm_s_cache_once_its_requests_end(standin_vllm, tiny_model, tmp_path):
    """POST /v1/unload_lora_adapter on vLLM: the name is no longer served (KeyError: 404), its request in flight
    finishes on its adapter, which is dropped from vLLM's cache only then; another name is untouched."""
    from gyre_inference.vllm_backend import VLLMBackend

    folders = {name: adapter_folder(tmp_path, name) for name in ("a", "b")}

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=8)
        await backend.start()
        engine = backend._engine
        await backend.update_adapter("a", FetchedWeights.local(folders["a"], 0))
        await backend.update_adapter("b", FetchedWeights.local(folders["b"], 0))
        running = backend.generate([3], SamplingParams(max_tokens=2, adapter="a"))
        engine.steps.put_nowait(None)
        first = await running.__anext__()
        await backend.remove_adapter("a")
        assert backend.adapter_names == ("b",) and engine.removed() == []  # a's request still uses it
        with pytest.raises(KeyError, match="'a'"):
            await backend.generate([1], SamplingParams(max_tokens=1, adapter="a")).__anext__()
        with pytest.raises(KeyError):
            await backend.remove_adapter("a")
        engine.steps.put_nowait(None)
        assert len([first, *[e async for e in running]]) == 2
        assert engine.removed() == [1] and set(engine.loras) == {2}
        await backend.shutdown()

    run(scenario())


def test_a_name_whose_adapter_vllm_evicted_and_whose_folder_is_gone_is_forgotten(standin_vllm, tiny_model, tmp_path):
    """A run's folder removed (run ended, versions pruned): its name serves on while vLLM holds the adapter,
    an evicted adapter whose folder exists is loaded back by vLLM, and an evicted one whose folder is gone is
    refused by name (AdapterGoneError: a 404, as on the torch backend) and forgotten, instead of failing
    inside vLLM; a later version of that name serves again."""
    from gyre_inference.backend import AdapterGoneError
    from gyre_inference.vllm_backend import VLLMBackend

    folders = {name: adapter_folder(tmp_path, name) for name in ("a3", "b4", "a9")}

    async def tokens(backend, adapter, n=2):
        stream = backend.generate([1, 2], SamplingParams(max_tokens=n, adapter=adapter))
        return [e.version async for e in stream]

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=8, adapters=("run-a", "run-b"))
        await backend.start()
        engine = backend._engine
        engine.auto = True
        await backend.update_adapter("run-a", FetchedWeights.local(folders["a3"], 3))
        await backend.update_adapter("run-b", FetchedWeights.local(folders["b4"], 4))
        a3, b4 = backend._named["run-a"][0], backend._named["run-b"][0]

        shutil.rmtree(folders["a3"])
        assert await tokens(backend, "run-a") == [3, 3]  # vLLM still holds it: served
        engine.evict(b4.lora_int_id)
        assert await tokens(backend, "run-b") == [4, 4]  # evicted, folder there: vLLM loads it back
        assert b4.lora_int_id in engine.loras

        engine.evict(a3.lora_int_id)
        with pytest.raises(AdapterGoneError, match="'run-a' was evicted by vLLM and cannot be loaded back"):
            await tokens(backend, "run-a")
        assert backend.adapter_names == ("run-b",) and engine.last("generate")["lora_request"] is b4
        assert a3.lora_int_id in engine.removed() and a3.lora_int_id not in engine.evicted
        with pytest.raises(KeyError, match="no adapter named 'run-a'"):  # forgotten: the API's plain 404
            await tokens(backend, "run-a")
        # the run is back with a new version
        await backend.update_adapter("run-a", FetchedWeights.local(folders["a9"], 9))
        assert await tokens(backend, "run-a") == [9, 9] and await tokens(backend, "run-b") == [4, 4]
        await backend.shutdown()

    run(scenario())


def test_openai_api_serves_each_run_name_like_the_torch_backend(standin_vllm, tiny_model, tmp_path):
    """Through the real HTTP app and the openai client: /v1/models lists each run's name, a completion for a
    name reaches vLLM with that run's adapter, and an unknown name gets the torch backend's exact 404."""
    import openai
    from gyre_inference.torch_backend import TorchBackend
    from gyre_inference.vllm_backend import VLLMBackend
    from http_app import serve_app

    names = ("run-a", "run-b")
    folder = adapter_folder(tmp_path, "a3")

    async def serve(backend, prepare):
        async with (
            serve_app(backend, tiny_model, "vllm-lora", prepare) as url,
            openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client,
        ):
            models = {m.id: (m.model_extra["parent"], m.model_extra["policy_version"])
                      for m in (await client.models.list()).data}  # fmt: skip
            completion = await client.completions.create(
                model="run-a", prompt=[5, 17, 33], max_tokens=3, logprobs=0, extra_body={"ignore_eos": True}
            )
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model="run-c", prompt=[5], max_tokens=1)
            return models, completion, missing.value

    async def scenario():
        engines = []

        async def start_vllm(backend):
            engines.append(backend._engine)
            backend._engine.auto = True
            await backend.update_adapter("run-a", FetchedWeights.local(folder, 3))

        vllm = VLLMBackend(tiny_model, max_loras=4, max_lora_rank=8, adapters=names)
        models, completion, missing = await serve(vllm, start_vllm)
        engine_request = engines[0].last("generate")["lora_request"]

        async def nothing(backend):
            pass

        torch_backend = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=2, adapters=names)
        torch_models, _, torch_missing = await serve(torch_backend, nothing)
        return models, completion, missing, engine_request, torch_models, torch_missing

    models, completion, missing, engine_request, torch_models, torch_missing = run(scenario())
    assert models == {"tiny": (None, 0), "run-a": ("tiny", 3), "run-b": ("tiny", 0)}
    assert set(torch_models) == set(models)
    assert engine_request.lora_path == str(folder) and engine_request.lora_name.startswith("run-a-")
    assert completion.model == "run-a" and completion.choices[0].logprobs.token_logprobs == [-0.5] * 3
    assert missing.status_code == torch_missing.status_code == 404
    assert missing.body == torch_missing.body and missing.body["code"] == "model_not_found"


# ---- settings ----------------------------------------------------------------------------------------
def test_a_guide_becomes_vllm_structured_outputs_on_its_guidance_backend(standin_vllm, tiny_model):
    """Structured outputs on vLLM: the engine runs the guidance backend (llguidance, as the torch backend) and each
    constrained request carries a StructuredOutputsParams built (and so checked) with vLLM's signature."""
    from gyre_inference.structured import Guide
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model)
        await backend.start()
        engine = backend._engine
        engine.auto = True
        assert engine.args.structured_outputs_config.backend == "guidance"
        guides = [Guide("json", {"type": "object"}), Guide("json_object"), Guide("regex", "[ab]+"),
                  Guide("choice", ("x", "y")), Guide("grammar", 'start: "z"')]  # fmt: skip
        for guide in guides:
            [_ async for _ in backend.generate([1, 2], SamplingParams(max_tokens=1, guide=guide))]
            sent = engine.last("generate")["sampling_params"].structured_outputs
            assert isinstance(sent, StandInStructuredOutputsParams)
            kind = "json" if guide.kind == "json_object" else guide.kind
            assert getattr(sent, kind) is not None
        [_ async for _ in backend.generate([1, 2], SamplingParams(max_tokens=1))]
        assert engine.last("generate")["sampling_params"].structured_outputs is None
        await backend.shutdown()

    run(scenario())


def test_lora_settings_come_from_one_pair_of_config_keys():
    """lora.max_loras / lora.max_rank drive both backends (the vLLM engine's max_loras / max_lora_rank)."""
    from gyre_inference.service import make_backend

    lora = {"max_loras": 3, "max_rank": 32, "adapters": ["run-a"]}
    backend = make_backend(InferenceConfig(backend="vllm", lora=lora))
    assert backend._engine_kwargs | {"enable_lora": True, "max_lora_rank": 32, "max_loras": 3} == backend._engine_kwargs
    assert backend.adapter_names == ("run-a",)
    assert make_backend(InferenceConfig(backend="vllm", lora={"max_loras": 2, "max_rank": 20}))._engine_kwargs[
        "max_lora_rank"
    ] == 32  # fmt: skip
    assert "enable_lora" not in make_backend(InferenceConfig(backend="vllm"))._engine_kwargs
    torch_backend = make_backend(InferenceConfig(lora=lora))
    assert torch_backend._adapter_settings == (3, 32, ("run-a",))
    with pytest.raises(ValueError, match="vLLM serves adapters up to rank 512"):
        InferenceConfig(backend="vllm", lora={"max_rank": 1024})
    InferenceConfig(lora={"max_rank": 1024})  # the torch backend has no fixed sizes


@pytest.mark.gpu
def test_stand_ins_match_vllm():
    """Where vllm imports: the stand-ins' signatures are vLLM's own (runs on a GPU machine)."""
    vllm = pytest.importorskip("vllm")
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_fields = set(inspect.signature(vllm.AsyncEngineArgs).parameters)
    assert {f.name for f in fields(StandInEngineArgs)} <= engine_fields
    methods = ("generate", "add_lora", "remove_lora", "list_loras", "pause_generation", "collective_rpc",
               "reset_prefix_cache")  # fmt: skip
    for method in methods:
        real = inspect.signature(getattr(AsyncLLM, method)).parameters
        ours = inspect.signature(getattr(StandInAsyncLLM, method)).parameters
        for name, param in ours.items():
            assert name in real and real[name].kind == param.kind, (method, name)
    request = LoRARequest(lora_name="gyre-1-step_1", lora_int_id=1, lora_path="/weights/step_1")
    assert (request.lora_int_id, request.lora_path) == (1, "/weights/step_1")
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    for standin, real in ((StandInStructuredOutputsParams, StructuredOutputsParams),
                          (StandInStructuredOutputsConfig, StructuredOutputsConfig)):  # fmt: skip
        real_fields = set(inspect.signature(real).parameters)
        assert {f.name for f in fields(standin)} <= real_fields, standin
    vllm.SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return
    assert tuple(typing.get_args(MaxLoRARanks)) == VLLM_LORA_RANKS


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_serves_each_run_adapter_on_a_gpu(tiny_model, tmp_path):
    """Real vLLM: each run's name samples with exactly its adapter (log-probs of base + that adapter, in mixed
    batches), a run's update replaces only its adapter, and the replaced one leaves vLLM's cache."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from gyre_inference.vllm_backend import VLLMBackend
    from test_inference_lora_adapter import PROMPT, reference_logprobs, write_adapter
    from transformers import AutoModelForCausalLM

    references = {
        None: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(),
        "a": write_adapter(tiny_model, tmp_path / "a", seed=1),
        "b": write_adapter(tiny_model, tmp_path / "b", seed=2),
    }

    async def sample(backend, name, seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, adapter=name)
        return [e async for e in backend.generate(PROMPT, params)]

    def closest(events):
        """The reference whose log-probs the sampled tokens match best, and its mean error (bf16: ~1e-3;
        between these adapters ~0.2)."""
        tokens, got = [e.token_id for e in events], torch.tensor([e.logprob for e in events])
        errors = {k: float((got - reference_logprobs(m, tokens)).abs().mean()) for k, m in references.items()}
        best = min(errors, key=errors.get)
        return best, errors[best]

    async def scenario():
        # bfloat16: vLLM's LoRA kernels take half precision only
        backend = VLLMBackend(tiny_model, dtype="bfloat16", gpu_memory_utilization=0.2, max_num_seqs=16,
                              max_loras=4, max_lora_rank=4, adapters=("run-a", "run-b"))  # fmt: skip
        await backend.start()
        try:
            await backend.update_adapter("run-a", FetchedWeights.local(tmp_path / "a", 1))
            await backend.update_adapter("run-b", FetchedWeights.local(tmp_path / "b", 2))
            names = [None, "run-a", "run-b"] * 2
            runs = await asyncio.gather(*(sample(backend, name, seed) for seed, name in enumerate(names)))
            for name, events in zip(names, runs, strict=True):
                best, error = closest(events)
                assert best == (name and name[-1]) and error < 0.02, (name, best, error)
                assert {e.version for e in events} == {{None: 0, "run-a": 1, "run-b": 2}[name]}

            # run-a now serves b's weights
            await backend.update_adapter("run-a", FetchedWeights.local(tmp_path / "b", 3))
            assert closest(await sample(backend, "run-a", 7))[0] == "b"
            assert closest(await sample(backend, "run-b", 8))[0] == "b"
            assert await backend._engine.list_loras() == {2, 3}  # run-a's first adapter left vLLM's cache
        finally:
            await backend.shutdown()

    asyncio.run(scenario())


def test_a_request_on_the_model_s_adapter_goes_on_without_it_once_other_full_weights_are_loaded(
    standin_vllm, tiny_model, tmp_path
):
    """The model's adapter version 1 was trained against the base: once full weights version 2 are loaded, a request
    started on the adapter goes on on the new weights without it (its tokens so far become the prompt of a new vLLM
    request for the rest), its later tokens stamped 2, as on the torch backend; the output computed by the adapter on
    top of version 2 is dropped. Before, vLLM kept the adapter on the request to its end, on top of weights it was
    not trained against, its tokens stamped 1. A reload of the base keeps the adapter on (it still fits)."""
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=16)
        await backend.start()
        engine = backend._engine
        await backend.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "step_1"), 1))
        adapter = backend._lora
        stream = backend.generate([1, 2, 3], SamplingParams(max_tokens=4, min_tokens=3, prompt_logprobs=0))
        engine.steps.put_nowait(None)
        first = await stream.__anext__()
        assert first.version == 1 and first.prompt_logprobs is not None
        assert engine.last("generate")["lora_request"] is adapter

        full = tmp_path / "step_2"
        shutil.copytree(tiny_model, full)
        await backend.update_weights(FetchedWeights.local(full, 2))
        engine.auto = True
        engine.steps.put_nowait(None)  # the old request's next output: the adapter on version 2, dropped
        rest = [e async for e in stream]
        assert [e.version for e in [first, *rest]] == [1, 2, 2, 2]
        assert [e.token_id for e in [first, *rest]] == [10, 10, 11, 12]  # the stand-in counts from 10 per request
        assert rest[-1].finish_reason == "length" and all(e.prompt_logprobs is None for e in rest)
        moved = engine.last("generate")
        assert moved["lora_request"] is None and moved["prompt"]["prompt_token_ids"] == [1, 2, 3, 10]
        assert (moved["sampling_params"].max_tokens, moved["sampling_params"].prompt_logprobs) == (3, None)
        assert adapter.lora_int_id in engine.removed() and engine.loras == {}
        assert not any(engine.running.values())  # the old vLLM request was aborted

        # the base (a reload) under a request on the adapter: it keeps it, and its version
        await backend.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "step_3"), 3))
        engine.auto = False
        stream = backend.generate([1], SamplingParams(max_tokens=2))
        engine.steps.put_nowait(None)
        first = await stream.__anext__()
        await backend.reload_base()
        engine.steps.put_nowait(None)
        assert [e.version for e in [first, *[e async for e in stream]]] == [3, 3]

        # a structured-output request with a token out cannot carry its grammar's state into a new request: an error
        from gyre_inference.structured import Guide

        await backend.update_weights(FetchedWeights.local(adapter_folder(tmp_path, "step_4"), 4))
        stream = backend.generate([1], SamplingParams(max_tokens=3, guide=Guide("regex", "[a-z]+")))
        engine.steps.put_nowait(None)
        await stream.__anext__()
        await backend.update_weights(FetchedWeights.local(full, 5))
        engine.steps.put_nowait(None)
        with pytest.raises(RuntimeError, match="constrained by a structured output"):
            await stream.__anext__()
        assert not any(engine.running.values())
        await backend.shutdown()

    run(scenario())


def test_a_request_whose_name_gets_a_new_version_while_its_adapter_is_looked_up_takes_the_new_one(
    standin_vllm, tiny_model, tmp_path
):
    """run-a's folder is gone, so its request asks vLLM whether it still holds the adapter; meanwhile run-a's next
    version arrives and the old adapter, used by no request yet, leaves vLLM's cache. The request takes the new adapter.
    Before, it went on with the adapter it had read, which vLLM no longer held and could not load back: it failed."""
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=2, max_lora_rank=8, adapters=("run-a",))
        await backend.start()
        engine = backend._engine
        engine.auto = True
        old, new = adapter_folder(tmp_path, "a1"), adapter_folder(tmp_path, "a2")
        await backend.update_adapter("run-a", FetchedWeights.local(old, 1))
        shutil.rmtree(old)  # pruned: the name serves on while vLLM holds the adapter
        listing, release = asyncio.Event(), asyncio.Event()
        list_loras = engine.list_loras

        async def slow_list():
            held = await list_loras()
            listing.set()
            await release.wait()
            return held

        engine.list_loras = slow_list
        request = asyncio.create_task(_collect(backend.generate([1], SamplingParams(max_tokens=2, adapter="run-a"))))
        await listing.wait()
        await backend.update_adapter("run-a", FetchedWeights.local(new, 2))
        assert engine.removed() == [1]  # the old adapter left vLLM: no request of ours used it
        release.set()
        assert [e.version for e in await request] == [2, 2]
        assert engine.last("generate")["lora_request"].lora_path == str(new)
        await backend.shutdown()

    run(scenario())


def relayed(error: BaseException) -> Exception:
    """`error` raised in vLLM's engine core as AsyncLLM hands it to us: the core runs in a process of its own and
    answers a failed utility call with its text, which the client raises as a plain Exception
    (vllm/v1/engine/core.py: f"Call to {method} method failed: {str(e)}"; core_client.py `_process_utility_output`)."""
    return Exception(f"Call to add_lora method failed: {error}")


def vllm_no_adapter_found(path: Path) -> ValueError:
    """vLLM's WorkerLoRAManager._load_adapter: a FileNotFoundError (no folder at lora_path) becomes this ValueError."""
    try:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path / ADAPTER_CONFIG))
    except FileNotFoundError as missing:
        try:
            raise ValueError(f"Loading lora run-a failed: No adapter found for {path}") from missing
        except ValueError as error:
            return error


class EngineDeadError(Exception):
    """vllm.v1.engine.exceptions.EngineDeadError (vLLM cannot be imported here): its name and message."""

    def __init__(self):
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")


def test_an_adapter_load_vllm_fails_for_a_reason_that_may_pass_is_sent_again_not_refused_for_good(
    standin_vllm, tiny_model, tmp_path
):
    """Every failure of vLLM's add_lora was wrapped as WeightsIncompatibleError, i.e. INVALID_ARGUMENT, which stops
    the run: an I/O error on the shared volume mid-write, a timeout or an out-of-memory that clears stopped a run that
    the next try would have continued. UpdateWeights over real gRPC now answers FAILED_PRECONDITION (the relay sends
    the version again, the replica keeps serving its own) for those, INVALID_ARGUMENT only for an adapter that does
    not fit (vLLM's ValueError), and UNAVAILABLE for an engine that died. vLLM cannot be installed on this machine: the
    failures are real exceptions of the types vLLM raises (OSError, TimeoutError, torch.OutOfMemoryError, ValueError,
    its FileNotFoundError turned ValueError), each also in the form AsyncLLM's client hands it over (`relayed`)."""
    import grpc
    import torch
    from gyre.v1 import inference_pb2, inference_pb2_grpc
    from gyre.weights import WeightStore
    from gyre_inference.control import ControlServer
    from gyre_inference.metrics import InferenceMetrics
    from gyre_inference.vllm_backend import VLLMBackend

    store = WeightStore(tmp_path / "weights")
    source = adapter_folder(tmp_path, "adapter", rank=4)
    version = store.publish(1, lambda folder: [shutil.copy(f, folder / f.name) for f in source.iterdir()])
    file = str(store.path(1) / ADAPTER_FILE)
    io_error = OSError(errno.EIO, os.strerror(errno.EIO), file)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has 12.00 MiB free.")
    unfit = ValueError(
        f"While loading {store.path(1)}, expected target modules in ['qkv_proj'] but received ['lm_head']"
    )
    rank = ValueError("LoRA rank 64 is greater than max_lora_rank 16.")
    may_pass, refused, down = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                               grpc.StatusCode.UNAVAILABLE)  # fmt: skip
    cases = [
        (io_error, may_pass), (relayed(io_error), may_pass), (TimeoutError(), may_pass),
        (relayed(TimeoutError("timed out waiting for the volume")), may_pass), (oom, may_pass),
        (relayed(oom), may_pass),
        (vllm_no_adapter_found(store.path(1)), may_pass), (relayed(vllm_no_adapter_found(store.path(1))), may_pass),
        (unfit, refused), (relayed(unfit), refused), (rank, refused), (relayed(rank), refused),
        (EngineDeadError(), down),
    ]  # fmt: skip

    async def scenario():
        backend = VLLMBackend(tiny_model, max_loras=1, max_lora_rank=8)
        await backend.start()
        add_lora = backend._engine.add_lora
        server = ControlServer(backend, InferenceMetrics("vllm-load-failures", backend), "tiny")
        port = await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = inference_pb2_grpc.InferenceControlStub(channel)
                request = inference_pb2.UpdateWeightsRequest(version=version.to_proto(), model="run-a")
                for error, code in cases:

                    async def fail(lora_request, error=error):
                        raise error

                    backend._engine.add_lora = fail
                    with pytest.raises(grpc.aio.AioRpcError) as answer:
                        await stub.UpdateWeights(request, timeout=30)
                    assert answer.value.code() == code, (repr(error), answer.value.details())
                    assert "still serving version 0" in answer.value.details()
                backend._engine.add_lora = add_lora  # the cause passed: the same version now loads
                assert (await stub.UpdateWeights(request, timeout=30)).step == 1
        finally:
            await server.stop(0)
            await backend.shutdown()

    run(scenario())


def test_an_io_error_reading_a_version_is_worth_another_try(standin_vllm, tiny_model, tmp_path, monkeypatch):
    """`adapter_rank` (adapter_config.json) and `safetensors_layout` (the full weights' headers) wrapped an OSError as
    WeightsIncompatibleError (refused for good, the run stops): an I/O error on the volume says nothing of whether
    the version fits. Real EIO: the config is a link to /proc/self/mem, whose read fails so; a header read, whose
    file size must be real, is given one by `read_header`. A folder where a file should be is still no version."""
    from gyre_inference import vllm_backend
    from gyre_inference.vllm_backend import adapter_rank, check_same_layout

    folder = adapter_folder(tmp_path, "a")
    (folder / ADAPTER_CONFIG).unlink()
    (folder / ADAPTER_CONFIG).symlink_to("/proc/self/mem")
    with pytest.raises(OSError) as error:
        adapter_rank(folder, 8)
    assert error.value.errno == errno.EIO and not isinstance(error.value, WeightsIncompatibleError)
    full = tmp_path / "full"
    (full / "model.safetensors").mkdir(parents=True)
    with pytest.raises(WeightsIncompatibleError, match="not a readable safetensors file"):
        check_same_layout(tiny_model, full)

    def io_error(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(vllm_backend, "read_header", io_error)
    with pytest.raises(OSError) as error:
        check_same_layout(tiny_model, tiny_model)
    assert error.value.errno == errno.EIO and not isinstance(error.value, WeightsIncompatibleError)


def test_a_full_load_that_fails_part_way_loads_the_served_weights_back(standin_vllm, tiny_model, tmp_path):
    """vLLM's `load_weights` copies tensor by tensor, so a load that failed part way (here an I/O error on the volume
    while a worker read the folder, in the text MultiprocExecutor relays) left the workers holding a mix of two
    versions, and they went on serving it under the old version's number: samples of no policy, tagged as one. The
    weights served before are now loaded back while the scheduler is still paused (the base, then the last full
    version), the failure is one worth another try (WeightsLoadError); when even that fails the engine is stopped, not
    resumed on mixed weights."""
    from gyre_inference.backend import BackendStoppedError, WeightsLoadError
    from gyre_inference.vllm_backend import VLLMBackend

    step_2, step_3 = tmp_path / "step_2", tmp_path / "step_3"
    shutil.copytree(tiny_model, step_2)
    shutil.copytree(tiny_model, step_3)

    async def scenario():
        backend = VLLMBackend(tiny_model)
        await backend.start()
        engine = backend._engine
        rpc, failing = engine.collective_rpc, set()

        async def read(method, timeout=None, args=(), kwargs=None):
            await rpc(method, timeout=timeout, args=args, kwargs=kwargs)
            if args[0] in failing:
                raise Exception(f"Worker failed with error '[Errno 5] Input/output error: {args[0]}', please check "
                                "the stack trace above for the root cause")  # fmt: skip

        def loads():
            return [c["args"][0] for name, c in engine.calls if name == "collective_rpc"]

        engine.collective_rpc = read
        failing.add(str(step_3))
        with pytest.raises(WeightsLoadError, match="loaded back"):
            await backend.update_weights(FetchedWeights.local(step_3, 3))
        assert loads() == [str(step_3), str(tiny_model)] and backend.version == 0  # the base, back
        assert engine.names()[-1] == "resume_generation" and backend.ready
        await backend.update_weights(FetchedWeights.local(step_2, 2))
        with pytest.raises(WeightsLoadError):
            await backend.update_weights(FetchedWeights.local(step_3, 3))
        assert loads()[-2:] == [str(step_3), str(step_2)] and backend.version == 2  # the version served, back

        failing.add(str(step_2))  # loading back fails too: the workers' weights are of no version
        with pytest.raises(BackendStoppedError, match="the replica exits to be restarted"):
            await backend.update_weights(FetchedWeights.local(step_3, 3))
        assert not backend.ready and engine.names()[-1] == "collective_rpc"  # stopped, never resumed

    run(scenario())
