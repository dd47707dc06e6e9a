"""Group advantage estimators and the zero-signal filter (formulas and papers: docs/algorithms.md).

A *group* is the `rollouts_per_example` samples of one prompt. Every estimator turns the group's
rewards R (and, for `opo`, the completion lengths ℓ) into one advantage per sample; the trainer copies
it to every token of the sample.

| name   | A_i                                   |
|--------|---------------------------------------|
| grpo   | (R_i − mean R) / (std R + ε)          |  std: Bessel-corrected, of the group, of the whole batch, or 1 (none)
| drgrpo | R_i − mean R                          |
| rloo   | R_i − mean_{j≠i} R_j = G/(G−1)·(R_i − mean R) |
| opo    | R_i − Σ_j ℓ_j R_j / Σ_j ℓ_j           |

Invariants: the output has the shape of the input (one array per group, same lengths); every
estimator returns zeros for a group whose rewards are all equal (such a group carries no signal and
is dropped by default before this is called, see `is_zero_signal`). numpy only, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

EPS = 1e-6
#: rewards closer than this count as equal (rewards are often sums of float ratios)
ZERO_SIGNAL_ATOL = 1e-9

AdvantageType = Literal["grpo", "drgrpo", "rloo", "opo"]
StdNorm = Literal["group", "batch", "none"]


def is_zero_signal(rewards: Sequence[float], atol: float = ZERO_SIGNAL_ATOL) -> bool:
    """True when every reward of the group is the same: all advantages would be 0."""
    r = np.asarray(rewards, dtype=np.float64)
    return r.size == 0 or float(r.max() - r.min()) <= atol


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a sample of `length` completion tokens (model tokens only) under a
    generation limit of `max_length`: 0 up to `max_length - buffer`, then falling linearly to `-factor` at the limit
    (and held there): -factor * min((length - (max_length - buffer)) / buffer, 1). `buffer` 0 = off (0 always).
    Added to the sample's reward before advantages (docs/algorithms.md, "Overlong reward shaping")."""
    if buffer <= 0 or factor == 0:
        return 0.0
    if buffer >= max_length or factor < 0:  # the config refuses these; a direct caller gets the same rule
        raise ValueError(f"overlong buffer {buffer} must be < the length limit {max_length}, factor {factor} >= 0")
    excess = length - (max_length - buffer)
    if excess <= 0:
        return 0.0
    return -factor * min(excess / buffer, 1.0)


def _std(values: np.ndarray) -> float:
    # Bessel's correction; a single value has no spread (and no signal)
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


def compute_advantages(
    rewards: Sequence[Sequence[float]],
    kind: AdvantageType = "drgrpo",
    *,
    std_norm: StdNorm = "group",
    lengths: Sequence[Sequence[int]] | None = None,
) -> list[np.ndarray]:
    """Advantages of every sample, group by group (float64 arrays shaped like `rewards`).

    `std_norm` only affects `grpo`; "batch" divides by the std of all rewards in `rewards`.
    `lengths` (completion tokens per sample, i.e. model-generated tokens) is required by `opo`.
    `rloo` needs groups of at least 2 samples (the leave-one-out mean of one sample is undefined).
    """
    groups = [np.asarray(g, dtype=np.float64) for g in rewards]
    if any(g.ndim != 1 or g.size == 0 for g in groups):
        raise ValueError("every group must be a non-empty 1-D sequence of rewards")
    for i, g in enumerate(groups):
        bad = np.flatnonzero(~np.isfinite(g))
        if bad.size:  # never trained on: which group and sample, so the environment's score can be found
            raise ValueError(f"rewards must be finite numbers: group {i}, sample {int(bad[0])} has reward {g[bad[0]]}")
    if kind == "opo":
        if lengths is None:
            raise ValueError("opo needs lengths: the completion tokens of every sample")
        lens = [np.asarray(g, dtype=np.float64) for g in lengths]
        if [len(x) for x in lens] != [len(g) for g in groups]:
            raise ValueError("lengths must have the shape of rewards")
        if any(np.any(x < 0) for x in lens):
            raise ValueError("lengths must be >= 0")
    batch_std = _std(np.concatenate(groups)) if groups else 0.0

    out = []
    for i, r in enumerate(groups):
        centered = r - r.mean()
        if kind == "grpo":
            if std_norm == "group":
                adv = centered / (_std(r) + EPS)
            elif std_norm == "batch":
                adv = centered / (batch_std + EPS)
            elif std_norm == "none":
                adv = centered
            else:
                raise ValueError(f"unknown std_norm {std_norm!r}")
        elif kind == "drgrpo":
            adv = centered
        elif kind == "rloo":
            if r.size < 2:
                raise ValueError("rloo needs at least 2 samples per group")
            adv = r.size / (r.size - 1) * centered
        elif kind == "opo":
            ell = lens[i]
            # no generated tokens at all: the length weights are undefined, fall back to the plain mean
            baseline = float((ell * r).sum() / ell.sum()) if ell.sum() > 0 else float(r.mean())
            adv = r - baseline
        else:
            raise ValueError(f"unknown advantage type {kind!r}")
        if is_zero_signal(r):
            adv = np.zeros_like(r)  # exact zeros, not rounding noise, for a group with no signal
        out.append(adv)
    return out
