"""Every loss setting against an independent reference written straight from docs/algorithms.md.

The reference below shares no code with `gyre_trainer.loss`: it walks the samples one by one in float64 with
plain Python control flow, one formula per table row of the doc (objectives, off-policy corrections,
regularisers, on-policy distillation, aggregations). `policy_loss` + `aggregate` must give the same batch loss
and the same gradient with respect to the trainer's log-probs on random small batches that hold the awkward
cases: samples without loss tokens (empty rows), one-token samples, an all-masked batch, off-policy ratios on
both sides of every clip, and bfloat16 inputs (against the float64 reference, at bfloat16's precision).
"""

from __future__ import annotations

import math

import pytest
import torch
from gyre.config.trainer import LossConfig
from gyre_trainer.loss import AGGREGATIONS, aggregate, get_loss, policy_loss

CLAMP = 20.0  # docs: log r is clamped to [−20, 20] before exp


def sg(x: torch.Tensor) -> torch.Tensor:
    return x.detach()


def clip(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    return torch.clamp(x, min=low, max=high)


def ratio(log_r: torch.Tensor) -> torch.Tensor:
    return torch.exp(clip(log_r, -CLAMP, CLAMP))


def surrogate(r: torch.Tensor, a: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)."""
    return -torch.minimum(r * a, clip(r, 1 - eps_low, 1 + eps_high) * a)


def objective_tokens(cfg: LossConfig, lp, mu, adv) -> list[torch.Tensor]:
    """ℓ_t of one sample's loss tokens (docs: Objectives), the objective seeing r = exp(lp − mu)."""
    log_r = [lp[t] - mu[t] for t in range(len(lp))]
    if cfg.type == "aipo":
        return [-torch.clamp(ratio(x), max=cfg.delta) * adv[t] for t, x in enumerate(log_r)]
    if cfg.type == "ppo_clip":
        out = []
        for t, x in enumerate(log_r):
            loss = surrogate(ratio(x), adv[t], cfg.eps_low, cfg.eps_high)
            if cfg.clip_ratio_c is not None and adv[t] < 0:
                loss = torch.clamp(loss, max=float(-cfg.clip_ratio_c * adv[t]))
            out.append(loss)
        return out
    if cfg.type == "gspo":
        log_s = torch.clamp(sum(sg(x) for x in log_r) / len(log_r), max=10.0)
        return [surrogate(torch.exp(log_s + lp[t] - sg(lp[t])), adv[t], cfg.eps_low, cfg.eps_high)
                for t in range(len(lp))]  # fmt: skip
    if cfg.type == "cispo":
        return [-sg(clip(ratio(x), 1 - cfg.eps_low, 1 + cfg.eps_high)) * adv[t] * lp[t] for t, x in enumerate(log_r)]
    if cfg.type == "masked_is":

        def inside(value: float) -> bool:
            return cfg.mask_low <= value <= cfg.mask_high

        seq_ok = inside(math.exp(sum(float(sg(x)) for x in log_r) / len(log_r))) if cfg.sequence_mask else True
        return [-ratio(x) * adv[t] if seq_ok and inside(math.exp(float(sg(x)))) else lp[t] * 0
                for t, x in enumerate(log_r)]  # fmt: skip
    raise AssertionError(cfg.type)


def correction_weights(cfg: LossConfig, lp, mu) -> list[float]:
    """w of `is_correction` (docs: Off-policy correction), q = sg[r]."""
    low, high = cfg.is_cap_low or 0.0, cfg.is_cap
    q = [math.exp(float(sg(lp[t] - mu[t]))) for t in range(len(lp))]
    if cfg.is_correction.startswith("seq"):
        q = [math.exp(sum(float(sg(lp[t] - mu[t])) for t in range(len(lp))))] * len(lp)
    if cfg.is_correction.endswith("tis"):
        return [min(max(v, low), high) for v in q]
    return [v if low <= v <= high else 0.0 for v in q]


def reference_kl(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = −d, k2 = d²/2, k3 = e^d − d − 1 (d clamped to ±20, k3 capped at 10), d = lp_ref − lp_θ."""
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d**2 / 2
    d = clip(d, -CLAMP, CLAMP)
    return torch.clamp(torch.exp(d) - d - 1, max=10.0)


def reference_batch_loss(cfg: LossConfig, samples: list[dict], norms: dict) -> torch.Tensor:
    """The batch loss of docs/algorithms.md: per-token ℓ of every loss token, then the aggregation's formula."""
    sums, means = [], []
    for s in samples:
        keep = [t for t, m in enumerate(s["mask"]) if m]
        if not keep:
            sums.append(s["lp"].sum() * 0)
            means.append(s["lp"].sum() * 0)
            continue
        lp, mu = [s["lp"][t] for t in keep], [s["mu"][t] for t in keep]
        adv = [torch.tensor(s["adv"], dtype=torch.float64) for _ in keep]
        if s.get("teacher") is not None and cfg.distill > 0:  # A_t = w·A + β·clamp(lp_T − sg[lp], ±20)
            adv = [cfg.reward_weight * a + cfg.distill * clip(s["teacher"][t] - sg(s["lp"][t]), -CLAMP, CLAMP)
                   for a, t in zip(adv, keep, strict=True)]  # fmt: skip
        else:
            adv = [cfg.reward_weight * a for a in adv]
        if cfg.is_correction == "none":
            tokens = objective_tokens(cfg, lp, mu, adv)
        else:  # the objective sees ρ = exp(lp − sg[lp]), times the detached weight w(q)
            weights = correction_weights(cfg, lp, mu)
            tokens = [w * x for w, x in zip(weights, objective_tokens(cfg, lp, [sg(x) for x in lp], adv), strict=True)]
        for i, t in enumerate(keep):
            log_r = s["lp"][t] - s["mu"][t]
            tokens[i] = tokens[i] + cfg.kl_tau * log_r**2
            if s.get("ref") is not None and cfg.ref_kl_coef > 0:
                kl = reference_kl(s["ref"][t] - s["lp"][t], cfg.ref_kl_estimator)
                tokens[i] = tokens[i] + cfg.ref_kl_coef * kl
        total = sum(tokens)
        sums.append(total)
        means.append(total / len(keep))
    T, N, L = norms["global_tokens"], norms["global_samples"], norms["max_tokens"]
    return {
        "token-mean": lambda: sum(sums) / T,
        "token-sum": lambda: sum(sums),
        "seq-mean-token-mean": lambda: sum(means) / N,
        "seq-mean-token-sum": lambda: sum(sums) / N,
        "seq-mean-token-sum-norm": lambda: sum(sums) / (N * L),
    }[cfg.aggregation]()


def random_samples(seed: int, *, all_masked: bool = False, teacher: bool = False, ref: bool = False) -> list[dict]:
    """Samples of lengths 1..9 with an empty one, a one-token one, and log-ratios on both sides of every clip."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 4, 1, 9, 3]
    samples = []
    for i, n in enumerate(lengths):
        mask = (torch.rand(n, generator=gen) > 0.25).tolist()
        mask[0] = n == 1 and i == 1  # the first one-token sample is a loss token, the second is not
        if i == 2 or all_masked:
            mask = [False] * n  # a sample without a single loss token
        mu = -torch.rand(n, generator=gen, dtype=torch.float64) * 5 - 0.05
        log_r = torch.randn(n, generator=gen, dtype=torch.float64) * 0.6  # mostly beyond ε = 0.2/0.28
        if i == 4:
            log_r[2] = 2.5  # beyond δ, c, mask_high/is_cap bands
        lp = (mu + log_r).clamp(max=0.0)
        samples.append({
            "lp": lp, "mu": mu, "mask": mask,
            "adv": float(torch.randn((), generator=gen, dtype=torch.float64)) if i != 3 else -1.3,
            "teacher": (lp + torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0.0) if teacher else None,
            "ref": (lp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0.0) if ref else None,
        })  # fmt: skip
    return samples


def code_batch_loss(cfg: LossConfig, samples: list[dict], norms: dict, lp: torch.Tensor, dtype) -> torch.Tensor:
    """`policy_loss` + `aggregate` on the samples packed back to back (`lp` the flat trainer log-probs, with grad)."""

    def cat(key: str):
        if samples[0].get(key) is None:
            return None
        return torch.cat([s[key] for s in samples]).to(dtype)

    lengths = torch.tensor([len(s["lp"]) for s in samples])
    mask = torch.tensor([m for s in samples for m in s["mask"]])
    adv = torch.cat([torch.full((len(s["lp"]),), s["adv"], dtype=torch.float64) for s in samples]).to(dtype)
    out = policy_loss(get_loss(cfg.type), lp, cat("mu"), adv, mask, lengths, cfg,
                      ref_logprobs=cat("ref"), teacher_logprobs=cat("teacher"))  # fmt: skip
    return aggregate(out.per_token_loss, mask, lengths, cfg.aggregation, **norms)


def compare(
    cfg: LossConfig, samples: list[dict], dtype=torch.float64, rtol: float = 1e-10, atol: float = 1e-12
) -> None:
    tokens = sum(sum(s["mask"]) for s in samples)
    norms = {"global_tokens": max(tokens, 1), "global_samples": len(samples), "max_tokens": 9}
    leaves = [s["lp"].clone().requires_grad_(True) for s in samples]
    want = reference_batch_loss(cfg, [{**s, "lp": leaf} for s, leaf in zip(samples, leaves, strict=True)], norms)
    want_grad = torch.autograd.grad(want, leaves, allow_unused=True, materialize_grads=True) if want.requires_grad \
        else [torch.zeros_like(x) for x in leaves]  # fmt: skip
    want_grad = torch.cat(want_grad)
    flat = torch.cat([s["lp"] for s in samples]).to(dtype).requires_grad_(True)
    got = code_batch_loss(cfg, samples, norms, flat, dtype)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(flat.grad).all()
    if dtype == torch.float64:
        value_tol = tol = {"rtol": rtol, "atol": atol}
    else:  # bfloat16 carries 8 bits of mantissa: every input is rounded to 2^-8 relative before the formula
        tol = {"rtol": 0.05, "atol": 0.05 * max(want_grad.abs().max().item(), 1e-3)}
        value_tol = {"rtol": 0.05, "atol": 0.05 * max(abs(want.item()), 1e-3)}
    torch.testing.assert_close(got.detach().double(), want.detach(), **value_tol)
    torch.testing.assert_close(flat.grad.double(), want_grad, **tol)


OBJECTIVES = [
    {"type": "aipo", "delta": 2.0},
    {"type": "ppo_clip"},
    {"type": "ppo_clip", "clip_ratio_c": None},
    {"type": "ppo_clip", "eps_low": 0.1, "eps_high": 0.1, "clip_ratio_c": 1.5},
    {"type": "gspo"},
    {"type": "gspo", "eps_low": 0.2, "eps_high": 0.28},
    {"type": "cispo"},
    {"type": "cispo", "eps_low": 0.2, "eps_high": 0.5},
    {"type": "masked_is", "mask_low": 0.5, "mask_high": 2.0},
    {"type": "masked_is", "mask_low": 0.5, "mask_high": 2.0, "sequence_mask": True},
    {"type": "masked_is", "mask_low": 0.0, "mask_high": 1.5},
]
CORRECTIONS = [
    {"is_correction": "none"},
    {"is_correction": "token_tis", "is_cap": 1.5},
    {"is_correction": "token_tis", "is_cap": 2.0, "is_cap_low": 0.5},
    {"is_correction": "seq_tis", "is_cap": 1.5, "is_cap_low": 0.7},
    {"is_correction": "token_mask", "is_cap": 1.5, "is_cap_low": 0.6},
    {"is_correction": "seq_mask", "is_cap": 3.0},
]


def label(settings: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items())


@pytest.mark.parametrize("how", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS, ids=label)
@pytest.mark.parametrize("objective", OBJECTIVES, ids=label)
def test_every_objective_correction_and_aggregation_matches_the_documented_formulas(objective, correction, how):
    cfg = LossConfig(**objective, **correction, aggregation=how, kl_tau=0.05)
    for seed in range(3):
        compare(cfg, random_samples(seed))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("objective", [{"type": "ppo_clip"}, {"type": "gspo"}, {"type": "cispo"}], ids=label)
def test_the_reference_kl_term_matches_the_documented_estimators(objective, estimator):
    cfg = LossConfig(**objective, ref_kl_coef=0.3, ref_kl_estimator=estimator)
    compare(cfg, random_samples(4, ref=True))


@pytest.mark.parametrize(("reward_weight", "distill"), [(1.0, 0.5), (0.0, 1.0), (0.7, 2.0)])
@pytest.mark.parametrize("correction", [{"is_correction": "none"}, {"is_correction": "token_tis", "is_cap": 1.5}],
                         ids=label)  # fmt: skip
@pytest.mark.parametrize("objective", OBJECTIVES[:2] + OBJECTIVES[4:5] + OBJECTIVES[6:7] + OBJECTIVES[8:9], ids=label)
def test_distillation_advantages_match_the_documented_formula(objective, correction, reward_weight, distill):
    cfg = LossConfig(**objective, **correction, reward_weight=reward_weight, distill=distill)
    # the distillation advantage is computed in float32 (the precision of the log-probs it is made of)
    compare(cfg, random_samples(5, teacher=True), rtol=1e-6, atol=1e-7)


def test_a_reward_weight_without_a_teacher_scales_the_advantage():
    compare(LossConfig(type="ppo_clip", reward_weight=0.25), random_samples(6))


@pytest.mark.parametrize("how", AGGREGATIONS)
@pytest.mark.parametrize("objective", OBJECTIVES, ids=label)
def test_an_all_masked_batch_has_zero_loss_and_gradient(objective, how):
    cfg = LossConfig(**objective, aggregation=how, kl_tau=0.1, is_correction="seq_tis")
    samples = random_samples(7, all_masked=True)
    compare(cfg, samples)
    flat = torch.cat([s["lp"] for s in samples]).requires_grad_(True)
    norms = {"global_tokens": 1, "global_samples": len(samples), "max_tokens": 9}
    loss = code_batch_loss(cfg, samples, norms, flat, torch.float64)
    loss.backward()
    assert loss.item() == 0.0 and not flat.grad.any()


@pytest.mark.parametrize("correction", CORRECTIONS[:2], ids=label)
@pytest.mark.parametrize("objective", OBJECTIVES, ids=label)
def test_bfloat16_agrees_with_the_float64_reference_to_its_precision(objective, correction):
    cfg = LossConfig(**objective, **correction, kl_tau=0.05)
    for seed in range(2):
        samples = random_samples(seed)
        # the reference sees the values bfloat16 holds, so only the arithmetic's rounding differs
        rounded = [{**s, **{k: s[k].to(torch.bfloat16).double() for k in ("lp", "mu")}} for s in samples]
        compare(cfg, rounded, dtype=torch.bfloat16)
