"""RL objectives (an open registry) and their aggregation by global counts.

Every objective is a function

    fn(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput

over one flat packed sequence of T tokens (several samples back to back; `sample_lengths` sums to T):
`logprobs` are the trainer's log-probs (with grad), `inference_logprobs` the behaviour policy's (the
log-probs inference reported when it sampled), `advantages` the sample's advantage on every token,
`loss_mask` true on sampled completion tokens. The importance ratio is r = exp(lp_θ − lp_μ); there
is no separate "old policy" forward pass. Formulas: ../shared/notes/algorithms.md.

Invariants every objective keeps (and a user objective should keep):
- `per_token_loss` is 0 wherever `loss_mask` is false, and no gradient flows through those tokens;
  the ratio is computed from a masked log-ratio, so garbage log-probs on prompt or padding tokens
  can never overflow into NaN.
- With identical weights on both sides (lp_θ == lp_μ, so r = 1) the gradient of every built-in
  objective is REINFORCE's, −A·∇lp_θ per token, before aggregation.
- `stats` maps a metric name to per-token values whose mean over loss tokens is that metric
  (0/1 indicators, so `clip_frac` is the fraction of loss tokens that were clipped).

`policy_loss` adds the optional regularisers (`kl_tau`·(log r)² toward the behaviour policy, k3 KL
to a frozen reference); `aggregate` reduces per-token losses to one micro-batch's share of the
batch loss, normalised by GLOBAL counts so that summing the shares of all micro-batches of all
ranks gives the full-batch loss whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from gyre.config.trainer import LossConfig
from gyre.imports import load_callable
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class LossOutput:
    """Per-token loss (T,) and per-token stats (name -> (T,) tensor, averaged over loss tokens)."""

    per_token_loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, LossConfig], LossOutput]

#: name -> objective. Extend with `register_loss` or name a function by import path in `loss.type`.
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: add an objective to `LOSSES` under `name`."""

    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> LossFn:
    """The objective registered as `name`, or the function `package.module:function` names.

    Raises ValueError with the known names (or the import problem) when it cannot be found, so a
    typo in `loss.type` fails at start-up rather than at the first batch.
    """
    if name in LOSSES:
        return LOSSES[name]
    if ":" not in name:
        raise ValueError(f"unknown loss {name!r}: use one of {', '.join(LOSSES)} or 'package.module:function'")
    return load_callable(name, f"loss {name!r}")


# --- helpers ------------------------------------------------------------------------------------------


def segment_ids(sample_lengths: Tensor, num_tokens: int) -> Tensor:
    """Sample number of every token: lengths [2, 3] -> [0, 0, 1, 1, 1]."""
    lengths = sample_lengths.to(torch.long)
    ids = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(ids, lengths, output_size=num_tokens)


def masked_log_ratio(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """log r = lp_θ − lp_μ on loss tokens, exactly 0 elsewhere (so r = 1 and no gradient there)."""
    return torch.where(loss_mask, logprobs - inference_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))


def per_sample_mean(values: Tensor, loss_mask: Tensor, sample_lengths: Tensor) -> Tensor:
    """Mean of `values` over each sample's loss tokens, shape (n,); 0 for a sample without any."""
    seg = segment_ids(sample_lengths, values.numel())
    n = sample_lengths.numel()
    mask = loss_mask.to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seg, values * mask)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seg, mask)
    return sums / counts.clamp(min=1)


def _indicator(condition: Tensor, loss_mask: Tensor) -> Tensor:
    return (condition & loss_mask).float()


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """PPO's −min(r·A, clip(r)·A) and where the clipped branch is the active (gradient-free) one."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = clipped < unclipped
    return loss, is_clipped


# --- objectives ---------------------------------------------------------------------------------------


@register_loss("aipo")
def aipo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """Token-level truncated importance sampling: −min(r, δ)·A (no gradient where r > δ)."""
    ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask).exp()
    loss = -torch.clamp(ratio, max=cfg.delta) * advantages
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(ratio > cfg.delta, loss_mask)})


@register_loss("ppo_clip")
def ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """GRPO/DAPO: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A); ε_high > ε_low is DAPO's clip-higher."""
    ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask).exp()
    loss, is_clipped = _clipped_surrogate(ratio, advantages, cfg)
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(is_clipped, loss_mask)})


@register_loss("gspo")
def gspo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """GSPO: the PPO surrogate on the sequence ratio s_i = exp(mean_t log r_t) of each sample.

    Token form (as in the paper and verl): log s_{i,t} = sg[log s_i] + lp_t − sg[lp_t], so every token
    carries the value s_i and the gradient s_i·∇lp_t; with seq-mean-token-mean aggregation this is
    exactly GSPO's sequence-level gradient. Clipping is per sequence (all tokens of a sample agree).
    Pair it with small ε (paper: 3e-4 / 4e-4).
    """
    log_ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask)
    seg = segment_ids(sample_lengths, logprobs.numel())
    log_seq_ratio = per_sample_mean(log_ratio.detach(), loss_mask, sample_lengths)[seg]
    token_log_ratio = log_seq_ratio + logprobs - logprobs.detach()
    ratio = torch.where(loss_mask, token_log_ratio, 0.0).exp()
    loss, is_clipped = _clipped_surrogate(ratio, advantages, cfg)
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(is_clipped, loss_mask)})


@register_loss("cispo")
def cispo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """CISPO (MiniMax-M1, verl's form): −sg[clip(r, 1−ε_low, 1+ε_high)]·A·lp_θ.

    The clipped ratio only weights the token; unlike PPO no token loses its gradient. TRL instead caps
    the weight at an absolute ε_high (min(r, ε_high)) with no lower bound; set eps_low=1 and
    eps_high=ε−1 here to get that form.
    """
    ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask).exp().detach()
    weight = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = -weight * advantages * logprobs
    is_clipped = (ratio < 1.0 - cfg.eps_low) | (ratio > 1.0 + cfg.eps_high)
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(is_clipped, loss_mask)})


@register_loss("masked_is")
def masked_is(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """Masked importance sampling (IcePop / MIS): −1[c_low ≤ r ≤ c_high]·r·A.

    With `cfg.sequence_mask`, a whole sample is also masked when its geometric-mean ratio
    exp(mean_t log r_t) leaves [c_low, c_high] (one wildly off token poisons the sequence).
    """
    log_ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask)
    ratio = log_ratio.exp()
    keep = (ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)
    if cfg.sequence_mask:
        seq_ratio = per_sample_mean(log_ratio.detach(), loss_mask, sample_lengths).exp()
        seq_keep = (seq_ratio >= cfg.mask_low) & (seq_ratio <= cfg.mask_high)
        keep = keep & seq_keep[segment_ids(sample_lengths, logprobs.numel())]
    loss = torch.where(keep & loss_mask, -ratio * advantages, 0.0)
    return LossOutput(loss, {"masked_frac": _indicator(~keep, loss_mask)})


# --- regularisers and aggregation ---------------------------------------------------------------------


def policy_loss(
    objective: LossFn,
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    sample_lengths: Tensor,
    cfg: LossConfig,
    ref_logprobs: Tensor | None = None,
) -> LossOutput:
    """`objective` plus the configured regularisers, per token.

    - `cfg.kl_tau > 0`: + kl_tau·(log r)², pulling the policy toward the behaviour policy (prime-rl).
    - `cfg.ref_kl_coef > 0` and `ref_logprobs` given: + ref_kl_coef·k3, with k3 = e^d − d − 1,
      d = lp_ref − lp_θ (Schulman's unbiased, always ≥ 0 estimator of KL(π_θ‖π_ref)); its mean is
      reported as the `ref_kl` stat.
    """
    out = objective(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg)
    loss, stats = out.per_token_loss, dict(out.stats)
    if cfg.kl_tau > 0:
        log_ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask)
        loss = loss + cfg.kl_tau * log_ratio.square()
    if ref_logprobs is not None:
        diff = masked_log_ratio(ref_logprobs.to(logprobs.dtype), logprobs, loss_mask)
        k3 = diff.exp() - diff - 1.0
        stats["ref_kl"] = k3.detach()
        if cfg.ref_kl_coef > 0:
            loss = loss + cfg.ref_kl_coef * k3
    return LossOutput(loss, stats)


def aggregate(
    per_token: Tensor,
    loss_mask: Tensor,
    sample_lengths: Tensor,
    how: Aggregation | str,
    *,
    global_tokens: int,
    global_samples: int,
    max_tokens: int,
) -> Tensor:
    """This micro-batch's share of the batch loss; summing all shares (all micro-batches, all ranks) = batch loss.

    - token-mean:              Σ m·ℓ / global_tokens                      (DAPO; the default)
    - seq-mean-token-mean:     Σ_i (Σ_t m·ℓ / Σ_t m) / global_samples     (GRPO, GSPO)
    - seq-mean-token-sum-norm: Σ m·ℓ / (global_samples · max_tokens)      (Dr.GRPO, constant normaliser)

    `global_tokens` / `global_samples` are counts over the WHOLE batch (every rank), never this
    micro-batch's own, which is why the result does not depend on how the batch was split. A sample
    never spans two micro-batches, so the per-sample mean is always complete.
    """
    if min(global_tokens, global_samples, max_tokens) <= 0:
        raise ValueError(
            f"aggregate: normalisers must be positive, got global_tokens={global_tokens}, "
            f"global_samples={global_samples}, max_tokens={max_tokens}"
        )
    masked = torch.where(loss_mask, per_token, 0.0)
    if how == "token-mean":
        return masked.sum() / global_tokens
    if how == "seq-mean-token-mean":
        return per_sample_mean(masked, loss_mask, sample_lengths).sum() / global_samples
    if how == "seq-mean-token-sum-norm":
        return masked.sum() / (global_samples * max_tokens)
    raise ValueError(f"unknown aggregation {how!r}: use one of {', '.join(AGGREGATIONS)}")


def mismatch_kl(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-token r − log r − 1 (k3 estimate of KL(μ‖π_θ), ≥ 0): trainer vs inference numerics."""
    log_ratio = masked_log_ratio(logprobs.detach(), inference_logprobs, loss_mask)
    return log_ratio.exp() - log_ratio - 1.0
