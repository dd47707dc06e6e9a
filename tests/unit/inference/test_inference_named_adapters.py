"""Named adapters on the torch backend (multi-run): each adapter name samples with exactly its adapter,
rows of several adapters and of the base share batches, versions are per name, bad adapters are refused
and the base model's weights are never touched."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import pytest
import pytest_asyncio
import torch
from gyre.transport import FetchedWeights
from gyre_inference.backend import AdapterGoneError, SamplingParams, WeightsIncompatibleError
from gyre_inference.torch_backend import TorchBackend
from test_inference_lora_adapter import PROMPT, reference_logprobs, write_adapter


@pytest_asyncio.fixture
async def backend(tiny_model):
    engine = TorchBackend(tiny_model, threads=1, max_batch_size=8, max_adapters=2, max_lora_rank=4, adapters=("a",))
    await engine.start()
    yield engine
    await engine.shutdown()


async def sample(engine, adapter, seed=3, n=10):
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=seed, adapter=adapter)
    events = [e async for e in engine.generate(PROMPT, params)]
    return [e.token_id for e in events], torch.tensor([e.logprob for e in events]), {e.version for e in events}


@pytest.mark.asyncio
async def test_each_name_samples_with_its_own_adapter_also_in_mixed_batches(backend, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    base_before = {k: v.clone() for k, v in backend._model.state_dict().items()}
    base_tokens, _, _ = await sample(backend, None)
    assert (await sample(backend, "a"))[0] == base_tokens  # declared, no version yet: the base
    models = {"a": write_adapter(tiny_model, tmp_path / "a", seed=1), "b": write_adapter(tiny_model, tmp_path / "b", 2)}
    await backend.update_adapter("a", FetchedWeights.local(tmp_path / "a", 5))
    await backend.update_adapter("b", FetchedWeights.local(tmp_path / "b", 7))  # a new name takes the free slot
    assert set(backend.adapter_names) == {"a", "b"}
    assert (backend.adapter_version("a"), backend.adapter_version("b"), backend.version) == (5, 7, 0)

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    alone = {}
    for name, reference in [(None, base), *models.items()]:
        tokens, logprobs, versions = await sample(backend, name)
        assert torch.allclose(logprobs, reference_logprobs(reference, tokens), atol=1e-4), name
        assert versions == {0 if name is None else backend.adapter_version(name)}
        alone[name] = tokens, logprobs
    assert alone["a"][0] != alone["b"][0] or not torch.equal(alone["a"][1], alone["b"][1])

    mixed = await asyncio.gather(*(sample(backend, name) for name in [None, "a", "b"] * 2))
    for name, (tokens, logprobs, _) in zip([None, "a", "b"] * 2, mixed, strict=True):
        assert tokens == alone[name][0], name
        assert torch.allclose(logprobs, alone[name][1], atol=1e-5), name
    for key, value in backend._model.state_dict().items():
        assert torch.equal(value, base_before[key]), f"base weight {key} changed"


@pytest.mark.asyncio
async def test_bad_adapters_and_names_are_refused(backend, tiny_model, tmp_path):
    with pytest.raises(KeyError, match="nope"):
        await sample(backend, "nope")
    big = tmp_path / "big"
    write_adapter(tiny_model, big, seed=1)
    small = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=2)
    await small.start()
    try:
        with pytest.raises(WeightsIncompatibleError, match="max_rank"):
            await small.update_adapter("x", FetchedWeights.local(big, 1))
        assert small.adapter_names == ()  # nothing changed
    finally:
        await small.shutdown()
    plain = TorchBackend(tiny_model, threads=1, max_batch_size=2)
    await plain.start()
    try:
        with pytest.raises(WeightsIncompatibleError, match="lora.max_loras"):
            await plain.update_adapter("a", FetchedWeights.local(big, 1))
    finally:
        await plain.shutdown()


@pytest.mark.asyncio
async def test_the_bank_stays_bounded_evicting_the_least_recently_used_idle_name_and_loads_it_back(
    tiny_model, tmp_path
):
    """Three runs' adapters, two slots: a new name evicts the least recently used name no queued or running
    row uses; a request for an evicted name loads it back from its folder (same samples, same version); an
    evicted name whose folder is gone is refused by name (404) and forgotten."""
    engine = TorchBackend(tiny_model, threads=1, max_batch_size=8, max_adapters=2, max_lora_rank=4)
    await engine.start()
    try:
        stacks = [a.shape for a, _ in engine._bank.layers.values()]
        models = {name: write_adapter(tiny_model, tmp_path / name, seed=i + 1) for i, name in enumerate("abc")}
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 3))
        await engine.update_adapter("b", FetchedWeights.local(tmp_path / "b", 4))
        alone = {name: await sample(engine, name, n=30) for name in "ab"}  # b used last, a least recently

        running = engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=3, adapter="a"))
        first = await running.__anext__()
        await sample(engine, "b", n=1)  # b used last: a is the least recently used, but its row is running
        await engine.update_adapter("c", FetchedWeights.local(tmp_path / "c", 5))  # so b, idle, is the one evicted
        assert set(engine._bank.slots) == {"a", "c"}
        rest = [e async for e in running]
        assert [first.token_id] + [e.token_id for e in rest] == alone["a"][0]  # a's row kept its adapter

        assert [a.shape for a, _ in engine._bank.layers.values()] == stacks  # bounded: no slot was added
        assert set(engine.adapter_names) == {"a", "b", "c"} and engine.adapter_version("b") == 4
        tokens, logprobs, versions = await sample(engine, "b", n=30)  # loaded back, evicting a (now idle, LRU)
        assert tokens == alone["b"][0] and torch.allclose(logprobs, alone["b"][1], atol=1e-6) and versions == {4}
        assert set(engine._bank.slots) == {"b", "c"}
        tokens, logprobs, _ = await sample(engine, "c")
        assert torch.allclose(logprobs, reference_logprobs(models["c"], tokens), atol=1e-4)

        shutil.rmtree(tmp_path / "a")  # e.g. pruned: a cannot come back
        with pytest.raises(AdapterGoneError, match="'a' was evicted and cannot be loaded back"):
            await sample(engine, "a")
        assert "a" not in engine.adapter_names
    finally:
        await engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.asyncio
async def test_cuda_graphs_with_adapters_give_the_same_tokens_as_eager(tiny_model, tmp_path):
    write_adapter(tiny_model, tmp_path / "a", seed=1)

    async def tokens(cuda_graphs: bool):
        engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8, cuda_graphs=cuda_graphs,
                              max_adapters=1, max_lora_rank=4)  # fmt: skip
        await engine.start()
        try:
            await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 1))
            runs = await asyncio.gather(*(sample(engine, name, seed=i, n=40) for i, name in enumerate([None, "a"] * 3)))
            return [r[0] for r in runs], engine._runner.cuda_graphs
        finally:
            await engine.shutdown()

    eager, graphs = await tokens(False), await tokens(True)
    assert graphs[1] and not eager[1]
    assert graphs[0] == eager[0]


@pytest.mark.asyncio
async def test_an_evicted_name_whose_folder_is_gone_gets_the_unknown_model_404_over_http(tiny_model, tmp_path):
    """Through the real HTTP app and the openai client: a name found gone only while generating (evicted, folder
    removed) gets the same 404 body as a name never served, streamed or not, and is forgotten."""
    import httpx
    import openai
    from http_app import serve_app

    async def three_names_two_gone(engine):
        for step, name in enumerate("abc", start=1):  # one slot: b evicts a, c evicts b
            write_adapter(tiny_model, tmp_path / name, seed=step)
            await engine.update_adapter(name, FetchedWeights.local(tmp_path / name, step))
        shutil.rmtree(tmp_path / "a")
        shutil.rmtree(tmp_path / "b")

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4)
    async with serve_app(engine, tiny_model, "gone-adapter", three_names_two_gone) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
            with pytest.raises(openai.NotFoundError) as never:
                await client.completions.create(model="z", prompt=[5], max_tokens=1)
            with pytest.raises(openai.NotFoundError) as gone:
                await client.completions.create(model="a", prompt=[5], max_tokens=2)
            with pytest.raises(openai.NotFoundError) as again:  # forgotten: refused before generating
                await client.completions.create(model="a", prompt=[5], max_tokens=2)
            served = await client.completions.create(model="c", prompt=[5], max_tokens=2)
        async with httpx.AsyncClient(timeout=30) as raw:
            text = (await raw.get(url.removesuffix("/v1") + "/metrics")).text
        async with httpx.AsyncClient(base_url=url, timeout=30) as raw:  # streamed: the error event carries the 404
            body = {"model": "b", "prompt": [5], "max_tokens": 2, "stream": True}
            response = await raw.post("/completions", json=body)
            events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data:")]
    expected = {**never.value.body, "message": never.value.body["message"].replace("`z`", "`{}`")}
    assert gone.value.body == {**expected, "message": expected["message"].format("a")}
    assert again.value.body == gone.value.body and gone.value.body["code"] == "model_not_found"
    assert served.model == "c" and len(served.choices[0].text) > 0
    from prometheus_client.parser import text_string_to_metric_families

    refused = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "gyre_inference_requests_total" and s.labels["outcome"] == "client_error")  # fmt: skip
    assert refused == 3  # each 404 counted once (the one found gone while generating was counted twice)
    assert response.status_code == 200 and "b" not in engine.adapter_names and set(engine.adapter_names) == {"c"}
    assert json.loads(events[-1])["error"] == {**expected, "message": expected["message"].format("b")}


@pytest.mark.asyncio
async def test_a_named_adapter_s_responses_carry_its_own_version_streamed_or_not(tiny_model, tmp_path):
    """x-gyre-policy-version of a request for adapter `a` is `a`'s version (5 here, the base serves 0). A stream's
    header carried the base model's version."""
    import httpx
    import openai
    from http_app import serve_app

    async def load_a(engine):
        write_adapter(tiny_model, tmp_path / "a", seed=1)
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 5))

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4)
    async with serve_app(engine, tiny_model, "adapter-version", load_a) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
            plain = await client.completions.with_raw_response.create(model="a", prompt=[5], max_tokens=2)
            base = await client.completions.with_raw_response.create(model="tiny", prompt=[5], max_tokens=2)
        async with httpx.AsyncClient(base_url=url, timeout=30) as raw:
            body = {"model": "a", "prompt": [5], "max_tokens": 2, "stream": True}
            streamed = await raw.post("/completions", json=body)
    assert plain.headers["x-gyre-policy-version"] == "5" and plain.parse().choices[0].model_extra["policy_version"] == 5
    assert base.headers["x-gyre-policy-version"] == "0"
    assert streamed.status_code == 200 and streamed.headers["x-gyre-policy-version"] == "5"


@pytest.mark.asyncio
async def test_every_model_card_carries_the_context_window_and_an_adapter_s_overlong_request_is_vllm_s_400(
    tiny_model, tmp_path
):
    """What an agent client reads through the openai SDK: vLLM's max_model_len on the base card and on a named
    adapter's (listed and retrieved), and for a prompt + max_tokens over it the 400 vLLM answers, naming the limit."""
    import openai
    from http_app import serve_app

    async def load_a(engine):
        write_adapter(tiny_model, tmp_path / "a", seed=1)
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 2))

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4, max_model_len=64)
    async with (
        serve_app(engine, tiny_model, "adapter-cards", load_a) as url,
        openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client,
    ):
        cards = {card.id: card.model_extra for card in (await client.models.list()).data}
        retrieved = (await client.models.retrieve("a")).model_extra
        with pytest.raises(openai.BadRequestError) as overlong:
            await client.completions.create(model="a", prompt=[5] * 60, max_tokens=10)
        fits = await client.completions.create(model="a", prompt=[5] * 54, max_tokens=10)
    assert {name: card["max_model_len"] for name, card in cards.items()} == {"tiny": 64, "a": 64}
    assert cards["a"]["parent"] == "tiny" and retrieved["max_model_len"] == 64
    body = overlong.value.body
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt")
    assert "maximum context length is 64 tokens" in body["message"] and "70" in body["message"], body
    assert fits.usage.completion_tokens <= 10


@pytest.mark.asyncio
async def test_metrics_of_a_named_adapter_s_requests_carry_its_run(tiny_model, tmp_path):
    """Multi-run: one replica serves every run's adapter under the run's name, so the series of a request for
    adapter `a` and `a`'s served version carry run_id="a" and the model's own keep the replica's run_id (before,
    every series carried the replica's: no run could be told apart on the inference dashboard)."""
    import httpx
    import openai
    from http_app import serve_app
    from prometheus_client.parser import text_string_to_metric_families

    async def load_a(engine):
        write_adapter(tiny_model, tmp_path / "a", seed=1)
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 5))

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=2, max_adapters=1, max_lora_rank=4)
    async with serve_app(engine, tiny_model, "exp", load_a) as url:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
            for model in ("a", "a", "tiny"):
                await client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2)
        async with httpx.AsyncClient(timeout=30) as raw:
            text = (await raw.get(url.removesuffix("/v1") + "/metrics")).text
    samples = {
        (s.name, s.labels.get("run_id"), s.labels.get("outcome"), s.labels.get("endpoint")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("gyre_inference_requests_total", "a", "success", "completions")] == 2
    assert samples[("gyre_inference_requests_total", "exp", "success", "completions")] == 1
    assert samples[("gyre_inference_requests_total", "a", "server_error", "completions")] == 0  # zeros for ratios
    assert samples[("gyre_inference_prompt_tokens_total", "a", None, None)] == 6
    assert samples[("gyre_inference_prompt_tokens_total", "exp", None, None)] == 3
    assert samples[("gyre_inference_time_to_first_token_seconds_count", "a", None, None)] == 2
    assert samples[("gyre_inference_policy_version", "a", None, None)] == 5
    assert samples[("gyre_inference_policy_version", "exp", None, None)] == 0
    assert {run for name, run, _, _ in samples if name == "gyre_inference_running_requests"} == {"exp"}


@pytest.mark.asyncio
async def test_a_request_for_an_evicted_name_waits_while_every_slot_is_busy(tiny_model, tmp_path, caplog):
    """One slot, held by b's running request: a request for evicted a waits until b's ends, then a is loaded back
    (vLLM's scheduler queues a request whose adapter does not fit max_loras). It failed at once (a 500 over HTTP).
    A waiting request that is cancelled leaves nothing behind."""
    caplog.set_level(logging.INFO, logger="gyre_inference.torch_backend")
    engine = TorchBackend(tiny_model, threads=1, max_batch_size=4, max_adapters=1, max_lora_rank=4)
    await engine.start()
    try:
        for step, name in enumerate("ab", start=1):
            write_adapter(tiny_model, tmp_path / name, seed=step)
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 1))
        alone = await sample(engine, "a")
        await engine.update_adapter("b", FetchedWeights.local(tmp_path / "b", 2))  # evicts a
        running = engine.generate(PROMPT, SamplingParams(max_tokens=400, temperature=1.0, seed=3, adapter="b"))
        await running.__anext__()
        waiting = asyncio.create_task(sample(engine, "a"))
        gives_up = asyncio.create_task(sample(engine, "a", seed=4))
        await asyncio.sleep(0.2)
        assert not waiting.done() and not gives_up.done() and set(engine._bank.slots) == {"b"}
        assert engine.load_stats() == (1, 2)  # the two wait as queued requests do
        write_adapter(tiny_model, tmp_path / "c", seed=3)
        with pytest.raises(WeightsIncompatibleError, match="slots are in use"):  # an update does not wait: refused
            await engine.update_adapter("c", FetchedWeights.local(tmp_path / "c", 1))
        gives_up.cancel()
        rest = [e async for e in running]
        assert rest[-1].finish_reason == "length" and {e.version for e in rest} == {2}
        tokens, logprobs, versions = await asyncio.wait_for(waiting, 60)
        assert tokens == alone[0] and torch.allclose(logprobs, alone[1], atol=1e-6) and versions == {1}
        with pytest.raises(asyncio.CancelledError):
            await gives_up
        assert set(engine._bank.slots) == {"a"} and not engine._waiting
        # one load back, logged once (each try that found the slot busy said "loading ... back" too)
        assert caplog.text.count("evicted adapter 'a' back") == 1, caplog.text
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_a_name_gets_its_slot_only_once_its_swap_filled_it(tiny_model, tmp_path):
    """One slot, held by a. The swap of new name c (then the load back of evicted a) fails in the engine after its slot
    was found and before its tensors were copied in: the name must not own the slot. Before, the slot was given to the
    name when found, so c (then a) was served from a slot still holding the other adapter's weights, under its own
    name and version."""
    engine = TorchBackend(tiny_model, threads=1, max_batch_size=4, max_adapters=1, max_lora_rank=4)
    await engine.start()
    try:
        models = {name: write_adapter(tiny_model, tmp_path / name, seed=i + 1) for i, name in enumerate("ac")}
        await engine.update_adapter("a", FetchedWeights.local(tmp_path / "a", 1))
        apply = engine._apply_swap

        def fails(swap):  # e.g. CUDA out of memory while copying, or a failed step drained before the swap
            raise RuntimeError("copy failed")

        engine._apply_swap = fails
        with pytest.raises(RuntimeError, match="copy failed"):
            await engine.update_adapter("c", FetchedWeights.local(tmp_path / "c", 2))
        assert "c" not in engine.adapter_names and "c" not in engine._bank.slots
        with pytest.raises(KeyError, match="'c'"):  # never served: a 404, not a's weights under c's name
            await sample(engine, "c")
        with pytest.raises(RuntimeError, match="copy failed"):  # a was evicted for c: its load back fails too
            await sample(engine, "a")
        assert engine._bank.slots == {}
        engine._apply_swap = apply
        for name, version in (("a", 1), ("c", None)):
            if version is None:
                await engine.update_adapter("c", FetchedWeights.local(tmp_path / "c", 2))
            tokens, logprobs, versions = await sample(engine, name)
            assert torch.allclose(logprobs, reference_logprobs(models[name], tokens), atol=1e-4), name
            assert versions == {engine.adapter_version(name)}
    finally:
        await engine.shutdown()
