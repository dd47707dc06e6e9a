"""`gyre trainer` and `gyre sft` configuration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from gyre.config.loader import Section, secret_file
from gyre.config.packing import DEFAULT_SEQ_LEN
from gyre.config.shared import JobConfig, ModelConfig, ServiceConfig

# The objectives gyre_trainer.loss registers (a unit test keeps the two in step): named here so a
# config is checked without importing torch, before any process starts.
BUILTIN_LOSSES = ("aipo", "ppo_clip", "gspo", "cispo", "masked_is")


class TrainerModelConfig(ModelConfig):
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "varlen"] = Field(
        "auto",
        description="Attention kernel for packed rows: auto = flash_attention_2 if flash-attn is installed, else "
        "varlen (torch's flash varlen kernel) on CUDA, sdpa on CPU. sdpa on GPU builds a dense block mask (slow).",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer and the log-prob kernels (GPU; the first steps compile).",
    )


#: Defaults that depend on the objective (docs/algorithms.md): unset keys take these values, so each
#: named objective is the published method. Objectives not listed (user functions) take "default".
OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "default": {"aggregation": "token-mean", "eps_low": 0.2, "eps_high": 0.28},
    # GSPO (Zheng et al. 2025): sequence-level loss, ε from the paper (section 5.1).
    "gspo": {"aggregation": "seq-mean-token-mean", "eps_low": 3e-4, "eps_high": 4e-4},
    # CISPO (MiniMax-M1): no lower bound on the IS weight (ε_low = 1 clips at 0), only ε_high.
    "cispo": {"aggregation": "token-mean", "eps_low": 1.0, "eps_high": 0.28},
}

Aggregation = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
ISCorrection = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask"]


class LossConfig(Section):
    """The RL objective; formulas and defaults in docs/algorithms.md."""

    type: str = Field(
        "ppo_clip",
        description="Objective: aipo | ppo_clip | gspo | cispo | masked_is, or 'package.module:function'.",
    )
    aggregation: Aggregation | None = Field(
        None,
        description="How per-token losses are reduced (normalised by global counts); "
        "unset = the objective's (gspo: seq-mean-token-mean, others: token-mean).",
    )
    eps_low: float | None = Field(
        None,
        ge=0,
        description="Lower clip range (ppo_clip, gspo, cispo); unset = the objective's "
        "(0.2; gspo 3e-4; cispo 1 = no lower bound).",
    )
    eps_high: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=True,
        description="Upper clip range; unset = the objective's (0.28, DAPO clip-higher; gspo 4e-4).",
    )
    clip_ratio_c: float | None = Field(
        3.0,
        allow_inf_nan=True,
        description="ppo_clip dual-clip: for A < 0 the loss is capped at -c*A (> 1; null = off).",
    )
    delta: float = Field(8.0, allow_inf_nan=True, description="aipo: truncation of the importance ratio (>= 1).")
    mask_low: float = Field(0.125, ge=0, description="masked_is: tokens with ratio below are masked (<= 1).")
    mask_high: float = Field(
        8.0, allow_inf_nan=True, description="masked_is: tokens with ratio above are masked (>= 1)."
    )
    sequence_mask: bool = Field(False, description="masked_is: mask whole sequences on the geometric-mean ratio.")
    is_correction: ISCorrection = Field(
        "none",
        description="Trainer/inference mismatch correction with any objective: token_tis | seq_tis (truncated "
        "importance weights) | token_mask | seq_mask (masked importance weights) | none.",
    )
    is_cap: float = Field(
        3.0, allow_inf_nan=True, description="is_correction: weights are truncated at / ratios above are masked (> 1)."
    )
    is_cap_low: float | None = Field(
        None, ge=0, description="is_correction: weights are raised to / ratios below are masked (< 1; null = none)."
    )
    kl_tau: float = Field(0.0, ge=0, description="Weight of the (log r)^2 regulariser toward the behaviour policy.")
    entropy_coeff: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus (verl's actor.entropy_coeff): - entropy_coeff x the policy's entropy on every "
        "valid loss token, aggregated like the loss (0 = off; the entropy metric is logged either way).",
    )
    ref_kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the frozen reference (base) model.")
    ref_kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Estimator of the reference KL: k1 (log ratio), k2 (half its square), k3 (clamped to 10)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="seq-mean-token-sum-norm (Dr.GRPO) constant; unset = the batch's generation budget "
        "(sampling.max_tokens x turns; in a mix, the longest entry's), or the longest sample for batches without one.",
    )
    distill: float = Field(
        0.0,
        ge=0,
        description="On-policy distillation: weight of the per-token reverse KL to the teacher, whose log-probs "
        "the batches carry (orchestrator.teacher); docs/algorithms.md.",
    )
    reward_weight: float = Field(
        1.0, ge=0, description="Weight of the reward's advantage next to the distillation term (0 = pure distillation)."
    )

    @field_validator("*")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        # NaN passes every bound check (NaN < 1 is False) and made every loss NaN: every step skipped, silently
        if isinstance(value, float) and math.isnan(value):
            raise ValueError("must be a number, got nan")
        return value

    @field_validator("distill", "reward_weight", "kl_tau", "ref_kl_coef", "entropy_coeff")
    @classmethod
    def _finite_weight(cls, value: float) -> float:
        # a bound may be infinite (is_cap, delta, mask_high = inf: no truncation), a weight of a term may not:
        # inf times the 0 of a masked token is NaN
        if math.isinf(value):
            raise ValueError(f"must be finite, got {value}")
        return value

    @field_validator("type")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value not in BUILTIN_LOSSES and ":" not in value:
            raise ValueError(
                f"unknown loss {value!r}: use one of {', '.join(BUILTIN_LOSSES)} or 'package.module:function'"
            )
        return value

    @field_validator("delta")
    @classmethod
    def _delta_keeps_on_policy_tokens(cls, value: float) -> float:
        if value < 1:
            raise ValueError(f"must be >= 1: delta={value} truncates every on-policy token (r = 1), no gradient flows")
        return value

    @field_validator("mask_low")
    @classmethod
    def _mask_low_keeps_on_policy_tokens(cls, value: float) -> float:
        if value > 1:
            raise ValueError(f"must be <= 1: mask_low={value} masks every on-policy token (r = 1), no gradient flows")
        return value

    @field_validator("mask_high")
    @classmethod
    def _mask_high_keeps_on_policy_tokens(cls, value: float) -> float:
        if value < 1:
            raise ValueError(f"must be >= 1: mask_high={value} masks every on-policy token (r = 1), no gradient flows")
        return value

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float | None) -> float | None:
        if value is not None and value <= 1:
            raise ValueError(
                f"must be > 1 or null: clip_ratio_c={value} caps every token with A < 0 at r <= 1, "
                "removing the gradient of negative advantages"
            )
        return value

    @field_validator("is_cap")
    @classmethod
    def _is_cap_above_one(cls, value: float) -> float:
        if value <= 1:
            raise ValueError(f"must be > 1: is_cap={value} truncates or masks on-policy tokens (r = 1)")
        return value

    @field_validator("is_cap_low")
    @classmethod
    def _is_cap_low_below_one(cls, value: float | None) -> float | None:
        if value is not None and value >= 1:
            raise ValueError(f"must be < 1 or null: is_cap_low={value} raises or masks on-policy tokens (r = 1)")
        return value

    @model_validator(mode="after")
    def _some_signal(self) -> LossConfig:
        if self.reward_weight == 0 and self.distill == 0:
            raise ValueError("reward_weight = 0 with distill = 0 leaves no learning signal: set loss.distill > 0 "
                             "(with orchestrator.teacher) or reward_weight > 0")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _objective_defaults(self) -> LossConfig:
        """Fill unset keys with the objective's own defaults (OBJECTIVE_DEFAULTS)."""
        defaults = OBJECTIVE_DEFAULTS.get(self.type, OBJECTIVE_DEFAULTS["default"])
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of lr (linear/cosine).")
    decay_steps: int | None = Field(
        None,
        ge=1,
        description="Warmup-stable-decay (WSD): linear/cosine decay over the last N updates before max_steps only, "
        "at the peak lr until then (unset = decay over every update after warmup).",
    )
    master_weights: bool = Field(
        True,
        description="AdamW updates a float32 copy of bf16/fp16 parameters (kept in the optimizer state) and rounds "
        "it into them; off, updates below bf16's resolution round away (most of them at lr 1e-5).",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        # torch refuses them only when the optimizer is built, after the model loaded, naming no config key
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _decay_needs_a_decay(self) -> OptimConfig:
        # a constant schedule has nothing to decay: the key would be accepted and silently do nothing
        if self.decay_steps is not None and self.scheduler == "constant":
            raise ValueError(
                f"decay_steps = {self.decay_steps} needs scheduler 'linear' or 'cosine' (the decay's shape), "
                "got 'constant': set one of those, or unset decay_steps (null)"
            )
        return self


class DataConfig(Section):
    seq_len: int = Field(
        DEFAULT_SEQ_LEN, ge=16, description="Tokens per packed micro-batch row (a longer row is refused)."
    )
    micro_batch_size: int = Field(1, ge=1, description="Packed rows per forward/backward.")


class CkptConfig(Section):
    interval: int | None = Field(None, ge=1, description="Full checkpoint every N steps (off when unset).")
    keep_last: int | None = Field(2, ge=1, description="Keep the newest N checkpoints (unset = all).")
    keep_interval: int | None = Field(None, ge=1, description="Also keep every checkpoint whose step is a multiple.")
    resume_step: int | None = Field(
        None,
        ge=-1,
        description="Unset = resume from the run's own progress (newest checkpoint / published weights) if any; "
        "-1 = the same but a checkpoint must exist; N = rewind to checkpoint N (0 = base model), "
        "deleting newer checkpoints and weights, once: a restart with the same N resumes where the run stands.",
    )


class TrainerCkptConfig(CkptConfig):
    on_stop: bool = Field(
        True,
        description="On SIGTERM/SIGINT (a pod evicted or drained, Ctrl-C) checkpoint the last trained step after "
        "finishing it, unless that step has its checkpoint already, so the restart resumes it exactly (a run without "
        "ckpt.interval included). The pod's terminationGracePeriodSeconds must cover a step, its publish and this "
        "checkpoint (gyre_trainer_checkpoint_seconds); a save cut by SIGKILL leaves no partial checkpoint.",
    )


class OrchestratorClientConfig(Section):
    address: str = Field("127.0.0.1:50061", description="gRPC address of the orchestrator (NotifyWeights).")
    timeout_s: float = Field(10.0, gt=0, description="Deadline of one NotifyWeights call.")
    control_token: SecretStr | None = Field(None, description="Shared secret sent as gRPC metadata.")
    control_token_file: Path | None = secret_file("control_token")
    retry_initial_s: float = Field(0.5, gt=0, description="First NotifyWeights retry delay (doubles per failure).")
    retry_max_s: float = Field(30.0, gt=0, description="Longest delay between NotifyWeights retries.")


class IntakeConfig(Section):
    poll_ms: int = Field(
        1000, ge=10, description="How long one Redis read blocks while waiting for a batch (then stop is re-checked)."
    )
    dead_letter_maxlen: int = Field(
        16,  # gyre.streams.DEAD_MAXLEN
        ge=1,
        description="Batches the trainer rejected, kept in gyre:{run}:batches:dead for inspection: the newest N "
        "(the older are trimmed and counted). Each is a whole batch in Redis memory: size maxmemory for it.",
    )


class DebugConfig(Section):
    """Keep a step whose gradients went wrong, to reproduce it with `gyre replay` (docs/trainer.md, "Debugging
    a step")."""

    dump: bool = Field(
        True,
        description="On a non-finite or spiking gradient norm, keep the step's batch and the parameters that "
        "produced it (before the update) in {output_dir}/debug/step_{s}.",
    )
    spike_factor: float = Field(
        10.0,
        gt=1,
        description="A gradient norm above this times the median of the previous spike_window steps' is a "
        "spike (counted in gyre_trainer_grad_norm_spikes_total, dumped with debug.dump).",
    )
    spike_window: int = Field(
        20, ge=3, description="Steps whose median gradient norm a step is compared with (3 at least before any)."
    )
    keep_last: int = Field(2, ge=1, description="Newest step dumps kept (each holds the weights: a model's size).")


class TrainerServerConfig(Section):
    host: str = Field("127.0.0.1", description="Bind address of the gRPC server and of /metrics (0.0.0.0 in pods).")
    port: int = Field(50071, ge=0, le=65535, description="gRPC port of gyre.v1.Trainer (status + health).")
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP /health and /ready of this node, served by its local rank 0 on every node (unset: none).",
    )


class LoraAdapterConfig(Section):
    """Train low-rank adapters (peft) instead of every weight; the base stays frozen (`gyre sft`'s `lora`)."""

    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is alpha / r * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )
    lr_ratio_b: float = Field(
        1.0,
        gt=0,
        description="LoRA+ (Hayou et al. 2024): lora_B's learning rate is optim.lr times this; lora_A keeps "
        "optim.lr (1 = plain LoRA).",
    )


class LoraConfig(LoraAdapterConfig):
    """Train low-rank adapters (peft) instead of every weight; the base stays frozen."""

    publish: Literal["merged", "adapter"] = Field(
        "merged",
        description="Publish merged full weights (every backend) or the adapter alone (PEFT files; the torch "
        "backend applies it to the base it keeps in memory).",
    )


class RunOrchestratorConfig(OrchestratorClientConfig):
    """The run's own orchestrator (a separate type: the chart owns the trainer's `orchestrator.address`, not this)."""


# a run id without dots: it also names the run's peft adapter, and module names cannot hold dots
RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"


class RunConfig(Section):
    """One run of a multi-run trainer (docs/trainer.md, "Multi-run"): its own LoRA adapter, optimizer,
    schedule, progress, batch stream, weights and orchestrator; the base model and loss are shared."""

    name: str = Field(
        ...,
        pattern=RUN_NAME,
        description="Run id: its Redis stream gyre:{name}:batches, its adapter, and the model name inference "
        "serves it under.",
    )
    output_dir: Path = Field(..., description="The run's own folder: weights, checkpoints, events.")
    max_steps: int | None = Field(None, ge=1, description="The run finishes after this step (unset = never).")
    orchestrator: RunOrchestratorConfig = Field(
        default_factory=RunOrchestratorConfig, description="The run's orchestrator (NotifyWeights)."
    )
    optim: OptimConfig | None = Field(None, description="The run's optimizer and schedule (unset = trainer.optim).")
    lora: LoraConfig | None = Field(None, description="The run's adapter shape (unset = trainer.lora).")
    resume_step: int | None = Field(None, ge=-1, description="As ckpt.resume_step, for this run only.")

    @field_validator("name")
    @classmethod
    def _not_inside_lora_prefix(cls, name: str) -> str:
        # peft finds adapter tensors by the substring "lora_": a name inside it (e.g. "a", "or") could
        # make peft re-initialise that adapter when its published weights are loaded back on resume
        if name in "lora_":
            raise ValueError(f"{name!r} is part of 'lora_', which peft reserves: choose a longer name")
        return name


class TrainerConfig(ServiceConfig):
    """Consume batches from Redis, optimise the policy, publish weights, notify the orchestrator."""

    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig, description="Policy model to start from.")
    loss: LossConfig = Field(default_factory=LossConfig, description="RL objective.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimiser and schedule.")
    data: DataConfig = Field(default_factory=DataConfig, description="Batch shapes.")
    ckpt: TrainerCkptConfig = Field(default_factory=TrainerCkptConfig, description="Checkpointing.")
    orchestrator: OrchestratorClientConfig = Field(
        default_factory=OrchestratorClientConfig, description="Orchestrator."
    )
    server: TrainerServerConfig = Field(default_factory=TrainerServerConfig, description="gRPC status server.")
    intake: IntakeConfig = Field(default_factory=IntakeConfig, description="Reading batches from Redis.")
    debug: DebugConfig = Field(default_factory=DebugConfig, description="Step dumps for `gyre replay`.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this step (unset = run until stopped).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Training device.")
    seed: int = Field(0, description="Random seed.")
    deterministic: bool = Field(False, description="Deterministic torch algorithms (tests).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward (long rows on a GPU)."
    )
    weights_keep_last: int = Field(3, ge=1, description="Weight versions kept on the volume (plus those in use).")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters only (unset = full fine-tuning).")
    bench: bool = Field(False, description="Benchmark on fake data: print tokens/s and MFU, then exit.")
    runs: list[RunConfig] = Field(
        default_factory=list,
        description="Multi-run: train these runs on one model, one LoRA adapter each (needs lora; "
        "run_id, output_dir, max_steps, orchestrator at top level are then unused).",
    )
    runs_dir: Path | None = Field(
        None,
        description="Multi-run: also pick up runs added later as {runs_dir}/<name>.toml (a [run] table each, "
        "the keys of runs[]); removing a file stops its run; the trainer then keeps waiting for runs until stopped.",
    )

    @model_validator(mode="after")
    def _multirun_needs_adapters(self) -> TrainerConfig:
        if not (self.runs or self.runs_dir):
            return self
        if self.lora is None:
            raise ValueError("runs: multi-run trains one LoRA adapter per run; set trainer.lora")
        for key in ("name", "output_dir"):
            seen = [str(getattr(r, key)) for r in self.runs]
            duplicated = sorted({v for v in seen if seen.count(v) > 1})
            if duplicated:
                raise ValueError(f"runs: {key} must differ between runs, {duplicated} appear twice")
        for where, lora in [("trainer.lora", self.lora)] + [(f"runs.{r.name}.lora", r.lora) for r in self.runs]:
            if lora is None:
                continue
            if "lm_head" in lora.target_modules:  # inference's per-run adapters sit in the decoder layers only
                raise ValueError(f"{where}.target_modules: lm_head cannot be served per run; drop it with runs")
            if "publish" in lora.model_fields_set and lora.publish != "adapter":
                raise ValueError(f"{where}.publish must be 'adapter' with runs: inference serves each run's adapter")
            lora.publish = "adapter"
        return self


class SFTDataConfig(Section):
    path: Path | None = Field(None, description="Chat-format JSONL ({'messages': [...]}) to train on.")
    fake: bool = Field(False, description="Train on generated data instead of data.path.")
    env: str | None = Field(None, description="Generate SFT data from this environment's reference answers.")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the environment (data.env).")
    num_examples: int = Field(2000, ge=1, description="Examples to generate (fake/env modes).")
    seq_len: int = Field(
        512,
        ge=16,
        description="Tokens per packed row; a longer conversation is cut to it (or to the model's context if shorter).",
    )
    batch_size: int = Field(16, ge=1, description="Packed rows per optimiser step.")
    micro_batch_size: int = Field(4, ge=1, description="Packed rows per forward/backward.")


class SFTConfig(JobConfig):
    """Supervised fine-tuning on chat data (loss on assistant tokens only)."""

    # JobConfig, not ServiceConfig: SFT reads no Redis, serves no /metrics and publishes no weights, so
    # --redis.*, --metrics.* and --weights.* would be options it accepts and ignores

    model: TrainerModelConfig = Field(default_factory=TrainerModelConfig, description="Model to fine-tune.")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig, description="Dataset.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3), description="Optimiser and schedule.")
    ckpt: TrainerCkptConfig = Field(default_factory=TrainerCkptConfig, description="Checkpointing (ckpt.on_stop too).")
    max_steps: int = Field(200, ge=1, description="Optimiser steps.")
    epochs: int | None = Field(None, ge=1, description="Stop after this many passes over the data.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Training device.")
    seed: int = Field(0, description="Random seed (model init order, data shuffling, generated data).")
    deterministic: bool = Field(False, description="Deterministic torch algorithms (tests).")
    save_dir: Path | None = Field(None, description="Where the final HF model goes (default: {output_dir}/sft).")
    lora: LoraAdapterConfig | None = Field(
        None,
        description="Train LoRA adapters only (unset = full fine-tuning); the result is the merged model, with the "
        "adapter alone in its lora/ folder (PEFT's files).",
    )

    @model_validator(mode="after")
    def _one_data_source(self) -> SFTConfig:
        # checked here, not in SFTDataConfig: its default (no source) failing inside the default factory was an
        # error of no key ("config key '<root>': Value error, set exactly one ...")
        data = self.data
        sources = [name for name, on in (("path", data.path is not None), ("fake", data.fake), ("env", data.env)) if on]
        if len(sources) != 1:
            raise ValueError(f"data: set exactly one of data.path, data.fake, data.env (got {sources or 'none'})")
        return self
