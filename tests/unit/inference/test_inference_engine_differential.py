"""A seeded random sweep of the torch engine against an independent transformers forward pass: prompts that share
prefixes (prefix cache, n-rollout groups), a KV cache small enough to make rows wait and be preempted, greedy and
sampled rows with and without filters, requests arriving mid-generation. Every reported log-prob must be the
reference's `log_softmax(logits / T)` of the sampled token, every greedy token the reference's argmax (unless the top
two are within the tolerance), and no block may be left held once the engine is idle."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.torch_backend import TorchBackend

pytestmark = pytest.mark.asyncio
ATOL = 1e-4


def _reference_logits(model, prompt, tokens):
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()


async def _generate(backend, prompt, params, delay):
    await asyncio.sleep(delay)
    events = [e async for e in backend.generate(prompt, params)]
    return prompt, params, events


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sweep", range(6))
async def test_random_batches_match_a_transformers_forward_pass(tiny_model, reference, sweep, overlap):
    rng = random.Random(sweep)
    # 14 blocks of 16 tokens: far less than the requests below need at once, so rows wait and are preempted
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, kv_cache_gb=14 * 16 * 4096 / 2**30, overlap=overlap)
    await backend.start()
    try:
        stems = [[rng.randrange(5, 900) for _ in range(rng.randrange(10, 40))] for _ in range(3)]
        runs = []
        for _ in range(10):
            prompt = rng.choice(stems) + [rng.randrange(5, 900) for _ in range(rng.randrange(0, 12))]
            greedy = rng.random() < 0.4
            stops = frozenset(rng.sample(range(5, 900), 60)) if rng.random() < 0.5 else frozenset()
            params = dict(max_tokens=rng.randrange(1, 60), seed=rng.randrange(2**31),
                          temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
                          top_p=rng.choice([1.0, 1.0, 0.9]), top_k=rng.choice([0, 0, 20]),
                          stop_token_ids=stops, min_tokens=rng.choice([0, 0, 4]) if stops else 0)  # fmt: skip
            copies = rng.choice([1, 1, 3])  # a group of rollouts: the same prompt at once
            delay = rng.choice([0.0, 0.0, 0.05, 0.2])  # some arrive while others are generating
            runs += [_generate(backend, prompt, SamplingParams(**params), delay) for _ in range(copies)]
        results = await asyncio.gather(*runs)
        for prompt, params, events in results:
            tokens = [e.token_id for e in events]
            stopped = [i for i, token in enumerate(tokens) if token in params.stop_token_ids]
            # a row ends at its first stop id, never one before min_tokens, else at its length
            if stopped:
                assert stopped == [len(tokens) - 1] and len(tokens) > params.min_tokens
                assert [e.finish_reason for e in events] == [None] * stopped[0] + ["stop"]
            else:
                assert len(tokens) == params.max_tokens
                assert [e.finish_reason for e in events] == [None] * (len(tokens) - 1) + ["length"]
            logits = _reference_logits(reference, prompt, tokens)
            held = list(params.stop_token_ids)
            logits[: params.min_tokens, held] = float("-inf")  # min_tokens holds the stop ids back (bias -inf)
            scale = params.temperature if params.temperature > 0 else 1.0
            expected = torch.log_softmax(logits / scale, -1)
            got = torch.tensor([e.logprob for e in events])
            assert torch.allclose(got, expected.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=ATOL)
            if params.temperature == 0:
                top2 = logits.topk(2).values
                clear = (top2[:, 0] - top2[:, 1]) > ATOL
                assert torch.equal(torch.tensor(tokens)[clear], logits.argmax(-1)[clear])
        seeded = {}
        for prompt, params, events in results:  # the same prompt and seed: the same tokens, shared or preempted
            key = (tuple(prompt), params.seed, params.temperature, params.top_p, params.top_k, params.max_tokens)
            seeded.setdefault(key, set()).add(tuple(e.token_id for e in events))
        assert all(len(outcomes) == 1 for outcomes in seeded.values())
        for _ in range(500):
            if backend.load_stats() == (0, 0):
                break
            await asyncio.sleep(0.01)
        assert backend._batch.pool.free_blocks == backend._runner.num_blocks - 1  # nothing leaked (0: the null block)
    finally:
        await backend.shutdown()
