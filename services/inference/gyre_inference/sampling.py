"""Next-token sampling for a batch of rows, each with its own temperature, top_p and random draw.

Sampling is inverse-CDF over the nucleus sorted by probability: row i takes the first token whose
cumulative (truncated) probability exceeds `uniform[i] * nucleus_mass`. Each row's randomness is a
single uniform drawn from that row's own generator, so a row's token depends only on its logits and
its generator, never on which other rows share the batch (batch-invariant up to float noise in the
logits themselves).

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
    temperature = temperature.to(logits.device, torch.float32)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)

    sorted_probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep a token while the mass strictly before it is below top_p: the most likely token always stays.
    nucleus = mass_before < top_p.to(logits.device, torch.float32)[:, None]
    nucleus[:, 0] = True
    sorted_probs = sorted_probs * nucleus
    cdf = sorted_probs.cumsum(dim=-1)
    target = uniform.to(logits.device, torch.float32) * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None].contiguous(), right=True)
    # Float rounding can put `target` at the very end of the CDF: clamp to the last token in the nucleus.
    index = torch.minimum(index, nucleus.sum(dim=-1, keepdim=True) - 1)
    sampled = order.gather(1, index)[:, 0]
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs
