"""Each advantage estimator on hand-made groups (values worked out by hand in the comments)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gyre_orchestrator.advantages import EPS, compute_advantages, is_zero_signal


def approx(values, expected):
    assert np.allclose(values, expected, rtol=0, atol=1e-9), (values, expected)


def test_grpo_group_std_uses_bessel_correction():
    # R = [1, 0, 0, 1]: mean 0.5, sample std (ddof=1) = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    (adv,) = compute_advantages([[1.0, 0.0, 0.0, 1.0]], "grpo", std_norm="group")
    s = math.sqrt(1 / 3)
    approx(adv, [0.5 / (s + EPS), -0.5 / (s + EPS), -0.5 / (s + EPS), 0.5 / (s + EPS)])


def test_grpo_batch_std_pools_every_group():
    # groups [0, 2] and [1, 5]: all rewards [0, 2, 1, 5], mean 2, ddof=1 var = (4+0+1+9)/3 = 14/3
    a, b = compute_advantages([[0.0, 2.0], [1.0, 5.0]], "grpo", std_norm="batch")
    s = math.sqrt(14 / 3)
    approx(a, [-1 / (s + EPS), 1 / (s + EPS)])  # centred on the group mean (1), scaled by the batch std
    approx(b, [-2 / (s + EPS), 2 / (s + EPS)])


def test_grpo_without_std_is_centering_only():
    (adv,) = compute_advantages([[3.0, 1.0, 2.0]], "grpo", std_norm="none")
    approx(adv, [1.0, -1.0, 0.0])


def test_drgrpo_subtracts_the_mean():
    (adv,) = compute_advantages([[1.0, 0.0, 0.0, 0.0]], "drgrpo")
    approx(adv, [0.75, -0.25, -0.25, -0.25])


def test_rloo_leave_one_out_baseline():
    # R = [1, 0, 0, 0]: sample 0's baseline = mean(0,0,0) = 0 -> 1; others: mean(1,0,0) = 1/3 -> -1/3
    (adv,) = compute_advantages([[1.0, 0.0, 0.0, 0.0]], "rloo")
    approx(adv, [1.0, -1 / 3, -1 / 3, -1 / 3])
    # the closed form G/(G-1) * (R_i - mean R) agrees
    approx(adv, 4 / 3 * (np.array([1.0, 0, 0, 0]) - 0.25))


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages([[1.0]], "rloo")


def test_opo_length_weighted_baseline():
    # R = [1, 0], lengths [1, 3]: baseline = (1*1 + 3*0) / 4 = 0.25
    (adv,) = compute_advantages([[1.0, 0.0]], "opo", lengths=[[1, 3]])
    approx(adv, [0.75, -0.25])
    # equal lengths: same as drgrpo
    (same,) = compute_advantages([[1.0, 0.0, 0.5]], "opo", lengths=[[7, 7, 7]])
    approx(same, compute_advantages([[1.0, 0.0, 0.5]], "drgrpo")[0])


def test_opo_requires_matching_lengths():
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages([[1.0, 0.0]], "opo")
    with pytest.raises(ValueError, match="shape"):
        compute_advantages([[1.0, 0.0]], "opo", lengths=[[1]])


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo", "opo"])
def test_zero_signal_group_gets_exact_zeros(kind):
    (adv,) = compute_advantages([[0.3, 0.3, 0.3]], kind, lengths=[[1, 2, 3]])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_zero_signal_detection():
    assert is_zero_signal([1.0, 1.0, 1.0])
    assert is_zero_signal([0.1 + 0.2, 0.3])  # float noise is not signal
    assert not is_zero_signal([1.0, 0.0])
    assert is_zero_signal([])


@pytest.mark.parametrize("bad", [[[]], [[float("nan"), 1.0]], [[1.0, float("inf")]]])
def test_bad_rewards_are_rejected(bad):
    with pytest.raises(ValueError):
        compute_advantages(bad, "drgrpo")


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo", "opo"])
def test_a_non_finite_reward_is_refused_naming_its_group_and_sample(kind):
    rewards = [[1.0, 0.0], [0.5, float("-inf"), float("nan")]]
    with pytest.raises(ValueError, match=r"rewards must be finite numbers: group 1, sample 1 has reward -inf"):
        compute_advantages(rewards, kind, lengths=[[1, 2], [3, 4, 5]])


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages([[1.0, 0.0]], "ppo")
