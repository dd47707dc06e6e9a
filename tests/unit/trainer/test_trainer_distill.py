"""On-policy distillation in the loss (docs/algorithms.md): the reverse-KL term against independent computations.

- hand-computed per-token losses and gradients on a small packed batch (r = 1, so every objective is REINFORCE);
- the estimator's gradient, averaged over many sampled tokens, equals the exact gradient of KL(π_θ‖π_T) of a
  categorical policy computed in closed form by autograd (no sampling, no estimator);
- the invalid-log-prob rule applies to the term; the trainer step carries the teacher's log-probs through
  packing and micro-batching (1 or 3 micro batches: the same gradient) and refuses distill without them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gyre.batch import MicroBatch, TrainBatch
from gyre.config.trainer import LossConfig
from gyre_trainer.loss import LOSSES, aggregate, get_loss, policy_loss
from pydantic import ValidationError

MASK = torch.tensor([False, True, True, True, False, True, True])
LENGTHS = torch.tensor([4, 3])
LP = [0.0, -1.2, -0.4, -2.0, 0.0, -0.9, -1.5]
TEACHER = [0.0, -0.2, -3.0, -2.5, 0.0, -0.1, -1.5]
ADV = [0.5] * 4 + [-1.0] * 3


def loss_and_grad(name: str, cfg: LossConfig, behaviour=None, teacher=TEACHER, teacher_mask=None):
    lp = torch.tensor(LP, requires_grad=True)
    behaviour = torch.tensor(LP if behaviour is None else behaviour)
    out = policy_loss(get_loss(name), lp, behaviour, torch.tensor(ADV), MASK, LENGTHS, cfg,
                      teacher_logprobs=None if teacher is None else torch.tensor(teacher),
                      teacher_mask=teacher_mask)  # fmt: skip
    out.per_token_loss.sum().backward()
    return out, lp.grad


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize(("reward_weight", "distill"), [(1.0, 0.5), (0.0, 1.0), (0.3, 2.0)])
def test_on_policy_every_objective_is_reinforce_with_the_teacher_in_the_advantage(name, reward_weight, distill):
    cfg = LossConfig(type=name, reward_weight=reward_weight, distill=distill)
    out, grad = loss_and_grad(name, cfg)
    # by hand: A_t = w·A + β·(lp_T − lp_θ), gradient −A_t per loss token (r = 1, REINFORCE), 0 elsewhere
    expected = [
        -(reward_weight * a + distill * (t - lp)) if m else 0.0
        for a, t, lp, m in zip(ADV, TEACHER, LP, MASK.tolist(), strict=True)
    ]
    assert grad.tolist() == pytest.approx(expected, abs=1e-6)
    kl = [lp - t if m else 0.0 for t, lp, m in zip(TEACHER, LP, MASK.tolist(), strict=True)]
    assert out.stats["teacher_kl"].tolist() == pytest.approx(kl, abs=1e-6)


SCORED = torch.tensor([True] * 4 + [False] * 3)  # the teacher refused the second sample


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize(("reward_weight", "distill"), [(1.0, 0.5), (0.0, 1.0), (0.3, 2.0)])
@pytest.mark.parametrize("off_policy", [False, True])
def test_a_sample_the_teacher_skipped_keeps_its_reward_gradient_and_loses_only_the_teacher_term(
    name, reward_weight, distill, off_policy
):
    """`teacher_mask` False on a sample: its gradient is the one it has in a batch without any teacher (the reward's,
    weighted by reward_weight), the other sample's is the one it has when the teacher scored everything. Before, the
    orchestrator left such a sample out of the batch: its reward term was lost with the teacher's."""
    cfg = LossConfig(type=name, reward_weight=reward_weight, distill=distill)
    behaviour = [lp - 0.3 * (i % 3) for i, lp in enumerate(LP)] if off_policy else None  # ratios off 1: clips too
    out, grad = loss_and_grad(name, cfg, behaviour=behaviour, teacher_mask=SCORED)
    _, no_teacher = loss_and_grad(name, cfg, behaviour=behaviour, teacher=None)
    _, all_scored = loss_and_grad(name, cfg, behaviour=behaviour)
    assert torch.equal(grad[~SCORED], no_teacher[~SCORED])
    assert torch.equal(grad[SCORED], all_scored[SCORED])
    if reward_weight and not off_policy:
        assert grad[~SCORED & MASK].abs().min() > 0  # REINFORCE: −w·A on every loss token of the skipped sample
    assert out.stats["teacher_kl"][~SCORED].abs().sum() == 0
    assert out.stats["teacher_frac"].tolist() == (SCORED & MASK).float().tolist()


def test_without_distill_the_teacher_is_only_measured():
    plain, plain_grad = loss_and_grad("ppo_clip", LossConfig(), teacher=None)
    measured, grad = loss_and_grad("ppo_clip", LossConfig())
    assert torch.equal(grad, plain_grad) and "teacher_kl" in measured.stats and "teacher_kl" not in plain.stats
    _, half = loss_and_grad("ppo_clip", LossConfig(reward_weight=0.5), teacher=None)
    assert torch.allclose(half, plain_grad * 0.5)


def test_the_term_goes_through_the_clip_like_the_reward():
    """Off-policy (r = e^0.5 on token 1): ppo_clip clips the distillation advantage as it clips a reward."""
    behaviour = list(LP)
    behaviour[1] = LP[1] - 0.5  # r = 1.65 > 1.28; A_1 = β·(lp_T − lp_θ) = +1.0 > 0: clipped, no gradient
    cfg = LossConfig(type="ppo_clip", reward_weight=0.0, distill=1.0)
    out, grad = loss_and_grad("ppo_clip", cfg, behaviour=behaviour)
    assert grad[1].item() == 0.0 and out.stats["clip_frac"][1].item() == 1.0
    assert out.per_token_loss[1].item() == pytest.approx(-1.28 * 1.0)


def test_invalid_inference_logprobs_leave_the_term_out():
    behaviour = list(LP)
    behaviour[2] = 5.0  # impossible: out of the loss, every term
    out, grad = loss_and_grad("ppo_clip", LossConfig(distill=1.0), behaviour=behaviour)
    assert grad[2].item() == 0.0 and out.per_token_loss[2].item() == 0.0 and out.stats["teacher_kl"][2].item() == 0
    assert grad[1].item() != 0.0


def test_the_estimator_follows_the_exact_reverse_kl_gradient():
    """A categorical policy over 12 tokens; the teacher a fixed other distribution. The exact gradient of
    KL(π_θ‖π_T) = Σ_y π_θ(y)(log π_θ(y) − log π_T(y)) comes from autograd on that closed form. The loss's
    gradient, pure distillation on 400k tokens sampled from π_θ (on-policy, token-mean), must match it."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(12, generator=gen, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(12, generator=gen) * 2, -1)
    exact_kl = (theta.softmax(-1) * (theta.log_softmax(-1) - teacher)).sum()
    (exact,) = torch.autograd.grad(exact_kl, theta)

    n = 400_000
    tokens = torch.multinomial(theta.detach().softmax(-1), n, replacement=True, generator=gen)
    lp = theta.log_softmax(-1)[tokens]
    cfg = LossConfig(type="ppo_clip", reward_weight=0.0, distill=1.0)
    mask = torch.ones(n, dtype=torch.bool)
    out = policy_loss(get_loss("ppo_clip"), lp, lp.detach(), torch.zeros(n), mask, torch.ones(n, dtype=torch.long),
                      cfg, teacher_logprobs=teacher[tokens])  # fmt: skip
    loss = aggregate(out.per_token_loss, mask, torch.ones(n, dtype=torch.long), "token-mean",
                     global_tokens=n, global_samples=n, max_tokens=1)  # fmt: skip
    (estimate,) = torch.autograd.grad(loss, theta)
    assert exact.norm() > 0.1
    assert torch.allclose(estimate, exact, atol=0.02 * exact.norm().item()), (estimate, exact)
    assert out.stats["teacher_kl"].mean().item() == pytest.approx(exact_kl.item(), abs=0.02)


def test_reward_weight_zero_needs_distill():
    with pytest.raises(ValidationError, match="no learning signal"):
        LossConfig(reward_weight=0.0)
    LossConfig(reward_weight=0.0, distill=1.0)


# ---- through the trainer step ------------------------------------------------------------------------


def _batch(teacher: bool, rows: int = 3, skipped=(), keep=None, num_loss_tokens=None) -> TrainBatch:
    """`rows` rows of two samples; `skipped`: samples the teacher refused (teacher_mask False on them); `keep`: the
    samples whose loss tokens stay (the others' are masked out; the batch's normalisers can stay the full batch's)."""
    rng = np.random.default_rng(0)
    micro, index = [], 0
    for _ in range(rows):
        samples = []
        for n in (5, 4):
            mask = (np.arange(n) > 1) & (keep is None or index in keep)
            samples.append({"input_ids": rng.integers(3, 200, n), "loss_mask": mask,
                            "advantages": np.full(n, rng.standard_normal()), "inference_logprobs": np.zeros(n),
                            "sample_index": index})  # fmt: skip
            lp_teacher = np.where(mask, -rng.random(n) * 3, 0.0)
            if teacher:
                samples[-1]["teacher_logprobs"] = lp_teacher * (index not in skipped)
                if skipped:
                    samples[-1]["teacher_mask"] = np.full(n, index not in skipped)
            index += 1
        micro.append(MicroBatch.from_samples(samples))
    loss_tokens = sum(mb.num_loss_tokens for mb in micro)
    return TrainBatch(step=1, micro_batches=[micro], samples=[{}] * index,
                      num_loss_tokens=num_loss_tokens or loss_tokens, num_samples=index).validate()  # fmt: skip


def test_the_step_uses_the_batch_teacher_logprobs_whatever_the_micro_batching(tiny_llama64):
    from gyre_trainer.step import compute_gradients

    model = tiny_llama64
    batch = _batch(teacher=True)
    cfg = LossConfig(distill=1.0, reward_weight=0.0)
    grads = []
    for micro_batch_size in (1, 3):
        model.zero_grad(set_to_none=True)
        metrics = compute_gradients(model, batch, loss_cfg=cfg, micro_batch_size=micro_batch_size, temperature=1.0)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].norm() > 0
    assert "teacher_kl" in metrics
    with pytest.raises(ValueError, match="carries no teacher log-probs"):
        compute_gradients(model, _batch(teacher=False), loss_cfg=cfg)


def test_the_step_trains_a_skipped_sample_on_its_reward_alone(tiny_llama64):
    """Through packing and the aggregation: a batch whose samples 1 and 4 the teacher refused has the gradient of its
    scored samples with the teacher plus that of samples 1 and 4 without any teacher (the loss is a sum over samples
    with the batch's global normaliser)."""
    from gyre_trainer.step import compute_gradients

    model, skipped, full = tiny_llama64, (1, 4), _batch(teacher=True).num_loss_tokens

    def gradient(batch, cfg, micro_batch_size=1):
        model.zero_grad(set_to_none=True)
        metrics = compute_gradients(model, batch, loss_cfg=cfg, micro_batch_size=micro_batch_size, temperature=1.0)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics

    cfg = LossConfig(distill=1.0, reward_weight=0.5)
    scored = [i for i in range(6) if i not in skipped]
    got, metrics = gradient(_batch(teacher=True, skipped=skipped), cfg, micro_batch_size=3)
    with_teacher, teacher_metrics = gradient(_batch(teacher=True, keep=scored, num_loss_tokens=full), cfg)
    reward_only, _ = gradient(_batch(teacher=False, keep=skipped, num_loss_tokens=full), cfg.model_copy(update={
        "distill": 0.0}))  # fmt: skip
    assert torch.allclose(got, with_teacher + reward_only, atol=1e-6) and reward_only.norm() > 0
    # teacher_kl is the mean over the tokens the teacher scored, teacher_frac their share of the loss tokens
    assert metrics["teacher_kl"] == pytest.approx(teacher_metrics["teacher_kl"], rel=1e-5)
    assert metrics["teacher_frac"] == pytest.approx(teacher_metrics["num_loss_tokens"] / full)


def test_teacher_kl_is_a_mean_over_the_valid_tokens_the_teacher_scored(tiny_llama64):
    """A loss token whose inference log-prob is impossible is out of every term (policy_loss), so its teacher gap is 0:
    counted in the denominator, it pulled teacher_kl toward 0. Samples 1 and 4 with impossible log-probs report the
    teacher_kl of the batch without their loss tokens."""
    from gyre_trainer.step import compute_gradients

    model, full = tiny_llama64, _batch(teacher=True).num_loss_tokens
    cfg = LossConfig(distill=1.0)
    corrupt = _batch(teacher=True)
    rows = corrupt.micro_batches[0]  # row r packs samples 2r (5 tokens) and 2r + 1 (4 tokens)
    rows[0].inference_logprobs[5:9] = -1e4  # sample 1
    rows[2].inference_logprobs[0:5] = -1e4  # sample 4
    metrics = compute_gradients(model, corrupt, loss_cfg=cfg, micro_batch_size=2, temperature=1.0)
    model.zero_grad(set_to_none=True)
    kept = _batch(teacher=True, keep=[0, 2, 3, 5], num_loss_tokens=full)
    expected = compute_gradients(model, kept, loss_cfg=cfg, temperature=1.0)
    model.zero_grad(set_to_none=True)
    assert metrics["invalid_logprob_frac"] == pytest.approx(1 - expected["num_loss_tokens"] / full)
    assert abs(expected["teacher_kl"]) > 0.1
    assert metrics["teacher_kl"] == pytest.approx(expected["teacher_kl"], rel=1e-6)
    assert metrics["num_valid_tokens"] == expected["num_loss_tokens"]


def test_the_orchestrators_teacher_kl_leaves_out_impossible_inference_logprobs():
    """The orchestrator's side of the metric (its step events' `teacher_kl`, lp_inference − lp_teacher) follows the
    trainer's rule: a loss token with an impossible inference log-prob (a server's -1e9 sentinel, NaN) is not a sample
    of the KL; one such token made the step's mean -1e8."""
    from types import SimpleNamespace

    from gyre_orchestrator.teacher import sampler_teacher_kl

    def sample(inference, teacher, mask, teacher_mask=None):
        return SimpleNamespace(inference_logprobs=np.array(inference, np.float32), loss_mask=np.array(mask),
                               teacher_logprobs=np.array(teacher, np.float32), teacher_mask=teacher_mask)  # fmt: skip

    samples = [
        sample([0.0, -1.0, -1e9, -2.0], [0.0, -1.5, -1.0, -1.0], [False, True, True, True]),  # gaps 0.5, -, -1.0
        sample([0.0, np.nan, -0.5], [0.0, -1.0, -1.0], [False, True, True]),  # gap 0.5
        sample([0.0, -3.0], [0.0, -1.0], [False, True], teacher_mask=np.array([False, False])),  # refused
    ]
    assert sampler_teacher_kl(samples) == pytest.approx((0.5 - 1.0 + 0.5) / 3)
    assert sampler_teacher_kl(samples[2:]) == 0.0
