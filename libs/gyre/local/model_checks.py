"""`gyre rl`'s checks of settings against the model, before anything starts: read from the model's config (no weights,
a second), from the model folder or the preset the launch will create (`gyre.model_shape`).

- a completion budget (`sampling.max_tokens`, an entry's own, its `eval.max_tokens`) that leaves no room for a prompt
  in the torch backend's context: every task was refused as too long, and the run stopped after 200 of them; an
  `engine.max_model_len` beyond the model's context (the replica refused it at load);
- a LoRA `target_modules` entry (the trainer's, a run's, the SFT warm-up's) that names no layer of the model, or its
  tied output layer: the trainer refused it only when it loaded the model, after Redis, inference and the
  orchestrator had started.

A model whose config cannot be read here (a custom architecture) is left to the services' own checks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gyre.config import ConfigError
from gyre.config.rl import RLConfig
from gyre.config.trainer import SFTConfig, TrainerConfig
from gyre.local.runs import ServiceConfigs

log = logging.getLogger(__name__)


def check_against_the_model(cfg: RLConfig, configs: ServiceConfigs, base: str, sft: SFTConfig | None) -> None:
    """ConfigError naming the key of the first setting the model `base` cannot take (`sft`: the warm-up's config,
    when it runs)."""
    from gyre.model_shape import model_config

    preset = cfg.model.init_preset if not Path(base).exists() else None
    try:
        config = model_config(base, preset)
    except Exception as e:  # noqa: BLE001 - the services check the same when they load the model
        log.debug("settings not checked against the model at launch: %s", e)
        return
    check_completion_budget(cfg, configs, config)
    check_lora_targets(configs.trainer, sft, config)


def check_completion_budget(cfg: RLConfig, configs: ServiceConfigs, config: Any) -> None:
    """Every run's training and eval completion budgets fit the served context with some prompt. The torch backend's
    context is `served_context`'s, and a `max_model_len` beyond the model's is refused here as the replica refused it
    at load; vLLM derives its own (rope scaling may extend it), so a vLLM run is left to the orchestrator's check."""
    from gyre.model_shape import served_context

    inference = configs.inference[0]
    if inference.backend != "torch":
        return
    try:
        context = served_context(config, inference.engine.max_model_len)
    except ValueError as e:
        raise ConfigError(f"config key 'inference.engine.max_model_len': {e}") from None
    runs = {run.name: (index, run) for index, run in enumerate(cfg.runs)}
    for name, orch in configs.orchestrators.items():
        index, run = runs.get(name, (None, None))
        for i, entry in enumerate(orch.envs):
            budgets = [(orch.max_tokens(entry), orch.max_tokens_key(i))]
            if entry.eval.enabled and entry.eval.max_tokens is not None:  # its evals' own (the run failed there)
                budgets.append((entry.eval.max_tokens, f"{orch.env_key(i)}.eval.max_tokens"))
            for tokens, key in budgets:
                if tokens < context:
                    continue
                own = run is not None and key.split(".")[0] in run.orchestrator  # the run's own table set it
                key = f"runs.{index}.orchestrator.{key}" if own else f"orchestrator.{key}"
                raise ConfigError(
                    f"config key '{key}': {tokens} completion tokens leave no room for a prompt in the model's "
                    f"context of {context} tokens (inference.engine.max_model_len, else the model's "
                    "max_position_embeddings): lower it, or serve a model with a longer context"
                )


def check_lora_targets(trainer: TrainerConfig, sft: SFTConfig | None, config: Any) -> None:
    """Every adapter's target_modules name layers of the model (the trainer's, each run's, the SFT warm-up's)."""
    from gyre.lora import lora_targets_problem

    wanted = [("sft.args.lora.target_modules", sft.lora if sft else None)]  # the warm-up trains the same model
    wanted += [("trainer.lora.target_modules", trainer.lora)] + [
        (f"runs.{i}.trainer.lora.target_modules" if run.lora else "trainer.lora.target_modules", run.lora)
        for i, run in enumerate(trainer.runs)
    ]
    if problem := lora_targets_problem(config, [(key, lora.target_modules) for key, lora in wanted if lora]):
        raise ConfigError(problem)
