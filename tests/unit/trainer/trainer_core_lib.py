"""Helpers of the trainer-core tests: random samples and TrainBatch layouts (import, not fixtures)."""

from __future__ import annotations

import numpy as np
from gyre.batch import MicroBatch, TrainBatch


def random_samples(rng: np.random.Generator, lengths, vocab_size: int = 1024) -> list[dict]:
    """Samples with a prompt (not in the loss), a completion (in the loss), one advantage per sample."""
    samples = []
    for i, length in enumerate(lengths):
        prompt = max(1, length // 3)
        samples.append(
            {
                "input_ids": rng.integers(3, vocab_size, length),
                "loss_mask": np.arange(length) >= prompt,
                "advantages": np.full(length, rng.normal(), dtype=np.float32),
                "inference_logprobs": (-rng.uniform(0.5, 8.0, length)).astype(np.float32),
                "sample_index": i,
            }
        )
    return samples


def make_batch(samples: list[dict], layout: list[list[list[int]]], step: int = 1) -> TrainBatch:
    """A TrainBatch whose rank r, micro-batch i packs samples `layout[r][i]` (global normalisers set)."""
    micro_batches = [[MicroBatch.from_samples([samples[j] for j in row]) for row in rank] for rank in layout]
    return TrainBatch(
        step=step,
        micro_batches=micro_batches,
        samples=[{"reward": 0.0} for _ in samples],
        num_loss_tokens=int(sum(np.count_nonzero(s["loss_mask"]) for s in samples)),
        num_samples=len(samples),
    ).validate()
