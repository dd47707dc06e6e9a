"""AdamW and the learning-rate schedule.

Schedule (a multiplier of `OptimConfig.lr`, for the s-th optimizer update, s = 0, 1, ...; the
scheduler's state is the number of updates taken, so it checkpoints and resumes exactly):
- warmup, s < W:            (s + 1) / W  (the first update already moves; none is wasted at lr 0)
- then, p = (s − D₀) / max(1, S − D₀ − 1) clipped to [0, 1], with S = max_steps and D₀ the first update of
  the decay: D₀ = W, or with `decay_steps` = D (warmup-stable-decay) D₀ = max(W, S − D), the peak held until then:
  constant: 1;  linear: 1 − (1 − m)·p;  cosine: m + (1 − m)·(1 + cos(π·p)) / 2,  m = min_lr_ratio.
The last update (s = S − 1) runs exactly at m·lr when at least two updates make the decay (S ≥ D₀ + 2);
a single one (S = D₀ + 1) runs at the peak, and with S ≤ W the schedule never leaves the warm-up.
"""

from __future__ import annotations

import math

import torch
from gyre.config.trainer import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lora_b_lr_ratio: float = 1.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay only on matrices (not norms or biases).

    `lora_b_lr_ratio` (LoRA+, `trainer.lora.lr_ratio_b`): the LoRA `lora_B` matrices get their own
    group at `cfg.lr` x ratio, after the others (so `param_groups[0]` keeps the base lr). The schedule
    multiplies every group's lr alike, so the ratio holds at every step. With ratio 1 the groups are
    those of plain training (checkpoints of either keep loading).
    Uses the fused kernel when every parameter lives on a GPU and foreach (multi-tensor) otherwise.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    params = [p for _, p in named]
    is_b = {id(p) for n, p in named if lora_b_lr_ratio != 1.0 and ".lora_B." in n}
    groups = [
        {"params": [p for p in params if p.dim() >= 2 and id(p) not in is_b], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2 and id(p) not in is_b], "weight_decay": 0.0},
        {
            "params": [p for p in params if id(p) in is_b],
            "weight_decay": cfg.weight_decay,
            "lr": cfg.lr * lora_b_lr_ratio,
        },
    ]
    groups = [g for g in groups if g["params"]]
    on_gpu = all(p.device.type == "cuda" for p in params)
    kwargs = {"fused": True} if on_gpu else {"foreach": True}
    optimizer = MasterWeightAdamW if cfg.master_weights else torch.optim.AdamW
    return optimizer(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


LOW_PRECISION = (torch.bfloat16, torch.float16)
_FLOAT32_STATE = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # of a low-precision parameter


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW that updates a float32 copy of every bfloat16/float16 parameter and rounds it into the parameter.

    In bfloat16 (8 bits of mantissa) an update smaller than 1/256 of a weight rounds away: at lr 1e-5 most
    weights of a bf16 model never move, and the run learns little or nothing. PRIME-RL, verl and Megatron keep
    float32 master weights for this reason. Here the model keeps computing (and publishing) in its own dtype,
    so the forward, backward and weights sent to inference are unchanged; the optimizer keeps the master copy
    (`state["master"]`, float32, sharded like the parameter under FSDP2) and float32 moments, and steps them
    with torch's own AdamW (fused on a GPU) on the gradient cast to float32. The master copy is part of the
    optimizer's state, so checkpoints save it and a resumed run continues exactly. Float32 parameters (a CPU
    run, LoRA adapters) are stepped as by `torch.optim.AdamW`.
    """

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(
            group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        for i, param in enumerate(params_with_grad):
            if param.dtype not in LOW_PRECISION:
                continue
            state = self.state[param]
            if "master" not in state:  # the first step (or a checkpoint from before master weights)
                state["master"] = param.detach().float()
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].float()
            params_with_grad[i], grads[i] = state["master"], grads[i].float()
            exp_avgs[i], exp_avg_sqs[i] = state["exp_avg"], state["exp_avg_sq"]
            if group["amsgrad"]:
                max_exp_avg_sqs[i] = state["max_exp_avg_sq"]
        return has_complex

    def load_state_dict(self, state_dict) -> None:
        # torch casts every floating-point state tensor to its parameter's dtype on load: the float32 master
        # copy and moments would come back rounded to bf16. Put the float32 values back.
        full = {
            pid: {k: v for k, v in st.items() if k in _FLOAT32_STATE and torch.is_tensor(v)}
            for pid, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, param in zip(ids, params, strict=True):
            if param.dtype in LOW_PRECISION and "master" in full.get(pid, {}):
                for key, value in full[pid].items():
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                master = self.state[param].get("master")
                if master is not None and param.grad is not None:
                    param.copy_(master)  # rounded to the parameter's dtype
        return loss


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int | None) -> float:
    """The schedule above: the multiplier of `cfg.lr` for optimizer update number `step` (0-based)."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.scheduler == "constant":
        return 1.0
    if max_steps is None:
        raise ValueError(f"scheduler {cfg.scheduler!r} decays to max_steps; set max_steps or use 'constant'")
    # WSD: the peak is held until the last decay_steps updates (a decay longer than what follows the warm-up
    # starts right after it, as without decay_steps)
    start = warmup if cfg.decay_steps is None else max(warmup, max_steps - cfg.decay_steps)
    progress = min(1.0, max(0.0, (step - start) / max(1, max_steps - start - 1)))
    floor = cfg.min_lr_ratio
    if cfg.scheduler == "linear":
        return 1.0 - (1.0 - floor) * progress
    if cfg.scheduler == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler {cfg.scheduler!r}: use constant, linear or cosine")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_multiplier`; call `.step()` once after every optimizer update."""
    # Fail now, not at the first step after warmup.
    if cfg.scheduler != "constant" and max_steps is None:
        raise ValueError(f"scheduler {cfg.scheduler!r} decays to max_steps; set max_steps or use 'constant'")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, max_steps))
