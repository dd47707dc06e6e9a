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

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_tensors, merge, split_lora, target_modules_problem
from gyre.lora import adapter_config as _adapter_config

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_FILE", "AdaptersOff", "activate_adapter", "add_adapter", "adapter_config",
    "adapter_from_file", "adapter_state_dict", "apply_lora", "merged_state_dict", "named_adapter_state",
    "write_adapter_folder",
]  # fmt: skip


def _peft_config(cfg: Any):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip


def apply_lora(
    model: torch.nn.Module, cfg: Any, adapter_name: str = "default", key: str = "trainer.lora"
) -> torch.nn.Module:
    """`model` wrapped in a peft LoRA model (cfg: rank, alpha, dropout, target_modules); base frozen. ValueError
    naming `key` (the config's lora section) when a target names no layer of the model."""
    from peft import get_peft_model

    if problem := target_modules_problem(model, cfg.target_modules):
        raise ValueError(f"{key}.target_modules: {problem}")
    with warnings.catch_warnings():
        # peft asks transformers' deprecated `is_gradient_checkpointing`: a FutureWarning in every LoRA run's log
        # that names neither Gyre nor anything its user can change
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, _peft_config(cfg), adapter_name=adapter_name)


def add_adapter(model: torch.nn.Module, name: str, cfg: Any) -> torch.nn.Module:
    """Multi-run: one more named adapter (a plain model becomes a peft model with it); returns the model."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return apply_lora(model, cfg, adapter_name=name)
    if problem := target_modules_problem(model, cfg.target_modules):
        raise ValueError(f"trainer.lora.target_modules: {problem}")
    model.add_adapter(name, _peft_config(cfg))
    return model


def activate_adapter(model: torch.nn.Module, name: str) -> None:
    """Forward passes use adapter `name` alone and only its parameters are trainable: the optimizer,
    gradient clipping and checkpoints (`checkpoint.trainable_only`) of a run see that run's adapter only."""
    model.set_adapter(name)
    own = re.compile(rf"\.lora_[A-Za-z_]+\.{re.escape(name)}\.")
    for param_name, param in model.named_parameters():
        param.requires_grad_(own.search(param_name) is not None)


def named_adapter_state(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors (CPU copies) under PEFT's file names, whatever adapter is active."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=name)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


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


def write_adapter_folder(folder: Path, adapter: dict[str, torch.Tensor], cfg: Any, base_model: str) -> None:
    """`folder` as a PEFT adapter folder (the adapter's tensors and `adapter_config.json`), which peft and vLLM's
    `--lora-modules` load; `adapter` under PEFT's file names (`adapter_state_dict`)."""
    from gyre.fsio import write_file
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(adapter, folder / ADAPTER_FILE, metadata={"format": "pt"})
    write_file(folder / ADAPTER_CONFIG, json.dumps(adapter_config(cfg, base_model), indent=1, sort_keys=True).encode())


def adapter_from_file(model: torch.nn.Module, tensors: dict[str, torch.Tensor], adapter_name: str = "default"):
    """The inverse of `adapter_state_dict`: an adapter file's tensors under `model`'s own names for adapter
    `adapter_name` (also an FSDP2-sharded model: the names and shapes are the global ones). ValueError
    when the file's adapter is not the model's: other modules (`lora.target_modules`) or another rank
    (`lora.rank`), e.g. a run re-launched with another adapter shape than it was trained with."""
    state = model.state_dict()
    own = re.compile(rf"\.lora_[AB]\.{re.escape(adapter_name)}\.weight$")
    by_file_name = adapter_tensors({name: name for name in state if own.search(name)})
    if by_file_name.keys() != tensors.keys():
        missing, unknown = sorted(by_file_name.keys() - tensors.keys()), sorted(tensors.keys() - by_file_name.keys())
        raise ValueError(f"the saved adapter has other modules than trainer.lora.target_modules gives: missing "
                         f"{missing[:3]}, unknown {unknown[:3]} (a run keeps its adapter's shape)")  # fmt: skip
    for file_name, name in by_file_name.items():
        if tuple(tensors[file_name].shape) != tuple(state[name].shape):
            raise rank_mismatch(file_name, tuple(tensors[file_name].shape), tuple(state[name].shape))
    return {name: tensors[file_name] for file_name, name in by_file_name.items()}


def rank_mismatch(name: str, saved: tuple[int, ...], wanted: tuple[int, ...]) -> ValueError:
    """The error for adapter tensor `name` saved as `saved` where the model has `wanted`: the run's rank."""
    rank = saved[0] if ".lora_A." in name else saved[-1]
    return ValueError(f"the saved adapter has rank {rank} ({name}: {list(saved)}, the model's {list(wanted)}): "
                      f"set trainer.lora.rank = {rank}, the run's rank")  # fmt: skip


class AdaptersOff:
    """A LoRA model's frozen base as the reference model of the KL term: the same modules with every
    adapter switched off while it runs (`reference_model`), not a second copy of the weights (as verl
    does for LoRA). Equal to the base model, since adapters only ever add to the frozen base weights."""

    def __init__(self, model: torch.nn.Module):
        self.model = model


@contextlib.contextmanager
def reference_model(ref: Any):
    """The module to run as the reference: `ref` itself, or for `AdaptersOff` its model with adapters off
    (peft's `disable_adapter`; leaving it makes the active adapter trainable again, as before)."""
    if not isinstance(ref, AdaptersOff):
        yield ref
        return
    with ref.model.disable_adapter():
        yield ref.model
