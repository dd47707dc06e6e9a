"""Training batch schema shared by the orchestrator (producer) and the trainer (consumer).

A `TrainBatch` is what the orchestrator pushes for trainer step `s`. It is already split across
data-parallel ranks: `micro_batches[rank][i]` is the i-th micro batch of that rank. A `MicroBatch`
packs several samples back to back into one row of T tokens; attention never crosses samples
because `position_ids` restart at 0 at every sample boundary.

Invariants (checked by `MicroBatch.validate` / `TrainBatch.validate`):
- every per-token array is 1-D of length T with the documented dtype;
- `sample_lengths` and `sample_index` are 1-D of length n (samples in this row), lengths > 0,
  `sum(sample_lengths) == T`;
- `position_ids` of each sample are exactly `0, 1, ..., len-1`;
- `loss_mask` is false at the first token of every sample (nothing precedes it, so no model
  log-prob exists for it: docs/architecture.md, "Alignment");
- every rank has the same number of micro batches (FSDP ranks must step in lock-step);
- `sample_index` values index into `TrainBatch.samples`;
- optional per-token arrays (`OPTIONAL_TOKEN_FIELDS`, e.g. `teacher_logprobs`) are None or follow the
  per-token rule, and a batch has each of them in every micro batch or in none; `teacher_mask` comes
  only with `teacher_logprobs`.

Global normalisers (`num_loss_tokens`, `num_samples`) live on the batch so that every rank divides
by the global count, not by its own share. This module is numpy only (no torch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: name -> dtype of the per-token arrays (length T).
TOKEN_FIELDS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "position_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "inference_logprobs": np.dtype(np.float32),
}
#: name -> dtype of the per-sample arrays (length n).
SAMPLE_FIELDS: dict[str, np.dtype] = {
    "sample_lengths": np.dtype(np.int32),
    "sample_index": np.dtype(np.int32),
}
ARRAY_FIELDS: dict[str, np.dtype] = {**TOKEN_FIELDS, **SAMPLE_FIELDS}
#: name -> dtype of per-token arrays a batch may carry or not (None). Added after schema 1 shipped: batches
#: without them still decode. `teacher_logprobs`: the teacher's log-prob of each sampled token (on-policy
#: distillation, docs/algorithms.md), 0 off the loss mask. `teacher_mask` (only beside `teacher_logprobs`): True where
#: the teacher scored the token; a loss token where it is False keeps its reward term and has no distillation term (a
#: sample the teacher refused, the last token of one it could score all but the last of). Absent: it scored them all.
OPTIONAL_TOKEN_FIELDS: dict[str, np.dtype] = {
    "teacher_logprobs": np.dtype(np.float32),
    "teacher_mask": np.dtype(np.bool_),
}

#: A sampled token's log-prob lies in [LOGPROB_MIN, LOGPROB_MAX]: no float32 probability is below e^-103.3 (the smallest
#: subnormal, 1.4e-45), and a log-prob is <= 0 up to rounding. A loss token whose inference log-prob is outside cannot
#: come from sampling: the trainer leaves it out of every loss term and every mean (`valid_logprobs`).
LOGPROB_MIN = -104.0
LOGPROB_MAX = 1e-3


def valid_logprobs(logprobs: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """`loss_mask` without the tokens whose log-prob is not a possible sampled log-prob (numpy; the trainer's torch
    twin is `gyre_trainer.loss.valid_inference_logprobs`)."""
    lp = np.asarray(logprobs)
    with np.errstate(invalid="ignore"):
        return np.asarray(loss_mask, dtype=bool) & np.isfinite(lp) & (lp >= LOGPROB_MIN) & (lp <= LOGPROB_MAX)


class BatchError(ValueError):
    """A batch violates the schema (wrong dtype, shape, lengths, positions, ...)."""


@dataclass
class MicroBatch:
    """One packed row of samples. See the module docstring for the invariants."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    sample_lengths: np.ndarray
    sample_index: np.ndarray
    teacher_logprobs: np.ndarray | None = None
    teacher_mask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @property
    def num_samples(self) -> int:
        return int(self.sample_lengths.shape[0])

    @property
    def optional_fields(self) -> tuple[str, ...]:
        """The optional per-token arrays this micro batch carries."""
        return tuple(name for name in OPTIONAL_TOKEN_FIELDS if getattr(self, name) is not None)

    def validate(self) -> MicroBatch:
        """Raise `BatchError` unless every invariant holds; return self for chaining."""
        for name, dtype in ARRAY_FIELDS.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray):
                raise BatchError(f"{name}: expected numpy array, got {type(arr).__name__}")
            if arr.dtype != dtype:
                raise BatchError(f"{name}: expected dtype {dtype}, got {arr.dtype}")
            if arr.ndim != 1:
                raise BatchError(f"{name}: expected 1-D array, got shape {arr.shape}")
        for name, dtype in OPTIONAL_TOKEN_FIELDS.items():
            arr = getattr(self, name)
            if arr is None:
                continue
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1:
                raise BatchError(f"{name}: expected None or a 1-D numpy array of dtype {dtype}")
        if self.teacher_mask is not None and self.teacher_logprobs is None:
            raise BatchError("teacher_mask: given without teacher_logprobs (it says where those are the teacher's)")
        t = self.num_tokens
        for name in (*TOKEN_FIELDS, *self.optional_fields):
            if getattr(self, name).shape[0] != t:
                raise BatchError(f"{name}: length {getattr(self, name).shape[0]} != input_ids length {t}")
        n = self.num_samples
        if self.sample_index.shape[0] != n:
            raise BatchError(f"sample_index: length {self.sample_index.shape[0]} != sample_lengths length {n}")
        if n and int(self.sample_lengths.min()) <= 0:
            raise BatchError("sample_lengths: every sample must have at least one token")
        total = int(self.sample_lengths.sum(dtype=np.int64))
        if total != t:
            raise BatchError(f"sample_lengths sum to {total}, but the row has {t} tokens")
        if n and int(self.sample_index.min()) < 0:
            raise BatchError("sample_index: negative index")
        if not np.array_equal(self.position_ids, expected_positions(self.sample_lengths)):
            raise BatchError("position_ids must count 0..len-1 within every sample")
        if t and self.loss_mask[self.position_ids == 0].any():
            raise BatchError("loss_mask must be false at the first token of every sample")
        return self

    @classmethod
    def from_samples(cls, samples: list[dict[str, Any]]) -> MicroBatch:
        """Concatenate samples into one row (a convenience for tests and tools, not the packer).

        Each sample is a dict with `input_ids`, `loss_mask`, `advantages`, `inference_logprobs`
        (sequences of length L), `sample_index` (int) and optionally `teacher_logprobs`, `teacher_mask` (each
        in every sample or in none); position ids are derived.
        """
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int32)

        def cat(key: str, dtype: np.dtype) -> np.ndarray:
            parts = [np.asarray(s[key], dtype=dtype) for s in samples]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        return cls(
            input_ids=cat("input_ids", TOKEN_FIELDS["input_ids"]),
            position_ids=expected_positions(lengths),
            loss_mask=cat("loss_mask", TOKEN_FIELDS["loss_mask"]),
            advantages=cat("advantages", TOKEN_FIELDS["advantages"]),
            inference_logprobs=cat("inference_logprobs", TOKEN_FIELDS["inference_logprobs"]),
            sample_lengths=lengths,
            sample_index=np.array([s["sample_index"] for s in samples], dtype=np.int32),
            **{
                name: cat(name, dtype)
                for name, dtype in OPTIONAL_TOKEN_FIELDS.items()
                if samples and all(name in s for s in samples)
            },
        ).validate()

    def equals(self, other: MicroBatch) -> bool:
        """Exact equality of every array (dtype, shape and bytes; NaNs compare equal bitwise)."""
        if self.optional_fields != other.optional_fields:
            return False
        return all(
            getattr(self, k).dtype == getattr(other, k).dtype
            and getattr(self, k).shape == getattr(other, k).shape
            and getattr(self, k).tobytes() == getattr(other, k).tobytes()
            for k in (*ARRAY_FIELDS, *self.optional_fields)
        )


def expected_positions(sample_lengths: np.ndarray) -> np.ndarray:
    """Position ids that restart at 0 for every sample: lengths [2, 3] -> [0, 1, 0, 1, 2]."""
    lengths = np.asarray(sample_lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return (np.arange(total, dtype=np.int64) - starts).astype(np.int32)


@dataclass
class TrainBatch:
    """Everything trainer step `step` consumes; see the module docstring for the invariants.

    `samples[j]` is JSON-able metadata of sample j (reward, advantage, min_version, max_version,
    env, ...). `num_loss_tokens` / `num_samples` are the global normalisers over all ranks.
    `temperature` is the sampling temperature inference used: the trainer must compute log-probs
    at the same temperature for them to be comparable with `inference_logprobs`. `max_tokens` is the
    generation budget of one sample (sampling.max_tokens × the environment's max turns; 0 = unknown):
    the constant normaliser of Dr.GRPO's seq-mean-token-sum-norm aggregation (docs/algorithms.md).
    """

    step: int
    micro_batches: list[list[MicroBatch]]
    samples: list[dict[str, Any]] = field(default_factory=list)
    num_loss_tokens: int = 0
    num_samples: int = 0
    created: float = field(default_factory=time.time)
    temperature: float = 1.0
    max_tokens: int = 0

    @property
    def num_ranks(self) -> int:
        return len(self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for rank in self.micro_batches for mb in rank)

    @property
    def has_teacher(self) -> bool:
        """The batch carries the teacher's log-probs (on-policy distillation)."""
        return any(mb.teacher_logprobs is not None for rank in self.micro_batches for mb in rank)

    def for_rank(self, rank: int) -> list[MicroBatch]:
        """The micro batches data-parallel rank `rank` trains on."""
        if not 0 <= rank < len(self.micro_batches):
            raise BatchError(f"batch for step {self.step} has {len(self.micro_batches)} ranks, no rank {rank}")
        return self.micro_batches[rank]

    def validate(self) -> TrainBatch:
        """Raise `BatchError` unless the batch and all its micro batches are consistent."""
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise BatchError(f"step must be a non-negative int, got {self.step!r}")
        if not self.micro_batches:
            raise BatchError("micro_batches: at least one rank is required")
        counts = {len(rank) for rank in self.micro_batches}
        if len(counts) != 1:
            raise BatchError(f"every rank must have the same number of micro batches, got {sorted(counts)}")
        for r, rank in enumerate(self.micro_batches):
            for i, mb in enumerate(rank):
                if not isinstance(mb, MicroBatch):
                    raise BatchError(f"micro_batches[{r}][{i}]: expected MicroBatch, got {type(mb).__name__}")
                try:
                    mb.validate()
                except BatchError as e:
                    raise BatchError(f"micro_batches[{r}][{i}]: {e}") from None
                if mb.optional_fields != self.micro_batches[0][0].optional_fields:
                    raise BatchError(
                        f"micro_batches[{r}][{i}]: optional fields {list(mb.optional_fields)}, but "
                        f"micro_batches[0][0] has {list(self.micro_batches[0][0].optional_fields)} "
                        "(every micro batch carries the same ones)"
                    )
                if mb.num_samples and int(mb.sample_index.max()) >= len(self.samples):
                    raise BatchError(
                        f"micro_batches[{r}][{i}]: sample_index {int(mb.sample_index.max())} "
                        f"out of range for {len(self.samples)} samples"
                    )
        for name in ("num_loss_tokens", "num_samples", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BatchError(f"{name} must be a non-negative int, got {value!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature <= 0
        ):
            raise BatchError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not isinstance(self.samples, list) or not all(isinstance(s, dict) for s in self.samples):
            raise BatchError("samples must be a list of dicts")
        return self
