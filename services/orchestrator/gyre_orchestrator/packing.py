"""Pack scored samples into `seq_len`-token rows, split them across data-parallel ranks, build a `TrainBatch`
(the bin packing itself: `gyre.packing`).

Invariants (tests check every one):
- no row holds more than `seq_len` tokens, and every token of every sample lands in exactly one row,
  contiguous and in order (samples are never cut: a sample longer than `seq_len` is an error here;
  the caller truncates or drops it first and counts it);
- every rank gets the same number of rows (FSDP ranks step in lock-step), and rows are assigned so
  that ranks carry similar token counts;
- rows holding several samples are split until the row count divides evenly; only when no row can
  be split (every row is one sample, e.g. fewer samples than ranks) are the missing slots filled with
  *padding rows*: one token, no loss token, pointing at a metadata entry `{"padding": true}` placed
  after the real samples (so `TrainBatch.num_samples` still counts real samples only). Fewer than
  `world_size` padding rows are ever added, and they carry nothing into the loss.

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gyre.batch import TOKEN_FIELDS, MicroBatch, TrainBatch, expected_positions
from gyre.packing import assign_to_ranks, first_fit_decreasing

PAD_TOKEN_ID = 0  # <|endoftext|> of the built-in tokenizer; never in the loss, so any id would do


@dataclass
class TrainSample:
    """One sample ready to pack; arrays are aligned per docs/architecture.md ("Alignment")."""

    input_ids: np.ndarray  # int32 [L]: prompt + every turn, as the model saw them
    loss_mask: np.ndarray  # bool  [L]: True iff the model sampled the token
    inference_logprobs: np.ndarray  # float32 [L]: log-prob of input_ids[t] at sampling time (0 off the mask)
    advantage: float
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able: reward, versions, env, ...
    teacher_logprobs: np.ndarray | None = None  # float32 [L]: the teacher's log-prob of input_ids[t] (distillation)
    teacher_mask: np.ndarray | None = None  # bool [L]: where the teacher scored the token (None: everywhere)

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.bool_)
        self.inference_logprobs = np.asarray(self.inference_logprobs, dtype=np.float32)
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = np.asarray(self.teacher_logprobs, dtype=np.float32)
        n = self.input_ids.shape[0]
        if self.input_ids.ndim != 1 or n == 0:
            raise ValueError("a sample needs a non-empty 1-D input_ids")
        if self.loss_mask.shape != (n,) or self.inference_logprobs.shape != (n,):
            raise ValueError(
                f"loss_mask {self.loss_mask.shape} and inference_logprobs {self.inference_logprobs.shape} "
                f"must match input_ids ({n},)"
            )
        if self.teacher_logprobs is not None and self.teacher_logprobs.shape != (n,):
            raise ValueError(f"teacher_logprobs {self.teacher_logprobs.shape} must match input_ids ({n},)")
        if self.teacher_mask is not None:
            self.teacher_mask = np.asarray(self.teacher_mask, dtype=np.bool_)
            if self.teacher_logprobs is None or self.teacher_mask.shape != (n,):
                raise ValueError(f"teacher_mask {self.teacher_mask.shape} needs teacher_logprobs and must match "
                                 f"input_ids ({n},)")  # fmt: skip

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


def _row(samples: Sequence[TrainSample], indices: list[int], teacher_mask: bool = False) -> MicroBatch:
    chosen = [samples[i] for i in indices]
    lengths = np.array([s.length for s in chosen], dtype=np.int32)
    teacher = chosen[0].teacher_logprobs is not None
    scored = [np.ones(s.length, dtype=np.bool_) if s.teacher_mask is None else s.teacher_mask for s in chosen]
    return MicroBatch(
        input_ids=np.concatenate([s.input_ids for s in chosen]),
        position_ids=expected_positions(lengths),
        loss_mask=np.concatenate([s.loss_mask for s in chosen]),
        advantages=np.concatenate([np.full(s.length, s.advantage, dtype=np.float32) for s in chosen]),
        inference_logprobs=np.concatenate([s.inference_logprobs for s in chosen]),
        sample_lengths=lengths,
        sample_index=np.asarray(indices, dtype=np.int32),
        teacher_logprobs=np.concatenate([s.teacher_logprobs for s in chosen]) if teacher else None,
        teacher_mask=np.concatenate(scored) if teacher_mask else None,
    )


def _padding_row(index: int, teacher: bool, teacher_mask: bool = False) -> MicroBatch:
    one = np.ones(1, dtype=np.int32)
    return MicroBatch(
        input_ids=np.full(1, PAD_TOKEN_ID, dtype=TOKEN_FIELDS["input_ids"]),
        position_ids=np.zeros(1, dtype=np.int32),
        loss_mask=np.zeros(1, dtype=np.bool_),
        advantages=np.zeros(1, dtype=np.float32),
        inference_logprobs=np.zeros(1, dtype=np.float32),
        sample_lengths=one,
        sample_index=np.full(1, index, dtype=np.int32),
        teacher_logprobs=np.zeros(1, dtype=np.float32) if teacher else None,
        teacher_mask=np.zeros(1, dtype=np.bool_) if teacher_mask else None,
    )


@dataclass
class PackResult:
    batch: TrainBatch
    num_rows: int
    efficiency: float  # real tokens / (rows × seq_len), in 0..1


def pack_batch(
    step: int,
    samples: Sequence[TrainSample],
    *,
    seq_len: int,
    world_size: int = 1,
    temperature: float = 1.0,
    max_tokens: int = 0,
) -> PackResult:
    """Pack `samples` into a validated `TrainBatch` for trainer step `step`."""
    if not samples:
        raise ValueError(f"step {step}: refusing to build an empty batch")
    teacher = samples[0].teacher_logprobs is not None
    if any((s.teacher_logprobs is not None) != teacher for s in samples):
        raise ValueError(f"step {step}: teacher_logprobs in some samples but not in others")
    # a batch carries `teacher_mask` only when the teacher left a token unscored (older trainers read the rest)
    teacher_mask = any(s.teacher_mask is not None and not s.teacher_mask.all() for s in samples)
    lengths = [s.length for s in samples]
    ranks = assign_to_ranks(first_fit_decreasing(lengths, seq_len), lengths, world_size)
    metadata = [dict(s.meta) for s in samples]
    padding_index = None
    micro_batches: list[list[MicroBatch]] = []
    for rank in ranks:
        rows = []
        for indices in rank:
            if indices:
                rows.append(_row(samples, indices, teacher_mask))
            else:
                if padding_index is None:
                    padding_index = len(metadata)
                    metadata.append({"padding": True})
                rows.append(_padding_row(padding_index, teacher, teacher_mask))
        micro_batches.append(rows)
    batch = TrainBatch(
        step=step,
        micro_batches=micro_batches,
        samples=metadata,
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        num_samples=len(samples),
        temperature=temperature,
        max_tokens=max_tokens,
    ).validate()
    num_rows = sum(len(r) for r in micro_batches)
    return PackResult(batch=batch, num_rows=num_rows, efficiency=sum(lengths) / (num_rows * seq_len))
