"""RL objectives (an open registry), off-policy corrections, and their aggregation by global counts.

Formulas, defaults and the papers they come from: docs/algorithms.md. Every objective is a function

    fn(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput

over one flat packed sequence of T tokens (several samples back to back; `sample_lengths` sums to T):
`logprobs` are the trainer's log-probs (with grad), `inference_logprobs` the behaviour policy's (the
log-probs inference reported when it sampled), `advantages` the sample's advantage on every token,
`loss_mask` true on sampled completion tokens. The importance ratio is r = exp(lp_θ − lp_μ); there
is no separate "old policy" forward pass.

Invariants every objective keeps (and a user objective should keep):
- `per_token_loss` is 0 wherever `loss_mask` is false, and no gradient flows through those tokens;
  the ratio is computed from a masked log-ratio, so garbage log-probs on prompt or padding tokens
  can never overflow into NaN.
- Finite for any finite input: log r is clamped to ±`LOG_RATIO_CLAMP` before `exp` (a token beyond
  the clamp gets no gradient), so a token the formula excludes (clipped, truncated, masked)
  contributes exactly zero gradient instead of inf·0 = NaN.
- With identical weights on both sides (lp_θ == lp_μ, so r = 1) the gradient of every built-in
  objective is REINFORCE's, −A·∇lp_θ per token, before aggregation.
- `stats` maps a metric name to per-token values whose mean over loss tokens is that metric
  (0/1 indicators, so `clip_frac` is the fraction of loss tokens that were clipped).

`policy_loss` first drops loss tokens whose inference log-prob no sampler can have produced
(`valid_inference_logprobs`, counted as `invalid_logprob_frac`), folds the on-policy distillation signal
into per-token advantages (`distill_advantages`: cfg.reward_weight·A + cfg.distill·(lp_teacher − sg[lp_θ])),
applies the optional off-policy correction (`cfg.is_correction`), the objective, and the regularisers
(`kl_tau`·(log r)² toward the behaviour policy, the entropy bonus, a k1/k2/k3 KL to a frozen reference); `aggregate`
reduces per-token losses to one micro-batch's share of the batch loss, normalised by GLOBAL counts so
that summing the shares of all micro-batches of all ranks gives the full-batch loss whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gyre.batch import LOGPROB_MAX, LOGPROB_MIN
from gyre.config.trainer import Aggregation, LossConfig
from gyre.imports import load_callable
from torch import Tensor

AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

#: |log r| is clamped to this before `exp` (verl's bound): e^20 ≈ 4.9e8 is finite in float32 and
#: bfloat16, and far beyond every clip, truncation and mask, so only tokens the formula already
#: excludes (or whose weight would be ≥ e^20) lose their gradient to the clamp.
LOG_RATIO_CLAMP = 20.0
#: GSPO: the sequence log-ratio log s_i is capped at this (verl), so s_i ≤ e^10.
SEQ_LOG_RATIO_MAX = 10.0
#: k3 reference KL: the estimate is capped at this (verl's low_var_kl).
KL_MAX = 10.0
#: Inference log-probs outside [min, max] on a loss token cannot come from sampling (`gyre.batch.LOGPROB_MIN`).
#: Such tokens are masked out of the loss and counted (`invalid_logprob_frac`).
INFERENCE_LOGPROB_MIN = LOGPROB_MIN
INFERENCE_LOGPROB_MAX = LOGPROB_MAX


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


def safe_ratio(log_ratio: Tensor) -> Tensor:
    """exp(log r) with log r clamped to ±LOG_RATIO_CLAMP: finite, no gradient beyond the clamp."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def valid_inference_logprobs(inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """`loss_mask` without the tokens whose inference log-prob is not a possible sampled log-prob."""
    lp = inference_logprobs
    return loss_mask & torch.isfinite(lp) & (lp >= INFERENCE_LOGPROB_MIN) & (lp <= INFERENCE_LOGPROB_MAX)


def per_sample_sum(values: Tensor, loss_mask: Tensor, sample_lengths: Tensor) -> Tensor:
    """Sum of `values` over each sample's loss tokens, shape (n,), accumulated in at least float32
    (bfloat16 cannot count past 256: 256 + 1 rounds back to 256)."""
    seg = segment_ids(sample_lengths, values.numel())
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    masked = torch.where(loss_mask, values, torch.zeros_like(values))
    return torch.zeros(sample_lengths.numel(), dtype=values.dtype, device=values.device).index_add(0, seg, masked)


def per_sample_mean(values: Tensor, loss_mask: Tensor, sample_lengths: Tensor) -> Tensor:
    """Mean of `values` over each sample's loss tokens, shape (n,); 0 for a sample without any."""
    counts = per_sample_sum(torch.ones_like(values), loss_mask, sample_lengths)
    return per_sample_sum(values, loss_mask, sample_lengths) / counts.clamp(min=1)


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
    ratio = safe_ratio(masked_log_ratio(logprobs, inference_logprobs, loss_mask))
    loss = -torch.clamp(ratio, max=cfg.delta) * advantages
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(ratio > cfg.delta, loss_mask)})


@register_loss("ppo_clip")
def ppo_clip(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """GRPO/DAPO: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A); ε_high > ε_low is DAPO's clip-higher.

    Dual-clip (`cfg.clip_ratio_c` = c): for A < 0 the loss is also capped at −c·A, so a token whose
    ratio against the stale behaviour policy exceeds c cannot dominate the batch (and gets no gradient).
    """
    ratio = safe_ratio(masked_log_ratio(logprobs, inference_logprobs, loss_mask))
    loss, is_clipped = _clipped_surrogate(ratio, advantages, cfg)
    stats = {"clip_frac": _indicator(is_clipped, loss_mask)}
    if cfg.clip_ratio_c is not None:
        cap = -cfg.clip_ratio_c * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap.to(loss.dtype), loss)
        stats["dual_clip_frac"] = _indicator(dual, loss_mask)
    return LossOutput(torch.where(loss_mask, loss, 0.0), stats)


@register_loss("gspo")
def gspo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """GSPO: the PPO surrogate on the sequence ratio s_i = exp(mean_t log r_t) of each sample.

    Token form (as in the paper and verl): log s_{i,t} = sg[log s_i] + lp_t − sg[lp_t], so every token
    carries the value s_i and the gradient s_i·∇lp_t; with seq-mean-token-mean aggregation (the
    default for gspo) this is exactly GSPO's sequence-level gradient. Clipping is per sequence (all
    tokens of a sample agree); log s_i is capped at SEQ_LOG_RATIO_MAX. Defaults ε = 3e-4 / 4e-4 (paper).
    """
    log_ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask)
    seg = segment_ids(sample_lengths, logprobs.numel())
    log_seq_ratio = per_sample_mean(log_ratio.detach(), loss_mask, sample_lengths).clamp(max=SEQ_LOG_RATIO_MAX)
    token_log_ratio = log_seq_ratio[seg] + logprobs - logprobs.detach()
    ratio = torch.where(loss_mask, token_log_ratio, 0.0).exp()
    loss, is_clipped = _clipped_surrogate(ratio, advantages, cfg)
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(is_clipped, loss_mask)})


@register_loss("cispo")
def cispo(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """CISPO (MiniMax-M1): −sg[clip(r, 1−ε_low, 1+ε_high)]·A·lp_θ.

    The clipped ratio only weights the token; unlike PPO no token loses its gradient. Default
    ε_low = 1 (no lower bound, as in the paper) and ε_high = 0.28. TRL's form caps the weight at an
    absolute value c with no lower bound: eps_low=1, eps_high=c−1 here.
    """
    ratio = safe_ratio(masked_log_ratio(logprobs, inference_logprobs, loss_mask)).detach()
    weight = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = -weight * advantages * logprobs
    is_clipped = (ratio < 1.0 - cfg.eps_low) | (ratio > 1.0 + cfg.eps_high)
    return LossOutput(torch.where(loss_mask, loss, 0.0), {"clip_frac": _indicator(is_clipped, loss_mask)})


@register_loss("masked_is")
def masked_is(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg: LossConfig) -> LossOutput:
    """Masked importance sampling (IcePop / MIS): −1[c_low ≤ r ≤ c_high]·r·A.

    With `cfg.sequence_mask`, a whole sample is also masked when its geometric-mean ratio
    exp(mean_t log r_t) leaves [c_low, c_high] (one wildly off token poisons the sequence).
    Bounds are compared in log space, so any ratio (even one beyond the exp clamp) is judged exactly.
    """
    log_ratio = masked_log_ratio(logprobs, inference_logprobs, loss_mask)
    keep = _within(log_ratio, cfg.mask_low, cfg.mask_high)
    if cfg.sequence_mask:
        seq_log_ratio = per_sample_mean(log_ratio.detach(), loss_mask, sample_lengths)
        keep = keep & _within(seq_log_ratio, cfg.mask_low, cfg.mask_high)[segment_ids(sample_lengths, logprobs.numel())]
    loss = torch.where(keep & loss_mask, -safe_ratio(log_ratio) * advantages, 0.0)
    return LossOutput(loss, {"masked_frac": _indicator(~keep, loss_mask)})


def _within(log_ratio: Tensor, low: float | None, high: float) -> Tensor:
    """low ≤ exp(log_ratio) ≤ high, decided on log r (no overflow); low None or 0 = no lower bound."""
    keep = log_ratio <= math.log(high)
    if low:
        keep = keep & (log_ratio >= math.log(low))
    return keep


# --- off-policy correction -----------------------------------------------------------------------------


def importance_weights(
    log_ratio: Tensor, loss_mask: Tensor, sample_lengths: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """Detached correction weights w (T,) of `cfg.is_correction` and where they were truncated/masked.

    q = π_θ/μ is the trainer/inference ratio of a token (token_*) or the product of a sample's token
    ratios, exp(Σ_t log r_t) (seq_*, as TRL and verl). *_tis: w = clip(q, is_cap_low, is_cap);
    *_mask: w = q where is_cap_low ≤ q ≤ is_cap, else 0. Computed in log space, and log w clamped to
    ±LOG_RATIO_CLAMP before `exp` as every ratio is, so w is finite also for a cap beyond float range
    (`is_cap = inf`, no truncation: a token at log q > 88.7 had w = inf and the step's gradient turned inf).
    """
    log_ratio = torch.where(loss_mask, log_ratio.detach(), torch.zeros_like(log_ratio))
    level, mode = cfg.is_correction.split("_")
    if level == "seq":
        log_ratio = per_sample_sum(log_ratio, loss_mask, sample_lengths)[segment_ids(sample_lengths, log_ratio.numel())]
    low = math.log(cfg.is_cap_low) if cfg.is_cap_low else -math.inf
    high = math.log(cfg.is_cap)
    outside = (log_ratio > high) | (log_ratio < low)
    if mode == "tis":
        weight = log_ratio.clamp(min=max(low, -LOG_RATIO_CLAMP), max=min(high, LOG_RATIO_CLAMP)).exp()
    else:
        weight = torch.where(outside, 0.0, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp())
    return torch.where(loss_mask, weight, 0.0), outside & loss_mask


# --- regularisers and aggregation ---------------------------------------------------------------------


def reference_kl(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from the sampled token, d = lp_ref − lp_θ (0 off the mask).

    k1 = −d (unbiased, can be negative), k2 = d²/2 (biased, ≥ 0), k3 = e^d − d − 1 (unbiased, ≥ 0;
    d clamped to ±LOG_RATIO_CLAMP and the estimate to ≤ KL_MAX, as verl's low_var_kl).
    """
    d = masked_log_ratio(ref_logprobs.to(logprobs.dtype), logprobs, loss_mask)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (d.exp() - d - 1.0).clamp(max=KL_MAX)
    raise ValueError(f"unknown ref_kl_estimator {estimator!r}: use k1, k2 or k3")


def distill_advantages(
    logprobs: Tensor,
    teacher_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    teacher_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token advantages with the teacher's signal, and the per-token reverse-KL estimate (0 off the mask).

    On-policy distillation (docs/algorithms.md): the student's tokens y_t ~ π_θ are scored by the teacher;
    the per-token reverse KL KL(π_θ‖π_T) at y_t is estimated by k_t = lp_θ − lp_T, and minimising it is
    REINFORCE with the per-token reward −k_t. So the objective sees the advantage

        A_t = reward_weight · A_i + distill · clamp(lp_T − sg[lp_θ], ±LOG_RATIO_CLAMP)

    and goes through the same ratio, clip and correction as the reward. With r = 1 its gradient is
    distill · (lp_θ − lp_T) · ∇lp_θ per token, whose expectation over y_t ~ π_θ is ∇KL(π_θ‖π_T) (the
    score-function identity; E[∇lp_θ] = 0). Returns (A_t, k_t); k_t is the `teacher_kl` metric.

    `teacher_mask` (None = every token): where it is False the teacher scored nothing (a sample it refused), so
    the token's distillation term is 0 and it keeps the reward's, A_t = reward_weight · A_i, as without a teacher.
    """
    scored = loss_mask if teacher_mask is None else loss_mask & teacher_mask
    gap = teacher_logprobs.float() - logprobs.detach().float()
    gap = torch.where(scored, gap, torch.zeros_like(gap))
    mixed = cfg.reward_weight * advantages.float() + cfg.distill * gap.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(loss_mask, mixed, torch.zeros_like(mixed)), -gap


def policy_loss(
    objective: LossFn,
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    sample_lengths: Tensor,
    cfg: LossConfig,
    ref_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    teacher_mask: Tensor | None = None,
    entropy: Tensor | None = None,
) -> LossOutput:
    """`objective` with the off-policy correction and the configured regularisers, per token.

    - Loss tokens whose inference log-prob is impossible (`valid_inference_logprobs`) are left out of
      every term (zero loss and gradient: objective, correction, regularisers; they still count in the
      aggregation's normalisers) and counted: stat `invalid_logprob_frac`. Such a token's record is
      corrupt, so nothing about it is trusted, not even for a term that would not need lp_μ.
    - `cfg.is_correction` ≠ none: the ratio splits as r = ρ·q with q = sg[r] the trainer/inference
      ratio (mismatch and staleness) and ρ = exp(lp_θ − sg[lp_θ]) (value 1, gradient ∇lp_θ). The
      objective sees ρ, i.e. the data as on-policy for the trainer's current parameters (the "old"
      policy of TRL/verl with one update per batch), and its per-token loss is multiplied by the
      correction weight w(q) (`importance_weights`). Stats `is_weight` (mean w) and `is_corrected_frac`.
    - `cfg.kl_tau > 0`: + kl_tau·(log r)², pulling the policy toward the behaviour policy (prime-rl).
    - `cfg.entropy_coeff > 0`: − entropy_coeff·H_t, H_t the policy's entropy at the token (`entropy`, with
      its gradient: `packed_logprobs(entropy_grad=True)`), an entropy bonus as verl's `entropy_coeff`.
    - `ref_logprobs` given: the `cfg.ref_kl_estimator` KL to the reference is reported as `ref_kl`
      and, with `cfg.ref_kl_coef > 0`, + ref_kl_coef·KL is added.
    - `teacher_logprobs` given: the reverse KL to the teacher is reported as `teacher_kl` and, with
      `cfg.distill > 0`, folded into the advantages (`distill_advantages`); `cfg.reward_weight` scales
      the reward's advantage either way. `teacher_mask` (None = all) says which tokens the teacher scored:
      the others keep their reward term alone; stat `teacher_frac` (the fraction of loss tokens it scored;
      `teacher_kl` is reported as the mean over those: `compute_gradients`).
    """
    mask = valid_inference_logprobs(inference_logprobs, loss_mask)
    stats = {"invalid_logprob_frac": (loss_mask & ~mask).float()}
    if teacher_logprobs is not None:
        mixed, teacher_kl = distill_advantages(logprobs, teacher_logprobs, advantages, mask, cfg, teacher_mask)
        stats["teacher_kl"] = teacher_kl
        stats["teacher_frac"] = (loss_mask if teacher_mask is None else loss_mask & teacher_mask).float()
        if cfg.distill > 0:
            advantages = mixed
    if cfg.reward_weight != 1 and (teacher_logprobs is None or cfg.distill == 0):
        advantages = cfg.reward_weight * advantages
    log_ratio = masked_log_ratio(logprobs, inference_logprobs, mask)
    if cfg.is_correction == "none":
        out = objective(logprobs, inference_logprobs, advantages, mask, sample_lengths, cfg)
        loss = out.per_token_loss
    else:
        weight, corrected = importance_weights(log_ratio, mask, sample_lengths, cfg)
        out = objective(logprobs, logprobs.detach(), advantages, mask, sample_lengths, cfg)
        loss = out.per_token_loss * weight.to(out.per_token_loss.dtype)
        stats.update(is_weight=weight, is_corrected_frac=corrected.float())
    stats.update(out.stats)
    if cfg.kl_tau > 0:
        loss = loss + cfg.kl_tau * log_ratio.square()
    if cfg.entropy_coeff > 0:
        if entropy is None:
            raise ValueError("loss.entropy_coeff > 0 needs the policy's per-token entropy (policy_loss(entropy=...))")
        loss = loss - cfg.entropy_coeff * torch.where(mask, entropy.to(loss.dtype), 0.0)
    if ref_logprobs is not None:
        kl = reference_kl(logprobs, ref_logprobs, mask, cfg.ref_kl_estimator)
        stats["ref_kl"] = kl.detach()
        if cfg.ref_kl_coef > 0:
            loss = loss + cfg.ref_kl_coef * kl
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
    - token-sum:               Σ m·ℓ                                      (no normaliser)
    - seq-mean-token-mean:     Σ_i (Σ_t m·ℓ / Σ_t m) / global_samples     (GRPO, GSPO)
    - seq-mean-token-sum:      Σ_i Σ_t m·ℓ / global_samples
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
    if how == "token-sum":
        return masked.sum()
    if how == "seq-mean-token-mean":
        return per_sample_mean(masked, loss_mask, sample_lengths).sum() / global_samples
    if how == "seq-mean-token-sum":
        return masked.sum() / global_samples
    if how == "seq-mean-token-sum-norm":
        return masked.sum() / (global_samples * max_tokens)
    raise ValueError(f"unknown aggregation {how!r}: use one of {', '.join(AGGREGATIONS)}")


def mismatch_log_ratio(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Detached per-token log r = lp_θ − lp_μ, clamped to ±LOG_RATIO_CLAMP as in the objectives; 0 off the valid
    loss tokens (those with a possible inference log-prob)."""
    mask = valid_inference_logprobs(inference_logprobs, loss_mask)
    return masked_log_ratio(logprobs.detach(), inference_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def mismatch_kl(logprobs: Tensor, inference_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-token r − log r − 1 (k3 estimate of KL(μ‖π_θ), ≥ 0): trainer vs inference numerics.

    0 on tokens whose inference log-prob is invalid; log r clamped as in the objectives (finite)."""
    log_ratio = mismatch_log_ratio(logprobs, inference_logprobs, loss_mask)
    return log_ratio.exp() - log_ratio - 1.0
