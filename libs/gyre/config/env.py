"""The `env` key of `gyre orchestrator` and `gyre eval`: one environment, or the entries of a mix.

`EnvConfig` (an environment and its own sampling and eval settings, `EnvSamplingConfig` and `EnvEvalConfig`),
`EnvOrMix` (one table or a list of entries, errors keyed as written) and the checks of a mix's entries. Its own module,
apart from `gyre.config.orchestrator`: both the orchestrator's config and `gyre eval`'s read it, and the entry's
keys are a concern of their own (which environment, how it is drawn, sampled and evaluated), not the run's.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from gyre.chat import TEMPLATE_ARGUMENTS
from gyre.config.loader import Section


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: refused at load when it sets one of apply_chat_template's own arguments (the server
    refuses each request that does, so every rollout of the run would fail)."""
    if value and (reserved := sorted(TEMPLATE_ARGUMENTS & set(value))):
        raise ValueError(
            f"may not set {', '.join(reserved)}: an argument of apply_chat_template itself, which the request "
            "decides (chat_template_kwargs holds the template's own variables, e.g. enable_thinking)"
        )
    return value


class EnvEvalConfig(Section):
    """One environment's (a mix entry's) evaluation, within the orchestrator's `eval` settings."""

    enabled: bool = Field(
        True, description="Evaluate this entry (false: trained on, never evaluated; the other entries still are)."
    )
    num_examples: int | None = Field(
        None, ge=1, description="Held-out tasks of this entry per eval (default: eval.num_examples)."
    )
    k: int | None = Field(None, ge=1, description="Samples per task of this entry's eval, pass@k (default: eval.k).")
    interval: int | None = Field(
        None, ge=1, description="Evaluate this entry every N steps (default: eval.interval, which turns evals on)."
    )
    temperature: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="This entry's eval temperature (default: eval.temperature)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Completion tokens per model turn of this entry's eval (default: its sampling.max_tokens, else "
        "the orchestrator's).",
    )


class EnvSamplingConfig(Section):
    """One environment's (a mix entry's) training sampling, within the orchestrator's `sampling` settings. The
    temperature stays the orchestrator's: a batch is scored by the trainer at one temperature."""

    max_tokens: int | None = Field(
        None, ge=1, description="Completion tokens per model turn of this entry (default: sampling.max_tokens)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="This entry's chat template variables, for its rollouts and evals: replaces (is not merged "
        "with) sampling.chat_template_kwargs (default: that).",
    )
    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="before")
    @classmethod
    def _one_temperature(cls, value: Any) -> Any:
        # said, not "unknown key": PRIME-RL users set sampling per environment, and the temperature cannot be
        if isinstance(value, dict) and "temperature" in value:
            raise ValueError(
                "temperature: the training temperature is the orchestrator's alone (sampling.temperature), since "
                "the trainer scores a batch at one temperature; an entry may set its own sampling.max_tokens and "
                "sampling.chat_template_kwargs, and its eval.temperature"
            )
        return value


class EnvConfig(Section):
    name: str = Field("reverse_text", description="Built-in environment name or 'package.module:load_environment'.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the environment.")
    ratio: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Mix ([[orchestrator.env]] entries): this entry's sampling weight, PRIME-RL's env_ratios; each "
        "group is drawn from an entry with probability ratio / (sum of the ratios). Ignored with one environment.",
    )
    label: str | None = Field(
        None,
        min_length=1,
        description="Mix: the entry's name in step records, metrics (the env label), evals and its resume cursor "
        "(default: name); two entries of the same environment need distinct labels.",
    )
    rollouts_per_example: int | None = Field(
        None,
        ge=1,
        description="Samples per task of this entry, its advantage group (default: the orchestrator's "
        "rollouts_per_example); batch_size counts groups, so a step's samples vary with the entries drawn.",
    )
    sampling: EnvSamplingConfig = Field(
        default_factory=EnvSamplingConfig,
        description="This entry's sampling (its max_tokens, its chat_template_kwargs).",
    )
    eval: EnvEvalConfig = Field(
        default_factory=EnvEvalConfig,
        description="This entry's evaluation (whether, its tasks, k, interval, temperature, max_tokens).",
    )

    @property
    def key(self) -> str:
        """What records, metrics and progress checkpoints call this entry."""
        return self.label or self.name

    @model_validator(mode="before")
    @classmethod
    def _gyre_spelling(cls, value: Any) -> Any:
        # PRIME-RL names the environment `id` and the entry `name`: a copied entry with both was refused with "did you
        # mean 'name'" for its id, which it has (an id alone, or the same as the name, gets that suggestion)
        if isinstance(value, dict) and "id" in value and "name" in value and value["id"] != value["name"]:
            raise ValueError(
                "write the environment as name = '...' (PRIME-RL's id); PRIME-RL's name (the entry's own name in "
                "logs) is label = '...' here"
            )
        return value


def validate_env(value: Any, handler: ValidatorFunctionWrapHandler) -> EnvConfig | list[EnvConfig]:
    """`env`, its errors keyed as the user wrote it (`env.0.ratio`, without the form's tag), then `check_env_mix`.
    A name alone stands for its table (`--orchestrator.env arithmetic`, `env = ["arithmetic", "reverse_text"]`): it
    was refused as "Input should be a valid dictionary", which named neither `env.name` nor the table form."""
    if isinstance(value, str):
        value = {"name": value}
    elif isinstance(value, list):
        value = [{"name": entry} if isinstance(entry, str) else entry for entry in value]
    try:
        env = handler(value)
    except ValidationError as e:
        errors = [{"type": err["type"], "input": err["input"], **({"ctx": err["ctx"]} if "ctx" in err else {}),
                   "loc": tuple(part for part in err["loc"] if part not in ("table", "entries"))}
                  for err in e.errors()]  # fmt: skip
        raise ValidationError.from_exception_data(e.title, errors) from None
    return check_env_mix(env)


# One table, or a mix's entries: told apart by the value's shape, so an error names one form's key (`env.1.ratio`),
# not both forms' ("Input should be a valid dictionary" beside the list entry's own error)
EnvOrMix = Annotated[
    Union[Annotated[EnvConfig, Tag("table")], Annotated[list[EnvConfig], Tag("entries")]],  # noqa: UP007
    Discriminator(lambda value: "entries" if isinstance(value, list) else "table"),
    WrapValidator(validate_env),
]


def env_entries(env: EnvConfig | list[EnvConfig]) -> list[EnvConfig]:
    """The environments of an orchestrator: one table, or the entries of a mix ([[orchestrator.env]])."""
    return list(env) if isinstance(env, list) else [env]


def check_env_mix(env: EnvConfig | list[EnvConfig]) -> EnvConfig | list[EnvConfig]:
    """A mix has entries, each with its own label (the records, metrics and resume cursors are keyed by it)."""
    if not isinstance(env, list):
        return env
    if not env:
        raise ValueError("an empty [[orchestrator.env]] list: give at least one environment (name = '...')")
    seen: dict[str, int] = {}
    for i, entry in enumerate(env):
        if entry.key in seen:
            j = seen[entry.key]
            raise ValueError(
                f"entries {j} and {i} are both called {entry.key!r}: give them distinct labels (env.{i}.label = "
                "'...'), which name each one in step records, metrics, evals and its resume cursor"
            )
        seen[entry.key] = i
    return env


def check_evaluated(env: EnvConfig | list[EnvConfig], why: str) -> None:
    """An evaluation asked for (`why`) needs an entry with eval.enabled: with none it silently evaluated nothing."""
    entries = env_entries(env)
    if not any(entry.eval.enabled for entry in entries):
        key, which = ("env", "entry of the mix") if isinstance(env, list) else ("env.eval.enabled", "environment")
        raise ValueError(
            f"{key}: every {which} has eval.enabled = false, so {why} would evaluate nothing: enable one"
            + (", or leave eval.interval unset" if why.startswith("eval.interval") else "")
        )
