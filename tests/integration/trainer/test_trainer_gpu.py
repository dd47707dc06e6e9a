"""The trainer on a CUDA GPU: bf16 training, checkpoint, resume and servable bf16 weights.

Skipped on machines without a GPU (the CPU paths are covered by the other tests of this folder).
"""

from __future__ import annotations

import pytest
import torch
from gyre.streams import BatchStream
from trainer_testlib import load_weights, push_batches, run_in_process, trained_steps, trainer_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_trainer_on_gpu_trains_resumes_and_publishes_bf16(tiny_model, redis_url, unique_run_id, tmp_path):
    from transformers import AutoModelForCausalLM

    push_batches(BatchStream(redis_url, unique_run_id), range(1, 4))
    opts = {"device": "cuda", "deterministic": "false", "ckpt.interval": 1}
    assert run_in_process(trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 2, **opts)) == 0
    assert run_in_process(trainer_args(tiny_model, tmp_path, redis_url, unique_run_id, 3, **opts)) == 0
    assert trained_steps(tmp_path) == [1, 2, 3]

    weights = load_weights(tmp_path / "weights" / "step_3")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # model.dtype auto = bf16 on GPU
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "step_3", dtype=torch.bfloat16).cuda()
    logits = model(torch.tensor([[1, 2, 3]], device="cuda")).logits
    assert torch.isfinite(logits).all()
