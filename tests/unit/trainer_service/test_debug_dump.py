"""Step dumps (`gyre_trainer.debug.StepDebugger.dump`) on a volume that cannot hold them."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from gyre.batch import MicroBatch, TrainBatch
from gyre.config.trainer import TrainerConfig
from gyre_trainer.debug import StepDebugger
from gyre_trainer.model import load_model
from support.fs import file_size_limit


def one_sample_batch(step: int) -> TrainBatch:
    n = 8
    sample = {
        "input_ids": np.arange(3, 3 + n),
        "loss_mask": np.arange(n) >= 3,
        "advantages": np.ones(n),
        "inference_logprobs": np.where(np.arange(n) >= 3, -2.0, 0.0),
        "sample_index": 0,
    }
    return TrainBatch(step=step, micro_batches=[[MicroBatch.from_samples([sample])]], samples=[{}],
                      num_loss_tokens=5, num_samples=1, created=1.0).validate()  # fmt: skip


def test_a_dump_the_volume_cannot_hold_is_skipped_with_a_warning_and_training_goes_on(tiny_model, ctx, tmp_path,
                                                                                      caplog):  # fmt: skip
    """A spike's dump (on by default) on a full volume raised out of the optimizer step: a diagnostic ended the run,
    and its model-sized partial folder stayed for good (pruning looked at `step_*` only), as did one of a dump
    killed half way. Now the dump is skipped with a warning naming the folder, and leftovers go at the next dump."""
    cfg = TrainerConfig(model={"name": str(tiny_model)}, output_dir=str(tmp_path))
    model = load_model(cfg.model, "cpu", torch.float32)
    debugger = StepDebugger(cfg, ctx, model.config, torch.float32, output_dir=tmp_path)
    killed = debugger.folder / ".tmp-step_1-123"  # a dump SIGKILLed half way
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"\0" * 1000)
    metrics = {"grad_norm": math.inf, "loss": 1.0}
    with caplog.at_level(logging.WARNING, "gyre_trainer.debug"), file_size_limit(1 << 20):
        assert debugger.dump(2, one_sample_batch(2), model, metrics, "not finite") is None
    assert f"step 2: could not keep it in {debugger.folder / 'step_2'}" in caplog.text
    assert "training goes on" in caplog.text and "MiB free of" in caplog.text
    assert sorted(p.name for p in debugger.folder.iterdir()) == [killed.name]  # its own partial folder is gone
    assert debugger.dump(3, one_sample_batch(3), model, metrics, "not finite") == debugger.folder / "step_3"
    assert sorted(p.name for p in debugger.folder.iterdir()) == ["step_3"]  # and the killed dump's with it
