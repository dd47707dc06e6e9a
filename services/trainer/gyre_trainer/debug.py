"""Keep a step whose gradients went wrong, so `gyre replay` can reproduce it (docs/trainer.md, "Debugging a step").

A step's gradient norm is *bad* when it is not finite, or when it exceeds `debug.spike_factor` times the
median of the previous `debug.spike_window` steps' (needs 3 of them and a median above 0; earlier bad steps and steps
with a zero gradient, whose update is skipped, do not count). The history is part of a checkpoint (`history` /
`restore`), so a resumed run judges its first steps against the steps before the stop.
Every rank sees the same global norm, so every rank decides alike: the parameters are gathered
collectively, and rank 0 writes `{output_dir}/debug/step_{s}/`, before the update, so they are exactly
those that produced the gradients:

    step.json          reason, the recorded loss / grad_norm / metrics, and how the step was computed
                       (loss config, micro-batch size, world size, dtype, device, torch threads, model settings)
    batch.bin          the batch as the stream carried it (`gyre.codec`)
    model.safetensors  the parameters (a LoRA run: the adapter's; its base stays `model.name`)
    config.json        the model's config (with the weights, a model folder `from_pretrained` loads)
    rng.pt             the torch RNG state (CPU, and the GPU's on a GPU) as the step's first forward found it:
                       dropout (a LoRA adapter's `lora.dropout`) draws its masks from it

The folder appears complete or not at all (`gyre.fsio.commit_dir`); the newest `debug.keep_last` are kept.
"""

from __future__ import annotations

import io
import json
import logging
import math
import shutil
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from gyre.codec import encode_batch
from gyre.config.trainer import TrainerConfig
from gyre.fsio import commit_dir, free_space, retire_dir, write_file, write_hashed
from gyre.safetensors_io import safetensors_chunks

from gyre_trainer import dist

log = logging.getLogger(__name__)

STEP_FILE = "step.json"
BATCH_FILE = "batch.bin"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
RNG_FILE = "rng.pt"
MIN_HISTORY = 3


def debug_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "debug"


class GradNormWatch:
    """Decides whether a step's gradient norm is bad (see the module docstring); rank-independent."""

    def __init__(self, spike_factor: float, window: int):
        self.spike_factor = spike_factor
        self.history: deque[float] = deque(maxlen=window)

    def observe(self, grad_norm: float) -> str | None:
        """The reason this norm is bad, or None (then it joins the history)."""
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm ({grad_norm})"
        if grad_norm == 0.0:
            # a step without signal (a zero-signal batch, no valid loss token: its update is skipped) says nothing
            # about the gradient's scale; in the history, a few of them made the median 0 and hid the next spike
            return None
        if len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            # a zero median (steps without signal: every group's advantages 0) sets no scale to spike against;
            # judged against it, every later step would be a spike (bad steps never join the history)
            if median > 0 and grad_norm > self.spike_factor * median:
                return (
                    f"gradient norm {grad_norm:.6g} is {grad_norm / median:.1f}x the median {median:.6g} of the "
                    f"previous {len(self.history)} steps (debug.spike_factor = {self.spike_factor:g})"
                )
        self.history.append(grad_norm)
        return None

    def restore(self, history: list[float] | None) -> None:
        """Continue from the history a checkpoint kept (`list(watch.history)`; None: a checkpoint from before it was
        kept, judged as a fresh start). The newest `spike_window` values count."""
        self.history.clear()
        self.history.extend(float(v) for v in history or () if math.isfinite(v) and v > 0)


class StepDebugger:
    """One run's `inspect_gradients` hook: counts bad steps and dumps them (`debug.dump`) into the run's folder.

    `lora`: the run's adapter config (its parameters alone are kept); `adapter`: its name on a multi-run
    trainer's shared base model (None: the model's only adapter, or none)."""

    def __init__(self, cfg: TrainerConfig, ctx: dist.DistContext, hf_config: Any, dtype: torch.dtype, *,
                 output_dir: Path, lora: Any = None, adapter: str | None = None, on_bad_step=None,
                 history: list[float] | None = None):  # fmt: skip
        self.cfg, self.ctx, self.hf_config, self.dtype = cfg, ctx, hf_config, dtype
        self.lora, self.adapter = lora, adapter
        self.watch = GradNormWatch(cfg.debug.spike_factor, cfg.debug.spike_window)
        self.watch.restore(history)  # a resumed run's: what its checkpoint kept
        self.folder = debug_dir(output_dir)
        self.on_bad_step = on_bad_step or (lambda step, reason: None)

    def hook(self, step: int, batch, model):
        """The callback `train_step(..., inspect_gradients=...)` takes for step `step`; make it just before the step.

        It keeps the RNG state of that moment: with dropout the step's forwards draw masks from it, and `gyre
        replay` (seeded alone) drew other masks, so a LoRA run with `lora.dropout` > 0 never replayed exactly."""
        rng = rng_state(self.ctx.device)

        def inspect(metrics: dict[str, float]) -> None:
            reason = self.watch.observe(metrics["grad_norm"])
            if reason is None:
                return
            log.warning("step %d: %s", step, reason)
            self.on_bad_step(step, reason)
            if self.cfg.debug.dump:
                self.dump(step, batch, model, metrics, reason, rng)

        return inspect

    def dump(
        self, step: int, batch, model, metrics: dict[str, float], reason: str, rng: dict[str, Any] | None = None
    ) -> Path | None:
        """Gather the parameters (every rank) and write the step's folder (rank 0); `rng`: `rng_state` before the
        step's forwards (rank 0's)."""
        state = dist.full_state_dict(model, self.ctx, trainable_only=self.lora is not None)
        if not self.ctx.is_main:
            return None
        final = self.folder / f"step_{step}"
        tmp = self.folder / f".tmp-step_{step}-{time.time_ns()}"
        try:
            tmp.mkdir(parents=True)
            write_hashed(tmp / WEIGHTS_FILE, safetensors_chunks(state, {"format": "pt"}))
            write_file(tmp / CONFIG_FILE, self.hf_config.to_json_string().encode())
            write_file(tmp / BATCH_FILE, encode_batch(batch))
            write_file(tmp / STEP_FILE, json.dumps(self.describe(step, metrics, reason), indent=1).encode())
            if rng is not None:
                buffer = io.BytesIO()
                torch.save(rng, buffer)
                write_file(tmp / RNG_FILE, buffer.getvalue())
            commit_dir(tmp, final)
        except OSError as e:
            # A diagnostic must not end the run: a full volume raised out of the step (the trainer died in its
            # optimizer step, before the update) and left the model-sized partial folder for good
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("step %d: could not keep it in %s (%s, %s); training goes on", step, final, e,
                        free_space(self.folder))  # fmt: skip
            return None
        log.warning("step %d kept in %s: reproduce it with `gyre replay %s`", step, final, final)
        self._prune()
        return final

    def describe(self, step: int, metrics: dict[str, float], reason: str) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "step": step,
            "reason": reason,
            "loss": metrics.get("loss"),
            "grad_norm": metrics["grad_norm"],
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)},
            # how the step was computed: what `gyre replay` needs to compute it again
            "world_size": self.ctx.world_size,
            "device": self.ctx.device.type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "deterministic": cfg.deterministic,
            "seed": cfg.seed,
            "model": cfg.model.model_dump(mode="json"),
            "lora": self.lora.model_dump(mode="json") if self.lora is not None else None,
            "adapter": self.adapter,
            "loss_config": cfg.loss.model_dump(mode="json"),
            "micro_batch_size": cfg.data.micro_batch_size,
            "activation_checkpointing": cfg.activation_checkpointing,
            "time": time.time(),
        }

    def _prune(self) -> None:
        steps = sorted((int(p.name.removeprefix("step_")), p) for p in self.folder.glob("step_*") if p.is_dir())
        for _, path in steps[: -self.cfg.debug.keep_last]:
            retire_dir(path)
        for path in self.folder.glob(".tmp-*"):  # a dump killed half way (rank 0 is the only writer, done now)
            shutil.rmtree(path, ignore_errors=True)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The torch RNG state the forwards on `device` draw from: the CPU generator's, and the GPU's on a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what `rng_state` kept (the GPU's part only when replaying on a GPU)."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
