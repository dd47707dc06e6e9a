"""vLLM's runtime LoRA routes (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`) through the real HTTP app on
the torch backend and the tiny model: load, list, sample, unload; every bad load a 4xx naming the field; a load or an
unload never disturbs queued or running requests; off by default; an operator action behind the control token."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import peft
import pytest
import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, adapter_tensors
from gyre_inference.backend import SamplingParams
from gyre_inference.lora_routes import runtime_updates_from_env
from gyre_inference.torch_backend import TorchBackend
from http_app import serve_app
from test_inference_lora_adapter import PROMPT, TARGETS, reference_logprobs, write_adapter


def engine(tiny_model, slots: int = 2, rank: int = 4) -> TorchBackend:
    return TorchBackend(tiny_model, threads=1, max_batch_size=4, max_adapters=slots, max_lora_rank=rank)


def root(url: str) -> str:
    return url.removesuffix("/v1")


async def post(url: str, route: str, body: dict, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=60) as raw:
        return await raw.post(root(url) + route, json=body, headers=headers)


async def load(url: str, name: str, path, token: str | None = None) -> httpx.Response:
    return await post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, token)


async def unload(url: str, name: str, token: str | None = None) -> httpx.Response:
    return await post(url, "/v1/unload_lora_adapter", {"lora_name": name}, token)


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


async def model_ids(url: str) -> list[str]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        return [card.id for card in (await client.models.list()).data]


def adapter_of_rank(tiny_model, folder, rank: int) -> None:
    """A PEFT adapter folder of `rank` (write_adapter's are rank 4)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in adapter_tensors(model.state_dict()).items()}, folder / ADAPTER_FILE)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(rank, rank, 0.0, TARGETS, str(tiny_model))))


def adapter_of_another_model(tiny_model, folder) -> None:
    """An adapter of a wider model: lora_A takes 8 more inputs, and its config names that model."""
    from safetensors.torch import load_file, save_file

    write_adapter(tiny_model, folder, seed=9)
    tensors = load_file(folder / ADAPTER_FILE)
    wider = {k: torch.cat([v, torch.zeros(v.shape[0], 8)], 1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(wider, folder / ADAPTER_FILE)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": "someone/wider-model"}))


LONG = (
    1000  # tokens of a request that is to run while adapters are loaded and unloaded (the tiny model's context: 1024)
)


async def sample(backend, adapter, n=30):
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=3, adapter=adapter)
    events = [e async for e in backend.generate(PROMPT, params)]
    return [e.token_id for e in events], torch.tensor([e.logprob for e in events])


@pytest.mark.asyncio
async def test_a_loaded_adapter_is_listed_and_served_until_unloaded(tiny_model, tmp_path):
    model_a = write_adapter(tiny_model, tmp_path / "a", seed=1)
    backend = engine(tiny_model)
    async with serve_app(backend, tiny_model, "runtime-lora", runtime_lora=True) as url:
        assert await model_ids(url) == ["tiny"]
        response = await load(url, "a", tmp_path / "a")
        assert response.status_code == 200 and response.text == "Success: LoRA adapter 'a' added successfully."
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            cards = {card.id: card for card in (await client.models.list()).data}
            assert list(cards) == ["tiny", "a"] and cards["a"].parent == "tiny"
            served = await client.completions.create(model="a", prompt=PROMPT, max_tokens=3)
            assert served.model == "a" and served.usage.completion_tokens == 3
            tokens, logprobs = await sample(backend, "a")  # exactly a's adapter
            assert torch.allclose(logprobs, reference_logprobs(model_a, tokens), atol=1e-4)

            response = await unload(url, "a")
            assert response.status_code == 200 and response.text == "Success: LoRA adapter 'a' removed successfully."
            assert [card.id for card in (await client.models.list()).data] == ["tiny"]
            with pytest.raises(openai.NotFoundError) as gone:
                await client.completions.create(model="a", prompt=PROMPT, max_tokens=3)
            assert gone.value.body["code"] == "model_not_found"
        again = error(await unload(url, "a"), 404)
        assert again == {"message": "The lora adapter 'a' cannot be found.", "type": "not_found_error",
                         "param": "lora_name", "code": "model_not_found"}  # fmt: skip
        assert (await load(url, "a", tmp_path / "a")).status_code == 200  # the name can be loaded again
        assert await model_ids(url) == ["tiny", "a"]


@pytest.mark.asyncio
async def test_bad_loads_get_a_4xx_naming_the_field_and_change_nothing(tiny_model, tmp_path):
    write_adapter(tiny_model, tmp_path / "a", seed=1)
    adapter_of_rank(tiny_model, tmp_path / "rank8", 8)
    adapter_of_another_model(tiny_model, tmp_path / "wider")
    (tmp_path / "empty").mkdir()
    async with serve_app(engine(tiny_model, slots=1), tiny_model, "runtime-lora", runtime_lora=True) as url:
        assert error(await post(url, "/v1/load_lora_adapter", {"lora_path": "x"}), 400)["param"] == "lora_name"
        assert error(await post(url, "/v1/load_lora_adapter", {"lora_name": "x"}), 400)["param"] == "lora_path"
        assert error(await load(url, " ", tmp_path / "a"), 400)["param"] == "lora_name"
        assert error(await load(url, "x", ""), 400)["param"] == "lora_path"
        assert error(await load(url, "tiny", tmp_path / "a"), 400)["param"] == "lora_name"  # the model's own id
        missing = error(await load(url, "x", tmp_path / "nope"), 404)
        assert missing["param"] == "lora_path" and "no such folder" in missing["message"]
        empty = error(await load(url, "x", tmp_path / "empty"), 400)
        assert empty["param"] == "lora_path" and "not a usable LoRA adapter" in empty["message"]
        rank = error(await load(url, "x", tmp_path / "rank8"), 400)
        assert rank["param"] == "lora_path" and "rank 8 exceeds lora.max_rank 4" in rank["message"]
        other = error(await load(url, "x", tmp_path / "wider"), 400)
        assert other["param"] == "lora_path" and "does not fit the model" in other["message"]
        assert "trained on base model 'someone/wider-model'" in other["message"]
        assert await model_ids(url) == ["tiny"]  # nothing was served by any of them

        assert (await load(url, "a", tmp_path / "a")).status_code == 200
        duplicate = error(await load(url, "a", tmp_path / "rank8"), 400)
        expected = {"message": "The lora adapter 'a' has already been loaded.", "type": "invalid_request_error"}
        assert duplicate == {**expected, "param": "lora_name", "code": "adapter_exists"}
        assert error(await unload(url, "tiny"), 400)["param"] == "lora_name"
        assert error(await post(url, "/v1/unload_lora_adapter", {}), 400)["param"] == "lora_name"
        assert await model_ids(url) == ["tiny", "a"]


@pytest.mark.asyncio
async def test_loads_and_unloads_never_disturb_queued_or_running_requests(tiny_model, tmp_path):
    """Two slots. b is loaded while a request of a runs; with both slots running requests, c is refused (409 naming
    lora.max_loras), also right after a is unloaded: a's running request still computes with a's slot, which is only
    reused once it is done. Every request gives exactly the tokens it gives alone."""
    models = {name: write_adapter(tiny_model, tmp_path / name, seed=i + 1) for i, name in enumerate("abc")}
    backend = engine(tiny_model, slots=2)
    async with serve_app(backend, tiny_model, "runtime-lora", runtime_lora=True) as url:
        assert (await load(url, "a", tmp_path / "a")).status_code == 200
        alone = await sample(backend, "a", n=LONG)

        def start(name):  # the engine generates on whether or not the tokens are read: long enough to outlast the calls
            return backend.generate(PROMPT, SamplingParams(max_tokens=LONG, temperature=1.0, seed=3, adapter=name))

        running_a = start("a")
        first_a = await running_a.__anext__()
        assert (await load(url, "b", tmp_path / "b")).status_code == 200
        running_b = start("b")
        first_b = await running_b.__anext__()
        busy = error(await load(url, "c", tmp_path / "c"), 409)
        assert busy["code"] == "adapter_slots_busy" and busy["param"] == "lora_name"
        assert "lora.max_loras" in busy["message"]
        assert (await unload(url, "a")).status_code == 200
        assert error(await load(url, "c", tmp_path / "c"), 409)["code"] == "adapter_slots_busy"  # a's row runs on

        tokens_a = [first_a.token_id] + [e.token_id async for e in running_a]
        tokens_b = [first_b.token_id] + [e.token_id async for e in running_b]
        assert tokens_a == alone[0]
        assert tokens_b == (await sample(backend, "b", n=LONG))[0]
        assert (await load(url, "c", tmp_path / "c")).status_code == 200  # a's slot is free now
        assert await model_ids(url) == ["tiny", "b", "c"]
        tokens, logprobs = await sample(backend, "c")
        assert torch.allclose(logprobs, reference_logprobs(models["c"], tokens), atol=1e-4)


@pytest.mark.asyncio
async def test_the_routes_are_off_by_default_and_need_the_control_token(tiny_model, tmp_path):
    async with serve_app(engine(tiny_model, slots=1), tiny_model, "runtime-lora") as url:
        assert (await unload(url, "a")).status_code == 404  # no such route
        assert error(await load(url, "a", tmp_path), 404)["code"] is None
    state = {"runtime_lora": True, "api_key": "client-key", "control_token": "operator-token"}
    async with serve_app(engine(tiny_model, slots=1), tiny_model, "runtime-lora", **state) as url:
        refused = error(await unload(url, "a", "client-key"), 401)
        assert "control token" in refused["message"] and refused["code"] == "invalid_api_key"
        assert error(await unload(url, "a"), 401)["code"] == "invalid_api_key"
        assert error(await unload(url, "a", "operator-token"), 404)["param"] == "lora_name"  # past the gate
        async with httpx.AsyncClient(timeout=60) as raw:  # the control token is no API key
            assert (
                await raw.get(url + "/models", headers={"Authorization": "Bearer operator-token"})
            ).status_code == 401
    async with serve_app(engine(tiny_model, slots=1), tiny_model, "runtime-lora", runtime_lora=True,
                         api_key="client-key") as url:  # fmt: skip
        assert error(await unload(url, "a"), 401)["code"] == "invalid_api_key"
        assert error(await unload(url, "a", "client-key"), 404)["param"] == "lora_name"  # no token: the API key


def test_vllm_s_env_var_turns_the_routes_on_and_a_value_it_would_read_as_off_is_refused():
    from gyre.config.inference import InferenceLoraConfig
    from pydantic import ValidationError

    var = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
    assert [runtime_updates_from_env({var: value}) for value in ("True", "1", " true ")] == [True] * 3
    assert [runtime_updates_from_env(env) for env in ({}, {var: ""}, {var: "0"}, {var: "False"})] == [False] * 4
    with pytest.raises(ValueError, match=f"{var}='yes': use true or 1"):
        runtime_updates_from_env({var: "yes"})
    with pytest.raises(ValidationError, match="runtime_updates = true needs max_loras >= 1"):
        InferenceLoraConfig(runtime_updates=True)
    assert InferenceLoraConfig(runtime_updates=True, max_loras=1).runtime_updates


@pytest.mark.asyncio
async def test_a_request_for_an_evicted_name_waits_for_an_unloaded_name_s_rows_without_spinning(tiny_model, tmp_path):
    """One slot: b evicted a; b is unloaded while its request runs. A request for a waits until that request ends (the
    slot still computes b), checking every SLOT_WAIT_SECONDS, not loading a again and again meanwhile."""
    for i, name in enumerate("ab"):
        write_adapter(tiny_model, tmp_path / name, seed=i + 1)
    backend = engine(tiny_model, slots=1)
    async with serve_app(backend, tiny_model, "runtime-lora", runtime_lora=True) as url:
        assert (await load(url, "a", tmp_path / "a")).status_code == 200
        alone_a = await sample(backend, "a")
        assert (await load(url, "b", tmp_path / "b")).status_code == 200  # evicts a (idle): loaded back on demand
        alone_b = await sample(backend, "b", n=LONG)
        running_b = backend.generate(PROMPT, SamplingParams(max_tokens=LONG, temperature=1.0, seed=3, adapter="b"))
        first_b = await running_b.__anext__()
        assert (await unload(url, "b")).status_code == 200
        tries = 0
        read = backend._bank.read

        def counted(path):
            nonlocal tries
            tries += 1
            return read(path)

        backend._bank.read = counted
        waiting_a = asyncio.create_task(sample(backend, "a"))
        tokens_b = [first_b.token_id] + [e.token_id async for e in running_b]
        assert tokens_b == alone_b[0]  # b's request finished on b's weights
        assert (await waiting_a)[0] == alone_a[0]
        assert tries <= 3, f"a was read {tries} times while it waited for the slot"


def test_the_openapi_document_says_what_the_routes_answer(tiny_model):
    from gyre_inference.api import AppState, create_app
    from gyre_inference.metrics import InferenceMetrics

    backend = engine(tiny_model, slots=1)  # never started: the document only
    document = create_app(AppState("tiny", "x", backend, InferenceMetrics("r", backend), runtime_lora=True)).openapi()
    load, unload = (document["paths"][f"/v1/{verb}_lora_adapter"]["post"]["responses"] for verb in ("load", "unload"))
    assert sorted(load) == ["200", "400", "401", "404", "409", "413", "415", "503"] and "409" not in unload
    assert set(load["200"]["content"]) == {"text/plain"} and "lora.max_loras" in load["409"]["description"]
    # they take the control token, not the API key, when one is set (the 401 said "API key")
    assert all("control token" in route["401"]["description"] for route in (load, unload))
    off = create_app(AppState("tiny", "x", backend, InferenceMetrics("r2", backend))).openapi()
    assert not [path for path in off["paths"] if "lora" in path]
