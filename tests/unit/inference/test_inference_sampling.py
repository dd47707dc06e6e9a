"""The sampling math of the torch engine (pure tensors, CPU): the same ops run inside the CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gyre_inference.sampling import sample, uniforms


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _filters(rows, top_p=1.0, top_k=0, min_p=0.0):
    full = torch.full
    return {"top_p": full((rows,), top_p), "top_k": full((rows,), top_k), "min_p": full((rows,), min_p)}


def _even(draws: int) -> torch.Tensor:
    return (torch.arange(draws, dtype=torch.float64) + 0.5) / draws


def test_reported_logprobs_are_log_softmax_at_the_temperature_and_t1_for_greedy():
    logits = _logits()
    temperature = torch.tensor([0.7, 1.3, 0.0])
    tokens, chosen, top_values, top_ids = sample(logits, temperature, torch.full((3,), 0.3), top_n=5,
                                                 **_filters(3, top_p=0.5))  # fmt: skip
    expected = torch.log_softmax(logits / torch.tensor([0.7, 1.3, 1.0])[:, None], -1)
    # top_p limits what may be drawn but is NOT renormalised into the reported log-probs
    assert torch.allclose(chosen, expected.gather(1, tokens[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(top_values, expected.topk(5).values, atol=1e-6)
    assert torch.equal(top_ids, expected.topk(5).indices)


@pytest.mark.parametrize("filtered", [False, True])
def test_greedy_takes_the_argmax_whatever_the_draw(filtered):
    logits = _logits(rows=4)
    for u in (0.0, 0.5, 0.999):
        extra = _filters(4, top_p=0.3, top_k=2) if filtered else {}
        tokens, *_ = sample(logits, torch.zeros(4), torch.full((4,), u), **extra)
        assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("filtered", [False, True])
def test_a_temperature_too_small_for_float32_is_greedy_with_finite_logprobs(filtered):
    # logits / 1e-40 overflow to inf: the draw and its log-prob were NaN (an empty answer with null log-probs)
    logits = _logits(rows=4)
    extra = _filters(4, top_p=0.5) if filtered else {}
    tiny = torch.tensor([1e-40, 1e-30, 1e-6, 0.0])
    tokens, chosen, top_values, _ = sample(logits, tiny, torch.full((4,), 0.7), top_n=3, **extra)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)  # as any greedy row: T = 1
    assert torch.allclose(chosen, expected.gather(1, tokens[:, None])[:, 0], atol=1e-6)
    assert torch.isfinite(top_values).all() and torch.allclose(top_values, expected.topk(3).values, atol=1e-6)


def _counts(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def test_evenly_spaced_draws_reproduce_the_distribution():
    # Inverse-CDF sampling: N evenly spaced uniforms hit each token about p_i * N times.
    vocab, draws = 20, 4000
    logits = _logits(rows=1, vocab=vocab).expand(draws, vocab)
    tokens, chosen, *_ = sample(logits, torch.full((draws,), 0.8), _even(draws))
    probs = torch.softmax(logits[0] / 0.8, -1).double()
    assert torch.allclose(_counts(tokens, vocab), probs, atol=2 / draws)
    assert torch.allclose(chosen.exp().double(), probs[tokens], atol=1e-6)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9])
def test_top_p_only_draws_from_the_nucleus_in_proportion(top_p):
    vocab, draws = 30, 3000
    logits = _logits(rows=1, vocab=vocab, seed=1)
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < top_p]
    tokens, *_ = sample(logits.expand(draws, vocab), torch.ones(draws), _even(draws), **_filters(draws, top_p=top_p))
    assert set(tokens.tolist()) == set(nucleus.tolist())
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[nucleus] = probs[nucleus].double() / probs[nucleus].sum()
    assert torch.allclose(_counts(tokens, vocab), expected, atol=2 / draws)


@pytest.mark.parametrize(("top_k", "min_p"), [(3, 0.0), (0, 0.2), (4, 0.1)])
def test_top_k_and_min_p_only_draw_the_kept_tokens_in_proportion(top_k, min_p):
    vocab, draws = 30, 3000
    logits = _logits(rows=1, vocab=vocab, seed=3) / 3
    probs = torch.softmax(logits[0], -1)
    keep = probs >= min_p * probs.max()
    if top_k:
        keep &= probs >= probs.topk(top_k).values[-1]
    tokens, *_ = sample(logits.expand(draws, vocab), torch.ones(draws), _even(draws),
                        **_filters(draws, top_k=top_k, min_p=min_p))  # fmt: skip
    expected = torch.where(keep, probs, 0).double()
    assert torch.allclose(_counts(tokens, vocab), expected / expected.sum(), atol=2 / draws)
    assert 1 < int(keep.sum()) < vocab  # the filters really cut something


@pytest.mark.parametrize(("top_k", "min_p"), [(2, 0.0), (0, 0.5)])
def test_top_p_applies_to_what_top_k_and_min_p_kept_renormalised(top_k, min_p):
    # vLLM: min-p / top-k first, then top-p over the renormalised rest. Probabilities 0.5, 0.3, 0.2: either filter keeps
    # the first two (mass 0.8), of which the first alone is 0.625 >= top_p 0.6, so only it may be drawn. top-p over the
    # unfiltered row (mass before the second 0.5 < 0.6) kept the second too: every high draw took it.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(100, 3)
    tokens, *_ = sample(logits, torch.ones(100), _even(100), **_filters(100, top_p=0.6, top_k=top_k, min_p=min_p))
    assert set(tokens.tolist()) == {0}


def test_biases_and_the_bitmask_change_the_distribution_sampled_and_reported():
    vocab, draws = 40, 2000
    logits = (_logits(rows=1, vocab=vocab, seed=4) / 3).expand(draws, vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[1, 5, 33, 34, 39]] = True
    words = torch.zeros(2, dtype=torch.int64)
    for token in allowed.nonzero()[:, 0].tolist():
        words[token // 32] |= 1 << (token % 32)
    bitmask = words.to(torch.int32).expand(draws, 2).contiguous()  # bit 31 set: a negative int32 word
    bias_ids = torch.tensor([[5, 33, 0]]).expand(draws, 3)
    bias_values = torch.tensor([[2.0, float("-inf"), 0.0]]).expand(draws, 3)
    tokens, chosen, *_ = sample(logits, torch.ones(draws), _even(draws), bitmask=bitmask, bias_ids=bias_ids,
                                bias_values=bias_values)  # fmt: skip
    adjusted = torch.where(allowed, logits[0], float("-inf"))
    adjusted[5] += 2.0
    adjusted[33] = float("-inf")
    probs = torch.softmax(adjusted, -1).double()
    assert set(tokens.tolist()) == {1, 5, 34, 39}
    assert torch.allclose(_counts(tokens, vocab), probs, atol=2 / draws)
    assert torch.allclose(chosen.double(), probs[tokens].log(), atol=1e-5)


def test_a_row_does_not_depend_on_its_batch_neighbours():
    logits = _logits(rows=5, vocab=64, seed=2)
    temperature = torch.tensor([1.0, 0.5, 0.0, 1.5, 0.9])
    filters = {"top_p": torch.tensor([1.0, 0.8, 1.0, 0.3, 0.95]), "top_k": torch.tensor([0, 5, 0, 0, 3]),
               "min_p": torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05])}  # fmt: skip
    uniform = torch.tensor([0.1, 0.7, 0.2, 0.99, 0.5])
    together = sample(logits, temperature, uniform, top_n=3, **filters)
    for i in range(5):
        one = {k: v[i : i + 1] for k, v in filters.items()}
        alone = sample(logits[i : i + 1], temperature[i : i + 1], uniform[i : i + 1], top_n=3, **one)
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a[0], b[i])


def test_the_draw_at_the_top_of_the_cdf_stays_inside_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -50.0, -60.0]])
    tokens, *_ = sample(logits, torch.ones(1), torch.tensor([1.0 - 1e-7]), **_filters(1, top_p=0.999))
    assert tokens.item() in (0, 1)
    plain, *_ = sample(torch.tensor([[5.0, 4.0, -200.0, -200.0]]), torch.ones(1), torch.tensor([1.0]))
    assert plain.item() in (0, 1)  # a uniform of exactly 1 never lands past the last token with weight


def test_uniforms_are_a_function_of_seed_and_counter_and_look_uniform():
    seeds = np.array([1, 1, 2, 2**63 - 1], dtype=np.uint64)
    counters = np.array([0, 1, 0, 7])
    u = uniforms(seeds, counters)
    assert u.dtype == np.float32 and np.array_equal(u, uniforms(seeds, counters))
    assert len(set(u.tolist())) == 4
    assert np.array_equal(uniforms(seeds[1:2], counters[1:2]), u[1:2])  # no dependence on the other rows
    many = uniforms(np.full(100_000, 12345, dtype=np.uint64), np.arange(100_000))
    assert many.min() >= 0 and many.max() < 1
    histogram = np.histogram(many, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(histogram - 10_000) < 500)


def test_a_row_that_filters_nothing_draws_the_same_token_beside_a_filtered_row():
    """The filtered variant (chosen when any row of the step asks for top-k/top-p/min-p) walks the CDF in order of
    decreasing probability; a row asking for none of them must still get the token it gets in the plain variant,
    or its tokens would depend on its batch mates."""
    logits = _logits(rows=2, vocab=200)
    temperature = torch.ones(2)
    for u in _even(50):
        uniform = torch.full((2,), float(u))
        plain, *_ = sample(logits, temperature, uniform)
        mixed, *_ = sample(logits, temperature, uniform, top_p=torch.tensor([1.0, 0.5]), top_k=torch.tensor([0, 0]),
                           min_p=torch.tensor([0.0, 0.0]))  # fmt: skip
        assert mixed[0] == plain[0]


def _penalised_reference(logits, prompt, output, repetition, frequency, presence):
    """vLLM's penalties written out token by token in plain torch (vllm apply_penalties): repetition over the prompt
    and the output, positive logits divided, the others multiplied; frequency and presence over the output only."""
    x = logits.clone()
    for token in set(prompt) | set(output):
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    for token in set(output):
        x[token] -= frequency * output.count(token) + presence
    return x


def test_penalties_follow_vllm_per_row_and_leave_an_unpenalised_row_bit_identical():
    from gyre_inference.sampling import Penalties

    vocab = 50
    logits = _logits(rows=4, vocab=vocab, seed=7)
    logits[1, 3] = float("-inf")  # a token the bias or grammar ruled out stays out
    prompts = [[1, 2, 3], [3, 4, 5, 3], [6], [1, 2]]
    outputs = [[2, 2, 9, 10, 2], [3, 11, 11], [6, 6], [2, 40]]
    rows = [(1.3, 0.5, 0.4), (0.7, -0.5, 1.5), (1.0, 2.0, -2.0), (1.0, 0.0, 0.0)]  # the last: off
    counts = torch.zeros(4, vocab)
    seen = torch.zeros(4, vocab, dtype=torch.bool)
    for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for token in output:
            counts[row, token] += 1
        seen[row, prompt + output] = True
    repetition, frequency, presence = (torch.tensor(column) for column in zip(*rows, strict=True))
    penalties = Penalties(counts, seen, repetition, frequency, presence)
    temperature = torch.tensor([0.7, 1.0, 0.0, 0.9])
    u = torch.tensor([0.3, 0.6, 0.5, 0.2])
    for filters in ({}, _filters(4, top_p=0.9)):
        tokens, chosen, top_values, top_ids = sample(logits, temperature, u, penalties=penalties, top_n=5, **filters)
        plain = sample(logits, temperature, u, top_n=5, **filters)
        for row in range(4):
            x = _penalised_reference(logits[row], prompts[row], outputs[row], *rows[row])
            scale = temperature[row] if temperature[row] > 0 else 1.0
            expected = torch.log_softmax(x / scale, -1)
            assert torch.allclose(chosen[row], expected[tokens[row]], atol=1e-6), row  # the processed log-probs
            assert torch.allclose(top_values[row], expected.topk(5).values, atol=1e-6), row
        assert tokens[2] == _penalised_reference(logits[2], prompts[2], outputs[2], *rows[2]).argmax()  # greedy
        # the row with every penalty off: bit for bit what the sampler gives without penalties
        assert (
            tokens[3] == plain[0][3] and torch.equal(chosen[3], plain[1][3]) and torch.equal(top_values[3], plain[2][3])
        )
        assert not torch.equal(chosen[:3], plain[1][:3])
