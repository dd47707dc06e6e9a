"""The sampling math of the torch backend (pure tensors, CPU)."""

from __future__ import annotations

import pytest
import torch
from gyre_inference.sampling import sample_next


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_reported_logprobs_are_log_softmax_at_the_temperature_and_t1_for_greedy():
    logits = _logits()
    temperature = torch.tensor([0.7, 1.3, 0.0])
    _, logprobs = sample_next(logits, temperature, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0.3, 0.3, 0.3]))
    assert torch.allclose(logprobs[0], torch.log_softmax(logits[0] / 0.7, -1), atol=1e-6)
    # top_p limits what may be drawn but is NOT renormalised into the reported log-probs
    assert torch.allclose(logprobs[1], torch.log_softmax(logits[1] / 1.3, -1), atol=1e-6)
    assert torch.allclose(logprobs[2], torch.log_softmax(logits[2], -1), atol=1e-6)


def test_greedy_takes_the_argmax_whatever_the_draw():
    logits = _logits(rows=4)
    for u in (0.0, 0.5, 0.999):
        tokens, _ = sample_next(logits, torch.zeros(4), torch.ones(4), torch.full((4,), u))
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_evenly_spaced_draws_reproduce_the_distribution():
    # Inverse-CDF sampling: N evenly spaced uniforms hit each token about p_i * N times.
    vocab, draws = 20, 4000
    logits = _logits(rows=1, vocab=vocab)
    uniform = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens, logprobs = sample_next(logits.expand(draws, vocab), torch.full((draws,), 0.8), torch.ones(draws), uniform)
    counts = torch.bincount(tokens, minlength=vocab).double() / draws
    assert torch.allclose(counts, logprobs[0].exp().double(), atol=2 / draws)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9])
def test_top_p_only_draws_from_the_nucleus_in_proportion(top_p):
    vocab, draws = 30, 3000
    logits = _logits(rows=1, vocab=vocab, seed=1)
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < top_p]
    uniform = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    tokens, _ = sample_next(logits.expand(draws, vocab), torch.ones(draws), torch.full((draws,), top_p), uniform)
    assert set(tokens.tolist()) == set(nucleus.tolist())
    counts = torch.bincount(tokens, minlength=vocab).double() / draws
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[nucleus] = probs[nucleus].double() / probs[nucleus].sum()
    assert torch.allclose(counts, expected, atol=2 / draws)


def test_a_row_does_not_depend_on_its_batch_neighbours():
    logits = _logits(rows=5, vocab=64, seed=2)
    temperature = torch.tensor([1.0, 0.5, 0.0, 1.5, 0.9])
    top_p = torch.tensor([1.0, 0.8, 1.0, 0.3, 0.95])
    uniform = torch.tensor([0.1, 0.7, 0.2, 0.99, 0.5], dtype=torch.float64)
    together, lp_together = sample_next(logits, temperature, top_p, uniform)
    for i in range(5):
        alone, lp_alone = sample_next(logits[i : i + 1], temperature[i : i + 1], top_p[i : i + 1], uniform[i : i + 1])
        assert alone.item() == together[i].item()
        assert torch.equal(lp_alone[0], lp_together[i])


def test_the_draw_at_the_top_of_the_cdf_stays_inside_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -50.0, -60.0]])
    top_of_cdf = torch.tensor([1.0 - 1e-12], dtype=torch.float64)
    tokens, _ = sample_next(logits, torch.ones(1), torch.tensor([0.999]), top_of_cdf)
    assert tokens.item() in (0, 1)
