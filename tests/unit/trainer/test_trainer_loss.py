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
    cfg = LossConfig(type="ppo_clip", eps_low=0.2, eps_high=0.28)
    loss, stats, grad = run("ppo_clip", cfg)
    r = {t: math.exp(LOG_RATIO[t]) for t in LOSS_TOKENS}
    expected = {
        1: (-r[1] * 1.5, -r[1] * 1.5),  # r ≈ 1.105 inside [0.8, 1.28]
        2: (-1.28 * 1.5, 0.0),  # A > 0, r ≈ 1.65 > 1.28: clipped, no gradient
        4: (0.8 * 0.8, 0.0),  # A < 0, r ≈ 0.67 < 0.8: clipped at 1 − ε_low
        5: (r[5] * 0.8, r[5] * 0.8),
        6: (r[6] * 0.8, r[6] * 0.8),  # A < 0, r ≈ 12.2: min picks r·A, the gradient flows
    }
    check(loss, grad, expected)
    assert stats["clip_frac"] == [0, 0, 1, 0, 1, 0, 0]


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


def test_mismatch_kl_is_r_minus_log_r_minus_one_on_loss_tokens():
    got = mismatch_kl(torch.tensor(trainer_lp()), torch.tensor(INFERENCE_LP), torch.tensor(MASK)).tolist()
    want = [math.exp(x) - x - 1 if m else 0.0 for x, m in zip(LOG_RATIO, MASK, strict=True)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("how", AGGREGATIONS)
def test_identical_weights_give_the_reinforce_gradient(name, how):
    """r = 1 everywhere: every objective's gradient is −A·∇lp (through the same aggregation)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 9, 2, 7])
    num_tokens = int(lengths.sum())
    mask = torch.rand(num_tokens, generator=gen) > 0.3
    adv = torch.repeat_interleave(torch.randn(4, generator=gen, dtype=torch.float64), lengths)
    base = -torch.rand(num_tokens, generator=gen, dtype=torch.float64) * 4
    norms = {"global_tokens": 40, "global_samples": 6, "max_tokens": 11}
    cfg = LossConfig(type=name, kl_tau=0.1, eps_low=3e-4, eps_high=4e-4)

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
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(per_token, mask, lengths, "token-sum", **norms)
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
