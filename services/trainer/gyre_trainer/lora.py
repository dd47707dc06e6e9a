"""LoRA with `peft`: train low-rank adapters only, publish merged weights or the adapter alone.

`apply_lora(model, cfg)` wraps the HF model in a `peft` LoRA model: the base parameters are frozen
(so `optim.build_optimizer`, which takes the trainable parameters, optimizes the adapters only, and
checkpoints hold adapter optimizer state), `lora_A`/`lora_B` of every target module are trainable.

Publishing works on the *full* state dict the trainer already gathers (`dist.full_state_dict`, also
under FSDP2), with plain tensor math, so it never changes the live model:
- `merged_state_dict`: `W = W_base + (alpha / r) · B @ A` for every adapted linear layer, under the base
  model's own names: a normal HF checkpoint that every backend (and `from_pretrained`) loads.
- `adapter_state_dict` + `adapter_config`: the adapter alone, in PEFT's file format
  (`adapter_model.safetensors` keys `base_model.model.<module>.lora_A.weight`, `adapter_config.json`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


def apply_lora(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """`model` wrapped in a peft LoRA model (cfg: rank, alpha, dropout, target_modules); base frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)


def scaling(cfg: Any) -> float:
    return cfg.alpha / cfg.rank


def _clean(name: str) -> str:
    """A peft parameter name -> the base model's name of the same tensor."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def split_lora(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(base tensors under the base model's names, {module: {"A": ..., "B": ...}}) of a peft state dict."""
    base: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        m = _LORA_KEY.match(name)
        if m:
            adapters.setdefault(_clean(m.group("module")), {})[m.group("ab")] = tensor
        else:
            base[_clean(name)] = tensor
    return base, adapters


def merge(base: dict[str, torch.Tensor], adapters: dict[str, dict[str, torch.Tensor]], scale: float) -> dict:
    """`base` with `W + scale · B @ A` for every adapted module (computed in float32, stored in W's dtype)."""
    merged = dict(base)
    for module, ab in adapters.items():
        key = f"{module}.weight"
        if key not in base:
            raise KeyError(f"adapter for {module}: the base has no {key}")
        weight = base[key]
        delta = ab["B"].to(torch.float32) @ ab["A"].to(torch.float32)
        merged[key] = (weight.to(torch.float32) + scale * delta.to(weight.device)).to(weight.dtype)
    return merged


def merged_state_dict(state_dict: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The full model's weights (base names) with the adapters merged in."""
    base, adapters = split_lora(state_dict)
    return merge(base, adapters, scaling(cfg))


def adapter_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, under PEFT's file names (what `PeftModel.from_pretrained` reads)."""
    _, adapters = split_lora(state_dict)
    return {
        f"{_PEFT_PREFIX}{module}.lora_{ab}.weight": t for module, pair in adapters.items() for ab, t in pair.items()
    }


def adapter_config(cfg: Any, base_model: str) -> dict[str, Any]:
    """`adapter_config.json` for the adapter (the keys PEFT and vLLM read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True,
    }  # fmt: skip


def read_adapter(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{module (base names): {"A", "B"}} from `adapter_model.safetensors` tensors (PEFT's names)."""
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = re.match(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$", name)
        if m is None:
            raise ValueError(f"{ADAPTER_FILE}: {name} is not a LoRA tensor")
        adapters.setdefault(_clean(m.group("module")), {})[m.group("ab")] = tensor
    incomplete = [m for m, ab in adapters.items() if set(ab) != {"A", "B"}]
    if incomplete:
        raise ValueError(f"{ADAPTER_FILE}: modules without both lora_A and lora_B: {incomplete[:5]}")
    return adapters
