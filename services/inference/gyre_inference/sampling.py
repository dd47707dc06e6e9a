"""Next-token sampling for a batch of rows, each with its own temperature, top_p and random draw.

Sampling is inverse-CDF: row i takes the first token whose cumulative probability exceeds
`uniform[i] * total`. Rows with top_p = 1 walk the CDF in vocabulary order (no sort: sorting a
[B, V] tensor costs more than the rest of a CPU decode step); rows with top_p < 1 walk it in order of
decreasing probability over the nucleus only. Each row's randomness is one uniform drawn from that
row's own generator, so a row's token depends only on its logits, its parameters and its generator,
never on which other rows share the batch (batch-invariant up to float noise in the logits).

Reported log-probs are `log_softmax(logits / T)` over the FULL vocabulary (T = 1 for greedy rows):
top_p decides which tokens may be drawn, but is not renormalised into the log-prob. This is the
quantity the trainer recomputes (`log_softmax(logits / T)`), so the importance ratio is 1 when both
sides hold the same weights.
"""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args: `logits` [B, V]; `temperature` [B] (0 = greedy); `top_p` [B] in (0, 1]; `uniform` [B] in [0, 1).
    Returns `(tokens [B] int64, logprobs [B, V] float32)` where `logprobs` is the reported distribution.
    """
    logits = logits.float()
    device = logits.device
    temperature, top_p = temperature.to(device, torch.float32), top_p.to(device, torch.float32)
    uniform = uniform.to(device, torch.float32)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    probs = logprobs.exp()

    tokens = _inverse_cdf(probs, uniform)
    nucleus_rows = ((top_p < 1) & ~greedy).nonzero()[:, 0]
    if len(nucleus_rows):
        sorted_probs, order = probs[nucleus_rows].sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep a token while the mass strictly before it is below top_p: the most likely token always stays.
        sorted_probs = sorted_probs * (mass_before < top_p[nucleus_rows, None])
        index = _inverse_cdf(sorted_probs, uniform[nucleus_rows])
        tokens[nucleus_rows] = order.gather(1, index[:, None])[:, 0]
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum of (non-negative) `weights` exceeds uniform * total."""
    cdf = weights.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None].contiguous(), right=True)
    index = index.clamp_(max=weights.shape[-1] - 1)
    picked_nothing = weights.gather(1, index)[:, 0] <= 0
    if bool(picked_nothing.any()):
        # Float rounding put the target at the very end of the CDF, past the last token with weight.
        last = weights.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
        index = torch.where(picked_nothing[:, None], last, index)
    return index[:, 0]
