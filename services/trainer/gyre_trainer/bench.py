"""`gyre bench trainer`: how much the RL machinery costs on top of a bare training step.

    gyre bench trainer                                   # tiny model made in a temp folder, CPU
    gyre bench trainer --model.name outputs/run/model --seq-len 2048 --num-samples 256 --device cuda

On fake packed batches of variable-length samples (packed first-fit-decreasing into rows of
`seq_len`), it measures in one run, interleaved step by step on the same model and tokens:
- bare:  forward + cross-entropy + backward + AdamW step on the packed rows;
- RL:    `train_step` (log-probs at a temperature, entropy, objective, global normalisation,
         metrics, clipping, AdamW, schedule) on the same rows as a `TrainBatch`;
and prints tokens/s of both, their ratio (target >= 0.9), the packing efficiency (real tokens ÷
rows·seq_len, target >= 0.95) and MFU against `perf.peak_flops` (a GPU's datasheet peak; on a CPU a
nominal peak per thread).
On CUDA it also measures, in the same run and on the same weights:
- ceiling: forward + cross-entropy + backward + AdamW on UNPACKED causal rows of `seq_len` tokens
  with `sdpa` (flash kernel, no mask) — what the model reaches without packing; RL ÷ ceiling is the
  figure to hold at >= 1.0;
- peak GPU memory of each kind, and MFU by PRIME-RL's formula (6·N + 12·L·hidden·seq_len per token,
  `perf.primerl_flops_per_token`) beside Gyre's (attention over each sample's own length).
`--find-max-seq-len` then tries RL steps on rows of seq_len·2, ·4, … tokens and prints the longest
that fits. `gyre trainer --bench` calls `bench_from_config` with the trainer's own model, shapes and loss.

    # docs/benchmarks.md, on an H100:
    gyre model init --preset qwen3-0.6b --output-dir outputs/qwen3-shape
    gyre bench trainer --model.name outputs/qwen3-shape --seq-len 8192 --num-samples 64 \
        --min-len 256 --max-len 4096 --find-max-seq-len
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from gyre.batch import MicroBatch, TrainBatch
from gyre.config import GyreSettings, parse_or_exit
from gyre.config.shared import ModelConfig
from gyre.config.trainer import LossConfig, OptimConfig, TrainerConfig
from gyre.model_init import PresetName
from gyre.packing import first_fit_decreasing
from pydantic import Field, field_validator, model_validator

from gyre_trainer.attention import uses_varlen, varlen_kwargs
from gyre_trainer.model import load_model, packed_logprobs, resolve_device
from gyre_trainer.optim import build_optimizer, build_scheduler
from gyre_trainer.perf import (
    MFUMeter,
    effective_seq_len,
    flops_per_token,
    non_embedding_params,
    peak_flops,
    primerl_flops_per_token,
)
from gyre_trainer.step import group_rows, pack_rows, train_step


class BenchModelConfig(ModelConfig):
    # An empty text key is refused (575eb07), so "no model" is None: the bench then builds a fresh one.
    name: str | None = Field(None, description="Model folder or hub id; unset = a fresh model of --preset.")


class TrainerBenchConfig(GyreSettings):
    """Benchmark the trainer step on fake packed batches (bare step vs full RL step, packing, MFU)."""

    model: BenchModelConfig = Field(
        default_factory=BenchModelConfig, description="Model to time; unset = a fresh model of --preset."
    )
    preset: PresetName = Field("tiny", description="Preset of the fresh model (`gyre model init`'s presets).")
    seq_len: int = Field(1024, ge=16, description="Tokens per packed row.")
    num_samples: int = Field(64, ge=1, description="Samples per step.")
    min_len: int = Field(32, ge=2, description="Shortest sample (tokens).")
    max_len: int = Field(384, ge=2, description="Longest sample (tokens, <= seq_len).")
    micro_batch_size: int = Field(1, ge=1, description="Packed rows per forward.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "varlen"] = Field(
        "auto", description="Attention kernel of the packed (bare and RL) steps; see the trainer's model option."
    )
    activation_checkpointing: bool = Field(False, description="Recompute decoder-layer activations in backward.")
    compile: bool = Field(False, description="torch.compile decoder layers and log-prob kernels (all kinds).")
    ceiling: bool = Field(True, description="CUDA: also time unpacked causal rows of seq_len (sdpa), the ceiling.")
    find_max_seq_len: bool = Field(
        False, description="CUDA: after the timings, find the longest row (seq_len x 2^k) an RL step fits in."
    )
    max_seq_len_limit: int = Field(131072, ge=16, description="Longest row --find-max-seq-len tries.")
    steps: int = Field(3, ge=1, description="Timed steps of each kind.")
    warmup: int = Field(2, ge=0, description="Untimed steps of each kind first (allocator and caches warm up).")
    loss: LossConfig = Field(default_factory=LossConfig, description="RL objective.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description="Optimiser.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device.")
    threads: int = Field(2, ge=1, description="CPU threads (torch.set_num_threads).")
    seed: int = Field(0, description="Seed of the fake data.")

    @field_validator("model", mode="before")
    @classmethod
    def _any_model_section(cls, value: Any) -> Any:
        # A trainer's or test's ModelConfig is taken as it is (pydantic wants this subclass's instance).
        return value.model_dump() if isinstance(value, ModelConfig) else value

    @model_validator(mode="after")
    def _lengths_fit(self) -> TrainerBenchConfig:
        if not self.min_len <= self.max_len <= self.seq_len:
            # "key: why" names the key (the loader's cross-key form); it said config key '<root>'
            key = "min_len" if self.min_len > self.max_len else "max_len"
            raise ValueError(
                f"{key}: need min_len <= max_len <= seq_len, got {self.min_len}, {self.max_len}, {self.seq_len}"
            )
        return self


def fake_batch(cfg: TrainerBenchConfig, vocab_size: int, rng: np.random.Generator) -> tuple[TrainBatch, float]:
    """A one-rank TrainBatch of random samples (prompt 20-50 %, completion in the loss) and its packing
    efficiency. Inference log-probs are filled in later from the model itself."""
    lengths = rng.integers(cfg.min_len, cfg.max_len + 1, cfg.num_samples).tolist()
    samples = [random_sample(length, i, vocab_size, rng) for i, length in enumerate(lengths)]
    rows = [MicroBatch.from_samples([samples[i] for i in b]) for b in first_fit_decreasing(lengths, cfg.seq_len)]
    return one_row_batch(rows), sum(lengths) / (len(rows) * cfg.seq_len)


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
    """The baseline: forward, next-token cross-entropy on every token, backward, AdamW. Rows are
    packed (the model's attention keeps samples apart) or, for the ceiling, one unpacked sample each."""
    for packed in groups:
        kwargs = varlen_kwargs(packed.row_lengths, packed.input_ids.device) if uses_varlen(model) else {}
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kwargs).logits
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
    rl_mfu_primerl: float = 0.0
    ceiling_tokens_per_s: float | None = None  # CUDA only
    peak_memory_gb: dict[str, float] | None = None  # CUDA only: per kind
    max_seq_len: int | None = None  # --find-max-seq-len


def _timed(fn, device: torch.device, peaks: dict[str, float] | None = None, kind: str = "") -> float:
    """Seconds of `fn()`; on CUDA also the peak memory it reached, kept as the max per kind in `peaks`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if peaks is not None:
            peaks[kind] = max(peaks.get(kind, 0.0), torch.cuda.max_memory_allocated(device) / 1e9)
    return time.perf_counter() - start


def random_sample(length: int, index: int, vocab_size: int, rng: np.random.Generator) -> dict:
    """A fake sample: a prompt of 20-50 % (not in the loss), then a completion in the loss."""
    prompt = max(1, int(length * rng.uniform(0.2, 0.5)))
    return {
        "input_ids": rng.integers(3, vocab_size, length),
        "loss_mask": np.arange(length) >= prompt,
        "advantages": np.full(length, rng.normal(), dtype=np.float32),
        "inference_logprobs": np.zeros(length, dtype=np.float32),
        "sample_index": index,
    }


def one_row_batch(rows: list[MicroBatch], step: int = 1) -> TrainBatch:
    """A one-rank TrainBatch of `rows` (sample metadata left empty)."""
    return TrainBatch(
        step=step,
        micro_batches=[rows],
        samples=[{} for r in rows for _ in range(r.num_samples)],
        num_loss_tokens=sum(r.num_loss_tokens for r in rows),
        num_samples=sum(r.num_samples for r in rows),
    ).validate()


def unpacked_rows(num_tokens: int, seq_len: int, vocab_size: int, rng: np.random.Generator) -> list[MicroBatch]:
    """At least `num_tokens` tokens as one-sample causal rows of `seq_len` tokens (the ceiling's input)."""
    count = -(-num_tokens // seq_len)
    return [MicroBatch.from_samples([random_sample(seq_len, 0, vocab_size, rng)]) for _ in range(count)]


def full_row(length: int, min_len: int, max_len: int, vocab_size: int, rng: np.random.Generator) -> MicroBatch:
    """One row of exactly `length` tokens packed with samples of min_len..max_len (the last one fills it)."""
    lengths: list[int] = []
    while sum(lengths) < length:
        room = length - sum(lengths)
        lengths.append(room if room < 2 * min_len else min(room, int(rng.integers(min_len, max_len + 1))))
    return MicroBatch.from_samples([random_sample(n, i, vocab_size, rng) for i, n in enumerate(lengths)])


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
        options = {"activation_checkpointing": cfg.activation_checkpointing, "compile": cfg.compile}
        model = load_model(model_cfg, device, attn_implementation=cfg.attn_implementation, **options)
        # The same weights again (not a deepcopy: compiled layers do not copy).
        bare_model = load_model(model_cfg, device, attn_implementation=cfg.attn_implementation, **options)
        ceiling_model = None
        if cfg.ceiling and device.type == "cuda":
            ceiling_model = load_model(model_cfg, device, attn_implementation="sdpa", **options)
    dtype = next(model.parameters()).dtype
    batch, efficiency = fake_batch(cfg, model.config.vocab_size, rng)
    fill_inference_logprobs(model, batch, noise=0.05, rng=rng)
    rows = batch.for_rank(0)
    groups = [pack_rows(g, device) for g in group_rows(rows, cfg.micro_batch_size)]
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim.model_copy(update={"scheduler": "constant"}), None)
    bare_optimizer = build_optimizer(bare_model, cfg.optim)
    kinds = {"bare": lambda: bare_step(bare_model, bare_optimizer, groups)}
    ceiling_optimizer = None

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

    kinds["rl"] = rl_step
    if ceiling_model is not None:
        plain = unpacked_rows(batch.num_tokens, cfg.seq_len, model.config.vocab_size, rng)
        ceiling_groups = [pack_rows(g, device) for g in group_rows(plain, cfg.micro_batch_size)]
        ceiling_optimizer = build_optimizer(ceiling_model, cfg.optim)
        kinds["ceiling"] = lambda: bare_step(ceiling_model, ceiling_optimizer, ceiling_groups)
        ceiling_tokens = sum(len(r.input_ids) for r in plain)

    lengths = np.concatenate([r.sample_lengths for r in rows])
    meter = MFUMeter(flops_per_token(model.config, effective_seq_len(lengths)), peak_flops(device, dtype))
    primerl = MFUMeter(primerl_flops_per_token(model.config, cfg.seq_len), peak_flops(device, dtype))
    tokens = batch.num_tokens
    log(
        f"gyre bench trainer: {type(model).__name__} ({non_embedding_params(model.config):,} non-embedding params) "
        f"on {_device_name(device)} {str(dtype).removeprefix('torch.')}, attention "
        f"{model.config._attn_implementation}, activation checkpointing "
        f"{'on' if cfg.activation_checkpointing else 'off'}, compile {'on' if cfg.compile else 'off'}, "
        f"{torch.get_num_threads()} threads\n"
        f"  batch: {cfg.num_samples} samples of {cfg.min_len}-{cfg.max_len} tokens ({tokens:,} tokens) in "
        f"{len(rows)} rows x {cfg.seq_len}, micro_batch_size {cfg.micro_batch_size}, loss {cfg.loss.type}"
    )

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    peaks: dict[str, float] = {}
    order = list(kinds)
    for i in range(cfg.warmup + cfg.steps):
        # Rotate which kind goes first, so drift in machine load hits all alike.
        for kind in order[i % len(order) :] + order[: i % len(order)]:
            seconds = _timed(kinds[kind], device, peaks, kind)
            if i >= cfg.warmup:
                times[kind].append(seconds)
    median = {kind: statistics.median(values) for kind, values in times.items()}
    bare_reading, rl_reading = meter.reading(tokens, median["bare"]), meter.reading(tokens, median["rl"])
    result = BenchResult(
        bare_tokens_per_s=bare_reading.tokens_per_s,
        rl_tokens_per_s=rl_reading.tokens_per_s,
        ratio=median["bare"] / median["rl"],
        packing_efficiency=efficiency,
        bare_mfu=bare_reading.mfu,
        rl_mfu=rl_reading.mfu,
        peak_flops=meter.peak,
        tokens_per_step=tokens,
        rows=len(rows),
        rl_mfu_primerl=primerl.reading(tokens, median["rl"]).mfu,
        peak_memory_gb=peaks or None,
    )
    table = [("bare fwd+bwd+AdamW", "bare", tokens), ("full RL train_step", "rl", tokens)]
    if "ceiling" in kinds:
        result.ceiling_tokens_per_s = ceiling_tokens / median["ceiling"]
        table.append((f"ceiling: unpacked {cfg.seq_len}", "ceiling", ceiling_tokens))
    memory = f"{'peak GB':>9}" if peaks else ""
    lines = [f"  {'':<28}{'tokens/s':>12}{'step s':>10}{'MFU':>9}{'MFU prime':>11}{memory}"]
    for label, kind, count in table:
        rate = count / median[kind]
        mem = f"{peaks[kind]:>9.1f}" if peaks else ""
        lines.append(
            f"  {label:<28}{rate:>12,.0f}{median[kind]:>10.3f}{meter.reading(count, median[kind]).mfu:>9.4f}"
            f"{primerl.reading(count, median[kind]).mfu:>11.4f}{mem}"
        )
    lines.append(f"  RL / bare tokens/s ratio:   {result.ratio:.3f}  (target >= 0.9; median of {cfg.steps} steps)")
    if result.ceiling_tokens_per_s:
        vs_ceiling = result.rl_tokens_per_s / result.ceiling_tokens_per_s
        lines.append(f"  RL / ceiling tokens/s:      {vs_ceiling:.3f}  (target >= 1.0: packing costs nothing)")
    lines.append(f"  packing efficiency:         {efficiency:.3f}  (real tokens / rows x seq_len, FFD; target >= 0.95)")
    lines.append(
        f"  peak: {meter.peak / 1e12:,.1f} TFLOP/s ({'datasheet' if device.type == 'cuda' else 'nominal CPU'}); "
        f"MFU = {meter.flops_per_token / 1e9:.2f} GFLOP/token (6N + 12·L·heads·head_dim·T, T = Σl²/Σl = "
        f"{effective_seq_len(lengths):.0f}); MFU prime = PRIME-RL's {primerl.flops_per_token / 1e9:.2f} GFLOP/token "
        f"(6N + 12·L·hidden·seq_len)"
    )
    log("\n".join(lines))
    if cfg.find_max_seq_len and device.type == "cuda":
        # Free the other kinds' models and optimizer states: the longest row gets the GPU to itself.
        kinds.clear()
        bare_model = bare_optimizer = ceiling_model = ceiling_optimizer = None
        torch.cuda.empty_cache()
        result.max_seq_len = find_max_seq_len(model, optimizer, scheduler, cfg, rng, log)
    return result


def find_max_seq_len(model, optimizer, scheduler, cfg: TrainerBenchConfig, rng, log=print) -> int | None:
    """Longest row (seq_len·2^k, up to `max_seq_len_limit`) whose RL step fits in GPU memory."""
    device = next(model.parameters()).device
    fits = None
    length = cfg.seq_len * 2
    while length <= cfg.max_seq_len_limit:
        row = full_row(length, cfg.min_len, max(cfg.max_len, length // 8), model.config.vocab_size, rng)
        batch = one_row_batch([row])
        fill_inference_logprobs(model, batch, noise=0.05, rng=rng)
        row_tokens = batch.num_tokens
        peaks: dict[str, float] = {}
        try:
            seconds = _timed(
                lambda b=batch: train_step(
                    model, optimizer, scheduler, b, loss_cfg=cfg.loss, max_grad_norm=cfg.optim.max_grad_norm
                ),
                device,
                peaks,
                "rl",
            )
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            log(f"  row of {length:>7,} tokens: out of memory")
            break
        fits = length
        log(
            f"  row of {length:>7,} tokens ({row_tokens:,} real): fits, peak {peaks['rl']:.1f} GB, "
            f"{row_tokens / seconds:,.0f} tokens/s (first step, includes warm-up)"
        )
        length *= 2
    log(f"  longest row that fits: {fits:,} tokens" if fits else "  no longer row fits")
    return fits


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


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
