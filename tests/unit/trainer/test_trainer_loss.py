"""RL objectives: hand-computed values and gradients, REINFORCE at r = 1, aggregation by global counts."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch
from gyre.config.trainer import LossConfig
from gyre_trainer.loss import AGGREGATIONS, LOSSES, aggregate, get_loss, mismatch_kl, policy_loss

# Two packed samples, lengths 3 and 4. Tokens 0 and 3 start a sample (trainer log-prob 0, never in
# the loss); token 0 carries a garbage behaviour log-prob that must not leak into anything.
LENGTHS = [3, 4]
MASK = [False, True, True, False, True, True, True]
LOG_RATIO = [0.0, 0.1, 0.5, 0.0, -0.4, 0.05, 2.5]  # lp_θ − lp_μ on the loss tokens
INFERENCE_LP = [-50.0, -1.2, -0.7, 0.0, -2.0, -0.3, -3.1]
ADV = [1.5, 1.5, 1.5, -0.8, -0.8, -0.8, -0.8]
LOSS_TOKENS = [1, 2, 4, 5, 6]
SAMPLE_OF = [0, 0, 0, 1, 1, 1, 1]


def trainer_lp() -> list[float]:
    return [INFERENCE_LP[t] + LOG_RATIO[t] if MASK[t] else 0.0 for t in range(7)]


def run(name: str, cfg: LossConfig, ref_lp: list[float] | None = None):
    """Per-token loss, stats and d(Σ loss)/d lp of objective `name` on the fixed tensors."""
    lp = torch.tensor(trainer_lp(), dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(ref_lp, dtype=torch.float64) if ref_lp is not None else None
    out = policy_loss(
        get_loss(name),
        lp,
        torch.tensor(INFERENCE_LP, dtype=torch.float64),
        torch.tensor(ADV, dtype=torch.float64),
        torch.tensor(MASK),
        torch.tensor(LENGTHS),
        cfg,
        ref_logprobs=ref,
    )
    out.per_token_loss.sum().backward()
    return out.per_token_loss.detach().tolist(), {k: v.tolist() for k, v in out.stats.items()}, lp.grad.tolist()


def check(got_loss, got_grad, expected: dict[int, tuple[float, float]]) -> None:
    """expected: loss token -> (loss, d loss / d lp); every other token must be exactly 0 in both."""
    for t in range(7):
        want_loss, want_grad = expected.get(t, (0.0, 0.0))
        assert got_loss[t] == pytest.approx(want_loss, rel=1e-12, abs=1e-12), f"loss of token {t}"
        assert got_grad[t] == pytest.approx(want_grad, rel=1e-12, abs=1e-12), f"gradient of token {t}"


def test_aipo_truncates_the_ratio_at_delta():
    cfg = LossConfig(type="aipo", delta=8.0)
    loss, stats, grad = run("aipo", cfg)
    expected = {}
    for t in LOSS_TOKENS:
        r, a = math.exp(LOG_RATIO[t]), ADV[t]
        # −min(r, δ)·A; d/dlp = −r·A below δ, 0 above (truncated).
        expected[t] = (-min(r, 8.0) * a, -r * a if r < 8.0 else 0.0)
    check(loss, grad, expected)
    assert stats["clip_frac"] == [0, 0, 0, 0, 0, 0, 1]  # only r = e^2.5 ≈ 12.2 exceeds δ
    assert expected[6] == (pytest.approx(6.4), 0.0)


def test_ppo_clip_by_hand():
    cfg = LossConfig(type="ppo_clip", eps_low=0.2, eps_high=0.28, clip_ratio_c=None)
    loss, stats, grad = run("ppo_clip", cfg)
    r = {t: math.exp(LOG_RATIO[t]) for t in LOSS_TOKENS}
    expected = {
        1: (-r[1] * 1.5, -r[1] * 1.5),  # r ≈ 1.105 inside [0.8, 1.28]
        2: (-1.28 * 1.5, 0.0),  # A > 0, r ≈ 1.65 > 1.28: clipped, no gradient
        4: (0.8 * 0.8, 0.0),  # A < 0, r ≈ 0.67 < 0.8: clipped at 1 − ε_low
        5: (r[5] * 0.8, r[5] * 0.8),
        6: (r[6] * 0.8, r[6] * 0.8),  # A < 0, r ≈ 12.2, no dual-clip: min picks r·A, the gradient flows
    }
    check(loss, grad, expected)
    assert stats["clip_frac"] == [0, 0, 1, 0, 1, 0, 0]
    assert "dual_clip_frac" not in stats


def test_ppo_clip_dual_clip_caps_negative_advantages_at_c():
    """Dual-clip (default c = 3): for A < 0 the loss is min(PPO loss, −c·A)."""
    r = {t: math.exp(LOG_RATIO[t]) for t in LOSS_TOKENS}
    loss, stats, grad = run("ppo_clip", LossConfig(type="ppo_clip"))
    assert LossConfig().clip_ratio_c == 3.0
    expected = {
        1: (-r[1] * 1.5, -r[1] * 1.5),
        2: (-1.28 * 1.5, 0.0),
        4: (0.8 * 0.8, 0.0),
        5: (r[5] * 0.8, r[5] * 0.8),  # r ≈ 1.05 < 3: PPO's loss 0.84 is below the cap 2.4
        6: (3 * 0.8, 0.0),  # r ≈ 12.2 > 3 with A = −0.8: capped at −c·A = 2.4, no gradient
    }
    check(loss, grad, expected)
    assert stats["dual_clip_frac"] == [0, 0, 0, 0, 0, 0, 1]
    assert stats["clip_frac"] == [0, 0, 1, 0, 1, 0, 0]
    # c = 1.02: token 5 (r ≈ 1.051, A < 0) is capped too; A > 0 tokens never are.
    loss, stats, grad = run("ppo_clip", LossConfig(type="ppo_clip", clip_ratio_c=1.02))
    expected.update({5: (1.02 * 0.8, 0.0), 6: (1.02 * 0.8, 0.0)})
    check(loss, grad, expected)
    assert stats["dual_clip_frac"] == [0, 0, 0, 0, 0, 1, 1]


def test_gspo_clips_whole_sequences_on_the_geometric_mean_ratio():
    cfg = LossConfig(type="gspo", eps_low=0.2, eps_high=0.28)
    loss, stats, grad = run("gspo", cfg)
    s0 = math.exp((0.1 + 0.5) / 2)  # ≈ 1.35 > 1.28 with A = +1.5: clipped
    s1 = math.exp((-0.4 + 0.05 + 2.5) / 3)  # ≈ 2.05 with A = −0.8: unclipped
    expected = {1: (-1.28 * 1.5, 0.0), 2: (-1.28 * 1.5, 0.0)}
    # Token form: value s_i on every token, d/dlp_t = s_i · (−A).
    expected.update({t: (s1 * 0.8, s1 * 0.8) for t in (4, 5, 6)})
    check(loss, grad, expected)
    assert s0 > 1.28
    assert stats["clip_frac"] == [0, 1, 1, 0, 0, 0, 0]


def test_cispo_weights_by_the_detached_clipped_ratio():
    cfg = LossConfig(type="cispo", eps_low=0.2, eps_high=0.28)
    loss, stats, grad = run("cispo", cfg)
    lp = trainer_lp()
    expected = {}
    for t in LOSS_TOKENS:
        weight = min(max(math.exp(LOG_RATIO[t]), 0.8), 1.28)
        expected[t] = (-weight * ADV[t] * lp[t], -weight * ADV[t])  # never zero: CISPO keeps every gradient
    check(loss, grad, expected)
    assert stats["clip_frac"] == [0, 0, 1, 0, 1, 0, 1]


def test_cispo_default_has_no_lower_bound():
    cfg = LossConfig(type="cispo")
    assert (cfg.eps_low, cfg.eps_high) == (1.0, 0.28)
    loss, stats, grad = run("cispo", cfg)
    lp = trainer_lp()
    expected = {}
    for t in LOSS_TOKENS:
        weight = min(math.exp(LOG_RATIO[t]), 1.28)  # token 4's r ≈ 0.67 is kept as it is
        expected[t] = (-weight * ADV[t] * lp[t], -weight * ADV[t])
    check(loss, grad, expected)
    assert stats["clip_frac"] == [0, 0, 1, 0, 0, 0, 1]


def test_masked_is_masks_tokens_outside_the_band():
    cfg = LossConfig(type="masked_is", mask_low=0.7, mask_high=8.0)
    loss, stats, grad = run("masked_is", cfg)
    expected = {}
    for t in (1, 2, 5):  # r ≈ 0.67 (token 4) and ≈ 12.2 (token 6) are masked
        r = math.exp(LOG_RATIO[t])
        expected[t] = (-r * ADV[t], -r * ADV[t])
    check(loss, grad, expected)
    assert stats["masked_frac"] == [0, 0, 0, 0, 1, 0, 1]


def test_masked_is_sequence_mask_drops_a_sample_whose_geometric_mean_leaves_the_band():
    cfg = LossConfig(type="masked_is", mask_low=0.7, mask_high=2.0, sequence_mask=True)
    loss, stats, grad = run("masked_is", cfg)
    # Sample 1's geometric-mean ratio e^(2.15/3) ≈ 2.05 > 2: all of it goes; sample 0 (≈ 1.35) stays.
    expected = {t: (-math.exp(LOG_RATIO[t]) * 1.5, -math.exp(LOG_RATIO[t]) * 1.5) for t in (1, 2)}
    check(loss, grad, expected)
    assert stats["masked_frac"] == [0, 0, 0, 0, 1, 1, 1]


def test_kl_tau_and_reference_k3_regularisers_by_hand():
    ref_lp = [0.0, -1.0, -0.9, 0.0, -2.2, -0.2, -1.0]
    cfg = LossConfig(type="aipo", kl_tau=0.3, ref_kl_coef=0.05)
    loss, stats, grad = run("aipo", cfg, ref_lp=ref_lp)
    lp = trainer_lp()
    expected = {}
    for t in LOSS_TOKENS:
        lr, r, a = LOG_RATIO[t], math.exp(LOG_RATIO[t]), ADV[t]
        d = ref_lp[t] - lp[t]
        value = -min(r, 8.0) * a + 0.3 * lr**2 + 0.05 * (math.exp(d) - d - 1)
        slope = (-r * a if r < 8 else 0.0) + 0.3 * 2 * lr + 0.05 * (1 - math.exp(d))
        expected[t] = (value, slope)
    check(loss, grad, expected)
    for t in range(7):
        d = ref_lp[t] - lp[t]
        assert stats["ref_kl"][t] == pytest.approx(math.exp(d) - d - 1 if MASK[t] else 0.0)


def test_entropy_bonus_by_hand():
    """− entropy_coeff·H_t on every valid loss token, with the entropy's own gradient; nothing elsewhere."""
    entropy_values = [9.0, 1.5, 0.25, 9.0, 2.0, 0.5, 3.0]
    inference_lp = list(INFERENCE_LP)
    inference_lp[5] = 5.0  # an impossible inference log-prob: the token is out of every term, the bonus too
    lp = torch.tensor(trainer_lp(), dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor(entropy_values, dtype=torch.float64, requires_grad=True)
    cfg = LossConfig(type="aipo", entropy_coeff=0.1)
    args = (lp, torch.tensor(inference_lp, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64),
            torch.tensor(MASK), torch.tensor(LENGTHS), cfg)  # fmt: skip
    out = policy_loss(get_loss("aipo"), *args, entropy=entropy)
    without = policy_loss(get_loss("aipo"), *args[:-1], LossConfig(type="aipo")).per_token_loss.detach()
    out.per_token_loss.sum().backward()
    bonus = (out.per_token_loss.detach() - without).tolist()
    assert bonus == pytest.approx([0, -0.15, -0.025, 0, -0.2, 0, -0.3], abs=1e-12)
    assert entropy.grad.tolist() == pytest.approx([0, -0.1, -0.1, 0, -0.1, 0, -0.1], abs=1e-12)
    with pytest.raises(ValueError, match="entropy_coeff > 0 needs the policy's per-token entropy"):
        policy_loss(get_loss("aipo"), *args)


@pytest.mark.parametrize(("estimator", "gradient_of"), [("k1", None), ("k2", "reverse"), ("k3", "forward")])
def test_what_each_reference_kl_estimator_pulls_toward_as_a_loss(estimator, gradient_of):
    """The trainer differentiates the estimate at the sampled token, the sampling held fixed (as verl and TRL do):
    the step's expected gradient is Σ_y sg[π_θ(y)]·∇k(y), exact here over a 12-token categorical policy. k1's is 0
    (E[∇lp_θ] = 0), k2's the gradient of KL(π_θ‖π_ref), k3's that of KL(π_ref‖π_θ) (docs/algorithms.md)."""
    from gyre_trainer.loss import reference_kl

    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(12, generator=generator, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(12, generator=generator, dtype=torch.float64), -1)
    lp = torch.log_softmax(theta, -1)
    per_token = reference_kl(lp, ref, torch.ones(12, dtype=torch.bool), estimator)
    assert per_token.detach().max() < 10 and (ref - lp).detach().abs().max() < 20  # k3's clamps are not in play
    (expected_step,) = torch.autograd.grad((lp.exp().detach() * per_token).sum(), theta, retain_graph=True)
    if gradient_of is None:
        assert expected_step.abs().max() < 1e-12
        return
    p, q = lp.exp(), ref.exp()
    kl = (p * (lp - ref)).sum() if gradient_of == "reverse" else (q * (ref - lp)).sum()
    (exact,) = torch.autograd.grad(kl, theta)
    assert exact.norm() > 0.1
    torch.testing.assert_close(expected_step, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_estimators_by_hand(estimator):
    ref_lp = [0.0, -1.0, -0.9, 0.0, -2.2, -0.2, -25.0]  # token 6: d = lp_ref − lp_θ ≈ −24.4
    loss, stats, grad = run("aipo", LossConfig(type="aipo", ref_kl_coef=0.5, ref_kl_estimator=estimator), ref_lp)
    lp = trainer_lp()
    expected = {}
    for t in LOSS_TOKENS:
        r, a, d = math.exp(LOG_RATIO[t]), ADV[t], ref_lp[t] - lp[t]
        if estimator == "k1":
            kl, slope = -d, 1.0  # log π_θ − log π_ref
        elif estimator == "k2":
            kl, slope = 0.5 * d * d, -d
        else:  # d clamped to ±20 (no gradient beyond), then e^d − d − 1 capped at 10
            dc = max(min(d, 20.0), -20.0)
            kl = math.exp(dc) - dc - 1
            slope = (1 - math.exp(dc)) if abs(d) < 20 and kl < 10 else 0.0
            kl = min(kl, 10.0)
        expected[t] = (-min(r, 8.0) * a + 0.5 * kl, (-r * a if r < 8 else 0.0) + 0.5 * slope)
        assert stats["ref_kl"][t] == pytest.approx(kl, rel=1e-12)
    check(loss, grad, expected)
    if estimator == "k3":
        assert expected[6][0] == pytest.approx(-8.0 * -0.8 + 0.5 * 10.0)  # capped at KL_MAX


def q_of_sample() -> list[float]:
    """Product of each sample's token ratios, on every token of the sample (seq_* corrections)."""
    sums = [sum(LOG_RATIO[t] for t in LOSS_TOKENS if SAMPLE_OF[t] == i) for i in (0, 1)]
    return [math.exp(sums[SAMPLE_OF[t]]) for t in range(7)]


@pytest.mark.parametrize("name", ["ppo_clip", "cispo"])
@pytest.mark.parametrize(
    ("correction", "cap_low", "weight_of"),
    [
        # token_tis: w = min(q_t, 3): token 6 (q ≈ 12.2) is truncated
        ("token_tis", None, lambda q, qs: min(q, 3.0)),
        ("token_tis", 0.7, lambda q, qs: min(max(q, 0.7), 3.0)),  # token 4 (q ≈ 0.67) raised to 0.7
        # seq_tis: sample 0's product e^0.6 ≈ 1.82 kept, sample 1's e^2.15 ≈ 8.6 truncated at 3
        ("seq_tis", None, lambda q, qs: min(qs, 3.0)),
        # token_mask: w = q inside [cap_low, 3], else 0
        ("token_mask", None, lambda q, qs: q if q <= 3.0 else 0.0),
        ("token_mask", 0.7, lambda q, qs: q if 0.7 <= q <= 3.0 else 0.0),
        ("seq_mask", None, lambda q, qs: qs if qs <= 3.0 else 0.0),  # sample 1 masked whole
    ],
)
def test_off_policy_corrections_by_hand(name, correction, cap_low, weight_of):
    """The objective sees the data as on-policy (ratio ρ = 1 with gradient ∇lp) times the weight w(q)."""
    cfg = LossConfig(type=name, is_correction=correction, is_cap=3.0, is_cap_low=cap_low)
    loss, stats, grad = run(name, cfg)
    lp, qs = trainer_lp(), q_of_sample()
    expected, weights = {}, [0.0] * 7
    for t in LOSS_TOKENS:
        w = weights[t] = weight_of(math.exp(LOG_RATIO[t]), qs[t])
        if name == "ppo_clip":  # −min(ρA, clip(ρ)A) at ρ = 1 is −A·ρ: value −w·A, gradient −w·A
            expected[t] = (-w * ADV[t], -w * ADV[t])
        else:  # cispo: −sg[clip(ρ)]·A·lp = −A·lp
            expected[t] = (-w * ADV[t] * lp[t], -w * ADV[t])
    check(loss, grad, expected)
    assert stats["is_weight"] == pytest.approx(weights, rel=1e-12)
    corrected = [int(MASK[t] and weights[t] != pytest.approx(math.exp(LOG_RATIO[t]))) for t in range(7)]
    if correction.startswith("seq"):
        corrected = [int(MASK[t] and weights[t] != pytest.approx(qs[t])) for t in range(7)]
    assert stats["is_corrected_frac"] == corrected
    assert sum(corrected) >= 1
    assert stats["clip_frac"] == [0.0] * 7  # the objective's own clip never fires at ρ = 1


def test_mismatch_kl_is_r_minus_log_r_minus_one_on_loss_tokens():
    got = mismatch_kl(torch.tensor(trainer_lp()), torch.tensor(INFERENCE_LP), torch.tensor(MASK)).tolist()
    want = [math.exp(x) - x - 1 if m else 0.0 for x, m in zip(LOG_RATIO, MASK, strict=True)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("correction", ["none", "token_tis", "seq_mask"])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("how", AGGREGATIONS)
def test_identical_weights_give_the_reinforce_gradient(name, how, correction):
    """r = 1 everywhere: every objective's gradient is −A·∇lp (through the same aggregation)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 9, 2, 7])
    num_tokens = int(lengths.sum())
    mask = torch.rand(num_tokens, generator=gen) > 0.3
    adv = torch.repeat_interleave(torch.randn(4, generator=gen, dtype=torch.float64), lengths)
    base = -torch.rand(num_tokens, generator=gen, dtype=torch.float64) * 4
    norms = {"global_tokens": 40, "global_samples": 6, "max_tokens": 11}
    cfg = LossConfig(type=name, kl_tau=0.1, eps_low=3e-4, eps_high=4e-4, is_correction=correction)

    def gradient(loss_of) -> torch.Tensor:
        lp = base.clone().requires_grad_(True)
        aggregate(loss_of(lp), mask, lengths, how, **norms).backward()
        return lp.grad

    objective = get_loss(name)
    got = gradient(lambda lp: policy_loss(objective, lp, lp.detach(), adv, mask, lengths, cfg).per_token_loss)
    reinforce = gradient(lambda lp: -adv * lp)
    assert reinforce.abs().sum() > 0
    torch.testing.assert_close(got, reinforce, rtol=1e-12, atol=1e-15)


def test_aggregations_by_hand_with_global_normalisers():
    per_token = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0])
    mask, lengths = torch.tensor(MASK), torch.tensor(LENGTHS)
    norms = {"global_tokens": 20, "global_samples": 5, "max_tokens": 16}
    assert aggregate(per_token, mask, lengths, "token-mean", **norms).item() == pytest.approx(15 / 20)
    assert aggregate(per_token, mask, lengths, "seq-mean-token-mean", **norms).item() == pytest.approx((1.5 + 4) / 5)
    assert aggregate(per_token, mask, lengths, "seq-mean-token-sum-norm", **norms).item() == pytest.approx(15 / 80)
    assert aggregate(per_token, mask, lengths, "token-sum", **norms).item() == pytest.approx(15)
    assert aggregate(per_token, mask, lengths, "seq-mean-token-sum", **norms).item() == pytest.approx(15 / 5)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(per_token, mask, lengths, "token-total", **norms)
    with pytest.raises(ValueError, match="positive"):
        aggregate(per_token, mask, lengths, "token-mean", global_tokens=0, global_samples=1, max_tokens=1)


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_shares_of_a_split_batch_add_up_to_the_whole(how):
    gen = torch.Generator().manual_seed(1)
    lengths = [4, 6, 3, 8, 5]
    per_token = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
    mask = torch.rand(sum(lengths), generator=gen) > 0.4
    norms = {"global_tokens": int(mask.sum()), "global_samples": len(lengths), "max_tokens": 8}
    whole = aggregate(per_token, mask, torch.tensor(lengths), how, **norms)
    for cut in (1, 2, 4):  # split after sample `cut`
        t = sum(lengths[:cut])
        parts = aggregate(per_token[:t], mask[:t], torch.tensor(lengths[:cut]), how, **norms) + aggregate(
            per_token[t:], mask[t:], torch.tensor(lengths[cut:]), how, **norms
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
    if how == "token-mean":
        assert whole.item() == pytest.approx(per_token[mask].mean().item(), rel=1e-12)


def test_garbage_off_mask_logprobs_never_produce_nan():
    lp = torch.tensor([0.0, -1.0, 0.0, -2.0], requires_grad=True)
    behaviour = torch.tensor([-1e30, -1.1, float("inf"), -2.1])  # prompt/padding slots hold anything
    mask = torch.tensor([False, True, False, True])
    for name in LOSSES:
        out = policy_loss(get_loss(name), lp, behaviour, torch.ones(4), mask, torch.tensor([2, 2]), LossConfig())
        out.per_token_loss.sum().backward()
        assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(lp.grad).all(), name
        assert lp.grad[0] == 0 and lp.grad[2] == 0
        lp.grad = None


def test_user_objective_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_objectives.py").write_text(
        textwrap.dedent(
            """
            import torch
            from gyre_trainer.loss import LossOutput

            def reinforce(logprobs, inference_logprobs, advantages, loss_mask, sample_lengths, cfg):
                loss = torch.where(loss_mask, -advantages * logprobs, 0.0)
                return LossOutput(loss, {"custom_frac": loss_mask.float()})
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = get_loss("my_objectives:reinforce")
        lp, adv, mask = torch.tensor([0.0, -2.0]), torch.tensor([3.0, 3.0]), torch.tensor([False, True])
        out = fn(lp, torch.zeros(2), adv, mask, None, None)
        assert out.per_token_loss.tolist() == [0.0, 6.0]
        with pytest.raises(ValueError, match="no callable 'missing'"):
            get_loss("my_objectives:missing")
    finally:
        sys.modules.pop("my_objectives", None)


def test_unknown_objectives_fail_with_the_known_names():
    with pytest.raises(ValueError, match="aipo, ppo_clip, gspo, cispo, masked_is"):
        get_loss("grpo_typo")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_loss("no_such_module_xyz:loss")
