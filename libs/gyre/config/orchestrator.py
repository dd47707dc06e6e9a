"""`gyre orchestrator` configuration (and `gyre eval`'s, its keys less training's); the `env` key is
`gyre.config.env`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from gyre.config.endpoint import EVAL_STARTUP_TIMEOUT_S, JudgeConfig, RewardModelConfig, TeacherConfig, route_problem
from gyre.config.env import EnvConfig, EnvOrMix, check_evaluated, check_template_kwargs, env_entries
from gyre.config.loader import GyreSettings, Section, secret_file
from gyre.config.packing import DEFAULT_SEQ_LEN
from gyre.config.shared import LogConfig, RedisConfig, ServiceConfig


def template_kwargs(sampling: EvalSamplingConfig, entry: EnvConfig) -> dict[str, Any]:
    """The chat_template_kwargs of `entry`'s requests (training and eval): its own sampling.chat_template_kwargs
    where it sets them (the whole table, not merged), else the orchestrator's `sampling`'s."""
    own = entry.sampling.chat_template_kwargs
    return own if own is not None else sampling.chat_template_kwargs


class EvalSamplingConfig(Section):
    """Sampling keys a `gyre eval` uses (its temperature is eval.temperature)."""

    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(128, ge=1, description="Completion tokens per model turn.")
    seed: int | None = Field(None, description="Base seed for requests (None = random).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the model's chat template, sent with every chat request of rollouts and "
        "evals (vLLM's chat_template_kwargs), e.g. {enable_thinking = false} for Qwen3; apply_chat_template's own "
        "arguments (add_generation_prompt, tools, ...) are refused. An entry's sampling.chat_template_kwargs "
        "replaces it.",
    )
    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


class SamplingConfig(EvalSamplingConfig):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of training rollouts (> 0).")

    @field_validator("temperature")
    @classmethod
    def _samples_from_a_distribution(cls, value: float) -> float:
        # Caught here, not after a step of rollouts: batches carry the temperature the trainer scores at (> 0)
        if value == 0:
            raise ValueError(
                "must be > 0: training samples need a distribution (greedy samples of a group are identical, so "
                "every group has no signal, and the trainer's log-probs are taken at this temperature); for "
                "greedy evals set orchestrator.eval.temperature = 0"
            )
        return value


class InferenceEndpointsConfig(Section):
    """Finding and calling the replicas' OpenAI API (what `gyre eval` reads)."""

    urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Static replica URLs: each server's root (http://host:8000) or its OpenAI base (…/v1).",
    )
    discovery: Literal["static", "dns", "kubernetes"] = Field("static", description="How replicas are found.")
    dns_name: str | None = Field(None, description="dns: headless Service name resolved to replica IPs.")
    kubernetes_service: str | None = Field(None, description="kubernetes: Service whose EndpointSlices are watched.")
    namespace: str | None = Field(None, description="kubernetes: namespace (default: the pod's).")
    http_port: int = Field(8000, description="dns/kubernetes: HTTP port of each replica.")
    control_port: int = Field(50051, description="gRPC InferenceControl port of each replica (static: same host).")
    control_urls: list[str] | None = Field(None, description="static: explicit host:port of each replica's control.")
    refresh_s: float = Field(10.0, gt=0, description="Re-resolve replicas this often.")
    api_key: SecretStr | None = Field(None, description="Bearer key for the HTTP API.")
    api_key_file: Path | None = secret_file("api_key")
    max_concurrency: int = Field(
        64,
        ge=1,
        description="Requests in flight across replicas (gyre rl and the chart set it to the fleet's rows, "
        "the sum of the replicas' engine.max_batch_size, so their batches fill; a value set here wins).",
    )
    timeout_s: float = Field(300.0, gt=0, description="HTTP timeout of one request.")
    retries: int = Field(3, ge=0, description="Retries per request (with backoff) before the sample fails.")
    model: str | None = Field(None, description="Model id sent in requests (default: the first one /v1/models lists).")
    failure_cooldown_s: float = Field(
        5.0,
        gt=0,
        description="A failed replica leaves rotation this long (doubling per failure, max 60 s); one that was down "
        "(restarting, loading its model) rejoins as soon as its status probe finds it ready.",
    )

    @field_validator("urls")
    @classmethod
    def _roots(cls, urls: list[str]) -> list[str]:
        # a replica's root: the client adds /v1 itself. An OpenAI base URL (…/v1), as vLLM's and the openai client's
        # users write it, sent every request to /v1/v1/… : a 404 at each one. A route beyond it (…/v1/chat/completions)
        # is refused here, before anything connects (it was a 404 after start)
        for i, url in enumerate(urls):
            if problem := route_problem(url):
                raise ValueError(f"entry {i} {problem}")
        return [url.rstrip("/").removesuffix("/v1") for url in urls]


class EvalInferenceConfig(InferenceEndpointsConfig):
    """`gyre eval`'s: also how long to wait for the replicas to come up."""

    startup_timeout_s: float = Field(
        EVAL_STARTUP_TIMEOUT_S,
        ge=0,
        allow_inf_nan=False,
        description="Before the first request, wait this long for a replica's /v1/models to answer (a model still "
        "loading: connection refused, 5xx, 429), logged every 30 s, then fail; 401, 403, 404 and a host name that "
        "does not resolve fail at once. 0 = don't wait (nor ask).",
    )


class InferenceClientConfig(InferenceEndpointsConfig):
    """The orchestrator's: also the replicas' control (weight updates, status probes)."""

    control_token: SecretStr | None = Field(None, description="Shared secret for InferenceControl calls.")
    control_token_file: Path | None = secret_file("control_token")
    health_interval_s: float = Field(2.0, gt=0, description="Probe every replica's GetStatus this often.")


class RelayConfig(Section):
    timeout_s: float = Field(120.0, gt=0, description="Deadline of one UpdateWeights call (load + swap).")
    retries: int = Field(3, ge=0, description="UpdateWeights retries per replica before it leaves rotation.")
    poll_store_s: float = Field(5.0, gt=0, description="Also look for new versions on the volume this often.")


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): a sample whose completion ends within
    the last `len` tokens of its limit loses reward, linearly, up to `penalty_factor` at the limit."""

    len: int = Field(
        0,
        ge=0,
        description="Buffer in completion tokens (model tokens only), L_buf: a sample longer than L_max - L_buf gets "
        "reward += -penalty_factor * min((length - (L_max - L_buf)) / L_buf, 1), L_max its entry's sampling.max_tokens "
        "(x the environment's max_turns for a multi-turn one, or x the turns the episode took where more: a verifiers "
        "harness without agent.max_turns); the shaped reward is what groups are filtered and "
        "advantages computed on. 0 = off. Must be < every entry's max_tokens.",
    )
    penalty_factor: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="The largest penalty, reached at the length limit (DAPO: 1)."
    )


class AdvantageConfig(Section):
    type: Literal["grpo", "drgrpo", "rloo", "opo"] = Field("drgrpo", description="Group advantage estimator.")
    std_norm: Literal["group", "batch", "none"] = Field("group", description="grpo: std used for scaling.")
    drop_zero_signal: bool = Field(True, description="Drop groups whose rewards are all equal.")
    refill: Literal["mix", "entry"] = Field(
        "mix",
        description="A mix: a dropped zero-signal group is replaced by a fresh draw of the mix (mix: the trained mix "
        "leans toward the entries with signal), or by its own entry's next task (entry: each entry "
        "keeps the share it was drawn, while the step's oversample budget lasts).",
    )
    oversample_limit: float = Field(
        2.0,
        ge=1,
        description="A step generates at most this many x batch_size groups (dropped ones replaced), so filtering "
        "makes a batch at most this many times slower to generate; then it closes with what it kept (with nothing "
        "kept: with its zero-signal groups, all advantages 0).",
    )
    overlong_buffer: OverlongBufferConfig = Field(
        default_factory=OverlongBufferConfig,
        description="Overlong reward shaping, DAPO's soft overlong punishment (len, penalty_factor; off by default).",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: samples cut at the length limit (stop_reason length) or to "
        "batch.seq_len (their reward covers tokens the trainer never sees) are left out of the batch, so out of the "
        "loss and its normalisers; their group's advantages are still computed over all its samples (counted: "
        "masked_truncated in the step lines).",
    )


class EvalOnceConfig(Section):
    """One evaluation: what `gyre eval` reads."""

    num_examples: int = Field(32, ge=1, description="Held-out tasks per eval.")
    k: int = Field(1, ge=1, description="Samples per task (avg@k, pass@k).")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    pass_threshold: float = Field(
        1.0, description="pass@k: a sample passes when its reward is >= this (within 1e-9: weighted sums round)."
    )


class EvalConfig(EvalOnceConfig):
    interval: int | None = Field(None, ge=1, description="Evaluate every N steps (unset = off).")
    at_start: bool = Field(True, description="Also evaluate the starting policy (step 0).")


class RolloutDumpConfig(Section):
    interval: int | None = Field(
        5, ge=1, description="Write rollouts/step_{s}.jsonl (every trained sample) every N steps and at step 1."
    )


class BatchConfig(Section):
    seq_len: int = Field(
        DEFAULT_SEQ_LEN, ge=16, description="Tokens per packed row (derived from the trainer's data.seq_len)."
    )
    dp_world_size: int = Field(
        1, ge=1, description="Trainer data-parallel ranks to split micro-batches over (derived from the trainer)."
    )
    stream_maxlen: int = Field(64, ge=2, description="Approximate bound of the batch stream length.")
    inline_max_bytes: int = Field(8 << 20, ge=0, description="Larger payloads go to the shared volume.")


class OrchestratorServerConfig(Section):
    host: str = Field("127.0.0.1", description="gRPC bind address of gyre.v1.Orchestrator.")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port of gyre.v1.Orchestrator.")
    control_token: SecretStr | None = Field(None, description="Shared secret required from the trainer when set.")
    control_token_file: Path | None = secret_file("control_token")


class OrchestratorRedisConfig(RedisConfig):
    retry_deadline_s: float = Field(
        300.0,
        gt=0,
        description="Retry every Redis call through an outage (backoff 0.5 s doubling to 30 s) this long, then fail.",
    )


class OrchestratorConfig(ServiceConfig):
    """Run environments against inference, score, compute advantages, pack and stream batches."""

    redis: OrchestratorRedisConfig = Field(default_factory=OrchestratorRedisConfig, description="Redis connection.")
    env: EnvOrMix = Field(
        default_factory=EnvConfig,
        description="Environment: one table [env], or a mix of several trained as one policy, [[env]] entries "
        "with their ratio (and a label to tell apart two of the same name); a name alone is its table with defaults "
        "(--orchestrator.env arithmetic, or a list of names: a mix of equal ratios).",
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="Tasks (groups) per step, each of rollouts_per_example samples. PRIME-RL's batch_size counts "
        "samples: its batch_size = 128 with rollouts_per_example = 16 is batch_size = 8 here.",
    )
    rollouts_per_example: int = Field(
        8, ge=1, description="Samples per task (the advantage group); a mix's entry may set its own."
    )
    max_async_level: int = Field(1, ge=0, description="Batch s uses samples from versions >= s-1-k.")
    max_steps: int | None = Field(None, ge=1, description="Stop after pushing this batch.")
    seed: int = Field(
        0,
        description="Task sampler seed: task i of the train split (a dataset's epoch order, a mix's draws) is a "
        "function of (seed, i). Fixed for a run: a re-run of a started run with another is refused (--fresh).",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    inference: InferenceClientConfig = Field(default_factory=InferenceClientConfig, description="Inference replicas.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantages and filters.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic evaluation.")
    rollouts: RolloutDumpConfig = Field(default_factory=RolloutDumpConfig, description="Sample dumps (see them).")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Packing and streaming.")
    server: OrchestratorServerConfig = Field(default_factory=OrchestratorServerConfig, description="gRPC server.")
    relay: RelayConfig = Field(default_factory=RelayConfig, description="Weight relay to the replicas.")
    judges: list[JudgeConfig] = Field(
        default_factory=list, description="LLM judges added to the environment's rubric (weight 0 = logged only)."
    )
    reward_models: list[RewardModelConfig] = Field(
        default_factory=list, description="Reward models (vLLM's /classify) added to the environment's rubric."
    )
    teacher: TeacherConfig | None = Field(
        None,
        description="On-policy distillation: the teacher whose log-probs of every sampled token the batches carry "
        "(with trainer.loss.distill > 0); groups are then never dropped for equal rewards.",
    )
    max_inflight_groups: int | None = Field(
        None,
        ge=1,
        description="Groups generated at once (default: ceil(max_concurrency / rollouts_per_example), a mix's "
        "largest).",
    )
    sample_attempts: int = Field(
        3,
        ge=1,
        description="Attempts per rollout (inference or environment errors: generated again) and per scoring of one "
        "completion (a judge, reward model or teacher failing: the same completion scored again) before the run "
        "fails.",
    )
    final_weights_timeout_s: float = Field(
        600.0, ge=0, description="After the last batch, wait this long for its weights to be relayed (0 = don't)."
    )
    ckpt_interval: int | None = Field(None, ge=1, description="Progress checkpoint every N steps (unset = off).")
    ckpt_keep_last: int = Field(
        3, ge=1, description="Keep the newest N progress checkpoints (and those of the trainer's checkpoints' steps)."
    )
    resume_step: int | None = Field(
        None,
        ge=-1,
        description="Unset or -1 = continue after the trainer's committed step and the batches still in the stream "
        "(a fresh start when the run has no state); N = rewind to step N with the trainer (progress checkpoint N), "
        "once: a restart with the same N resumes where the run stands.",
    )

    @property
    def envs(self) -> list[EnvConfig]:
        """The environments: one, or the entries of a mix."""
        return env_entries(self.env)

    @model_validator(mode="after")
    def _stream_holds_the_async_window(self) -> OrchestratorConfig:
        # The orchestrator runs up to max_async_level + 1 batches ahead of the trainer's published weights, each
        # an unacked stream entry; MAXLEN must never trim one of them (the trainer would wait for it forever).
        # One more for a batch pushed again after a crash.
        need = self.max_async_level + 2
        if self.batch.stream_maxlen < need:
            raise ValueError(
                f"batch.stream_maxlen: {self.batch.stream_maxlen} cannot hold the {self.max_async_level + 1} batches "
                f"that max_async_level = {self.max_async_level} lets the orchestrator push ahead of the trainer, "
                f"plus one pushed again after a crash: set it >= {need} (or lower max_async_level)"
            )
        return self

    def group_size(self, entry: EnvConfig) -> int:
        """Samples per task of `entry` (one of `envs`): its own rollouts_per_example, else the orchestrator's."""
        return entry.rollouts_per_example or self.rollouts_per_example

    def max_tokens(self, entry: EnvConfig) -> int:
        """Completion tokens per model turn of `entry`'s training rollouts: its own sampling.max_tokens, else the
        orchestrator's."""
        return entry.sampling.max_tokens or self.sampling.max_tokens

    def max_tokens_key(self, i: int) -> str:
        """The key that set entry `i`'s training max_tokens, as errors name it."""
        own = self.envs[i].sampling.max_tokens is not None
        return f"{self.env_key(i)}.sampling.max_tokens" if own else "sampling.max_tokens"

    def env_key(self, i: int) -> str:
        """The config key of entry `i` of `envs`, as errors name it: `env` (one table) or `env.{i}` (a mix)."""
        return f"env.{i}" if isinstance(self.env, list) else "env"

    @model_validator(mode="after")
    def _groups_can_carry_a_signal(self) -> OrchestratorConfig:
        # Checked here, not when the service starts: `gyre rl` then refuses it before starting anything. Each entry's
        # group size, named by the key that set it (an entry's own, else the orchestrator's)
        for i, entry in enumerate(self.envs):
            size = self.group_size(entry)
            key = "rollouts_per_example" if entry.rollouts_per_example is None else (
                f"{self.env_key(i)}.rollouts_per_example")  # fmt: skip
            if self.advantage.type == "rloo" and size < 2:
                raise ValueError(
                    f"advantage.type: 'rloo' needs {key} >= 2 (got {size}): the leave-one-out baseline of a single "
                    "sample is undefined"
                )
            if size < 2 and self.teacher is None:
                # every advantage is group-relative: one sample per task is its own baseline, so every advantage is
                # 0 and every group is dropped as zero-signal (each step then spends its whole oversample budget)
                raise ValueError(
                    f"{key}: 1 sample per task gives every group advantage "
                    f"(advantage.type = {self.advantage.type!r}) the value 0, so nothing is learned: set it >= 2 "
                    "(only on-policy distillation, with [teacher], trains on groups of 1)"
                )
        return self

    @model_validator(mode="after")
    def _teacher_at_temperature_one(self) -> OrchestratorConfig:
        # The teacher's log-probs are untempered (prompt_logprobs: T = 1, vLLM's rule) and the trainer's lp_theta is
        # at the sampling temperature: at any other T the "reverse KL" compared a tempered student with the plain
        # teacher, and silently distilled toward another distribution than the teacher's
        if self.teacher is not None and self.sampling.temperature != 1:
            raise ValueError(
                f"sampling.temperature: {self.sampling.temperature:g} with [teacher]: on-policy distillation "
                "compares the student's log-probs at the sampling temperature with the teacher's at 1 (its "
                "prompt_logprobs are untempered), so the reverse-KL term would pull the student at this "
                "temperature toward the teacher at 1; set sampling.temperature = 1 (docs/algorithms.md, on-policy "
                "distillation)"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> OrchestratorConfig:
        # refused here, not at the first sample: a buffer of the whole limit or more penalises every sample
        buffer = self.advantage.overlong_buffer.len
        for i, entry in enumerate(self.envs):
            if buffer and buffer >= self.max_tokens(entry):
                raise ValueError(
                    f"advantage.overlong_buffer.len: {buffer} must be < {self.max_tokens_key(i)} = "
                    f"{self.max_tokens(entry)} (the penalty starts max_tokens - len tokens into the completion)"
                )
        return self

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> OrchestratorConfig:
        if self.eval.interval is not None:
            check_evaluated(self.env, f"eval.interval = {self.eval.interval}")
            return self
        for i, entry in enumerate(self.envs):  # an entry's interval alone evaluated nothing, silently
            if entry.eval.interval is not None:
                raise ValueError(
                    f"{self.env_key(i)}.eval.interval: evaluations are off (eval.interval unset): set eval.interval "
                    "too, which every entry without its own interval follows"
                )
        return self

    @model_validator(mode="after")
    def _distinct_signal_names(self) -> OrchestratorConfig:
        check_signal_names(self.judges, self.reward_models)
        return self


def check_signal_names(judges: list[JudgeConfig], reward_models: list[RewardModelConfig]) -> None:
    """Judges and reward models are reward functions of one rubric: their names must differ."""
    names = [judge.name for judge in judges] + [model.name for model in reward_models]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"judges / reward_models: the name {twice[0]!r} is used twice (names must differ)")


class GyreEvalConfig(GyreSettings):
    """`gyre eval`: the keys one evaluation of a served model reads (an orchestrator's, less training's)."""

    # `@ exp.toml#orchestrator` reads a run's [orchestrator] table less its training keys (gyre.config.loader)
    reads_sections_of: ClassVar[dict[str, str]] = {"orchestrator": "gyre.config.orchestrator:OrchestratorConfig"}

    output_dir: Path = Field(Path("outputs/run"), description="Where events/eval.jsonl gets the result.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging.")
    env: EnvOrMix = Field(
        default_factory=EnvConfig,
        description="Environment: one table [env], or [[env]] entries (a mix: each one evaluated, reported by label).",
    )
    inference: EvalInferenceConfig = Field(default_factory=EvalInferenceConfig, description="Inference replicas.")
    eval: EvalOnceConfig = Field(default_factory=EvalOnceConfig, description="The evaluation.")
    sampling: EvalSamplingConfig = Field(
        default_factory=EvalSamplingConfig, description="Sampling parameters (the temperature is eval.temperature)."
    )
    judges: list[JudgeConfig] = Field(
        default_factory=list, description="LLM judges added to the environment's rubric (weight 0 = logged only)."
    )
    reward_models: list[RewardModelConfig] = Field(
        default_factory=list, description="Reward models (vLLM's /classify) added to the environment's rubric."
    )

    @property
    def envs(self) -> list[EnvConfig]:
        """The environments: one, or the entries of a mix."""
        return env_entries(self.env)

    @model_validator(mode="after")
    def _distinct_signal_names(self) -> GyreEvalConfig:
        check_signal_names(self.judges, self.reward_models)
        return self

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> GyreEvalConfig:
        check_evaluated(self.env, "gyre eval")
        return self

    @model_validator(mode="after")
    def _short_startup_wait(self) -> GyreEvalConfig:
        # a one-off evaluation waited out a training run's bound (30 min, a judge pod loading beside the
        # orchestrator) for a judge that was not there; a startup_timeout_s given is kept
        for signal in (*self.judges, *self.reward_models):
            if "startup_timeout_s" not in signal.model_fields_set:
                signal.startup_timeout_s = EVAL_STARTUP_TIMEOUT_S
        return self
