"""Prompt log-probs (vLLM's `prompt_logprobs`): the torch engine against a transformers forward, the vLLM mapping.

The engine contract (docs/inference.md): `SamplingParams.prompt_logprobs = k` puts on a sequence's first event one
entry per prompt token, None for the first, then log_softmax(logits)[token] at temperature 1 (whatever the request's
temperature), the token's rank and its k most likely alternatives, computed from the prefill's hidden states.
"""

from __future__ import annotations

import asyncio
from collections import namedtuple

import pytest
import torch
from gyre_inference.backend import PromptLogprob, SamplingParams
from gyre_inference.prompt_logprobs import to_vllm
from gyre_inference.vllm_backend import prompt_entries
from test_inference_vllm_lora import standin_vllm  # noqa: F401, F811 (the stand-in vLLM engine, a fixture)

# Same fields as vllm.logprobs.Logprob (the contract test below checks the real class has them).
Logprob = namedtuple("Logprob", ["logprob", "rank", "decoded_token"])
PROMPTS = [[1, 705, 201, 74, 75, 2, 201, 1, 739, 201], [5, 6], list(range(10, 60)), [300, 301, 302, 303], [42]]


def reference_entries(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of each prompt token after the first, its rank, the full log-prob rows) from one forward."""
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(prompt[1:])[:, None])
    return chosen[:, 0], (rows > chosen).sum(-1) + 1, rows


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [0, 3])
async def test_prompt_logprobs_equal_a_transformers_forward(backend, reference, k):
    """Prompts of different lengths prefilled together (left padding), some not asking: exact to 1e-4 at T = 1
    although the requests sample at T = 0.7; only the first event carries them."""

    async def run(i, prompt):
        wanted = None if i == 3 else k  # one row of the batch does not ask
        params = SamplingParams(max_tokens=3, temperature=0.7, seed=i, prompt_logprobs=wanted)
        return [e async for e in backend.generate(prompt, params)]

    runs = await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))
    for i, (prompt, events) in enumerate(zip(PROMPTS, runs, strict=True)):
        assert all(e.prompt_logprobs is None for e in events[1:])
        entries = events[0].prompt_logprobs
        if i == 3:
            assert entries is None
            continue
        assert len(entries) == len(prompt) and entries[0] is None
        if len(prompt) == 1:
            continue
        chosen, ranks, rows = reference_entries(reference, prompt)
        assert torch.allclose(torch.tensor([e.logprob for e in entries[1:]]), chosen, atol=1e-4)
        assert [e.rank for e in entries[1:]] == ranks.tolist()
        for entry, row in zip(entries[1:], rows, strict=True):
            assert len(entry.top) == k
            if k:
                values, ids = row.topk(k)
                assert [t for t, _ in entry.top] == ids.tolist()
                assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), values, atol=1e-4)


@pytest.mark.asyncio
async def test_prompt_logprobs_in_chunks_equal_one_pass(reference):
    """The head runs over the prompt in chunks (bounded memory): the chunk size changes nothing."""
    from gyre_inference.prompt_logprobs import prompt_logprobs

    prompt = list(range(20, 80))
    with torch.no_grad():
        hidden = reference.get_decoder()(torch.tensor([prompt])).last_hidden_state[0, :-1]
    head = reference.get_output_embeddings()
    whole = prompt_logprobs(hidden, head, prompt, 2, chunk=1000)
    chunked = prompt_logprobs(hidden, head, prompt, 2, chunk=7)
    assert [e.rank for e in chunked[1:]] == [e.rank for e in whole[1:]]
    for a, b in zip(chunked[1:], whole[1:], strict=True):  # a matmul over fewer rows may round differently
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_vllm_prompt_logprobs_map_onto_entries():
    raw = [
        None,
        {9: Logprob(-2.0, 3, "a"), 4: Logprob(-0.1, 1, "b"), 5: Logprob(-1.5, 2, "c")},
        {7: Logprob(-0.2, 1, "d"), 3: Logprob(-1.9, 2, "e")},  # the prompt token is also the most likely
    ]
    entries = prompt_entries([1, 9, 7], raw, 2)
    assert entries == (
        None,
        PromptLogprob(-2.0, 3, ((4, -0.1), (5, -1.5))),
        PromptLogprob(-0.2, 1, ((7, -0.2), (3, -1.9))),
    )
    assert prompt_entries([1, 9, 7], raw, 0)[1] == PromptLogprob(-2.0, 3, ())
    with pytest.raises(RuntimeError, match="prompt log-probs for 2 tokens"):
        prompt_entries([1, 9], raw, 1)
    with pytest.raises(RuntimeError, match="no prompt log-prob for prompt token 8"):
        prompt_entries([1, 8, 7], raw, 1)


def test_vllm_response_shape():
    entries = (None, PromptLogprob(-2.0, 3, ((4, -0.1), (5, -1.5))), PromptLogprob(-0.2, 1, ((7, -0.2),)))
    shaped = to_vllm(entries, [1, 9, 7], lambda t: f"t{t}")
    assert shaped == [
        None,
        {"9": {"logprob": -2.0, "rank": 3, "decoded_token": "t9"}, "4": {"logprob": -0.1, "rank": 1,
         "decoded_token": "t4"}, "5": {"logprob": -1.5, "rank": 2, "decoded_token": "t5"}},
        {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "t7"}},
    ]  # fmt: skip
    assert list(shaped[1]) == ["9", "4", "5"]  # the prompt token first, as vLLM


def test_vllm_prompt_logprobs_contract():
    """The vLLM names this mapping relies on (runs wherever vllm imports)."""
    vllm = pytest.importorskip("vllm")
    from vllm.logprobs import Logprob as VLLMLogprob
    from vllm.outputs import RequestOutput

    assert vllm.SamplingParams(prompt_logprobs=2, max_tokens=1).prompt_logprobs == 2
    assert "prompt_logprobs" in RequestOutput.__init__.__code__.co_varnames
    entry = VLLMLogprob(logprob=-0.5, rank=1, decoded_token=None)
    assert prompt_entries([1, 4], [None, {4: entry}], 1) == (None, PromptLogprob(-0.5, 1, ((4, -0.5),)))


def test_the_vllm_backend_puts_vllm_prompt_logprobs_on_the_first_event(standin_vllm, tiny_model):  # noqa: F811
    """Through `VLLMBackend.generate` with the stand-in engine (vLLM's signatures, test_inference_vllm_lora.py):
    the field reaches vLLM's SamplingParams, the first output's entries reach the first event, mapped."""
    from gyre_inference.vllm_backend import VLLMBackend

    async def scenario():
        backend = VLLMBackend(tiny_model)
        await backend.start()
        backend._engine.auto = True
        events = [e async for e in backend.generate([1, 20, 30], SamplingParams(max_tokens=3, prompt_logprobs=2))]
        assert backend._engine.last("generate")["sampling_params"].prompt_logprobs == 2
        plain = [e async for e in backend.generate([1, 20], SamplingParams(max_tokens=2))]
        await backend.shutdown()
        return events, plain

    events, plain = asyncio.run(scenario())
    assert events[0].prompt_logprobs == (
        None,
        PromptLogprob(-2.0, 3, ((0, -0.01), (1, -0.02))),
        PromptLogprob(-3.0, 3, ((0, -0.01), (1, -0.02))),
    )
    assert all(e.prompt_logprobs is None for e in events[1:] + plain)


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_prompt_logprobs_equal_a_transformers_forward_on_a_gpu(tiny_model):
    """The real vLLM engine: its prompt_logprobs, mapped, equal a float32 transformers forward (2e-3: vLLM's own
    kernels in float32), the first entry None, on the first event only."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from gyre_inference.vllm_backend import VLLMBackend
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    chosen, ranks, _ = reference_entries(reference, prompt)

    async def scenario():
        backend = VLLMBackend(tiny_model, dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=8)
        await backend.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0.7, seed=1, prompt_logprobs=2)
            return [e async for e in backend.generate(prompt, params)]
        finally:
            await backend.shutdown()

    events = asyncio.run(scenario())
    entries = events[0].prompt_logprobs
    assert entries[0] is None and all(e.prompt_logprobs is None for e in events[1:])
    assert torch.allclose(torch.tensor([e.logprob for e in entries[1:]]), chosen, atol=2e-3)
    assert [e.rank for e in entries[1:]] == ranks.tolist() and all(len(e.top) == 2 for e in entries[1:])
