"""Config sections every service shares (declared once; `gyre rl` sets them at top level)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from gyre.config.loader import GyreSettings, Section, secret_file


class RedisConfig(Section):
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL carrying the batch streams.")
    password: SecretStr | None = Field(
        None,
        description="Redis password, used when `url` carries none (characters such as @ / % need no URL "
        "escaping). Keep it out of config files: set password_file, or GYRE_REDIS__PASSWORD.",
    )
    password_file: Path | None = secret_file("password")
    owner: str | None = Field(
        None,
        description="Who this run's keys on the Redis belong to (the Helm chart sets `<namespace>/<release>`). Set: "
        "the trainer and the orchestrator record it at start (`gyre:{run_id}:owner`) and refuse, exit 2, a run id "
        "another owner holds: two experiments with one run_id on one Redis trained each other's batches. Unset: no "
        "claim (`gyre rl` claims for its services, with its output folder).",
    )

    def client(self, **kwargs):
        """A redis-py client for this config (bytes replies: stream payloads are binary)."""
        import redis

        if self.password is not None:
            kwargs.setdefault("password", self.password.get_secret_value())
        # redis-py lets a password in the URL win over the keyword, which is what the field promises.
        return redis.Redis.from_url(self.url, **kwargs)


class LogConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level (any case).")
    file: Path | None = Field(None, description="Also append logs to this file.")
    format: Literal["text", "json"] = Field(
        "text",
        description="text: one readable line per record (a traceback on the lines after it); json: one JSON object "
        "per line (time, level, severity, service, run_id, logger, message, exception, step), for Loki, "
        'Elasticsearch or Cloud Logging (docs/kubernetes.md, "Logs"). Environment: GYRE_LOG__FORMAT=json.',
    )

    @field_validator("level", "format", mode="before")
    @classmethod
    def _any_case(cls, value: Any, info: ValidationInfo) -> Any:
        # `--log.level debug` (PRIME-RL's spelling, and Python's own names in lower case) was refused
        if isinstance(value, str):
            return value.upper() if info.field_name == "level" else value.lower()
        return value


class MetricsConfig(Section):
    port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port (0 = pick a free one; unset = service default)."
    )


class ModelConfig(Section):
    shorthand: ClassVar[str] = "name"  # `--model X`, `model = "X"`: the model's name (gyre.config.loader)
    name: str = Field(
        "outputs/run/model",
        description="Model folder (HF format: config.json, tokenizer, *.safetensors or *.bin weights) or hub id "
        "(org/name). Unset: {output_dir}/model, the folder `gyre rl` creates its model in (outputs/run/model with "
        "the default output_dir). A folder that does not exist or lacks config.json, weights or a tokenizer stops "
        "the service at start (exit 2, naming the path): create one with `gyre model init --output-dir DIR` (a "
        "small random model) or `gyre model import SOURCE --output-dir DIR` (a pretrained one) and set "
        "model.name = DIR.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype: auto = float32 on CPU, bfloat16 on GPU."
    )

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, data: Any) -> Any:
        # `--model Qwen/Qwen3-0.6B` (vLLM's and PRIME-RL's way) or `model = "..."` in TOML: the model's name. It was
        # "Input should be a valid dictionary or instance of ModelConfig". A bare `--model` is refused before this.
        return {"name": data} if isinstance(data, str) else data


class FolderTransportConfig(Section):
    """Weights travel as step folders on the shared volume (`{output_dir}/weights/step_{s}`)."""

    kind: Literal["folder"] = Field("folder", description="Weight transport (folder: the shared volume).")
    full_verify: bool = Field(
        False,
        description="Replicas re-hash every file before loading (default: check each file's size and the "
        "manifest digest; the trainer hashed the files once).",
    )


# The weight-transport config union (`gyre.transport`): one member per transport, told apart by `kind`.
# With a second transport this becomes Annotated[FolderTransportConfig | ..., Field(discriminator="kind")].
WeightsTransportConfig = FolderTransportConfig


class WandbConfig(Section):
    enabled: bool = Field(False, description="Log metrics and sample tables to Weights & Biases (gyre[wandb]).")
    project: str = Field("gyre", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); unset = your default.")
    group: str | None = Field(None, description="Run group (default: run_id); one W&B run per service.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (unset = the WANDB_MODE environment variable, else online)."
    )
    samples: int = Field(8, ge=0, description="Rows of the samples table logged at each rollout dump.")


class ProcessConfig(GyreSettings):
    """Keys of every Gyre process: experiment id, shared folder, logging."""

    check_environment: ClassVar[bool] = True  # GYRE_MAX_STEPZ is an error naming it, not a silent default

    run_id: str = Field(
        "gyre",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="Experiment id (Redis keys, metric labels, W&B group).",
    )
    output_dir: Path = Field(Path("outputs/run"), description="Shared volume: weights, checkpoints, events, logs.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")

    @model_validator(mode="before")
    @classmethod
    def _model_in_output_dir(cls, data: Any) -> Any:
        """An unset `model.name` of a process that loads one is `{output_dir}/model`, where `gyre rl` creates the
        model: it was `outputs/run/model` whatever the output_dir, so `gyre trainer --output-dir outputs/b` loaded
        the model of the default run's folder (or failed naming a folder the user never chose)."""
        if "model" not in cls.model_fields or not isinstance(data, dict):
            return data
        model = data.get("model")
        if model is not None and not isinstance(model, dict) or (model or {}).get("name") is not None:
            return data  # set (or a ModelConfig given whole)
        output_dir = data.get("output_dir") or cls.model_fields["output_dir"].default
        return {**data, "model": {**(model or {}), "name": str(Path(output_dir) / "model")}}


class JobConfig(ProcessConfig):
    """Keys of a process that trains into a run's folder (`gyre sft` has no more than these shared ones)."""

    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases (optional).")


class ServingConfig(ProcessConfig):
    """Keys of a process that serves /metrics and receives weights (`gyre inference`: no Redis, no W&B)."""

    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus exposition.")
    weights: WeightsTransportConfig = Field(
        default_factory=FolderTransportConfig, description="How weights travel from the trainer to the replicas."
    )


class ServiceConfig(JobConfig, ServingConfig):
    """Keys the trainer and the orchestrator have: a job's and a server's, plus Redis."""

    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis connection.")
