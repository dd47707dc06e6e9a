"""`dist.full_state_dict` on one process: what the trainer publishes each step, copied into host tensors
that are reused from step to step (pinned on a GPU) instead of fresh host memory every step."""

from __future__ import annotations

import pytest
import torch
from gyre_trainer import dist


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False)).to(device)


def _check_two_steps(device: str) -> dict[str, torch.Tensor]:
    model, ctx = _model(device), dist.DistContext(device=torch.device(device))
    first = dist.full_state_dict(model, ctx)
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    assert first.keys() == expected.keys() and all(torch.equal(first[k], expected[k]) for k in expected)
    assert all(t.device.type == "cpu" for t in first.values())
    pointers = {k: t.data_ptr() for k, t in first.items()}
    with torch.no_grad():  # an optimizer step changes every value
        for p in model.parameters():
            p.mul_(-2).add_(1)
    second = dist.full_state_dict(model, ctx)
    assert {k: t.data_ptr() for k, t in second.items()} == pointers  # the same host memory, reused
    assert all(torch.equal(second[k], v.detach().cpu()) for k, v in model.state_dict().items())
    assert not torch.equal(second["0.weight"], expected["0.weight"])  # it holds the new values
    other = dist.full_state_dict(_model(device), ctx)  # another model gets its own copies
    assert not set(t.data_ptr() for t in other.values()) & set(pointers.values())
    return second


def test_host_copies_are_reused_and_hold_each_steps_values():
    _check_two_steps("cpu")


def test_trainable_only_leaves_the_frozen_parameters_on_the_device():
    model, ctx = _model("cpu"), dist.DistContext()
    model[0].requires_grad_(False)  # a frozen base, as under LoRA
    assert set(dist.full_state_dict(model, ctx, trainable_only=True)) == {"1.weight"}
    assert set(dist.full_state_dict(model, ctx)) == {"0.weight", "0.bias", "1.weight"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_copies_of_a_gpu_model_are_pinned():
    assert all(t.is_pinned() for t in _check_two_steps("cuda").values())
