"""vLLM's `allowed_token_ids` and `bad_words` in the torch engine (CPU): per row, token by token against an independent
transformers forward pass with vLLM's masks applied in plain torch; rows without them are bit for bit as beside the
same rows without them; an allow-list (a fixed bitmask) keeps the overlapped loop, a bad word of several tokens makes
its steps synchronous. The `gpu` test runs them with CUDA graphs and the overlapped loop on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gyre_inference.backend import SamplingParams
from gyre_inference.sampling import allowed_bitmask, bias_entries
from gyre_inference.torch_backend import TorchBackend
from test_inference_engine import PROMPT, _run_params, idle, together

ALLOWED = frozenset(range(40, 400, 7))


def test_allowed_bitmask_sets_exactly_the_allowed_tokens():
    vocab = 100
    words = allowed_bitmask([0, 31, 32, 63, 99], vocab)
    assert words.dtype == np.int32 and words.shape == (4,)
    bits = ((words.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[:vocab]
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 63, 99]


def test_a_bad_word_bans_its_last_token_only_right_after_its_other_tokens():
    words = ((5,), (7, 8, 9))
    inf = float("-inf")
    assert bias_entries((), (), False, words, []) == [(5, inf), (0, 0.0)]  # the slot is kept: a fixed width
    assert bias_entries((), (), False, words, [1, 7]) == [(5, inf), (0, 0.0)]
    assert bias_entries(((3, 1.5),), (), False, words, [1, 7, 8]) == [(3, 1.5), (5, inf), (9, inf)]
    assert bias_entries((), (), False, words, [7, 8, 2]) == [(5, inf), (0, 0.0)]


def _masked(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's allowed_token_ids and bad_words in plain torch, on one row's logits."""
    x = logits.clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[sorted(params.allowed_token_ids)] = True
        x[~keep] = float("-inf")
    for word in params.bad_word_ids:
        if len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1 :]) == word[:-1]:
            x[word[-1]] = float("-inf")
    return x


def _check(model, prompt, tokens, logprobs, params: SamplingParams) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    scale = params.temperature if params.temperature > 0 else 1.0
    for t, token in enumerate(tokens):
        x = _masked(logits[t], tokens[:t], params)
        assert torch.isfinite(x[token]), (params, t)  # never a masked or banned token
        assert float(torch.log_softmax(x / scale, -1)[token]) == pytest.approx(float(logprobs[t]), abs=1e-4)
        if params.temperature == 0:
            assert token == int(x.argmax())


def _contains(tokens, word) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def _first_ban(base, pair) -> int:
    """Where a greedy row that wrote `base` first meets the two-token bad word `pair` (its last token's index)."""
    return next(i for i in range(1, len(base)) if (base[i - 1], base[i]) == pair)


async def _greedy(backend, prompt, max_tokens=24):
    tokens, *_ = await _run_params(backend, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return tokens


@pytest.mark.asyncio
@pytest.mark.parametrize("overlap", [False, True])
async def test_allowed_and_banned_rows_sample_the_masked_distribution_and_plain_rows_are_untouched(
    tiny_model, reference, overlap
):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=overlap)
    await backend.start()
    try:
        base = await _greedy(backend, PROMPT[4:])
        # a two-token word the greedy row writes at 5-6 (its 6th token is banned there), and a one-token word
        pair = (base[5], base[6])
        at = _first_ban(base, pair)
        single = next(t for t in base[at + 1 :] if t not in base[: at + 1])
        banned = [
            (PROMPT[4:], SamplingParams(max_tokens=24, temperature=0.0, bad_word_ids=(pair, (single,)))),
            (PROMPT, SamplingParams(max_tokens=24, seed=1, temperature=0.9, allowed_token_ids=ALLOWED)),
            (
                PROMPT[:9],
                SamplingParams(
                    max_tokens=24, temperature=0.0, allowed_token_ids=ALLOWED, bad_word_ids=((min(ALLOWED),),)
                ),
            ),  # fmt: skip
        ]
        plain = (PROMPT[2:], SamplingParams(max_tokens=24, seed=4, top_logprobs=3))
        off = [(p, dataclasses.replace(params, allowed_token_ids=None, bad_word_ids=())) for p, params in banned]
        *mixed, beside = await together(backend, [_run_params(backend, p, params) for p, params in [*banned, plain]])
        *_, alone = await together(backend, [_run_params(backend, p, params) for p, params in [*off, plain]])
        await idle(backend)
    finally:
        await backend.shutdown()
    for (prompt, params), (tokens, logprobs, _) in zip(banned, mixed, strict=True):
        _check(reference, prompt, tokens, logprobs, params)
        assert params.allowed_token_ids is None or set(tokens) <= ALLOWED
    assert min(ALLOWED) not in mixed[2][0]
    words = mixed[0][0]
    assert words[:at] == base[:at] and words[at] != base[at]  # banned right after the word's first token
    assert not _contains(words, pair) and single not in words
    assert beside[0] == alone[0] and torch.equal(beside[1], alone[1])
    assert [e.top_logprobs for e in beside[2]] == [e.top_logprobs for e in alone[2]]


@pytest.mark.asyncio
async def test_an_allow_list_keeps_the_overlapped_loop_and_a_bad_word_of_several_tokens_steps_synchronously(
    tiny_model,
):
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8, overlap=True)
    await backend.start()
    stats = backend.stats
    try:
        base = await _greedy(backend, PROMPT)
        before = stats.overlapped_steps
        allowed = SamplingParams(max_tokens=20, seed=2, allowed_token_ids=ALLOWED, bad_word_ids=((41,),))
        tokens, *_ = await _run_params(backend, PROMPT, allowed)
        assert set(tokens) <= ALLOWED - {41} and stats.overlapped_steps - before >= 15
        before = stats.overlapped_steps
        pair = (base[3], base[4])
        at = _first_ban(base, pair)
        tokens, *_ = await _run_params(
            backend, PROMPT, SamplingParams(max_tokens=20, temperature=0.0, bad_word_ids=(pair,))
        )
        assert stats.overlapped_steps == before and tokens[:at] == base[:at] and tokens[at] != base[at]
    finally:
        await backend.shutdown()


@pytest.mark.asyncio
async def test_an_allow_list_under_a_grammar_keeps_the_tokens_both_allow(tiny_model, model_text):
    from gyre_inference.structured import Guide

    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8)
    await backend.start()
    try:
        digits = {model_text.tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
        allowed = frozenset(digits - {model_text.tokenizer.convert_tokens_to_ids("7")}) | set(model_text.eos_token_ids)
        guide = Guide("regex", "[0-9]{6}")
        for seed in range(3):
            params = SamplingParams(max_tokens=10, seed=seed, allowed_token_ids=allowed, guide=guide,
                                    constraint=model_text.grammars.matcher(guide))  # fmt: skip
            tokens, *_ = await _run_params(backend, [5, 6, 7], params)
            text = model_text.decode(tokens)
            assert len(text) == 6 and text.isdigit() and "7" not in text, text
    finally:
        await backend.shutdown()


@pytest.mark.asyncio
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_allowed_rows_replay_cuda_graphs_and_plain_rows_are_untouched_on_the_gpu(tiny_model):
    """bf16, CUDA graphs and the overlapped loop on: an allow-listed batch runs as graph replays with overlapped
    steps, its tokens are all allowed, and the plain row beside it is bit for bit as beside the same rows without
    the list. A bad word of several tokens steps synchronously, still as graph replays."""
    backend = TorchBackend(tiny_model, device="cuda", dtype="bfloat16", max_batch_size=8)
    await backend.start()
    runner, stats = backend._runner, backend.stats
    listed = [(PROMPT, SamplingParams(max_tokens=24, seed=s, allowed_token_ids=ALLOWED)) for s in range(3)]
    plain = (PROMPT[2:], SamplingParams(max_tokens=24, seed=4))
    off = [(p, dataclasses.replace(params, allowed_token_ids=None)) for p, params in listed]
    try:
        assert backend.overlap and runner.cuda_graphs
        # once first: graphs captured and the prompts' blocks cached, so both runs below prefill the same positions
        # (a bf16 prefill over other positions may round the first token's logits differently)
        await together(backend, [_run_params(backend, p, params) for p, params in [*off, plain]])
        await idle(backend)
        *_, alone = await together(backend, [_run_params(backend, p, params) for p, params in [*off, plain]])
        await idle(backend)
        replays, overlapped = runner.replays, stats.overlapped_steps
        *mixed, beside = await together(backend, [_run_params(backend, p, params) for p, params in [*listed, plain]])
        await idle(backend)
        assert runner.replays - replays >= 20 and stats.overlapped_steps - overlapped >= 15
        for tokens, _, _ in mixed:
            assert set(tokens) <= ALLOWED
        assert beside[0] == alone[0] and torch.equal(beside[1], alone[1])
        base = await _greedy(backend, PROMPT)
        replays, overlapped = runner.replays, stats.overlapped_steps
        pair = (base[3], base[4])
        at = _first_ban(base, pair)
        tokens, *_ = await _run_params(
            backend, PROMPT, SamplingParams(max_tokens=20, temperature=0.0, bad_word_ids=(pair,))
        )
        assert tokens[:at] == base[:at] and tokens[at] != base[at]
        assert stats.overlapped_steps == overlapped and runner.replays - replays >= 15
    finally:
        await backend.shutdown()


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does(model_text):
    encode = lambda text: tuple(model_text.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    for word in ("hello", " hello", "the cat"):
        alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        expected = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        assert model_text.bad_word_ids([word]) == tuple(expected)
    assert len(model_text.bad_word_ids(["hello"])) == 2  # " hello" starts with another token: banned as well
