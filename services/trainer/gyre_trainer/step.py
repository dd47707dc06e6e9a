"""One optimizer step on a `TrainBatch` (RL) or on packed rows (SFT).

    result = train_step(model, optimizer, scheduler, batch, loss_cfg=cfg.loss,
                        micro_batch_size=cfg.data.micro_batch_size, max_grad_norm=cfg.optim.max_grad_norm,
                        rank=rank, world_size=world_size)
    result.metrics  # loss, entropy, mismatch_kl, ratio_*, clip_frac|masked_frac, grad_norm, lr, num_tokens, ...

Gradient invariant: after `compute_gradients` on every rank, the parameters' gradient is the
gradient of the FULL batch loss (normalised by the batch's global counts), whatever the number of
micro-batches, `micro_batch_size` or data-parallel ranks. Each micro-batch back-propagates its share
of that loss (see `loss.aggregate`); shares add up across micro-batches by gradient accumulation and
across ranks by the data-parallel gradient reduction. FSDP2 (and DDP) AVERAGE gradients over ranks,
so each rank multiplies its shares by `data_parallel_scale(world_size)` = world_size to turn that
average back into the sum. Without a distributed wrapper (world_size 1) the scale is 1.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from gyre.batch import TrainBatch
from gyre.config.trainer import LossConfig
from torch import Tensor

from gyre_trainer.lora import reference_model
from gyre_trainer.loss import aggregate, get_loss, mismatch_log_ratio, policy_loss, valid_inference_logprobs
from gyre_trainer.model import packed_logprobs

log = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # any id works: padding is its own segment, never attended to, never in the loss


@dataclass
class StepResult:
    """Metrics of one step (floats; summed/averaged over all ranks when torch.distributed is initialised)."""

    metrics: dict[str, float] = field(default_factory=dict)


def data_parallel_scale(world_size: int) -> float:
    """Factor each rank applies to its loss shares so that the ranks' AVERAGED gradient (FSDP2/DDP)
    equals the single-process gradient of the whole batch: the mean of world_size shares × world_size
    is their sum. An FSDP2 test checks it by comparing against a single process on the same batch."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return float(world_size)


@dataclass
class PackedGroup:
    """`micro_batch_size` rows stacked for one forward: (B, T) ids/positions, flat (B·T,) per-token fields.

    Rows shorter than the longest are right-padded with one extra padding segment (positions
    restarting at 0, loss mask false), so the flat `sample_lengths` still sum to B·T.
    """

    input_ids: Tensor
    position_ids: Tensor
    row_lengths: list[Tensor]
    sample_lengths: Tensor
    loss_mask: Tensor
    advantages: Tensor | None
    inference_logprobs: Tensor | None
    num_tokens: int
    teacher_logprobs: Tensor | None = None
    teacher_mask: Tensor | None = None  # None: the teacher scored every token (or there is no teacher)


def pack_rows(rows: Sequence[Any], device: torch.device) -> PackedGroup:
    """Stack rows (MicroBatch-like: numpy `input_ids`, `loss_mask`, `sample_lengths`, optionally
    `advantages`, `inference_logprobs`, `teacher_logprobs`, `teacher_mask`) into one forward's tensors on `device`."""
    width = max(len(r.input_ids) for r in rows)

    def padded(row, name: str, dtype, fill) -> np.ndarray:
        values = np.asarray(getattr(row, name), dtype=dtype)
        return np.concatenate([values, np.full(width - len(values), fill, dtype=dtype)])

    def stacked(name: str, dtype, fill) -> Tensor:
        return torch.from_numpy(np.stack([padded(r, name, dtype, fill) for r in rows])).to(device, non_blocking=True)

    row_lengths, positions = [], []
    for r in rows:
        lengths = np.asarray(r.sample_lengths, dtype=np.int64)
        if width > len(r.input_ids):
            lengths = np.append(lengths, width - len(r.input_ids))
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions.append(np.arange(width, dtype=np.int64) - starts)
        row_lengths.append(torch.from_numpy(lengths))
    has_rl = all(hasattr(r, "advantages") and hasattr(r, "inference_logprobs") for r in rows)
    has_teacher = all(getattr(r, "teacher_logprobs", None) is not None for r in rows)
    has_teacher_mask = has_teacher and all(getattr(r, "teacher_mask", None) is not None for r in rows)
    return PackedGroup(
        input_ids=stacked("input_ids", np.int64, PAD_TOKEN_ID),
        position_ids=torch.from_numpy(np.stack(positions)).to(device, non_blocking=True),
        row_lengths=row_lengths,
        sample_lengths=torch.cat(row_lengths).to(device),
        loss_mask=stacked("loss_mask", np.bool_, False).reshape(-1),
        advantages=stacked("advantages", np.float32, 0.0).reshape(-1) if has_rl else None,
        inference_logprobs=stacked("inference_logprobs", np.float32, 0.0).reshape(-1) if has_rl else None,
        num_tokens=sum(len(r.input_ids) for r in rows),
        teacher_logprobs=stacked("teacher_logprobs", np.float32, 0.0).reshape(-1) if has_teacher else None,
        teacher_mask=stacked("teacher_mask", np.bool_, False).reshape(-1) if has_teacher_mask else None,
    )


def group_rows(rows: Sequence[Any], micro_batch_size: int) -> list[list[Any]]:
    """Consecutive groups of `micro_batch_size` rows (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]


def _sync_gradients(model, enabled: bool) -> None:
    # FSDP2: reduce-scatter gradients only on the last micro-batch instead of after every backward.
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def _all_reduce_sum(values: Tensor, world_size: int) -> Tensor:
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def _all_reduce_max(values: Tensor, world_size: int) -> Tensor:
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def max_loss_tokens_per_sample(batch: TrainBatch) -> int:
    """Most loss tokens of any sample in the whole batch (every rank): Dr.GRPO's constant for batches
    that carry no generation budget (`TrainBatch.max_tokens` 0)."""
    most = 0
    for rank in batch.micro_batches:
        for mb in rank:
            if mb.num_samples:
                starts = np.cumsum(mb.sample_lengths) - mb.sample_lengths
                most = max(most, int(np.add.reduceat(mb.loss_mask.astype(np.int64), starts).max()))
    return max(most, 1)


def compute_gradients(
    model,
    batch: TrainBatch,
    *,
    loss_cfg: LossConfig,
    rank: int = 0,
    world_size: int = 1,
    micro_batch_size: int = 1,
    ref_model=None,
    temperature: float | None = None,
) -> dict[str, float]:
    """Accumulate this rank's share of the batch-loss gradient into `.grad` (see the module docstring).

    Returns the step's loss metrics (global when torch.distributed is initialised and world_size > 1).
    Raises ValueError when the batch's global normalisers are smaller than this rank's own counts.
    """
    rows = batch.for_rank(rank)
    objective = get_loss(loss_cfg.type)
    if loss_cfg.distill > 0 and not batch.has_teacher:
        raise ValueError(
            f"batch {batch.step}: loss.distill = {loss_cfg.distill} but the batch carries no teacher log-probs: "
            "set orchestrator.teacher (docs/algorithms.md, on-policy distillation)"
        )
    temperature = temperature if temperature is not None else float(batch.temperature)
    local_loss_tokens = sum(mb.num_loss_tokens for mb in rows)
    if batch.num_loss_tokens < local_loss_tokens or (local_loss_tokens and batch.num_samples < 1):
        raise ValueError(
            f"batch {batch.step}: global normalisers (num_loss_tokens={batch.num_loss_tokens}, "
            f"num_samples={batch.num_samples}) are below rank {rank}'s own counts "
            f"({local_loss_tokens} loss tokens)"
        )
    norms = {
        "global_tokens": max(batch.num_loss_tokens, 1),
        "global_samples": max(batch.num_samples, 1),
        # Dr.GRPO's constant: the configured one, else the batch's generation budget (docs/algorithms.md)
        "max_tokens": loss_cfg.max_tokens or batch.max_tokens or max_loss_tokens_per_sample(batch),
    }
    scale = data_parallel_scale(world_size)
    device = next(model.parameters()).device
    groups = group_rows(rows, micro_batch_size)

    sums: dict[str, Tensor] = {}
    # the largest and (negated) smallest importance ratio of the batch's valid loss tokens: reduced with MAX
    peaks = torch.full((2,), -math.inf, dtype=torch.float64, device=device)

    def add(name: str, value: Tensor) -> None:
        value = value.detach().double()
        sums[name] = sums[name] + value if name in sums else value

    for index, group in enumerate(groups):
        packed = pack_rows(group, device)
        mask = packed.loss_mask
        logprobs, entropy = packed_logprobs(
            model, packed.input_ids, packed.position_ids, packed.row_lengths, temperature,
            entropy_grad=loss_cfg.entropy_coeff > 0,
        )  # fmt: skip
        logprobs, entropy = logprobs.reshape(-1), entropy.reshape(-1)
        ref_logprobs = None
        if ref_model is not None:
            with torch.no_grad(), reference_model(ref_model) as reference:
                ref_logprobs = packed_logprobs(
                    reference, packed.input_ids, packed.position_ids, packed.row_lengths, temperature
                )[0].reshape(-1)
        out = policy_loss(
            objective,
            logprobs,
            packed.inference_logprobs,
            packed.advantages,
            mask,
            packed.sample_lengths,
            loss_cfg,
            ref_logprobs=ref_logprobs,
            teacher_logprobs=packed.teacher_logprobs,
            teacher_mask=packed.teacher_mask,
            entropy=entropy,
        )
        share = aggregate(out.per_token_loss, mask, packed.sample_lengths, loss_cfg.aggregation, **norms)
        _sync_gradients(model, index == len(groups) - 1)
        (share * scale).backward()

        # the loss tokens the objective trains on: those with a possible inference log-prob (`policy_loss`)
        valid = valid_inference_logprobs(packed.inference_logprobs, mask)
        add("loss", share)
        add("loss_tokens", mask.sum())
        add("valid_tokens", valid.sum())
        add("tokens", torch.tensor(packed.num_tokens, device=device))
        add("entropy", (entropy * mask).sum())
        for name, per_token in out.stats.items():
            add(name, (per_token * mask).sum())
        if packed.teacher_logprobs is not None:
            scored = valid if packed.teacher_mask is None else valid & packed.teacher_mask
            add("teacher_tokens", scored.sum())
        # trainer vs inference on the sampled tokens (numerics and staleness): r = π_θ/μ, its k3 KL, its range
        log_ratio = mismatch_log_ratio(logprobs, packed.inference_logprobs, mask)
        ratio = log_ratio.exp()
        add("mismatch_kl", ((ratio - log_ratio - 1.0) * valid).sum())
        add("ratio_mean", (ratio * valid).sum())
        ratio = ratio.double()  # (no .any() or indexing: either would wait for the GPU at every micro-batch)
        highest = torch.where(valid, ratio, -math.inf).max()
        negated_lowest = torch.where(valid, -ratio, -math.inf).max()
        peaks = torch.maximum(peaks, torch.stack([highest, negated_lowest]))

    if not sums:  # a rank without micro-batches (only an empty batch has none)
        sums = {name: torch.zeros((), dtype=torch.float64, device=device)
                for name in ("loss", "loss_tokens", "valid_tokens", "tokens")}  # fmt: skip
    names = sorted(sums)
    reduced = _all_reduce_sum(torch.stack([sums[n] for n in names]), world_size).tolist()
    totals = dict(zip(names, reduced, strict=True))
    highest, negated_lowest = _all_reduce_max(peaks, world_size).tolist()
    loss_tokens, valid_tokens = totals.pop("loss_tokens"), totals.pop("valid_tokens")
    teacher_tokens = totals.pop("teacher_tokens", 0.0)
    metrics = {
        "loss": totals.pop("loss"),
        "num_tokens": totals.pop("tokens"),
        "num_loss_tokens": loss_tokens,
        "num_valid_tokens": valid_tokens,
        "num_samples": float(batch.num_samples),
        # a mean over the valid loss tokens of the whole batch (an invalid token has no ratio), whatever the split
        "mismatch_kl": totals.pop("mismatch_kl", 0.0) / max(valid_tokens, 1.0),
    }
    ratio_sum = totals.pop("ratio_mean", 0.0)
    if valid_tokens and math.isfinite(highest):  # the ratio is defined on the valid loss tokens only
        metrics.update(ratio_mean=ratio_sum / valid_tokens, ratio_min=-negated_lowest, ratio_max=highest)
    # Means of a quantity are over the tokens it is defined on: the KLs and the correction weight over the valid
    # loss tokens (an impossible inference log-prob has none of them: 0 there, which counted in the denominator
    # pulled the mean toward 0), the teacher's KL over the valid tokens it scored. Entropy and the 0/1 stats
    # (clip_frac, invalid_logprob_frac, teacher_frac, ...) are over every loss token.
    per_valid = {"ref_kl": valid_tokens, "is_weight": valid_tokens, "teacher_kl": teacher_tokens}
    metrics.update({name: value / max(per_valid.get(name, loss_tokens), 1.0) for name, value in totals.items()})
    return metrics


def gradient_norm(model) -> Tensor:
    """The total 2-norm of the accumulated gradients (of the whole model when sharded: every rank gets it)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding partial norms of the shards
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def optimizer_step(
    model,
    optimizer,
    scheduler,
    max_grad_norm: float,
    before_update: Callable[[float], None] | None = None,
    skip: str | None = None,
) -> dict[str, Any]:
    """Clip gradients to `max_grad_norm`, update, advance the schedule, clear gradients.

    The update is skipped (parameters and optimizer state untouched: no moment decay, no step count, no
    weight decay; `skipped` = 1 and `skip_reason` says why) when the gradient norm is not finite, when it is
    exactly 0 (no signal: a zero-signal batch, every advantage 0, or no loss token at all), or when the caller
    says `skip` (a batch without a valid loss token). AdamW on a zero gradient is not a no-op: it replays the
    decayed momentum of earlier batches and shrinks every matrix by its weight decay, so a batch that teaches
    nothing would still move the model. A skipped update still advances the schedule, so lr stays aligned with
    the trainer step (the step counts as trained: it is published and acked like any other).
    `lr` is the learning rate this update used. `before_update(grad_norm)` runs once the norm is known,
    while the parameters are still those that produced the gradients (the debug dump, `gyre_trainer.debug`).
    """
    lr = float(optimizer.param_groups[0]["lr"])
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = gradient_norm(model)
    if before_update is not None:
        before_update(float(grad_norm))
    norm = float(grad_norm)
    if skip is None and not math.isfinite(norm):
        skip = f"non-finite gradient norm ({norm})"
    elif skip is None and norm == 0.0:
        skip = "zero gradient (no signal: every advantage 0, or no loss token)"
    if skip is None:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
        optimizer.step()
    with warnings.catch_warnings():  # a skipped update still advances the schedule, on purpose
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, Any] = {"grad_norm": norm, "lr": lr, "skipped": 0.0 if skip is None else 1.0}
    if skip is not None:
        metrics["skip_reason"] = skip
    return metrics


def train_step(
    model,
    optimizer,
    scheduler,
    batch: TrainBatch,
    *,
    loss_cfg: LossConfig,
    max_grad_norm: float,
    rank: int = 0,
    world_size: int = 1,
    micro_batch_size: int = 1,
    ref_model=None,
    temperature: float | None = None,
    inspect_gradients: Callable[[dict[str, float]], None] | None = None,
) -> StepResult:
    """One RL step on `batch.for_rank(rank)`: gradients of the globally normalised loss, clip, update.

    `temperature` defaults to the batch's (the one inference sampled and scored at). `ref_model`
    (frozen, same tokenizer; `lora.AdaptersOff(model)` for a LoRA model's own base) enables the KL term
    (`loss_cfg.ref_kl_coef`) and the `ref_kl` metric.

    Metrics: `loss` (the full batch loss), `entropy` (mean over loss tokens), `mismatch_kl` (mean
    r − log r − 1 over the valid loss tokens of the batch), `ratio_mean`, `ratio_min`, `ratio_max` (of the
    importance ratio r = π_θ/μ over the same tokens; min/max absent without any), the objective's stats
    (`clip_frac` or `masked_frac`, fractions of loss tokens), `num_tokens`, `num_loss_tokens`,
    `num_valid_tokens` (loss tokens with a possible inference log-prob), `num_samples`, `grad_norm`
    (before clipping), `lr` (used by this update), `skipped` (1 = no update: `optimizer_step`; then also
    `skip_reason`, a string). A batch without a valid loss token skips the update (warned in the log).

    `inspect_gradients(metrics)` sees the loss metrics and `grad_norm` before the update, on every rank
    (the step's debug dump: `gyre_trainer.debug.StepDebugger`).
    """
    metrics = compute_gradients(
        model,
        batch,
        loss_cfg=loss_cfg,
        rank=rank,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        ref_model=ref_model,
        temperature=temperature,
    )
    before_update = None
    if inspect_gradients is not None:

        def before_update(grad_norm: float) -> None:
            inspect_gradients({**metrics, "grad_norm": grad_norm})

    skip = None
    if not metrics["num_valid_tokens"]:
        invalid = metrics["num_loss_tokens"] - metrics["num_valid_tokens"]
        skip = (f"no valid loss token ({int(metrics['num_loss_tokens'])} loss tokens, {int(invalid)} of them with "
                "an impossible inference log-prob)")  # fmt: skip
    metrics.update(optimizer_step(model, optimizer, scheduler, max_grad_norm, before_update, skip))
    if metrics["skipped"]:
        log.warning("batch %d: optimizer update skipped: %s; the step counts as trained (schedule advanced)",
                    batch.step, metrics["skip_reason"])  # fmt: skip
    return StepResult(metrics)


def compute_sft_gradients(
    model,
    rows: Sequence[Any],
    *,
    micro_batch_size: int = 1,
    world_size: int = 1,
    global_loss_tokens: int | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of the SFT loss, −Σ m·lp / global_loss_tokens over all rows of all ranks.

    `rows` are this rank's packed rows (MicroBatch-like: `input_ids`, `loss_mask`, `sample_lengths`).
    `global_loss_tokens` defaults to this rank's count, summed over ranks when torch.distributed is
    initialised, so the gradient does not depend on the split either.
    """
    device = next(model.parameters()).device
    if global_loss_tokens is None:
        local = torch.tensor(float(sum(int(np.count_nonzero(r.loss_mask)) for r in rows)), device=device)
        global_loss_tokens = int(_all_reduce_sum(local, world_size).item())
    normaliser = max(global_loss_tokens, 1)
    scale = data_parallel_scale(world_size)
    groups = group_rows(rows, micro_batch_size)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss, entropy sum, loss tokens, tokens
    for index, group in enumerate(groups):
        packed = pack_rows(group, device)
        logprobs, entropy = packed_logprobs(model, packed.input_ids, packed.position_ids, packed.row_lengths)
        mask = packed.loss_mask
        share = -torch.where(mask, logprobs.reshape(-1), 0.0).sum() / normaliser
        _sync_gradients(model, index == len(groups) - 1)
        (share * scale).backward()
        entropy_sum = (entropy.reshape(-1) * mask).sum()
        tokens = torch.tensor(packed.num_tokens, device=device)
        totals += torch.stack([share.detach(), entropy_sum, mask.sum(), tokens]).to(totals)
    loss, entropy_sum, loss_tokens, tokens = _all_reduce_sum(totals, world_size).tolist()
    return {
        "loss": loss,
        "entropy": entropy_sum / max(loss_tokens, 1.0),
        "num_tokens": tokens,
        "num_loss_tokens": loss_tokens,
    }


def sft_step(
    model,
    optimizer,
    scheduler,
    rows: Sequence[Any],
    *,
    max_grad_norm: float,
    micro_batch_size: int = 1,
    world_size: int = 1,
    global_loss_tokens: int | None = None,
) -> StepResult:
    """One supervised step: `compute_sft_gradients` (mean cross-entropy on loss-mask tokens), clip, update."""
    metrics = compute_sft_gradients(
        model, rows, micro_batch_size=micro_batch_size, world_size=world_size, global_loss_tokens=global_loss_tokens
    )
    metrics.update(optimizer_step(model, optimizer, scheduler, max_grad_norm))
    return StepResult(metrics)
