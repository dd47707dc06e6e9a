"""AdamW parameter groups and the learning-rate schedules, read off a real optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from gyre.config.trainer import OptimConfig
from gyre_trainer.optim import build_optimizer, build_scheduler


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))


def lrs(cfg: OptimConfig, max_steps: int | None, steps: int) -> list[float]:
    """The learning rate each of `steps` real optimizer updates ran with."""
    net = model()
    optimizer = build_optimizer(net, cfg)
    scheduler = build_scheduler(optimizer, cfg, max_steps)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        net(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return seen


def test_constant_with_warmup():
    got = lrs(OptimConfig(lr=0.1, scheduler="constant", warmup_steps=4), None, 7)
    assert got == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1, 0.1])


def test_linear_decays_to_min_lr_ratio_on_the_last_step():
    got = lrs(OptimConfig(lr=1.0, scheduler="linear", warmup_steps=2, min_lr_ratio=0.1), 7, 7)
    # after warmup, p = (s − 2) / (7 − 2 − 1) for s = 2..6 → 1 − 0.9·p
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1])


def test_cosine_shape():
    got = lrs(OptimConfig(lr=2.0, scheduler="cosine", warmup_steps=1, min_lr_ratio=0.0), 6, 8)
    expected = [2.0] + [2.0 * 0.5 * (1 + math.cos(math.pi * (s - 1) / 4)) for s in range(1, 6)] + [0.0, 0.0]
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[3] == pytest.approx(1.0)  # halfway
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))  # never increases after warmup


def test_scheduler_state_resumes_where_it_left_off():
    cfg = OptimConfig(lr=1.0, scheduler="cosine", warmup_steps=2, min_lr_ratio=0.2)
    straight = lrs(cfg, 10, 10)
    net = model()
    optimizer = build_optimizer(net, cfg)
    scheduler = build_scheduler(optimizer, cfg, 10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = (optimizer.state_dict(), scheduler.state_dict())
    optimizer2 = build_optimizer(net, cfg)
    scheduler2 = build_scheduler(optimizer2, cfg, 10)
    optimizer2.load_state_dict(state[0])
    scheduler2.load_state_dict(state[1])
    resumed = []
    for _ in range(6):
        resumed.append(optimizer2.param_groups[0]["lr"])
        optimizer2.step()
        scheduler2.step()
    assert resumed == pytest.approx(straight[4:])


def test_decaying_schedules_need_max_steps():
    net = model()
    optimizer = build_optimizer(net, OptimConfig())
    with pytest.raises(ValueError, match="max_steps"):
        build_scheduler(optimizer, OptimConfig(scheduler="cosine", warmup_steps=5), None)


def test_weight_decay_skips_norms_and_biases():
    net = model()
    optimizer = build_optimizer(net, OptimConfig(weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6))
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(net[0].weight), id(net[2].weight)}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(net.parameters()))
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95) and optimizer.param_groups[0]["eps"] == 1e-6
    assert optimizer.defaults["foreach"] is True  # CPU parameters: multi-tensor kernel


def small_steps(dtype: torch.dtype, cfg: OptimConfig, steps: int = 5, device: str = "cpu"):
    """`model()` in `dtype` after `steps` AdamW updates on the same bf16-representable gradients, from the same
    bf16-representable start; returns the model and its optimizer."""
    torch.manual_seed(0)
    net = model()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.bfloat16())
    net = net.to(device=device, dtype=dtype)
    optimizer = build_optimizer(net, cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g).bfloat16().to(device=device, dtype=dtype)
        optimizer.step()
    return net, optimizer


def test_bf16_parameters_take_the_float32_update_rounded_not_lose_it():
    # audit: AdamW updated bf16 weights in place, so an update below bf16's resolution (1/256 of the weight)
    # rounded away: at lr 1e-5 most weights of a GPU run (bf16 by default) never moved
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
    reference, _ = small_steps(torch.float32, cfg, steps=100)
    net, optimizer = small_steps(torch.bfloat16, cfg, steps=100)
    for (name, ref), p in zip(reference.named_parameters(), net.parameters(), strict=True):
        master = optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and torch.equal(master, ref.detach()), name  # float32 AdamW, exactly
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), ref.detach().bfloat16()), name  # rounded
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())

    lost, _ = small_steps(torch.bfloat16, cfg.model_copy(update={"master_weights": False}), steps=100)
    for i in (0, 2):  # the matrices: each update is below half a bf16 step of their weights, so none lands
        off = (lost[i].weight != reference[i].weight.detach().bfloat16()).float().mean().item()
        assert off > 0.5, (i, off)


def test_float32_parameters_are_stepped_as_by_adamw():
    cfg = OptimConfig(lr=1e-3)
    plain, _ = small_steps(torch.float32, cfg.model_copy(update={"master_weights": False}))
    net, optimizer = small_steps(torch.float32, cfg)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), net.parameters(), strict=True))
    assert all("master" not in s for s in optimizer.state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_master_weights_with_the_fused_kernel_on_gpu():
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
    reference, _ = small_steps(torch.float32, cfg, steps=50, device="cuda")
    net, optimizer = small_steps(torch.bfloat16, cfg, steps=50, device="cuda")
    assert optimizer.defaults["fused"] is True
    for ref, p in zip(reference.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(optimizer.state[p]["master"], ref.detach(), rtol=0, atol=1e-6)
        assert p.dtype == torch.bfloat16


@pytest.mark.parametrize("betas", [(1.0, 0.999), (0.9, float("nan")), (-0.1, 0.9)])
def test_betas_outside_zero_one_are_refused_naming_the_key(betas):
    """torch refused them only when the optimizer was built, after the model loaded, naming no config key."""
    from gyre.config import ConfigError, load_config
    from gyre.config.trainer import TrainerConfig

    # NaN: refused with every non-finite number (a config-wide rule), still naming the key
    with pytest.raises(ConfigError, match=r"optim\.betas.*(\[0, 1\)|finite number)"):
        load_config(TrainerConfig, ["--optim.betas", str(list(betas)).replace("nan", "NaN")])


def test_warmup_stable_decay_holds_the_peak_until_the_last_decay_steps():
    got = lrs(OptimConfig(lr=1.0, scheduler="linear", warmup_steps=2, decay_steps=3, min_lr_ratio=0.1), 8, 9)
    # warm-up (s = 0, 1), the peak while s < 8 − 3 = 5, then 1 − 0.9·p with p = (s − 5) / 2; held at m after
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1])


def test_warmup_stable_decay_with_a_cosine_decay():
    got = lrs(OptimConfig(lr=2.0, scheduler="cosine", decay_steps=5, min_lr_ratio=0.0), 10, 10)
    expected = [2.0] * 5 + [2.0 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_decay_steps_longer_than_the_run_decays_right_after_warmup():
    """A decay that does not fit starts after the warm-up: the schedule without decay_steps."""
    cfg = dict(lr=1.0, scheduler="linear", warmup_steps=2, min_lr_ratio=0.1)
    assert lrs(OptimConfig(**cfg, decay_steps=100), 7, 7) == pytest.approx(lrs(OptimConfig(**cfg), 7, 7))


def test_decay_steps_with_a_constant_schedule_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="decay_steps = 5 needs scheduler 'linear' or 'cosine'"):
        OptimConfig(decay_steps=5)
