"""LoRA training with `peft`; the adapter math and files live in `gyre.lora` (shared with inference).

`apply_lora(model, cfg)` wraps the HF model in a `peft` LoRA model: the base parameters are frozen
(so `optim.build_optimizer`, which takes the trainable parameters, optimizes the adapters only, and
checkpoints hold adapter optimizer state), `lora_A`/`lora_B` of every target module are trainable.

Publishing works on the *full* state dict the trainer already gathers (`dist.full_state_dict`, also
under FSDP2), with plain tensor math, so it never changes the live model:
- `merged_state_dict`: `W = W_base + (alpha / r) · B @ A` under the base model's own names: a normal
  HF checkpoint that every backend (and `from_pretrained`) loads (`trainer.lora.publish = "merged"`);
- `adapter_state_dict` + `adapter_config`: the adapter alone in PEFT's format (`publish = "adapter"`),
  which the torch inference backend applies to the base it keeps in memory.
"""

from __future__ import annotations

from typing import Any

import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_tensors, merge, split_lora
from gyre.lora import adapter_config as _adapter_config

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "adapter_config", "adapter_state_dict", "apply_lora", "merged_state_dict"]


def apply_lora(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """`model` wrapped in a peft LoRA model (cfg: rank, alpha, dropout, target_modules); base frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)


def merged_state_dict(state_dict: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The full model's weights (base names) with the adapters merged in."""
    base, adapters = split_lora(state_dict)
    return merge(base, adapters, cfg.alpha / cfg.rank)


def adapter_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, under PEFT's file names (what `PeftModel.from_pretrained` reads)."""
    return {name: t.contiguous() for name, t in adapter_tensors(state_dict).items()}


def adapter_config(cfg: Any, base_model: str) -> dict[str, Any]:
    """`adapter_config.json` for the adapter."""
    return _adapter_config(cfg.rank, cfg.alpha, cfg.dropout, list(cfg.target_modules), base_model)
