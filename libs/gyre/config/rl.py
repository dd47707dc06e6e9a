"""`gyre rl` configuration: one experiment file for the three local services.

Shared keys (``run_id``, ``output_dir``, ``redis``, ``log``, ``model``, ``max_steps``) are set once at
top level; ``[inference]``, ``[trainer]``, ``[orchestrator]`` and ``[sft]`` hold each service's own
keys and are validated against that service's config model when the launcher resolves them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from gyre.config.loader import GyreSettings, Section
from gyre.config.shared import LogConfig, ModelConfig, WandbConfig


class RLRedisConfig(Section):
    url: str | None = Field(None, description="External Redis URL; unset = start an embedded redis-server.")


class RLModelConfig(ModelConfig):
    name: str | None = Field(
        None, description="Base model: a local folder or a Hugging Face hub id (default: {output_dir}/model)."
    )
    init_preset: str | None = Field(
        None,
        description="Create a random model with `gyre model init` at this preset (e.g. 'tiny') if the model folder "
        "does not exist; only inside output_dir. Unset: the model must exist or be fetchable from the hub.",
    )
    init_seed: int = Field(0, description="Seed of the created model.")


def _enabled_by(keys: tuple[str, ...], value: Any) -> Any:
    """A section's raw values with `enabled = true` when one of `keys` is set and `enabled` is not (PRIME-RL's
    way: `--ckpt.interval 5` alone checkpoints; it was silently ignored); an explicit `enabled = false` stays."""
    if isinstance(value, dict) and "enabled" not in value and any(key in value for key in keys):
        return {**value, "enabled": True}
    return value


class RLCkptConfig(Section):
    enabled: bool = Field(
        False,
        description="Write trainer + orchestrator checkpoints (a bare --ckpt, or setting interval or keep_last, "
        "enables).",
    )
    interval: int = Field(1, ge=1, description="Checkpoint every N steps when enabled.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    resume_step: int | None = Field(
        None,
        ge=-1,
        description="Unset = continue the run where it stands (a fresh start if it has none); -1 = the same but a "
        "trainer checkpoint must exist; N = rewind both services to checkpoint N.",
    )


class SFTWarmupConfig(Section):
    enabled: bool = Field(
        False,
        description="Run `gyre sft` before RL and start RL from its result (a bare --sft, or setting sft.args, "
        "enables it).",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keys of `gyre sft` (see `gyre sft --help`), e.g. {max_steps = 300}."
    )

    @model_validator(mode="before")
    @classmethod
    def _args_enable(cls, value: Any) -> Any:
        return _enabled_by(("args",), value)


class RLRunConfig(Section):
    """One run of a multi-run experiment (`[[runs]]`): its own adapter, orchestrator, stream and folder."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="Run id: its folder {output_dir}/runs/{name}, its stream, and the model name inference serves.",
    )
    max_steps: int | None = Field(None, ge=1, description="RL steps of this run (unset = the top-level max_steps).")
    trainer: dict[str, Any] = Field(
        default_factory=dict, description="The run's keys of trainer.runs[] (optim, lora, resume_step)."
    )
    orchestrator: dict[str, Any] = Field(
        default_factory=dict, description="Keys of [orchestrator] that differ for this run (env, sampling, seed...)."
    )


class RLServerConfig(Section):
    """Another model served beside the policy (`[[servers]]`): an LLM judge, a reward model or a distillation
    teacher, each its own `gyre inference` process. The orchestrator's settings reach it by name:
    `url = "server:<name>"` in `[[orchestrator.judges]]`, `[[orchestrator.reward_models]]` or
    `[orchestrator.teacher]`."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$", description="How settings refer to it.")
    model: str = Field(..., description="Its model: a local folder or a Hugging Face hub id.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Its [inference] keys (`gyre inference --help`), e.g. {runner = 'pooling'} for a reward model.",
    )


class RLConfig(GyreSettings):
    """Run inference, orchestrator and trainer as local processes with an embedded Redis.

    The same command again continues the run where it stands (Ctrl-C, a crash, a larger --max-steps); --fresh
    starts it over; --ckpt.resume-step N rewinds it; another --output-dir is another run (docs/local.md)."""

    check_environment: ClassVar[bool] = True  # parse_or_exit: a misspelt GYRE_ variable names itself
    # parse_or_exit: gyre rl's own lines are for a console (its services' logs follow log.format): errors stay text
    console_errors: ClassVar[bool] = True
    # the configs its sections are validated as (by the launcher): an unknown top-level key is suggested where it
    # lives there (a top-level `seq_len`, PRIME-RL's shared key, is 'trainer.data.seq_len')
    section_models: ClassVar[dict[str, str]] = {
        "inference": "gyre.config.inference:InferenceConfig",
        "trainer": "gyre.config.trainer:TrainerConfig",
        "orchestrator": "gyre.config.orchestrator:OrchestratorConfig",
        "sft.args": "gyre.config.trainer:SFTConfig",  # `[sft] max_steps = ...` means sft.args.max_steps
    }

    run_id: str = Field(
        "gyre",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="Experiment id: names its Redis stream and W&B runs; fixed for an output_dir once it has run.",
    )
    output_dir: Path = Field(
        Path("outputs/run"),
        description="Local folder standing in for the shared volume; one run each (two experiments side by side: "
        "two folders).",
    )
    max_steps: int = Field(20, ge=1, description="RL steps (batches trained); a larger one continues a finished run.")
    fresh: bool = Field(
        False,
        description="Start over: delete the previous run in output_dir (weights, checkpoints, events, stream, logs, "
        "created model, SFT result) first. Without it a re-run continues the run, and a changed run_id, model.name, "
        "orchestrator.env, orchestrator.seed or LoRA shape is refused (docs/local.md).",
    )
    redis: RLRedisConfig = Field(default_factory=RLRedisConfig, description="Redis.")
    log: LogConfig = Field(
        default_factory=LogConfig,
        description="Log level, file and format of every service (the launcher's own lines stay text).",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases for every service.")
    model: RLModelConfig = Field(default_factory=RLModelConfig, description="Base policy model.")
    ckpt: RLCkptConfig = Field(default_factory=RLCkptConfig, description="Checkpoints and resume.")
    sft: SFTWarmupConfig = Field(default_factory=SFTWarmupConfig, description="Optional SFT warm-up.")
    inference_replicas: int = Field(1, ge=1, description="Local inference processes (the orchestrator balances).")
    inference_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of an inference process (a replica, a [[servers]] model) that exits mid-run, with "
        "backoff (2 s, 4 s, 8 s...), as Kubernetes restarts its pod; the count starts over once it has run 5 "
        "minutes. One more exit stops the run; 0 = stop at the first.",
    )
    trainer_nproc: int = Field(1, ge=1, description="Trainer processes (>1 runs torchrun with FSDP2).")
    inference_gpus: str | None = Field(
        None, description="CUDA_VISIBLE_DEVICES of every inference replica, e.g. '0' (unset = inherit)."
    )
    trainer_gpus: str | None = Field(None, description="CUDA_VISIBLE_DEVICES of the trainer, e.g. '1,2,3'.")
    inference_ready_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the launch waits for each inference process (a replica, a [[servers]] model) to load "
        "its model and answer before it stops with the process's last log lines (one that exits fails at once). Raise "
        "it for a large model: vLLM loads, compiles and captures CUDA graphs for minutes.",
    )
    trainer_stop_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long a stop (Ctrl-C, SIGTERM) waits for the trainer (and the SFT warm-up) to finish its "
        "step and checkpoint it (ckpt.on_stop) before killing it; a second Ctrl-C kills it at once. Raise it when "
        "gyre_trainer_checkpoint_seconds comes near (a larger model, a slow disk): a killed save loses the steps "
        "since the last checkpoint.",
    )
    console: Literal["progress", "all"] = Field(
        "progress", description="progress: progress bar + warnings; all: every child log line, prefixed."
    )
    prometheus: bool = Field(False, description="Also start a local Prometheus scraping the three services.")
    runs: list[RLRunConfig] = Field(
        default_factory=list,
        description="Multi-run: these runs share the base model, one trainer (one LoRA adapter per run) and the "
        "inference replicas (each run's adapter under its name); each gets its own orchestrator.",
    )
    servers: list[RLServerConfig] = Field(
        default_factory=list,
        description="Other models served locally beside the policy (judges, reward models, a teacher); the "
        "orchestrator's settings name them with url = 'server:<name>'.",
    )
    inference: dict[str, Any] = Field(default_factory=dict, description="[inference] keys (`gyre inference --help`).")
    trainer: dict[str, Any] = Field(default_factory=dict, description="[trainer] keys (`gyre trainer --help`).")
    orchestrator: dict[str, Any] = Field(
        default_factory=dict, description="[orchestrator] keys (`gyre orchestrator --help`)."
    )

    @field_validator("runs", "servers")
    @classmethod
    def _distinct_names(cls, entries: list, info) -> list:
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            kind = "run" if info.field_name == "runs" else "server"
            raise ValueError(f"{kind} names must differ: {sorted({n for n in names if names.count(n) > 1})} repeat")
        return entries

    @field_validator("ckpt", "sft", mode="before")
    @classmethod
    def _bare_section_flag(cls, value: Any, info) -> Any:
        # PRIME-RL style: `--ckpt` alone turns checkpointing on with defaults; `--sft` alone the warm-up (it was
        # "Input should be a valid dictionary or instance of SFTWarmupConfig (got 'true')")
        if isinstance(value, bool | str) and str(value).lower() in ("true", "false"):
            return {"enabled": str(value).lower() == "true"}
        return _enabled_by(("interval", "keep_last"), value) if info.field_name == "ckpt" else value
