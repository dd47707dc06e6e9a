"""The decode step of every batch-size bucket run at start (`ModelRunner.capture_all`; on CUDA it captures the graphs
while loading, as vLLM does): on idle rows it must change nothing that follows. On CPU the same step runs eagerly
through the fused path the CUDA graphs capture (`attention="fused-torch"`); the gpu test checks the captures."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.model_runner import buckets
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio
PROMPTS = [[1, 705, 201, 74, 75, 2, 201, 1, 739, 201], [5, 6], list(range(10, 60)), [300, 301, 302, 303]]


async def generate_all(engine):
    """The same batch every time: queued under the engine's condition, so one prefill admits all of it."""

    async def one(prompt, seed):
        events = [e async for e in engine.generate(prompt, SamplingParams(max_tokens=24, seed=seed))]
        return [e.token_id for e in events], [e.logprob for e in events]

    with engine._cond:
        tasks = [asyncio.ensure_future(one(p, 11 + i)) for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.1)
    return await asyncio.gather(*tasks)


async def test_running_every_bucket_on_idle_rows_changes_no_later_output(tiny_model):
    async def outputs(warm: bool):
        engine = TorchBackend(tiny_model, threads=1, max_batch_size=8, attention="fused-torch")
        await engine.start()
        try:
            first = await generate_all(engine)
            if warm:  # between two batches, the engine thread idle on its condition: as at load, rows all idle
                with engine._cond:
                    steps, seconds = engine._runner.steps, engine._runner.device_seconds
                    assert engine._runner.capture_all() == len(buckets(8)) == 4  # 1, 2, 4, 8
                    assert engine._runner.steps == steps + 4 and engine._runner.device_seconds == seconds
            return first, await generate_all(engine)
        finally:
            await engine.shutdown()

    (plain_first, plain_second), (warm_first, warm_second) = await outputs(False), await outputs(True)
    assert warm_first == plain_first
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(warm_second, plain_second, strict=True):
        assert tokens == expected_tokens
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-6)
    assert len({tuple(tokens) for tokens, _ in warm_second}) == len(PROMPTS)  # different outputs: the test can fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_on_cuda_every_bucket_is_captured_while_loading_and_none_later(tiny_model):
    engine = TorchBackend(tiny_model, device="cuda", dtype="float32", max_batch_size=8)
    await engine.start()
    try:
        runner = engine._runner
        assert runner.paged_kernel, "the Triton kernels did not pass their self-check: no fused step to capture"
        assert sorted(rows for rows, _ in runner._forward_graphs) == buckets(8)
        captured = runner.captures
        for size in (1, 3, 8):
            results = await asyncio.gather(*(
                asyncio.ensure_future(_tokens(engine, p, seed)) for seed, p in enumerate((PROMPTS * 2)[:size])
            ))  # fmt: skip
            assert all(len(tokens) == 24 for tokens in results)
        assert runner.captures == captured  # every batch size and the plain sampler were ready
    finally:
        await engine.shutdown()


async def _tokens(engine, prompt, seed):
    return [e.token_id async for e in engine.generate(prompt, SamplingParams(max_tokens=24, seed=seed))]
