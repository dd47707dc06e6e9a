"""RL objectives on absurd inputs: finite loss and gradient, excluded tokens contribute exactly zero.

One token of a small packed batch is given a log-ratio of ±1e4 (float32's exp overflows beyond 88.7).
Where the formula excludes that token (clipped, truncated, masked; for gspo the whole sample), the
gradient must equal the gradient of the same batch without it, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from gyre.config.trainer import LossConfig
from gyre_trainer.loss import (
    INFERENCE_LOGPROB_MIN,
    LOG_RATIO_CLAMP,
    LOSSES,
    SEQ_LOG_RATIO_MAX,
    aggregate,
    get_loss,
    mismatch_kl,
    per_sample_mean,
    policy_loss,
)
from pydantic import ValidationError

LENGTHS = [4, 4]
MASK = [False, True, True, True, False, True, True, True]
TRAINER_LP = [0.0, -1.2, -0.4, -2.0, 0.0, -0.9, -1.5, -0.3]
BEHAVIOUR_LP = [0.0, -1.1, -0.5, -1.8, 0.0, -1.0, -1.4, -0.3]  # sample 1: mean log r ≈ 0 (inside gspo's ε)
EXTREME = 2  # the token given the absurd log-ratio (sample 0)
NORMS = {"global_tokens": 2000, "global_samples": 4, "max_tokens": 1000}


def objective_grad(name, cfg, adv_sign, log_ratio, dtype, mask=MASK):
    """Per-token loss and d(Σ loss)/d lp of objective `name` with token EXTREME at `log_ratio`."""
    lp = torch.tensor(TRAINER_LP, dtype=dtype, requires_grad=True)
    behaviour = torch.tensor(BEHAVIOUR_LP, dtype=torch.float32)
    behaviour[EXTREME] = TRAINER_LP[EXTREME] - log_ratio
    adv = torch.tensor([adv_sign * 1.5] * 4 + [0.7] * 4, dtype=torch.float32)
    out = get_loss(name)(lp, behaviour, adv, torch.tensor(mask), torch.tensor(LENGTHS), cfg)
    out.per_token_loss.sum().backward()
    return out.per_token_loss.detach(), lp.grad


def without(*tokens):
    return [m and t not in tokens for t, m in enumerate(MASK)]


def excluded_by_formula(name: str, cfg: LossConfig, adv_sign: int, log_ratio: float) -> list[int] | None:
    """Tokens whose gradient the formula removes when token EXTREME has this log-ratio (None: it keeps it)."""
    if name in ("aipo", "masked_is"):
        return [EXTREME]  # truncated (r > δ) / masked; at r ≈ 0 aipo's gradient r·A vanishes too
    if name == "ppo_clip":
        if log_ratio > 0 and adv_sign < 0 and cfg.clip_ratio_c is None:
            return None  # −r·A with A < 0 and no dual-clip: the formula's gradient is unbounded
        return [EXTREME]  # clipped, dual-clipped, or r ≈ 0 with A > 0
    if name == "gspo":
        # the sequence ratio of sample 0 is e^10 (capped) or 0: clipped, or s·A = 0 — unless A < 0, r huge
        return None if (log_ratio > 0 and adv_sign < 0) else [1, 2, 3]
    return None  # cispo: every token keeps a (clipped) weight


CASES = [(name, LossConfig(type=name)) for name in sorted(LOSSES)]
CASES.append(("ppo_clip", LossConfig(type="ppo_clip", clip_ratio_c=None)))
CASES.append(("masked_is", LossConfig(type="masked_is", sequence_mask=True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("log_ratio", [1e4, -1e4])
@pytest.mark.parametrize("adv_sign", [1, -1])
@pytest.mark.parametrize(("name", "cfg"), CASES, ids=lambda c: getattr(c, "type", c))
def test_an_absurd_log_ratio_gives_a_finite_loss_and_exactly_zero_gradient_where_excluded(
    name, cfg, adv_sign, log_ratio, dtype
):
    loss, grad = objective_grad(name, cfg, adv_sign, log_ratio, dtype)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    excluded = excluded_by_formula(name, cfg, adv_sign, log_ratio)
    if name == "masked_is" and cfg.sequence_mask:
        excluded = [1, 2, 3]  # the geometric-mean ratio of sample 0 leaves the band: the sample goes
    if excluded is None:
        return
    _, reference = objective_grad(name, cfg, adv_sign, log_ratio, dtype, mask=without(*excluded))
    assert torch.equal(grad, reference), (grad, reference)
    assert reference[[5, 6, 7]].abs().sum() > 0  # the other sample still learns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gspo_and_cispo_keep_a_finite_gradient_where_the_formula_keeps_the_token(dtype):
    # gspo, A < 0, log s capped at 10: every token of the sample gets −A·e^10·∇lp.
    _, grad = objective_grad("gspo", LossConfig(type="gspo"), -1, 1e4, dtype)
    want = torch.tensor(1.5 * torch.e**SEQ_LOG_RATIO_MAX, dtype=dtype).item()
    assert grad[[1, 2, 3]].tolist() == pytest.approx([want] * 3, rel=1e-2)
    # cispo at r = e^1e4: the weight is capped at 1 + ε_high, the gradient is −1.28·A.
    _, grad = objective_grad("cispo", LossConfig(type="cispo"), 1, 1e4, dtype)
    assert grad[EXTREME].item() == pytest.approx(-1.28 * 1.5, rel=1e-2)


@pytest.mark.parametrize("correction", ["none", "token_tis", "seq_tis", "token_mask", "seq_mask"])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_policy_loss_masks_and_counts_impossible_inference_logprobs(name, correction, dtype):
    """Inference log-probs below e^-104 or above 0 are left out of the loss, with any correction."""
    lp = torch.tensor(TRAINER_LP, dtype=dtype, requires_grad=True)
    behaviour = torch.tensor(BEHAVIOUR_LP)
    behaviour[2], behaviour[6] = -9999.0, 9999.0  # finite, but no sampler reports these
    behaviour[3] = INFERENCE_LOGPROB_MIN  # the bound itself is valid
    cfg = LossConfig(type=name, is_correction=correction, kl_tau=0.1, ref_kl_coef=0.1)
    adv = torch.tensor([1.5] * 4 + [-0.7] * 4)
    ref = torch.tensor(TRAINER_LP) - 30.0
    out = policy_loss(get_loss(name), lp, behaviour, adv, torch.tensor(MASK), torch.tensor(LENGTHS), cfg, ref)
    out.per_token_loss.sum().backward()
    assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(lp.grad).all()
    assert out.stats["invalid_logprob_frac"].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    # every term, the regularisers included, leaves the invalid tokens out: zero loss, zero gradient
    assert out.per_token_loss[[2, 6]].tolist() == [0.0, 0.0]
    assert lp.grad[[2, 6]].tolist() == [0.0, 0.0]
    assert lp.grad[[1, 3, 5, 7]].abs().min() > 0  # the valid tokens still learn


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_reference_kl_leaves_a_token_with_an_invalid_inference_logprob_alone(estimator):
    """docs/algorithms.md: an invalid inference log-prob removes the token from the loss, every term included.

    Before the fix the KL term still acted there: with ref_kl_coef = 0.1 and lp_ref − lp_θ = −2 (k3) the
    token got loss 0.1·(e^−2 + 1) = 0.1135 and gradient 0.1·(1 − e^−2) = 0.0865."""
    lp = torch.tensor([0.0, -1.0, -1.0], requires_grad=True)
    behaviour = torch.tensor([0.0, -1.0, 9999.0])  # token 2 was never sampled with that log-prob
    ref = lp.detach() - 2.0
    mask, lengths = torch.tensor([False, True, True]), torch.tensor([3])
    cfg = LossConfig(type="ppo_clip", ref_kl_coef=0.1, ref_kl_estimator=estimator)
    out = policy_loss(get_loss("ppo_clip"), lp, behaviour, torch.zeros(3), mask, lengths, cfg, ref)
    out.per_token_loss.sum().backward()
    expected = {"k1": 0.2, "k2": 0.2, "k3": 0.1 * (torch.e**-2 + 1)}[estimator]
    assert out.per_token_loss.tolist() == pytest.approx([0.0, expected, 0.0], abs=1e-6)
    assert lp.grad[2].item() == 0.0 and lp.grad[1].item() != 0.0
    assert out.stats["ref_kl"][2].item() == 0.0


@pytest.mark.parametrize("correction", ["token_tis", "seq_tis", "token_mask", "seq_mask"])
@pytest.mark.parametrize("trainer_lp", [-1e4, -150.0])
def test_corrections_are_finite_when_the_trainer_finds_a_sampled_token_impossible(correction, trainer_lp):
    lp_values = list(TRAINER_LP)
    lp_values[EXTREME] = trainer_lp  # log r = −1e4 with a valid inference log-prob
    lp = torch.tensor(lp_values, requires_grad=True)
    for name in LOSSES:
        cfg = LossConfig(type=name, is_correction=correction)
        adv = torch.tensor([1.5] * 4 + [-0.7] * 4)
        out = policy_loss(
            get_loss(name), lp, torch.tensor(BEHAVIOUR_LP), adv, torch.tensor(MASK), torch.tensor(LENGTHS), cfg
        )
        out.per_token_loss.sum().backward()
        assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(lp.grad).all(), name
        assert lp.grad[EXTREME].abs().item() < 1e-6, name  # weight ≤ e^-20 or masked
        lp.grad = None


def test_per_sample_means_of_long_bfloat16_samples_are_exact():
    """bfloat16 has 8 mantissa bits: counting 1000 tokens in it would stop at 256."""
    lengths = torch.tensor([1000, 3])
    values = torch.full((1003,), 0.5, dtype=torch.bfloat16)
    assert per_sample_mean(values, torch.ones(1003, dtype=torch.bool), lengths).tolist() == [0.5, 0.5]
    per_token = torch.ones(1003, dtype=torch.bfloat16)
    share = aggregate(per_token, torch.ones(1003, dtype=torch.bool), lengths, "seq-mean-token-mean", **NORMS)
    assert share.item() == pytest.approx(2 / 4)


def test_mismatch_kl_is_finite_on_absurd_inputs():
    lp = torch.tensor([0.0, -1.0, -9000.0, -2.0])
    behaviour = torch.tensor([0.0, -9999.0, -1.0, -2.0])
    got = mismatch_kl(lp, behaviour, torch.tensor([False, True, True, True]))
    assert torch.isfinite(got).all()
    assert got[1] == 0  # an impossible inference log-prob is left out
    assert got[2].item() == pytest.approx(torch.e**-20 + 20 - 1)  # log r clamped at −20


def test_objective_defaults_are_the_published_methods():
    gspo = LossConfig(type="gspo")
    assert (gspo.aggregation, gspo.eps_low, gspo.eps_high) == ("seq-mean-token-mean", 3e-4, 4e-4)
    cispo = LossConfig(type="cispo")
    assert (cispo.aggregation, cispo.eps_low, cispo.eps_high) == ("token-mean", 1.0, 0.28)
    ppo = LossConfig()
    assert (ppo.aggregation, ppo.eps_low, ppo.eps_high, ppo.clip_ratio_c) == ("token-mean", 0.2, 0.28, 3.0)
    assert LossConfig(type="my.module:fn").eps_low == 0.2
    explicit = LossConfig(type="gspo", aggregation="token-mean", eps_low=0.1)
    assert (explicit.aggregation, explicit.eps_low, explicit.eps_high) == ("token-mean", 0.1, 4e-4)
    assert LossConfig(is_correction="token_tis").is_cap == 3.0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("delta", 0.5),
        ("mask_low", 1.5),
        ("mask_high", 0.9),
        ("clip_ratio_c", 1.0),
        ("is_cap", 0.8),
        ("is_cap_low", 1.0),
        ("eps_low", -0.1),
        ("aggregation", "token-avg"),
        ("is_correction", "tis"),
        ("ref_kl_estimator", "k4"),
    ],
)
def test_settings_that_zero_every_gradient_are_rejected_naming_the_key(key, value):
    with pytest.raises(ValidationError) as info:
        LossConfig(**{key: value})
    assert info.value.errors()[0]["loc"] == (key,)


@pytest.mark.parametrize("correction", ["token_tis", "seq_tis", "token_mask", "seq_mask"])
@pytest.mark.parametrize("is_cap", [float("inf"), 1e39])
def test_a_cap_beyond_float_range_keeps_the_correction_weight_finite(correction, is_cap):
    """`is_cap = inf` (no truncation) or any cap above e^88.7: the weight of a token at log q = 95 was exp(95) = inf in
    float32, the step's gradient inf (the update skipped at every such token). Its log-weight is clamped at
    LOG_RATIO_CLAMP as every ratio is."""
    behaviour = list(BEHAVIOUR_LP)
    behaviour[EXTREME] = TRAINER_LP[EXTREME] - 95.0
    lp = torch.tensor(TRAINER_LP, requires_grad=True)
    for name in LOSSES:
        cfg = LossConfig(type=name, is_correction=correction, is_cap=is_cap)
        adv = torch.tensor([1.5] * 4 + [-0.7] * 4)
        out = policy_loss(get_loss(name), lp, torch.tensor(behaviour), adv, torch.tensor(MASK), torch.tensor(LENGTHS),
                          cfg)  # fmt: skip
        out.per_token_loss.sum().backward()
        assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(lp.grad).all(), name
        assert out.stats["is_weight"].max() <= math.exp(LOG_RATIO_CLAMP) * 1.0001, name
        lp.grad = None


@pytest.mark.parametrize(
    ("key", "value"),
    [("delta", float("nan")), ("is_cap", float("nan")), ("eps_high", float("nan")), ("distill", float("inf")),
     ("reward_weight", float("inf")), ("kl_tau", float("inf")), ("ref_kl_coef", float("inf")),
     ("entropy_coeff", float("inf")), ("entropy_coeff", float("nan")), ("entropy_coeff", -0.01)],
)  # fmt: skip
def test_nan_settings_and_infinite_weights_are_refused_naming_the_key(key, value):
    """NaN passes every bound check (NaN < 1 is False) and an infinite weight times a masked token's 0 is NaN: either
    made every loss NaN and every update skipped, silently."""
    with pytest.raises(ValidationError) as info:
        LossConfig(**{key: value})
    assert info.value.errors()[0]["loc"] == (key,)
    assert LossConfig(is_cap=float("inf"), delta=float("inf"), mask_high=float("inf")).is_cap == float("inf")
