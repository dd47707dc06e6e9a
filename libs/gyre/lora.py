"""LoRA adapters as tensors and files, shared by the trainer (publishing) and inference (applying).

Torch-free to import (the functions only call tensor methods), so the orchestrator never pays for
torch. Names: PEFT's state dict calls a module `base_model.model.<module>` with `<module>.base_layer.weight`
for the frozen weight and `<module>.lora_{A,B}.<adapter>.weight` for the adapter; its adapter *file*
(`adapter_model.safetensors`) drops the adapter name. `W = W_base + (alpha / r) · B @ A` (no rsLoRA).
"""

from __future__ import annotations

import difflib
import re
from os import PathLike
from typing import Any

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def clean_name(name: str) -> str:
    """A peft parameter name -> the base model's name of the same tensor."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def split_lora(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(base tensors under the base model's names, {module: {"A": ..., "B": ...}}) of a peft state dict
    or of an adapter file's tensors."""
    base: dict[str, Any] = {}
    adapters: dict[str, dict[str, Any]] = {}
    for name, tensor in state_dict.items():
        m = _LORA_KEY.match(name)
        if m:
            adapters.setdefault(clean_name(m.group("module")), {})[m.group("ab")] = tensor
        else:
            base[clean_name(name)] = tensor
    incomplete = [m for m, ab in adapters.items() if set(ab) != {"A", "B"}]
    if incomplete:
        raise ValueError(f"LoRA modules without both lora_A and lora_B: {incomplete[:5]}")
    return base, adapters


def merge(base: dict[str, Any], adapters: dict[str, dict[str, Any]], scale: float) -> dict[str, Any]:
    """`base` with `W + scale · B @ A` for every adapted module (computed in float32, stored in W's dtype)."""
    merged = dict(base)
    for module, ab in adapters.items():
        key = f"{module}.weight"
        if key not in base:
            raise KeyError(f"adapter for {module}: the base model has no {key}")
        weight = base[key]
        delta = ab["B"].float() @ ab["A"].float()
        merged[key] = (weight.float() + scale * delta.to(weight.device)).to(weight.dtype)
    return merged


def adapter_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The adapter tensors of a peft state dict, under PEFT's file names (`PeftModel.from_pretrained`)."""
    _, adapters = split_lora(state_dict)
    return {
        f"{_PEFT_PREFIX}{module}.lora_{ab}.weight": t for module, pair in adapters.items() for ab, t in pair.items()
    }


def adapter_config(rank: int, alpha: float, dropout: float, target_modules: list[str], base_model: str) -> dict:
    """`adapter_config.json` (the keys PEFT and vLLM read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(target_modules),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
    }  # fmt: skip


def config_scale(config: dict) -> float:
    """alpha / r of an `adapter_config.json` (ValueError naming the key when it cannot be applied)."""
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise ValueError(f"{ADAPTER_CONFIG}: {key} must be a positive number, got {config.get(key)!r}")
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{ADAPTER_CONFIG}: rsLoRA/DoRA adapters are not supported")
    return config["lora_alpha"] / config["r"]


def target_modules_problem(model: Any, target_modules: list[str]) -> str | None:
    """What is wrong with LoRA's `target_modules` for `model` (an `nn.Module`; on the meta device will do), or
    None when every entry names layers of the model (as peft matches them: the module's name or its last parts)
    and none is an output layer tied to the input embeddings. peft refuses only a list of which nothing matches:
    ["q_proj", "v_prj"] trained q_proj alone. An adapter on a tied `lm_head` would change one of two copies of a
    single tensor: the merged weights could not say which one to keep."""
    import torch

    names = [name for name, _ in model.named_modules() if name]
    for target in target_modules:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            layers = sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                             if isinstance(module, torch.nn.Linear)})  # fmt: skip
            close = difflib.get_close_matches(target, layers, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{target!r} names no layer of the model{hint}; its linear layers: {', '.join(layers)}"
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None or not getattr(model.config, "tie_word_embeddings", False):
        return None
    for name, module in model.named_modules():
        if module is out and any(name == t or name.endswith(f".{t}") for t in target_modules):
            return (f"{name!r} is tied to the input embeddings (tie_word_embeddings): an adapter on it "
                    "cannot be merged into one tensor; drop it from target_modules")  # fmt: skip
    return None


def lora_targets_problem(model: Any, wanted: list[tuple[str, list[str]]]) -> str | None:
    """`config key 'KEY': ...` for the first `(KEY, target_modules)` of `wanted` that `target_modules_problem` finds
    on the skeleton of `model` (an HF config, or a model folder or hub id whose config is read), built on the meta
    device (no weights, a second): what a launch or a service checks before anything loads. None when every entry
    names layers, or when the config cannot be read or the skeleton built here (a custom architecture: left to
    `apply_lora`'s check on the loaded model)."""
    from gyre.model_shape import model_config, model_skeleton

    if not wanted:
        return None
    try:
        skeleton = model_skeleton(model_config(str(model)) if isinstance(model, str | PathLike) else model)
    except Exception:  # noqa: BLE001 - checked again where the model loads
        return None
    for key, targets in wanted:
        if problem := target_modules_problem(skeleton, targets):
            return f"config key '{key}': {problem}"
    return None
