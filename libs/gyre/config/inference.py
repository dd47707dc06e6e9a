"""`gyre inference` configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from gyre.config.loader import Section
from gyre.config.shared import ModelConfig, ServiceConfig

# The adapter ranks vLLM can allocate (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 in a pod).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API (0 = free port).")
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body accepted; a larger one gets 413 without being read."
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM: how long in-flight requests (HTTP and gRPC) may finish before being cut."
    )


class ControlConfig(Section):
    host: str = Field("127.0.0.1", description="gRPC bind address of InferenceControl.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port of InferenceControl.")


class AuthConfig(Section):
    api_key: SecretStr | None = Field(None, description="Bearer key required on /v1/* when set.")
    control_token: SecretStr | None = Field(None, description="Shared secret required on gRPC control calls when set.")


class EngineConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Torch backend device.")
    max_batch_size: int = Field(64, ge=1, description="Sequences decoded together by the torch backend.")
    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + completion); default: the model's."
    )
    seed: int = Field(0, description="Default sampling seed of the engine.")
    threads: int | None = Field(
        None,
        ge=1,
        description="Torch backend on CPU: torch threads; default: the CPUs the container may use "
        "(affinity and cgroup quota) minus one for the HTTP loop, at least 1.",
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM: fraction of GPU memory to use.")
    max_lora_rank: int | None = Field(
        None,
        description="vLLM: serve LoRA adapter versions (trainer.lora.publish = adapter) up to this rank, one of "
        f"{', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's sizes; at least trainer.lora.rank); unset = the vLLM "
        "backend refuses adapter versions. The torch backend applies adapters without it (its named adapter "
        "slots are lora.max_adapters / lora.max_rank).",
    )
    max_loras: int = Field(
        2,
        ge=1,
        description="vLLM with max_lora_rank: adapters in one batch (2: requests started before a swap finish "
        "with their adapter while new ones use the next).",
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_lora_rank(cls, value: int | None) -> int | None:
        if value is not None and value not in VLLM_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(VLLM_LORA_RANKS)} (vLLM's sizes), got {value}")
        return value


class InferenceLoraConfig(Section):
    """Named LoRA adapters served next to the model (multi-run: one per run, under the run's name)."""

    adapters: list[str] = Field(
        default_factory=list,
        description="Model names served from the start (the base model until their first UpdateWeights).",
    )
    max_adapters: int = Field(
        0, ge=0, description="Adapter slots; UpdateWeights for a new name takes a free one (0 = no named adapters)."
    )
    max_rank: int = Field(16, ge=1, description="Largest adapter rank a slot holds.")

    @model_validator(mode="after")
    def _slots_for_the_names(self) -> InferenceLoraConfig:
        if len(self.adapters) > self.max_adapters:
            raise ValueError(f"max_adapters = {self.max_adapters} is fewer than the {len(self.adapters)} adapters")
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapters: a name appears twice")
        return self


class InferenceConfig(ServiceConfig):
    """Serve one policy model over an OpenAI-compatible HTTP API with gRPC weight control."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Generation backend.")
    served_model_name: str | None = Field(None, description="Model id in the API (default: model.name).")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server.")
    control: ControlConfig = Field(default_factory=ControlConfig, description="gRPC control server.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Authentication.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Backend engine.")
    lora: InferenceLoraConfig = Field(default_factory=InferenceLoraConfig, description="Named LoRA adapters.")
