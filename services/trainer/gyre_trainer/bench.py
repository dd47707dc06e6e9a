"""`gyre bench trainer`: how much the RL machinery costs on top of a bare training step.

    gyre bench trainer                                   # tiny model made in a temp folder, CPU
    gyre bench trainer --model.name outputs/run/model --seq-len 2048 --num-samples 256 --device cuda

On fake packed batches of variable-length samples (packed first-fit-decreasing into rows of
`seq_len`), it measures in one run, interleaved step by step on the same model and tokens:
- bare:  forward + cross-entropy + backward + AdamW step on the packed rows;
- RL:    `train_step` (log-probs at a temperature, entropy, objective, global normalisation,
         metrics, clipping, AdamW, schedule) on the same rows as a `TrainBatch`;
and prints tokens/s of both, their ratio (target >= 0.9), the packing efficiency (real tokens ÷
rows·seq_len, target >= 0.95) and MFU against `perf.peak_flops` (a measured matmul peak on CPU).
`gyre trainer --bench` calls `bench_from_config` with the trainer's own model, shapes and loss.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from gyre.batch import MicroBatch, TrainBatch
from gyre.config.loader import GyreSettings, parse_or_exit
from gyre.config.shared import ModelConfig
from gyre.config.trainer import LossConfig, OptimConfig, TrainerConfig
from pydantic import Field, model_validator

from gyre_trainer.model import load_model, packed_logprobs, resolve_device
from gyre_trainer.optim import build_optimizer, build_scheduler
from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token, non_embedding_params, peak_flops
from gyre_trainer.step import group_rows, pack_rows, train_step


class TrainerBenchConfig(GyreSettings):
    """Benchmark the trainer step on fake packed batches (bare step vs full RL step, packing, MFU)."""

    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(name=""), description="Model folder; empty = a fresh tiny model."
    )
    preset: Literal["tiny", "small", "medium"] = Field("tiny", description="Preset of the fresh model.")
    seq_len: int = Field(1024, ge=16, description="Tokens per packed row.")
    num_samples: int = Field(64, ge=1, description="Samples per step.")
    min_len: int = Field(32, ge=2, description="Shortest sample (tokens).")
    max_len: int = Field(384, ge=2, description="Longest sample (tokens, <= seq_len).")
    micro_batch_size: int = Field(1, ge=1, description="Packed rows per forward.")
    steps: int = Field(3, ge=1, description="Timed steps of each kind.")
    warmup: int = Field(1, ge=0, description="Untimed steps of each kind first.")
    loss: LossConfig = Field(default_factory=LossConfig, description="RL objective.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description="Optimiser.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device.")
    threads: int = Field(2, ge=1, description="CPU threads (torch.set_num_threads).")
    seed: int = Field(0, description="Seed of the fake data.")

    @model_validator(mode="after")
    def _lengths_fit(self) -> TrainerBenchConfig:
        if not self.min_len <= self.max_len <= self.seq_len:
            raise ValueError(f"need min_len <= max_len <= seq_len, got {self.min_len}, {self.max_len}, {self.seq_len}")
        return self


def pack_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total <= capacity, first-fit-decreasing
    (longest first, each into the first bin with room): within 11/9·OPT + 1 bins."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def fake_batch(cfg: TrainerBenchConfig, vocab_size: int, rng: np.random.Generator) -> tuple[TrainBatch, float]:
    """A one-rank TrainBatch of random samples (prompt 20-50 %, completion in the loss) and its packing
    efficiency. Inference log-probs are filled in later from the model itself."""
    lengths = rng.integers(cfg.min_len, cfg.max_len + 1, cfg.num_samples).tolist()
    samples = []
    for i, length in enumerate(lengths):
        prompt = max(1, int(length * rng.uniform(0.2, 0.5)))
        samples.append(
            {
                "input_ids": rng.integers(3, vocab_size, length),
                "loss_mask": np.arange(length) >= prompt,
                "advantages": np.full(length, rng.normal(), dtype=np.float32),
                "inference_logprobs": np.zeros(length, dtype=np.float32),
                "sample_index": i,
            }
        )
    rows = [MicroBatch.from_samples([samples[i] for i in b]) for b in pack_first_fit_decreasing(lengths, cfg.seq_len)]
    batch = TrainBatch(
        step=1,
        micro_batches=[rows],
        samples=[{} for _ in samples],
        num_loss_tokens=sum(r.num_loss_tokens for r in rows),
        num_samples=len(samples),
    ).validate()
    return batch, sum(lengths) / (len(rows) * cfg.seq_len)


@torch.no_grad()
def fill_inference_logprobs(model, batch: TrainBatch, noise: float, rng: np.random.Generator) -> None:
    """Behaviour log-probs = the model's own plus small noise, so ratios (and clipping) look realistic."""
    for row in batch.for_rank(0):
        lp, _ = packed_logprobs(
            model,
            torch.from_numpy(row.input_ids.astype(np.int64)).to(model.device),
            torch.from_numpy(row.position_ids.astype(np.int64)).to(model.device),
            row.sample_lengths,
        )
        row.inference_logprobs[:] = lp.float().cpu().numpy() + rng.normal(0, noise, row.num_tokens) * row.loss_mask


def bare_step(model, optimizer, groups) -> None:
    """The baseline: forward, next-token cross-entropy on every token, backward, AdamW."""
    for packed in groups:
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), packed.input_ids[:, 1:].flatten()
        )
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class BenchResult:
    bare_tokens_per_s: float
    rl_tokens_per_s: float
    ratio: float
    packing_efficiency: float
    bare_mfu: float
    rl_mfu: float
    peak_flops: float
    tokens_per_step: int
    rows: int


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(cfg: TrainerBenchConfig, log=print) -> BenchResult:
    """Build the model and fake batch, time `warmup + steps` of each kind interleaved, report medians."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        model_cfg = cfg.model
        if not model_cfg.name:
            from gyre.model_init import init_model

            model_cfg = model_cfg.model_copy(update={"name": str(init_model(f"{tmp}/model", preset=cfg.preset))})
        model = load_model(model_cfg, device)
    dtype = next(model.parameters()).dtype
    batch, efficiency = fake_batch(cfg, model.config.vocab_size, rng)
    fill_inference_logprobs(model, batch, noise=0.05, rng=rng)
    rows = batch.for_rank(0)
    groups = [pack_rows(g, device) for g in group_rows(rows, cfg.micro_batch_size)]
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim.model_copy(update={"scheduler": "constant"}), None)
    bare_model = copy.deepcopy(model)
    bare_optimizer = build_optimizer(bare_model, cfg.optim)

    lengths = np.concatenate([r.sample_lengths for r in rows])
    meter = MFUMeter(flops_per_token(model.config, effective_seq_len(lengths)), peak_flops(device, dtype))
    tokens = batch.num_tokens
    log(
        f"gyre bench trainer: {type(model).__name__} ({non_embedding_params(model.config):,} non-embedding params) "
        f"on {device} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads\n"
        f"  batch: {cfg.num_samples} samples of {cfg.min_len}-{cfg.max_len} tokens ({tokens:,} tokens) in "
        f"{len(rows)} rows x {cfg.seq_len}, micro_batch_size {cfg.micro_batch_size}, loss {cfg.loss.type}"
    )

    def rl_step() -> None:
        train_step(
            model,
            optimizer,
            scheduler,
            batch,
            loss_cfg=cfg.loss,
            max_grad_norm=cfg.optim.max_grad_norm,
            micro_batch_size=cfg.micro_batch_size,
        )

    bare_times, rl_times = [], []
    for i in range(cfg.warmup + cfg.steps):
        # Alternate which kind goes first, so drift in machine load hits both alike.
        if i % 2:
            rl = _timed(rl_step, device)
            bare = _timed(lambda: bare_step(bare_model, bare_optimizer, groups), device)
        else:
            bare = _timed(lambda: bare_step(bare_model, bare_optimizer, groups), device)
            rl = _timed(rl_step, device)
        if i >= cfg.warmup:
            bare_times.append(bare)
            rl_times.append(rl)
    bare_s, rl_s = statistics.median(bare_times), statistics.median(rl_times)
    bare_reading, rl_reading = meter.reading(tokens, bare_s), meter.reading(tokens, rl_s)
    result = BenchResult(
        bare_tokens_per_s=bare_reading.tokens_per_s,
        rl_tokens_per_s=rl_reading.tokens_per_s,
        ratio=bare_s / rl_s,
        packing_efficiency=efficiency,
        bare_mfu=bare_reading.mfu,
        rl_mfu=rl_reading.mfu,
        peak_flops=meter.peak,
        tokens_per_step=tokens,
        rows=len(rows),
    )
    log(
        f"  {'':<28}{'tokens/s':>12}{'step s':>10}{'MFU':>9}\n"
        f"  {'bare fwd+bwd+AdamW':<28}{bare_reading.tokens_per_s:>12,.0f}{bare_s:>10.3f}{bare_reading.mfu:>9.4f}\n"
        f"  {'full RL train_step':<28}{rl_reading.tokens_per_s:>12,.0f}{rl_s:>10.3f}{rl_reading.mfu:>9.4f}\n"
        f"  RL / bare tokens/s ratio:   {result.ratio:.3f}  (target >= 0.9; median of {cfg.steps} steps)\n"
        f"  packing efficiency:         {efficiency:.3f}  (real tokens / rows x seq_len, FFD; target >= 0.95)\n"
        f"  peak: {meter.peak / 1e9:,.1f} GFLOP/s ({'datasheet' if device.type == 'cuda' else 'measured matmul'}), "
        f"{meter.flops_per_token / 1e6:.2f} MFLOP/token (6N + 12·L·H·T, T = {effective_seq_len(lengths):.0f})"
    )
    return result


def bench_from_config(cfg: TrainerConfig, log=print) -> BenchResult:
    """`gyre trainer --bench`: the trainer's own model, row length, micro-batch size, loss and optimiser."""
    seq_len = cfg.data.seq_len
    min_len = max(2, seq_len // 32)
    bench_cfg = TrainerBenchConfig(
        model=cfg.model,
        seq_len=seq_len,
        num_samples=40,  # about 8 rows of samples averaging a fifth of a row
        min_len=min_len,
        max_len=max(min_len, seq_len * 3 // 8),
        micro_batch_size=cfg.data.micro_batch_size,
        loss=cfg.loss,
        optim=cfg.optim,
        device=cfg.device,
        seed=cfg.seed,
    )
    return run(bench_cfg, log=log)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_or_exit(TrainerBenchConfig, list(argv) if argv is not None else None, prog="gyre bench trainer")
    try:
        run(cfg)
    except (ValueError, OSError) as error:  # OSError: transformers' "not a model folder"
        print(f"gyre bench trainer: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
