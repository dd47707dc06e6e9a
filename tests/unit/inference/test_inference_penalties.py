"""vLLM's presence, frequency and repetition penalties in the torch engine (CPU): per row, checked token by token
against plain torch over an independent transformers forward pass; the reported log-probs are those of the penalised
distribution; rows without penalties are bit for bit as beside unpenalised rows; a preempted row's recompute counts
its tokens again; a penalised step never runs as a CUDA graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend
from test_inference_engine import PROMPT, _run_params, together

pytestmark = pytest.mark.asyncio


def penalised_logprobs(model, prompt, tokens, params: SamplingParams):
    """Per generated token: log_softmax of the penalised logits at the temperature, and the penalised argmax."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    rows, best = [], []
    for t in range(len(tokens)):
        x, output = logits[t].clone(), tokens[:t]
        for token in set(prompt) | set(output):
            factor = params.repetition_penalty
            x[token] = x[token] / factor if x[token] > 0 else x[token] * factor
        for token in set(output):
            x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
        scale = params.temperature if params.temperature > 0 else 1.0
        rows.append(torch.log_softmax(x / scale, -1))
        best.append(int(x.argmax()))
    return torch.stack(rows).gather(1, torch.tensor(tokens)[:, None])[:, 0], best


PENALISED = [
    (PROMPT, SamplingParams(max_tokens=30, seed=1, temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.4)),
    (PROMPT[:9], SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5)),
    (PROMPT[4:], SamplingParams(max_tokens=30, seed=3, presence_penalty=-1.0, frequency_penalty=1.5)),
]  # fmt: skip
PLAIN = (PROMPT[2:], SamplingParams(max_tokens=30, seed=4, top_logprobs=3))


@pytest.mark.parametrize("overlap", [False, True])
async def test_penalised_rows_sample_the_penalised_distribution_and_plain_rows_are_untouched(tiny_model, reference,
                                                                                             overlap):  # fmt: skip
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=overlap)
    await backend.start()
    try:
        *penalised, plain = await together(backend, [_run_params(backend, p, params) for p, params in
                                                     [*PENALISED, PLAIN]])  # fmt: skip
        # the same rows without their penalties: the plain row must be bit for bit the same beside them
        off = [(p, dataclasses.replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0))
               for p, params in PENALISED]  # fmt: skip
        *unpenalised, alone = await together(backend, [_run_params(backend, p, params) for p, params in [*off, PLAIN]])
    finally:
        await backend.shutdown()
    for (prompt, params), (tokens, logprobs, _) in zip(PENALISED, penalised, strict=True):
        expected, best = penalised_logprobs(reference, prompt, tokens, params)
        assert torch.allclose(logprobs, expected, atol=1e-4), params
        if params.temperature == 0:
            assert tokens == best
    for with_penalties, without in zip(penalised, unpenalised, strict=True):
        assert with_penalties[0] != without[0]  # the penalties changed what was sampled
    assert plain[0] == alone[0] and torch.equal(plain[1], alone[1])
    assert [e.top_logprobs for e in plain[2]] == [e.top_logprobs for e in alone[2]]


async def test_a_preempted_penalised_row_counts_its_tokens_again_on_recompute(tiny_model):
    async def tokens(kv_cache_gb):
        backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, kv_cache_gb=kv_cache_gb)
        await backend.start()
        try:
            params = [SamplingParams(max_tokens=60, seed=i, temperature=0.8, repetition_penalty=1.2,
                                     frequency_penalty=0.3) for i in range(6)]  # fmt: skip
            results = await together(backend, [_run_params(backend, PROMPT[i:], p) for i, p in enumerate(params)])
            return [r[0] for r in results], backend._batch.preempted
        finally:
            await backend.shutdown()

    roomy, none_preempted = await tokens(None)
    tight, preempted = await tokens(30 * 16 * 4096 / 2**30)  # as test_inference_engine's block-pressure test
    assert none_preempted == 0 and preempted > 0
    assert tight == roomy


async def test_a_penalised_step_runs_eagerly_even_where_the_runner_captures_graphs(tiny_model):
    """A CUDA graph's capture fails on CPU, so a step that reached one fails here: a penalised batch must not."""
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=False)
    await backend.start()
    try:
        backend._runner.cuda_graphs = True
        tokens, _, events = await _run_params(backend, PROMPT, SamplingParams(max_tokens=5, presence_penalty=0.5))
        assert len(tokens) == 5 and events[-1].finish_reason == "length"
    finally:
        await backend.shutdown()
