"""`gyre replay` of a kept step draws the dropout masks the step drew (a LoRA run with `lora.dropout` > 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gyre.config.trainer import LoraConfig, TrainerConfig
from gyre_trainer import dist
from gyre_trainer.debug import RNG_FILE, StepDebugger
from gyre_trainer.lora import apply_lora
from gyre_trainer.model import load_model
from gyre_trainer.optim import build_optimizer, build_scheduler
from gyre_trainer.replay import replay
from gyre_trainer.step import train_step
from trainer_core_lib import make_batch, random_samples


@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_a_kept_step_of_a_lora_run_with_dropout_replays_exactly(tiny_model, tmp_path, dropout):
    cfg = TrainerConfig(model={"name": str(tiny_model)}, lora=LoraConfig(rank=4, dropout=dropout), device="cpu",
                        output_dir=str(tmp_path))  # fmt: skip
    ctx = dist.init_distributed("cpu")
    dist.seed_everything(cfg.seed, cfg.deterministic)
    model = apply_lora(load_model(cfg.model, "cpu", torch.float32), cfg.lora)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, None)
    batch = make_batch(random_samples(np.random.default_rng(0), [9, 14, 6, 11]), [[[0, 1], [2, 3]]])
    debugger = StepDebugger(cfg, ctx, model.config, torch.float32, output_dir=tmp_path, lora=cfg.lora)
    for _ in range(2):  # the RNG has moved on since the seed when step 3 goes wrong
        train_step(model, optimizer, scheduler, batch, loss_cfg=cfg.loss, max_grad_norm=1.0)
    debugger.watch.history.extend([1e-12] * 3)  # any norm is a spike now: step 3 is kept
    result = train_step(model, optimizer, scheduler, batch, loss_cfg=cfg.loss, max_grad_norm=1.0,
                        inspect_gradients=debugger.hook(3, batch, model))  # fmt: skip
    kept = tmp_path / "debug" / "step_3"
    assert (kept / RNG_FILE).is_file()
    replayed = replay(kept)
    # with dropout, a replay seeded alone drew other masks (loss 0.32114 for 0.32132, grad norm 1.38 for 1.49)
    assert (replayed["loss"], replayed["grad_norm"]) == (result.metrics["loss"], result.metrics["grad_norm"])
