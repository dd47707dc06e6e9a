"""vLLM backend, LoRA adapter versions: our calls checked against vLLM's signatures with a stand-in engine.

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
import enum
import inspect
import json
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

    def __post_init__(self):
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


class StandInOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def standin_sampling_params(*, n=1, temperature=1.0, top_p=1.0, max_tokens=16, seed=None, stop_token_ids=None,
                            ignore_eos=False, logprobs=None, detokenize=True, output_kind=None, min_tokens=0,
                            logit_bias=None):  # fmt: skip
    return SimpleNamespace(max_tokens=max_tokens)


Logprob = SimpleNamespace


class StandInAsyncLLM:
    """Records every call; generate emits one token per step until told to stop (see `step`)."""

    def __init__(self, args: StandInEngineArgs):
        self.args = args
        self.model_config = SimpleNamespace(max_model_len=64)
        self.calls: list[tuple[str, dict]] = []
        self.loras: dict[int, StandInLoRARequest] = {}
        self.steps = asyncio.Queue()

    def _record(self, method, *args, **kwargs):
        bound = inspect.signature(getattr(StandInAsyncLLM, method)).bind(self, *args, **kwargs)
        self.calls.append((method, {k: v for k, v in bound.arguments.items() if k != "self"}))

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None):
        return cls(engine_args)

    async def generate(self, prompt, sampling_params, request_id, *, prompt_text=None, lora_request=None,
                       tokenization_kwargs=None, trace_headers=None, priority=0, data_parallel_rank=None):  # fmt: skip
        self._record("generate", prompt, sampling_params, request_id, lora_request=lora_request)
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            raise AssertionError("a request named an adapter vLLM was never given")
        for i in range(sampling_params.max_tokens):
            await self.steps.get()
            last = i == sampling_params.max_tokens - 1
            token = 10 + i
            yield SimpleNamespace(
                finished=last,
                outputs=[SimpleNamespace(token_ids=[token], logprobs=[{token: Logprob(logprob=-0.5, rank=1)}],
                                         finish_reason="length" if last else None)],
            )  # fmt: skip

    async def add_lora(self, lora_request) -> bool:
        self._record("add_lora", lora_request)
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id) -> bool:
        self._record("remove_lora", lora_id)
        return self.loras.pop(lora_id, None) is not None

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


@pytest.fixture
def standin_vllm(monkeypatch):
    """Install the stand-ins as the `vllm` modules the backend imports."""
    modules = {
        "vllm": {"AsyncEngineArgs": StandInEngineArgs, "SamplingParams": standin_sampling_params},
        "vllm.sampling_params": {"RequestOutputKind": StandInOutputKind},
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


# ---- the mapping -------------------------------------------------------------------------------------
def test_adapter_versions_become_lora_requests_with_a_new_id_each(standin_vllm, tiny_model, tmp_path):
    from gyre_inference.vllm_backend import VLLMBackend

    v1, v2 = adapter_folder(tmp_path, "step_1"), adapter_folder(tmp_path, "step_2")

    async def scenario():
        backend = VLLMBackend(tiny_model, max_lora_rank=16, max_loras=2)
        await backend.start()
        engine = backend._engine
        args = engine.args
        assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, 16, 2)

        await backend.update_weights(v1, 1)
        first = engine.calls[-1][1]["lora_request"]
        assert engine.names() == ["add_lora"]  # no pause, no weight reload: vLLM applies the adapter per request
        assert (first.lora_int_id, first.lora_path) == (1, str(v1)) and backend.version == 1

        params = SamplingParams(max_tokens=4, temperature=1.0)
        early = backend.generate([1, 2, 3], params)
        engine.steps.put_nowait(None)
        events = [await early.__anext__()]
        assert engine.calls[-1][1]["lora_request"] is first

        await backend.update_weights(v2, 2)
        second = engine.calls[-1][1]["lora_request"]
        assert second.lora_int_id == 2 and second.lora_path == str(v2) and second.lora_name != first.lora_name
        late = backend.generate([4, 5], params)
        for _ in range(8):
            engine.steps.put_nowait(None)
        events += [e async for e in early]
        late_events = [e async for e in late]
        assert engine.calls[-1][1]["lora_request"] is second
        # a request keeps the adapter it started with to the end, and its tokens say so
        assert [e.version for e in events] == [1, 1, 1, 1] and {e.version for e in late_events} == {2}

        # a full-weights version: requests go without an adapter; the next adapter first brings back the base
        full = tmp_path / "step_3"
        shutil.copytree(tiny_model, full)
        await backend.update_weights(full, 3)
        generate = backend.generate([1], SamplingParams(max_tokens=1))
        engine.steps.put_nowait(None)
        assert [e.version async for e in generate] == [3] and engine.calls[-1][1]["lora_request"] is None
        del engine.calls[:]
        await backend.update_weights(v1, 4)
        rpc = [c for name, c in engine.calls if name == "collective_rpc"]
        assert [c["args"] for c in rpc] == [(str(tiny_model),)], "the base is reloaded under the adapter"
        assert engine.calls[-1][1]["lora_request"].lora_int_id == 3  # a re-served folder still gets a new id
        await backend.shutdown()

    run(scenario())


def test_adapters_need_lora_enabled_and_a_rank_that_fits(standin_vllm, tiny_model, tmp_path):
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        plain = VLLMBackend(tiny_model)
        await plain.start()
        assert plain._engine.args.enable_lora is False
        with pytest.raises(WeightsIncompatibleError, match="engine.max_lora_rank"):
            await plain.update_weights(adapter_folder(tmp_path, "a"), 1)
        small = VLLMBackend(tiny_model, max_lora_rank=8)
        await small.start()
        with pytest.raises(WeightsIncompatibleError, match="rank 16 exceeds engine.max_lora_rank 8"):
            await small.update_weights(adapter_folder(tmp_path, "b", rank=16), 1)
        broken = adapter_folder(tmp_path, "c")
        (broken / ADAPTER_CONFIG).write_text('{"r": 0, "lora_alpha": 1}')
        with pytest.raises(WeightsIncompatibleError, match="not a usable LoRA adapter"):
            await small.update_weights(broken, 1)
        assert small._engine.calls == [] and small.version == 0  # nothing reached the engine

    run(scenario())


def test_lora_engine_settings_come_from_config():
    from gyre_inference.service import make_backend

    config = InferenceConfig(backend="vllm", engine={"max_lora_rank": 32, "max_loras": 3})
    backend = make_backend(config)
    assert backend._engine_kwargs | {"enable_lora": True, "max_lora_rank": 32, "max_loras": 3} == backend._engine_kwargs
    assert "enable_lora" not in make_backend(InferenceConfig(backend="vllm"))._engine_kwargs
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        InferenceConfig(engine={"max_lora_rank": 12})


def test_stand_ins_match_vllm():
    """Where vllm imports: the stand-ins' signatures are vLLM's own (runs on a GPU machine)."""
    vllm = pytest.importorskip("vllm")
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_fields = set(inspect.signature(vllm.AsyncEngineArgs).parameters)
    assert {f.name for f in fields(StandInEngineArgs)} <= engine_fields
    for method in ("generate", "add_lora", "remove_lora", "pause_generation", "collective_rpc", "reset_prefix_cache"):
        real = inspect.signature(getattr(AsyncLLM, method)).parameters
        ours = inspect.signature(getattr(StandInAsyncLLM, method)).parameters
        for name, param in ours.items():
            assert name in real and real[name].kind == param.kind, (method, name)
    request = LoRARequest(lora_name="gyre-1-step_1", lora_int_id=1, lora_path="/weights/step_1")
    assert (request.lora_int_id, request.lora_path) == (1, "/weights/step_1")
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:
        return
    assert tuple(typing.get_args(MaxLoRARanks)) == VLLM_LORA_RANKS
