"""The torch engine on the tiny model: log-probs, seeds, continuous batching, cancellation, weight swaps."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gyre.transport import FetchedWeights
from gyre_inference.backend import SamplingParams, WeightsIncompatibleError
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio


def _reference_logprobs(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def _run(backend, prompt, **params):
    events = [e async for e in backend.generate(prompt, SamplingParams(**params))]
    return [e.token_id for e in events], [e.logprob for e in events], events


PROMPTS = [[1, 705, 201, 74, 75, 2, 201, 1, 739, 201], [5, 6], list(range(10, 60)), [300, 301, 302, 303]]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
async def test_logprobs_match_an_independent_forward_pass(backend, reference, temperature, top_p):
    # concurrent prompts of different lengths: left padding, merging and trimming are all exercised
    runs = await asyncio.gather(
        *(
            _run(backend, p, max_tokens=12 + 3 * i, temperature=temperature, top_p=top_p, seed=i)
            for i, p in enumerate(PROMPTS)
        )
    )
    for prompt, (tokens, logprobs, events) in zip(PROMPTS, runs, strict=True):
        assert len(tokens) == 12 + 3 * PROMPTS.index(prompt) and events[-1].finish_reason == "length"
        expected = _reference_logprobs(reference, prompt, tokens, temperature)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
        if temperature == 0:
            with torch.no_grad():
                greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                                            eos_token_id=None)  # fmt: skip
            assert tokens == greedy[0, len(prompt) :].tolist()


async def test_a_seed_gives_the_same_tokens_alone_or_in_any_batch(backend):
    alone = await _run(backend, PROMPTS[0], max_tokens=16, seed=123)

    async def late(prompt, delay, seed):
        await asyncio.sleep(delay)
        return await _run(backend, prompt, max_tokens=16, seed=seed)

    batched = await asyncio.gather(late(PROMPTS[2], 0, 1), late(PROMPTS[0], 0.05, 123), late(PROMPTS[1], 0.01, 2))
    assert batched[1][0] == alone[0]
    assert torch.allclose(torch.tensor(batched[1][1]), torch.tensor(alone[1]), atol=1e-5)
    other_seed = await _run(backend, PROMPTS[0], max_tokens=16, seed=124)
    assert other_seed[0] != alone[0]


async def test_new_sequences_join_a_running_batch_and_leave_when_closed(backend):
    first = backend.generate(PROMPTS[2], SamplingParams(max_tokens=400, seed=0))
    await first.__anext__()
    second = backend.generate(PROMPTS[0], SamplingParams(max_tokens=300, seed=0))
    await second.__anext__()  # the second sequence decodes while the first is still running

    async def running_becomes(n):
        for _ in range(200):
            if backend.load_stats() == (n, 0):
                return True
            await asyncio.sleep(0.01)
        return False

    assert await running_becomes(2)
    await second.aclose()  # closing a stream aborts its sequence: the row leaves the batch
    assert await running_becomes(1)
    await first.aclose()
    assert await running_becomes(0)


async def test_a_stop_token_ends_the_sequence_and_is_its_last_token(backend):
    tokens, _, _ = await _run(backend, PROMPTS[1], max_tokens=20, temperature=0.0)
    stop = tokens[5]
    first = tokens.index(stop)
    stop_ids = frozenset({stop})
    stopped, _, events = await _run(backend, PROMPTS[1], max_tokens=20, temperature=0.0, stop_token_ids=stop_ids)
    assert stopped == tokens[: first + 1] and events[-1].finish_reason == "stop"


async def test_logit_bias_and_min_tokens_change_the_sampled_distribution_and_its_logprobs(backend, reference):
    prompt, bias = PROMPTS[0], 2.5
    tokens, logprobs, _ = await _run(backend, prompt, max_tokens=10, temperature=0.8, seed=4, logit_bias=((7, bias),))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logits[:, 7] += bias  # the reported log-prob is that of the biased distribution, which was sampled
    expected = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
    # the stop token is (almost) certain, yet cannot come before min_tokens; then it ends the sequence
    stop = {"max_tokens": 10, "seed": 1, "logit_bias": ((9, 100.0),), "stop_token_ids": frozenset({9})}
    tokens, _, events = await _run(backend, prompt, **stop)
    assert tokens == [9] and events[-1].finish_reason == "stop"
    tokens, _, events = await _run(backend, prompt, **stop, min_tokens=4)
    assert len(tokens) == 5 and 9 not in tokens[:4] and tokens[4] == 9 and events[-1].finish_reason == "stop"


async def test_prompt_plus_completion_never_exceeds_the_context(tiny_model):
    engine = TorchBackend(tiny_model, threads=1, max_model_len=32)
    await engine.start()
    try:
        tokens, _, events = await _run(engine, list(range(3, 30)), max_tokens=100)
        assert len(tokens) == 5 and events[-1].finish_reason == "length"
    finally:
        await engine.shutdown()


def _save_perturbed(tiny_model, folder, scale=0.05, seed=1):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    return model.eval()


async def test_weight_swap_between_steps_keeps_sequences_running(backend, reference, tiny_model, tmp_path):
    new_model = _save_perturbed(tiny_model, tmp_path / "v1")
    stream = backend.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0))
    events = [await stream.__anext__() for _ in range(3)]
    await backend.update_weights(FetchedWeights.local(tmp_path / "v1", 1))
    events += [e async for e in stream]
    versions = [e.version for e in events]
    assert len(events) == 40 and versions[:3] == [0, 0, 0] and versions[-1] == 1
    assert versions == sorted(versions)  # one switch, between two steps
    assert backend.version == 1
    # a request after the swap is served entirely by the new weights
    tokens, logprobs, fresh = await _run(backend, PROMPTS[3], max_tokens=10, temperature=0.8, seed=5)
    assert {e.version for e in fresh} == {1}
    assert torch.allclose(torch.tensor(logprobs), _reference_logprobs(new_model, PROMPTS[3], tokens, 0.8), atol=1e-4)
    await backend.reload_base()
    tokens, logprobs, fresh = await _run(backend, PROMPTS[3], max_tokens=10, temperature=0.8, seed=5)
    assert backend.version == 0 and {e.version for e in fresh} == {0}
    assert torch.allclose(torch.tensor(logprobs), _reference_logprobs(reference, PROMPTS[3], tokens, 0.8), atol=1e-4)


async def test_a_swap_its_caller_gave_up_on_is_dropped_and_the_batch_keeps_running(backend, tiny_model, tmp_path):
    """An UpdateWeights cancelled (say, its deadline passed) after handing its swap to the engine thread:
    the engine skips it. Before, applying it raised InvalidStateError in the engine thread, which failed
    every sequence of the batch."""
    from gyre_inference.torch_backend import _Swap

    _save_perturbed(tiny_model, tmp_path / "v1")
    stream = backend.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0))
    events = [await stream.__anext__() for _ in range(3)]
    swap = _Swap(backend._read_weights(tmp_path / "v1"), 1)
    swap.done.cancel()  # what asyncio.wrap_future does to it when the awaiting call is cancelled
    with backend._cond:
        backend._swap = swap
        backend._cond.notify()
    events += [e async for e in stream]
    assert len(events) == 40 and events[-1].finish_reason == "length"
    assert {e.version for e in events} == {0} and backend.version == 0
    await backend.update_weights(FetchedWeights.local(tmp_path / "v1", 1))  # the next swap goes through
    assert backend.version == 1


async def test_a_retry_replaces_a_swap_its_caller_gave_up_on_before_the_engine_saw_it(backend, tiny_model, tmp_path):
    """An UpdateWeights cancelled while the engine thread was busy (a long step) leaves its swap pending; the
    orchestrator's retry must take its place. Before, the retry failed with "a weight swap is already pending"
    (INTERNAL over gRPC) until the engine's next iteration happened to drop the cancelled one."""
    from gyre_inference.torch_backend import _Swap

    _save_perturbed(tiny_model, tmp_path / "v1")
    swap = _Swap(backend._read_weights(tmp_path / "v1"), 1)
    swap.done.cancel()
    with backend._cond:  # not notified: the engine thread has not looked at it yet (it is idle, as if busy)
        backend._swap = swap
    await asyncio.wait_for(backend.update_weights(FetchedWeights.local(tmp_path / "v1", 2)), 60)
    assert backend.version == 2
    events = [e async for e in backend.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))]
    assert {e.version for e in events} == {2}


async def test_weights_that_do_not_fit_are_refused_and_the_old_ones_keep_serving(backend, tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    before = await _run(backend, PROMPTS[0], max_tokens=8, seed=9)
    good = load_file(tiny_model / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    broken = {
        "shape": {**good, name: torch.zeros(7, 3)},
        "unknown": {**good, "not.a.weight": torch.zeros(2)},
        "missing": {k: v for k, v in good.items() if k != name},
        "ints": {**good, name: torch.ones(good[name].shape, dtype=torch.int32)},  # was cast into garbage weights
    }
    (tmp_path / "empty").mkdir()
    for folder, tensors in broken.items():
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x01")
    reasons = {"empty": "no \\*.safetensors", "shape": "has shape", "unknown": "does not have", "missing": "missing",
               "garbage": "not a readable safetensors file", "ints": "is torch.int32, the model"}  # fmt: skip
    for folder, reason in reasons.items():
        with pytest.raises(WeightsIncompatibleError, match=reason):
            await backend.update_weights(FetchedWeights.local(tmp_path / folder, 7))
    assert backend.version == 0
    after = await _run(backend, PROMPTS[0], max_tokens=8, seed=9)
    assert after[:2] == before[:2]


async def test_a_failed_engine_step_is_a_500_naming_the_error_and_the_engine_serves_on(tiny_model, caplog):
    """A decode step that raises fails its sequences only: the client gets a 500 whose message carries the
    error itself (the type alone was all a client's log showed of a failure on a GPU run), the traceback
    is in the server's log, and the next request is served."""
    import openai
    from http_app import serve_app

    engine = TorchBackend(tiny_model, threads=1, max_batch_size=4)
    decode, failures = engine._decode, [RuntimeError("boom in the decode step")]

    def failing_once():
        if failures:
            raise failures.pop()
        decode()

    engine._decode = failing_once
    async with (
        serve_app(engine, tiny_model, "failing-step") as url,
        openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client,
    ):
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4)
        served = await client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4)
    assert failed.value.body["message"] == "internal error: RuntimeError: boom in the decode step"
    assert "engine step failed" in caplog.text and "boom in the decode step" in caplog.text
    assert served.usage.completion_tokens == 4


# ---- the static-cache decode step (CUDA graphs off on CPU; the gpu tests turn them on) -----------------
def _tiny_family(kind: str, folder):
    """A random 2-layer model of another family (grouped-query attention; Qwen3 adds q/k norms)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[kind]
    config = config_class(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
async def test_the_decode_step_matches_transformers_on_each_family(kind, tmp_path):
    reference = _tiny_family(kind, tmp_path)
    engine = TorchBackend(tmp_path, threads=1, max_batch_size=4, device="cpu")
    await engine.start()
    try:
        prompts = [[3, 4, 5], list(range(20, 90)), [7]]  # 70 tokens: the cache grows past its first 64 columns
        runs = await asyncio.gather(*(_run(engine, p, max_tokens=12, temperature=0.0) for p in prompts))
        for prompt, (tokens, logprobs, _) in zip(prompts, runs, strict=True):
            with torch.no_grad():
                greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert tokens == greedy[0, len(prompt) :].tolist()
            expected = _reference_logprobs(reference, prompt, tokens, 1.0)
            assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
    finally:
        await engine.shutdown()


async def test_unsupported_families_are_refused_clearly():
    from gyre_inference.model_runner import check_supported
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(ValueError, match="supports model types llama, mistral, qwen2, qwen3; this model is 'gpt2'"):
        check_supported(GPT2Config())
    with pytest.raises(ValueError, match="sliding window"):
        check_supported(Qwen2Config(use_sliding_window=True))


async def test_the_context_is_shortened_to_what_the_kv_cache_holds(tiny_model):
    # tiny preset: 4 layers x 2 x 4 kv heads x 32 x 4 bytes = 4 KiB per token; 0.5 MiB = 128 tokens = 8 blocks
    engine = TorchBackend(tiny_model, threads=1, kv_cache_gb=0.5 / 1024)
    await engine.start()
    try:
        assert engine.max_model_len == 7 * 16  # block 0 is the null block
        tokens, _, events = await _run(engine, list(range(3, 100)), max_tokens=50)
        assert len(tokens) == 7 * 16 - 97 and events[-1].finish_reason == "length"
    finally:
        await engine.shutdown()


async def test_rows_are_reused_and_the_busy_ones_stay_packed(backend):
    async def busy_becomes(expected):
        for _ in range(300):
            if [seq is not None for seq in backend._batch.rows[:3]] == expected:
                return True
            await asyncio.sleep(0.01)
        return False

    first = backend.generate(PROMPTS[0], SamplingParams(max_tokens=300, seed=0))
    second = backend.generate(PROMPTS[1], SamplingParams(max_tokens=300, seed=1))
    await first.__anext__()
    await second.__anext__()
    assert await busy_becomes([True, True, False])
    await first.aclose()
    assert await busy_becomes([False, True, False])
    assert backend._batch.inputs.ints_np[:, 0].tolist() == [0, 0, 0, 1, 0, 0]  # a freed row reads the null block
    third = backend.generate(PROMPTS[2], SamplingParams(max_tokens=300, seed=5))
    await third.__anext__()
    assert await busy_becomes([True, True, False])  # the lowest free slot
    await second.aclose()
    await third.aclose()
    assert await busy_becomes([False, False, False])


async def _together(engine, runs):
    """Start `runs` (coroutines) so the engine admits them in ONE prefill: the batch is then the same
    in every repetition, whatever the timing (the engine waits on its condition while we hold it)."""
    with engine._cond:  # re-entrant: generate() takes it again on this thread to enqueue
        tasks = [asyncio.ensure_future(run) for run in runs]
        await asyncio.sleep(0.1)
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_cuda_graphs_give_the_same_tokens_as_eager(tiny_model, dtype):
    """Greedy and seeded sampling over a batch of prompts of different lengths: the graph-captured decode
    step and the eager one produce identical tokens (and a sequence alone too)."""

    async def tokens(cuda_graphs: bool):
        engine = TorchBackend(tiny_model, device="cuda", dtype=dtype, max_batch_size=8, cuda_graphs=cuda_graphs)
        await engine.start()
        try:
            greedy = await _together(engine, [_run(engine, p, max_tokens=100, temperature=0.0) for p in PROMPTS])
            seeded = await _together(
                engine, [_run(engine, p, max_tokens=100, seed=7 + i) for i, p in enumerate(PROMPTS)]
            )
            alone = await _run(engine, PROMPTS[0], max_tokens=100, seed=7)
            return [r[0] for r in greedy], [r[0] for r in seeded], alone[0], engine._runner.cuda_graphs
        finally:
            await engine.shutdown()

    eager, graphs = await tokens(False), await tokens(True)
    assert eager[3] is False and graphs[3] is True
    assert graphs[:3] == eager[:3]
    assert graphs[1][0] != graphs[1][1]  # different prompts and seeds, different outputs: the test can fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_cuda_graph_decode_matches_transformers_greedy(tiny_model):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8)
    await engine.start()
    try:
        assert engine.cuda_graphs
        for prompt in PROMPTS:
            tokens, _, _ = await _run(engine, prompt, max_tokens=30, temperature=0.0)
            with torch.no_grad():
                greedy = reference.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=30,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert tokens == greedy[0, len(prompt) :].tolist()
    finally:
        await engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_graphs_captured_while_other_threads_use_the_gpu_keep_serving(tiny_model):
    """Graphs are captured lazily, whenever a new (rows, width) shape appears, while worker threads use
    the GPU: a weight swap or an adapter is read onto it, into fresh memory when the allocator's cache
    has none to reuse. Swapping in the same weights over and over, with fresh allocations beside them,
    while 16 shapes get captured must change nothing: the same tokens as without."""

    async def runs(engine):
        out = []
        for batch in (1, 2, 4, 8):  # rows 1..8 x widths 64..512: a capture every few steps
            out += await _together(
                engine, [_run(engine, p, max_tokens=400, seed=i) for i, p in enumerate((PROMPTS * 2)[:batch])]
            )
        return [r[0] for r in out]

    async def tokens(swapping: bool):
        # captured on first use, as the test means (by default every batch size is captured while loading)
        engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8,
                              capture_graphs_at_start=False)  # fmt: skip
        await engine.start()
        swaps, held = 0, []

        async def swap_forever():
            nonlocal swaps

            def allocate():  # memory the allocator must take from the driver (cudaMalloc), in a worker thread
                torch.cuda.empty_cache()  # no cached block to reuse: every allocation below is a cudaMalloc
                held.append(torch.ones(1 << 20, device="cuda"))

            while True:
                await asyncio.to_thread(allocate)
                await engine.update_weights(FetchedWeights.local(tiny_model, swaps + 1))
                swaps += 1

        swapper = asyncio.create_task(swap_forever()) if swapping else None
        try:
            return await runs(engine), swaps
        finally:
            if swapper is not None:
                swapper.cancel()
                await asyncio.gather(swapper, return_exceptions=True)
            await engine.shutdown()

    (quiet, _), (swapped, swaps) = await tokens(False), await tokens(True)
    assert swaps >= 20  # the swaps really overlapped the run
    assert swapped == quiet


@pytest.mark.filterwarnings("error::FutureWarning")
async def test_generation_uses_no_deprecated_transformers_argument(backend):
    # transformers 5.2x warns that forward's `past_key_values=` goes away in 5.40 (`cache=` replaces it): as an
    # error here, the prefill would fail the request
    tokens, _, events = await _run(backend, PROMPTS[0], max_tokens=4, temperature=0.0)
    assert len(tokens) == 4 and events[-1].finish_reason == "length"


async def test_sequences_being_prefilled_count_once_as_running(backend, monkeypatch):
    """The rows a prefill fills were counted twice while it ran (as rows, and as still being admitted): GetStatus and
    gyre_inference_running_requests said 4 for a request of n = 2 for as long as its prefill took."""
    seen = []
    prefill = backend._batch.prefill

    def watched(seqs):
        seen.append((len(seqs), backend.load_stats()))
        return prefill(seqs)

    monkeypatch.setattr(backend._batch, "prefill", watched)
    first = backend.generate(PROMPTS[2], SamplingParams(max_tokens=400, seed=0))
    await first.__anext__()
    await asyncio.gather(*(_run(backend, PROMPTS[0], max_tokens=4, seed=i) for i in range(2)))
    await first.aclose()
    assert seen and seen[0] == (1, (1, 0)), seen  # the first alone: one row, nothing else running
    assert all(running == seqs + 1 for seqs, (running, _) in seen[1:]), seen  # a later one beside the first


async def test_tied_embeddings_given_twice_with_different_values_are_refused(tmp_path):
    """Audit: a model that ties lm_head to the input embeddings holds one tensor under both names. A folder that
    gives both with different values (weights trained untied) was copied name by name into that one tensor: the last
    copy won and the served head (or embedding) was silently not the trained one. Equal copies still load."""
    from safetensors.torch import save_file

    reference = _tiny_family("llama", tmp_path / "base")
    engine = TorchBackend(tmp_path / "base", threads=1, max_batch_size=2, device="cpu")
    await engine.start()
    try:
        embed = reference.model.embed_tokens.weight.detach().clone()
        tensors = {k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}
        tensors["lm_head.weight"] = embed.clone()
        (tmp_path / "equal").mkdir()
        save_file(tensors, str(tmp_path / "equal" / "model.safetensors"))
        await engine.update_weights(FetchedWeights.local(tmp_path / "equal", 1))
        assert engine.version == 1
        tensors["lm_head.weight"] = embed + 1.0
        (tmp_path / "untied").mkdir()
        save_file(tensors, str(tmp_path / "untied" / "model.safetensors"))
        with pytest.raises(WeightsIncompatibleError, match="lm_head.weight .*one tensor in the served model"):
            await engine.update_weights(FetchedWeights.local(tmp_path / "untied", 2))
        assert engine.version == 1
        assert torch.equal(engine._weights["model.embed_tokens.weight"], embed)
    finally:
        await engine.shutdown()
