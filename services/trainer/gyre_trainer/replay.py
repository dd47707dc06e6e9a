"""`gyre replay DEBUG/STEP_N`: compute a kept step's loss and gradient norm again (docs/trainer.md,
"Debugging a step").

The trainer keeps a step whose gradient norm is non-finite or spiking (`gyre_trainer.debug`): its batch,
the parameters that produced the gradients, and how it computed them. Replay rebuilds the model the same
way (the kept weights; a LoRA run's adapter, a multi-run run's too, onto its base `model.name`), sets the
same torch thread count and deterministic mode, puts back the RNG state the step started from (dropout's
masks), and runs the trainer's own `compute_gradients` and `gradient_norm` on the batch.
On the machine and dtype the step ran on, loss and gradient norm come out bit for bit the same; then the
step can be taken apart (a micro-batch at a time, a sample at a time) where it happened. A step trained
by several ranks is replayed rank by rank in one process (the sum of the ranks' shares is the batch
gradient), equal up to the order of the floating-point sums.

    gyre replay --step-dir outputs/run/debug/step_7
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

from gyre.config import Section, parse_or_exit
from pydantic import Field

SUMMARY = "Compute a kept step's (debug/step_N) loss and gradient norm again and compare them with the recorded ones."


class ReplayConfig(Section):
    """`gyre replay` options."""

    step_dir: Path = Field(..., description="A kept step: {output_dir}/debug/step_N.")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="Where to compute.")
    threads: int | None = Field(None, ge=1, description="torch threads (default: the step's own, for exact sums).")
    model_name: str | None = Field(
        None, description="The base model, where it is now (LoRA runs, reference KL); default: the step's model.name."
    )
    strict: bool = Field(False, description="Exit with status 1 unless loss and gradient norm are reproduced exactly.")


def replay(step_dir: Path, device: str = "cpu", threads: int | None = None, model_name: str | None = None) -> dict:
    """{'loss', 'grad_norm'} recomputed from `step_dir`, with the recorded step description under 'recorded'."""
    import torch
    from gyre.codec import decode_batch
    from gyre.config.trainer import LoraConfig, LossConfig, TrainerModelConfig
    from safetensors.torch import load_file

    from gyre_trainer import dist
    from gyre_trainer.debug import BATCH_FILE, RNG_FILE, STEP_FILE, WEIGHTS_FILE, set_rng_state
    from gyre_trainer.model import load_model
    from gyre_trainer.step import compute_gradients, gradient_norm

    step_dir = Path(step_dir)
    if not (step_dir / STEP_FILE).is_file():
        raise FileNotFoundError(f"{step_dir} is not a kept step (no {STEP_FILE}): look in <output_dir>/debug/")
    info = json.loads((step_dir / STEP_FILE).read_text())
    torch.set_num_threads(threads or info["torch_threads"])
    dist.seed_everything(info["seed"], info["deterministic"])
    dtype = getattr(torch, info["dtype"])
    model_cfg = TrainerModelConfig(**info["model"])
    base = model_cfg.model_copy(update={"name": model_name or model_cfg.name})
    # built as the RL trainer builds it: the model's own dropout off (model.load_model)
    kwargs = {"activation_checkpointing": info["activation_checkpointing"], "dropout": False}
    if info["lora"] is None:  # the kept folder is a whole model: config.json + the parameters
        model = load_model(model_cfg.model_copy(update={"name": str(step_dir)}), device, dtype, **kwargs)
    else:
        from gyre_trainer.lora import apply_lora

        model = apply_lora(load_model(base, device, dtype, **kwargs), LoraConfig(**info["lora"]))
        tensors = load_file(step_dir / WEIGHTS_FILE)
        if info.get("adapter"):  # a multi-run run's named adapter: here the model's only ("default") one
            tensors = {k.replace(f".{info['adapter']}.", ".default."): v for k, v in tensors.items()}
        dist.load_full_state_dict(model, tensors, trainable_only=True)
    loss_cfg = LossConfig(**info["loss_config"])
    ref_model = None
    if loss_cfg.ref_kl_coef > 0 and info["lora"] is not None:
        from gyre_trainer.lora import AdaptersOff

        ref_model = AdaptersOff(model)
    elif loss_cfg.ref_kl_coef > 0:
        ref_model = load_model(base, device, dtype).eval().requires_grad_(False)
    batch = decode_batch((step_dir / BATCH_FILE).read_bytes())
    if (step_dir / RNG_FILE).is_file():  # dropout draws the step's masks again (rank 0's RNG, for every rank)
        set_rng_state(torch.load(step_dir / RNG_FILE, weights_only=True), next(model.parameters()).device)
    loss = 0.0
    for rank in range(info["world_size"]):  # every rank's share, accumulated as the ranks' reduction does
        metrics = compute_gradients(model, batch, loss_cfg=loss_cfg, rank=rank, world_size=1,
                                    micro_batch_size=info["micro_batch_size"], ref_model=ref_model)  # fmt: skip
        loss += metrics["loss"]
    return {"loss": loss, "grad_norm": float(gradient_norm(model)), "recorded": info}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_or_exit(ReplayConfig, argv, prog="gyre replay", summary=SUMMARY)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model is noise here
    try:
        result = replay(cfg.step_dir, cfg.device, cfg.threads, cfg.model_name)
    except (FileNotFoundError, ValueError, OSError) as error:
        print(f"gyre replay: error: {error}", file=sys.stderr)
        return 2
    info = result["recorded"]
    print(f"step {info['step']}: {info['reason']}")
    print(f"  {'':10} {'recorded':>24} {'replayed':>24}")
    exact = True
    for key in ("loss", "grad_norm"):
        recorded, replayed = info[key], result[key]
        same = recorded == replayed or (recorded != recorded and replayed != replayed)  # NaN replays as NaN
        exact &= same
        note = "exact" if same else f"differs by {abs(replayed - recorded):.3g}"
        print(f"  {key:10} {recorded!r:>24} {replayed!r:>24}  {note}")
    if not exact:
        print(
            f"  (recorded on {info['device']} in {info['dtype']} with {info['world_size']} rank(s) and "
            f"{info['torch_threads']} threads: only the same machine, dtype and ranks reproduce it bit for bit)"
        )
    return 1 if cfg.strict and not exact else 0
