"""`gyre inference` configuration."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from gyre.config.loader import Section, secret_file
from gyre.config.shared import ModelConfig, ServingConfig

# The adapter ranks vLLM can allocate (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerConfig(Section):
    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 in a pod).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API (0 = free port).")
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body accepted; a larger one gets 413 without being read."
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: how long in-flight requests (HTTP and gRPC) may finish; those still running then "
        "end with a 503 not_ready (streams with an error event).",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="How long an idle keep-alive connection stays open. Longer than clients' own idle expiry (httpx "
        "5 s, aiohttp 15 s, cloud load balancers ~60 s), so the client closes it first: a server closing a connection "
        "just as a client reuses it fails that request with a connection error (uvicorn's default 5 s equals httpx's).",
    )


class ControlConfig(Section):
    host: str = Field("127.0.0.1", description="gRPC bind address of InferenceControl.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port of InferenceControl.")


class AuthConfig(Section):
    api_key: SecretStr | None = Field(None, description="Bearer key required on /v1/* when set.")
    control_token: SecretStr | None = Field(None, description="Shared secret required on gRPC control calls when set.")
    api_key_file: Path | None = secret_file("api_key")
    control_token_file: Path | None = secret_file("control_token")


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
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        description="Torch backend: size of the paged KV cache in GiB; default: what max_batch_size full contexts "
        "need, at most half the GPU memory free after loading (CPU: at most 1 GiB). The served context is "
        "shortened to what it holds.",
    )
    capture_graphs_at_start: bool = Field(
        True,
        description="Torch backend on CUDA: capture the decode step's CUDA graph for every batch-size bucket while "
        "loading (vLLM does too; seconds at start), so no request waits for a capture; false: each on first use.",
    )
    log_stats_interval_s: float = Field(
        10.0,
        ge=0,
        description="Torch backend: log one line of engine statistics every this many seconds while it works "
        "(requests running and waiting, KV cache use, prompt and generation tokens/s, prefix-cache hits, decode "
        "step time and its device share, prefills, CUDA graph captures, weight swaps); 0: never.",
    )
    prefix_caching: bool = Field(
        True,
        description="Torch backend: reuse the KV blocks of prompt prefixes already computed (a group's rollouts, "
        "a multi-turn history) under the same weights and adapter.",
    )
    overlap: bool | None = Field(
        None,
        description="Torch backend: overlap the host's work with the device's in decoding (vLLM's async "
        "scheduling): step n+1 is launched before step n's tokens are read, so their hand-off, scheduling and "
        "input upload run while the GPU computes; the same tokens either way. Default: on for CUDA, off on CPU "
        "(a CPU step leaves nothing to overlap).",
    )


class InferenceLoraConfig(Section):
    """LoRA adapters served next to the model, by both backends (multi-run: one per run, under the run's name).

    One pair of keys for the torch and the vLLM backend: `max_loras` adapters at once, each of rank up to
    `max_rank` (vLLM's `max_loras` / `max_lora_rank`; the torch backend's adapter slots).
    """

    adapters: list[str] = Field(
        default_factory=list,
        description="Model names served from the start (the base model until their first UpdateWeights).",
    )
    max_loras: int = Field(
        0,
        ge=0,
        description="LoRA adapters resident at once, which one batch may mix (0 = none); more names are served by "
        "evicting the least recently used idle adapter and loading it back on demand. Torch backend: adapter "
        "slots (0 = no names; the model's own adapter versions are merged into its weights). vLLM: its "
        "max_loras (0 = LoRA off: adapter versions are refused); a request keeps the adapter version it started "
        "with, so give two per name (one run: 2, N runs: 2N) or requests after a swap wait for the previous "
        "version's requests to finish.",
    )
    max_rank: int = Field(
        16,
        ge=1,
        description="Largest adapter rank served (at least trainer.lora.rank). vLLM allocates the next of its sizes "
        f"{', '.join(map(str, VLLM_LORA_RANKS))}.",
    )

    runtime_updates: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; vLLM's env var "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns them on too). An operator action: they need the control token "
        "when auth.control_token is set, else the API key.",
    )

    @model_validator(mode="after")
    def _slots_for_the_names(self) -> InferenceLoraConfig:
        if self.runtime_updates and not self.max_loras:
            raise ValueError("runtime_updates = true needs max_loras >= 1 (adapter slots to load into)")
        if len(self.adapters) > self.max_loras:
            raise ValueError(f"max_loras = {self.max_loras} is fewer than the {len(self.adapters)} adapters")
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapters: a name appears twice")
        return self


def vllm_lora_rank(max_rank: int) -> int:
    """vLLM's max_lora_rank for adapters up to `max_rank`: the smallest of its sizes that holds them."""
    for size in VLLM_LORA_RANKS:
        if size >= max_rank:
            return size
    raise ValueError(f"lora.max_rank {max_rank} exceeds vLLM's largest adapter rank {VLLM_LORA_RANKS[-1]}")


def loras_for_runs(backend: str, runs: int) -> int:
    """lora.max_loras that serves `runs` named adapters without waiting: one per run on the torch backend (a
    swap replaces the adapter in place between decode steps), two on vLLM (requests keep the version they
    started with, so a run's old and new versions overlap after each swap)."""
    return runs * (2 if backend == "vllm" else 1)


class InferenceConfig(ServingConfig):
    """Serve one policy model over an OpenAI-compatible HTTP API with gRPC weight control."""

    # ServingConfig, not ServiceConfig: inference reads no Redis and logs nothing to W&B (--redis.*, --wandb.*
    # were options it accepted and ignored)

    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Generation backend.")
    runner: Literal["generate", "pooling"] = Field(
        "generate",
        description="generate: a causal LM (chat, completions, tokens-in). pooling: a sequence-classification "
        "reward model on vLLM's /classify (torch backend; vLLM serves one itself with `vllm serve --runner pooling`).",
    )
    served_model_name: str | None = Field(None, description="Model id in the API (default: model.name).")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server.")
    control: ControlConfig = Field(default_factory=ControlConfig, description="gRPC control server.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Authentication.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Backend engine.")
    lora: InferenceLoraConfig = Field(default_factory=InferenceLoraConfig, description="LoRA adapters.")

    # Keys that moved (old -> new): using an old one is an error naming the new one. The torch and vLLM
    # backends had a pair each for the same two limits; both now read lora.max_loras / lora.max_rank.
    moved_keys: ClassVar[dict[str, str]] = {
        "engine.max_lora_rank": "lora.max_rank",
        "engine.max_loras": "lora.max_loras",
        "lora.max_adapters": "lora.max_loras",
    }

    @field_validator("runner")
    @classmethod
    def _pooling_on_torch(cls, runner: str, info: ValidationInfo) -> str:
        if runner == "pooling" and info.data.get("backend") == "vllm":
            raise ValueError(
                "runner = 'pooling' runs on the torch backend; serve a reward model on vLLM with "
                "`vllm serve MODEL --runner pooling` (Gyre's reward_model rubric calls its /classify)"
            )
        return runner

    @field_validator("lora")
    @classmethod
    def _vllm_rank(cls, lora: InferenceLoraConfig, info: ValidationInfo) -> InferenceLoraConfig:
        if info.data.get("backend") == "vllm" and lora.max_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_rank {lora.max_rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
        return lora
