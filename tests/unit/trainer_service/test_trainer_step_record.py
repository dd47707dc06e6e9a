"""The trainer_steps.jsonl record of a step: the contract fields and the extras users chart (W&B logs it as is)."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.batch import MicroBatch, TrainBatch
from gyre_trainer.intake import IntakeItem
from gyre_trainer.run import step_record


def item() -> IntakeItem:
    n = 6
    row = MicroBatch.from_samples([{"input_ids": np.arange(3, 3 + n), "loss_mask": np.arange(n) >= 2,
                                    "advantages": np.ones(n), "inference_logprobs": np.full(n, -1.0),
                                    "sample_index": 0}])  # fmt: skip
    batch = TrainBatch(step=4, micro_batches=[[row]], samples=[{"min_version": 2, "max_version": 3}],
                       num_loss_tokens=4, num_samples=1).validate()  # fmt: skip
    return IntakeItem(step=4, batch=batch, num_bytes=0)


def test_the_record_carries_throughput_and_the_ratio_stats():
    metrics = {"loss": 0.5, "num_tokens": 600.0, "num_loss_tokens": 400.0, "num_valid_tokens": 398.0, "grad_norm": 1.0,
               "lr": 1e-5, "entropy": 2.0, "mismatch_kl": 1e-3, "ratio_mean": 1.01, "ratio_min": 0.2, "ratio_max": 9.0,
               "clip_frac": 0.1, "skipped": 0.0}  # fmt: skip
    record = step_record(item(), metrics, 1.5, 0.3)
    assert record["tokens_per_second"] == pytest.approx(400.0)  # the step's tokens, all ranks, over its wall time
    assert (record["ratio_mean"], record["ratio_min"], record["ratio_max"]) == (1.01, 0.2, 9.0)
    assert (record["num_loss_tokens"], record["num_valid_tokens"], record["clip_frac"]) == (400, 398, 0.1)
    assert (record["min_version"], record["max_version"], record["step"]) == (2, 3, 4)
    assert step_record(item(), metrics, 0.0, 0.3)["tokens_per_second"] == 0.0  # a clock that did not move
