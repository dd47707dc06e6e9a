"""Turn `argv` into a validated config model.

Sources, highest priority first:

1. CLI options ``--a.b value`` / ``--a.b=value`` (kebab or snake case; a bare ``--flag`` means true),
   then section files ``--a @ file.toml`` (the file is table ``a``: PRIME-RL's ``rl --trainer @ trainer.toml``),
2. TOML files given as ``@ file.toml`` (several allowed, merged left to right),
3. environment variables ``GYRE_A__B`` (handled by pydantic-settings, see :class:`GyreSettings`),
4. field defaults.

A secret (an API key, a token, a password) can also be read from a file: its ``<key>_file`` companion
(:func:`secret_file`) names the file, e.g. a mounted Kubernetes Secret, so the value never travels in an
environment variable that every child process inherits.

Every error is a ConfigError naming the offending key (its wording: `gyre.config.mistakes`);
`gyre.config.command_line.parse_or_exit` prints it and exits with status 2, as argparse does for usage errors.
This module holds the settings classes (Section, GyreSettings and their environment sources), the sources read and
merged (`collect`) and `load_config`.
"""

from __future__ import annotations

import json
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from gyre.config.fields import (
    import_config_model,
    number_only,
    option_type,
    plain_list,
    section_model,
    type_name,
    unannotated,
)
from gyre.config.mistakes import ConfigError, format_validation_error
from gyre.config.toml_io import read_toml

T = TypeVar("T", bound=BaseModel)


SECRET_FILE_FOR = "secret_file_for"  # json_schema_extra key of a `<key>_file` field: the key it fills


def secret_file(of: str) -> Any:
    """The `<of>_file` companion of secret field `of`: a path whose text becomes `of` when the config is
    loaded (trailing newlines dropped: `kubectl create secret --from-file` keeps one)."""
    return Field(
        None,
        description=f"Read {of} from this file (e.g. a mounted Kubernetes Secret) instead of setting it; "
        "trailing newlines are dropped.",
        json_schema_extra={SECRET_FILE_FOR: of},
    )


def reveal(secret: SecretStr | None) -> str | None:
    """A secret's text, for the one client that sends it (SecretStr keeps it out of every repr, dump and log)."""
    return None if secret is None else secret.get_secret_value()


def read_secret_files(cls: type[BaseModel], data: Any) -> Any:
    """Replace each set `<key>_file` of `data` (a section's raw values) by the file's text under `<key>`."""
    if not isinstance(data, dict):
        return data
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        target, path = extra.get(SECRET_FILE_FOR), data.get(name)
        if not target or path in (None, ""):
            continue
        if data.get(target) not in (None, ""):
            raise ValueError(f"set {target} or {name}, not both")
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{name} = {str(path)!r}: cannot read the file ({e.strerror or e})") from None
        data = {**data, target: text.rstrip("\n"), name: None}
    return data


def _no_lax_value(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """Values pydantic read as something else, refused naming the key. A TOML `true`/`false` in a number key: lax
    mode took it as 1 or 0, so `lr = true` trained at a learning rate of 1.0 and `max_steps = true` ran one step
    (options and GYRE_ variables are text, already refused). An empty path key (`--output-dir "$DIR"` with DIR
    unset): Path("") is ".", and the run wrote its weights, checkpoints and logs into the current folder."""
    field = cls.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and number_only(field.annotation):
        raise ValueError(f"Input should be a number, not {str(value).lower()}")
    if field is not None and unannotated(field.annotation) is Path and isinstance(value, str) and not value.strip():
        raise ValueError("an empty path (it would be the current folder); give a folder")
    # An empty text key or list entry (`GYRE_TRAINER__LORA__TARGET_MODULES=` is the list [""], `--model.name "$M"`
    # with M unset): it passed validation and the run failed later with a library's traceback (peft, transformers)
    # that named no key. Optional keys are left alone: None is their "unset", and a chart may render one as "".
    annotation = unannotated(field.annotation) if field is not None else None
    if annotation is str and isinstance(value, str) and not value.strip():
        raise ValueError(f"an empty value {value!r}; give one or leave the key out for its default")
    if typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,) and isinstance(value, list):
        blank = [i for i, entry in enumerate(value) if isinstance(entry, str) and not entry.strip()]
        if blank:
            raise ValueError(
                f'entry {blank[0]} of {value!r} is empty (an empty variable or option gives [""]); '
                "give the entries, or leave the key out for its default"
            )
    return value


class Section(BaseModel):
    """A nested config section: unknown keys are errors, defaults are validated, `<key>_file` fields
    (:func:`secret_file`) read their secret from a file."""

    # allow_inf_nan=False: `inf`/`nan` in a float key (a temperature, lr, timeout, LoRA alpha) was accepted and the
    # run sampled uniform noise, trained NaN weights or waited for ever; a key where inf means "no bound" says so
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)
    # {key: the file it was read from}: kept (not dumped) so that a service can read a Secret rotated in place again
    _secret_files: dict[str, Path] = PrivateAttr(default_factory=dict)
    _refuse_lax_values = field_validator("*", mode="before")(classmethod(_no_lax_value))

    @model_validator(mode="wrap")
    @classmethod
    def _read_secret_files(cls, data: Any, handler: Any) -> Any:
        files = {}
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
                if extra.get(SECRET_FILE_FOR) and data.get(name) not in (None, ""):
                    files[extra[SECRET_FILE_FOR]] = Path(data[name])
        section = handler(read_secret_files(cls, data))
        if files:
            section._secret_files = files
        return section

    def reread_secret(self, key: str) -> Any:
        """`key` read again from the `<key>_file` it was loaded from (the kubelet rewrites a mounted Secret that is
        updated in place); None when it was not read from a file. ValueError naming the setting when the file can
        no longer be read or is empty."""
        path = self._secret_files.get(key)
        if path is None:
            return None
        try:
            text = path.read_text().rstrip("\n")
        except OSError as e:
            raise ValueError(f"{key}_file = {str(path)!r}: cannot read the file ({e.strerror or e})") from None
        if not text.strip():
            raise ValueError(f"{key}_file = {str(path)!r}: the file is empty")
        return text


class GyreSettings(BaseSettings):
    """Root of a service config: CLI/TOML values arrive as init kwargs, then env, then defaults."""

    model_config = SettingsConfigDict(
        env_prefix="GYRE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        case_sensitive=False,
        allow_inf_nan=False,  # as Section's
    )
    # parse_or_exit refuses a GYRE_ variable that looks like a key of this command but is none (check_environment_keys).
    # On for `gyre rl` and the processes (trainer, orchestrator, inference, sft: as the chart runs them, configured by
    # GYRE_ variables), where an ignored variable trains or serves with a default; not for the benches and `gyre eval`.
    check_environment: ClassVar[bool] = False
    _refuse_lax_values = field_validator("*", mode="before")(classmethod(_no_lax_value))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env files or secret dirs: one documented set of sources, nothing implicit.
        env = _PlainEnvValues(settings_cls) if isinstance(env_settings, EnvSettingsSource) else env_settings
        return (init_settings, _EnvBelowInit(settings_cls, env, init_settings))


class _PlainEnvValues(EnvSettingsSource):
    """The environment read as the command line is: a plain (non-JSON) value of a list option is its one entry
    (`GYRE_INFERENCE__URLS=http://host:8000/v1`), of a section with a shorthand key that key (`GYRE_MODEL=Qwen/...`
    is model.name). Both stopped every command with pydantic-settings' traceback ("error parsing value")."""

    def __call__(self) -> dict[str, Any]:
        # gyre rl's free-form sections hold strings (GYRE_TRAINER__LORA__TARGET_MODULES=q_proj), made lists here as
        # for a typed option: the section's own validation refused them
        return _plain_entries(self.settings_cls, super().__call__())

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            annotation = getattr(field, "annotation", None)
            if not isinstance(value, str) or value[:1] in "[{":  # meant as JSON: its error, as on the command line
                raise
            if plain_list(annotation):
                return [value]
            shorthand = getattr(section_model(annotation), SHORTHAND, None)
            if isinstance(shorthand, str):
                return {shorthand: value}
            raise


class _EnvBelowInit(PydanticBaseSettingsSource):
    """The environment's values, less the secrets that CLI options or TOML files set: `<key>` and its
    `<key>_file` are one setting, so a TOML's password (what `gyre rl` writes for its children) beats an
    environment's `password_file` exactly as it beats an environment's `password`."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource, init: Any):
        super().__init__(settings_cls)
        self.env, self.init = env, init

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ gives the whole dict

    def __call__(self) -> dict[str, Any]:
        return _drop_secrets_set_above(self.settings_cls, self.env(), getattr(self.init, "init_kwargs", {}))


def _drop_secrets_set_above(model: type[BaseModel], lower: dict, higher: dict) -> dict:
    out = dict(lower)
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        target = extra.get(SECRET_FILE_FOR)
        if target and any(higher.get(k) not in (None, "") for k in (name, target)):
            out.pop(name, None)
            out.pop(target, None)
        sub = section_model(field.annotation)
        if sub is not None and isinstance(out.get(name), dict) and isinstance(higher.get(name), dict):
            out[name] = _drop_secrets_set_above(sub, out[name], higher[name])
    return out


class HelpRequested(Exception):  # noqa: N818 - control flow, not an error
    pass


class BareFlag(str):
    """The value of an option given without one (`--fresh`): true, but only for an on/off option
    (:func:`check_bare_flags`); `--output-dir` with its value forgotten must not become a folder "true"."""


def deep_merge(base: dict, override: dict, _at: str = "") -> dict:
    """Merge ``override`` into a copy of ``base``; nested tables merge, everything else replaces. A table over a list
    of tables sets entries by index (`{"1": {...}}`), else is refused (ConfigError)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, f"{_at}{key}.")
        elif _indexes(value, out.get(key)):
            # `@ mix.toml --orchestrator.env.1.ratio 2` (PRIME-RL's `--orchestrator.env.0.args.x`): the dotted option
            # sets that entry's key; it replaced the whole list by {"1": {...}}, "unknown key 'env.1'"
            entries = list(out[key])
            for index, entry in value.items():
                entries[int(index)] = deep_merge(entries[int(index)], entry, f"{_at}{key}.{index}.")
            out[key] = entries
        elif isinstance(value, dict) and value and _tables(out.get(key)):
            # `--orchestrator.env.args.x 1` over a mix ([[orchestrator.env]]) replaced the whole mix by one environment
            # (the default, reverse_text: its name was not given), silently
            entries = out[key]
            raise ConfigError(
                f"config key '{_at}{key}': is a list of {len(entries)} tables ([[{_at}{key}]] entries); set one "
                f"entry's keys by its index (--{_at}{key}.0.{next(iter(value))} ...), or give the whole list "
                f"(--{_at}{key} '[...]', JSON), not a table"
            )
        elif isinstance(value, BareFlag) and isinstance(out.get(key), dict):
            # `@ exp.toml --ckpt` turns the file's [ckpt] on; it replaced the table (its interval went back to 1).
            # Still a BareFlag: check_bare_flags refuses it for a section without `enabled`
            out[key] = {**out[key], "enabled": value}
        else:
            out[key] = value
    return out


def _tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(entry, dict) for entry in value)


def _indexes(value: Any, entries: Any) -> bool:
    """`value` sets keys of entries of the list of tables `entries` by their index ({"1": {"ratio": 2}})."""
    return (isinstance(value, dict) and isinstance(entries, list) and bool(value)
            and all(k.isdigit() and int(k) < len(entries) and isinstance(entries[int(k)], dict)
                    and isinstance(v, dict) for k, v in value.items()))  # fmt: skip


def _cli_value(raw: str, name: str) -> Any:
    # Scalars stay strings so pydantic coerces them to the field's type ("3" -> 3, "true" -> True);
    # only structured literals are parsed here.
    if raw.lower() in ("none", "null"):
        return None
    if raw.startswith(("[", "{")):  # not raw[:1] in "[{": "" is in every string, and an empty value crashed below
        try:
            return json.loads(raw)
        except json.JSONDecodeError as json_error:
            try:
                return tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                # the key, and JSON's reason: the message named neither the option nor what was expected, and
                # TOML's reason ("Expected '=' after a key") misled, as the docs ask for JSON
                key, example = name.replace("-", "_"), "[1, 2]" if raw[0] == "[" else '{"a": 1}'
                raise ConfigError(
                    f"config key '{key}': cannot parse {raw!r} as JSON ({json_error}); lists and tables are JSON, "
                    f"quoted for the shell: --{name} '{example}'"
                ) from None
    return raw


def _set_nested(target: dict, dotted: str, value: Any) -> None:
    parts = [p.replace("-", "_") for p in dotted.split(".")]
    if not all(parts):
        raise ConfigError(f"bad option name --{dotted}")
    node = target
    for part in parts[:-1]:
        if node.get(part) == "true":  # `--ckpt --ckpt.interval 2`: the bare flag means {enabled = true}
            node[part] = {"enabled": True}
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"option --{dotted} conflicts with a value given for {part}")
    if value == "true" and isinstance(node.get(parts[-1]), dict):
        node[parts[-1]]["enabled"] = True
    else:
        node[parts[-1]] = value


def read_section(path: str, model: type[BaseModel] | None) -> dict:
    """``file.toml#name``: the ``[name]`` table of an experiment file plus the shared top-level keys.

    An experiment file (what `gyre rl` and the Helm chart's ConfigMap hold) sets shared keys once at
    top level and per-service keys in ``[inference]``, ``[trainer]``, ``[orchestrator]``. A service
    reads its own table; shared keys are inherited where the service's config (`model`) has such a key,
    in shared tables too: `gyre rl`'s own ``model.init_preset`` is not the trainer's to refuse.
    """
    file, _, section = path.partition("#")
    data = read_toml(file)
    if not section:
        foreign = sorted(k for k, v in data.items() if isinstance(v, dict) and k in SECTION_NAMES)
        if model is not None and any(k not in model.model_fields for k in foreign):
            # every key of it was "unknown key", one line each: say what the file is and how to read it
            tables = ", ".join(f"[{k}]" for k in foreign)
            own = EXPERIMENT_TABLES.get(model.__name__)
            listed = ", ".join("#" + k for k in foreign)
            how = f"'@ {file}#{own}'" if own in foreign else f"'@ {file}#<table>' ({listed})"
            raise ConfigError(
                f"{file} is an experiment file (its {tables} tables are gyre rl's): read this command's table of it "
                f"with {how}, which adds the file's shared top-level keys; or run the experiment with gyre rl"
            )
        return data
    if section not in data and section not in ("inference", "trainer", "orchestrator", "sft"):
        raise ConfigError(f"{file}: no [{section}] table")
    shared = {k: v for k, v in data.items() if not isinstance(v, dict) or k not in SECTION_NAMES}
    table = data.get(section, {})
    if model is not None:
        shared = _inherited(model, shared)
        if (other := getattr(model, "reads_sections_of", {}).get(section)) is not None:
            table = _less_keys_of(model, import_config_model(other), table)
    # each part's `model = "x"` as {name = "x"} before they merge: the table's replaced the shared [model] (its dtype
    # was lost, silently), as a file's did an option's before ede93f8
    return deep_merge(expand_shorthands(model, shared), expand_shorthands(model, table))


def _less_keys_of(model: type[BaseModel], other: type[BaseModel], values: dict) -> dict:
    """`values` (a table of `other`'s config) without the keys `other` has and `model` has not: `gyre eval @
    exp.toml#orchestrator` reads the run's environment and eval settings, not its batch_size (each was "unknown
    key"). A key neither has stays, to be refused by name."""
    out = {}
    for key, value in values.items():
        mine, theirs = model.model_fields.get(key), other.model_fields.get(key)
        if mine is None:
            if theirs is None:
                out[key] = value
            continue
        sub, other_sub = section_model(mine.annotation), section_model(theirs.annotation) if theirs else None
        use = sub is not None and other_sub is not None and isinstance(value, dict)
        out[key] = _less_keys_of(sub, other_sub, value) if use else value
    return out


def _inherited(model: type[BaseModel], shared: dict) -> dict:
    out = {}
    for key, value in shared.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        sub = section_model(field.annotation)
        out[key] = _inherited(sub, value) if sub is not None and isinstance(value, dict) else value
    return out


SECTION_NAMES = {"inference", "trainer", "orchestrator", "sft"}
# The experiment table each command's config is read from (by its class name: gyre.config imports no service).
EXPERIMENT_TABLES = {"TrainerConfig": "trainer", "InferenceConfig": "inference", "OrchestratorConfig": "orchestrator",
                     "GyreEvalConfig": "orchestrator"}  # fmt: skip


def collect(argv: list[str], model: type[BaseModel] | None = None) -> dict:
    """Merge ``@ file.toml`` arguments and ``--a.b value`` options into one nested dict."""
    files: dict = {}
    tables: dict = {}  # `--trainer @ trainer.toml`: a file as one section's table, between files and options
    cli: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            raise HelpRequested
        if arg == "@" or (arg.startswith("@") and len(arg) > 1):
            path = arg[1:] if arg != "@" else (argv[i + 1] if i + 1 < len(argv) else None)
            if not path:
                raise ConfigError("'@' must be followed by a TOML file path")
            files = deep_merge(files, expand_shorthands(model, read_section(path, model)))
            i += 1 if arg != "@" else 2
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r} (options look like --a.b value; files like @ x.toml)")
        name, eq, raw = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.startswith("@") and _is_table(model, name):
                # PRIME-RL's `rl --trainer @ trainer.toml --orchestrator @ orch.toml`: was "config key 'trainer': the
                # option needs a value", and the file was read as the whole config
                path = nxt[1:] if nxt != "@" else (argv[i + 2] if i + 2 < len(argv) else None)
                if not path:
                    raise ConfigError(f"'--{name} @' must be followed by a TOML file path")
                # merged, as a JSON table is: `--trainer.optim @ optim.toml --trainer @ trainer.toml` (or one section
                # given twice) lost the first file's keys, silently
                given: dict = {}
                _set_nested(given, name, _read_table(path))
                tables = deep_merge(tables, expand_shorthands(model, given))
                i += 2 if nxt != "@" else 3
                continue
            if nxt is None or nxt.startswith("--") or nxt.startswith("@"):
                _set_nested(cli, name, BareFlag("true"))
                i += 1
                continue
            raw, i = nxt, i + 2
        else:
            i += 1
        value = _cli_value(raw, name)
        if isinstance(value, dict):
            # a table given whole (`--model '{"dtype": "bfloat16"}' --model.name X`, as the chart writes a server's
            # args) merges with that table's other options, in either order: it is not the section's shorthand
            # (model.name = {dtype}: the dtype was lost), nor does it replace the keys given before it
            given: dict = {}
            _set_nested(given, name, value)
            cli = deep_merge(cli, given)
        else:
            if isinstance(value, str) and plain_list(option_type(model, name, sections=True)):
                # `--inference.urls http://host:8000/v1`, as vLLM and PRIME-RL users write one entry: the list of
                # it. Not split at commas (a URL's query or a path may hold one): several entries are JSON
                value = [value]
            _set_nested(cli, _shorthand_key(model, name), value)
    return deep_merge(deep_merge(files, tables), cli)


def _plain_entries(model: type[BaseModel], values: dict, prefix: str = "") -> dict:
    """`values` with each string set for a list option of plain values (:func:`plain_list`) as its one entry."""
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, dict):
            out[key] = _plain_entries(model, value, f"{prefix}{key}.")
        elif isinstance(value, str) and plain_list(option_type(model, prefix + key, sections=True)):
            out[key] = [value]
    return out


SHORTHAND = "shorthand"  # a Section's ClassVar: the key a plain value given for the whole section sets


def expand_shorthands(model: type[BaseModel] | None, values: dict) -> dict:
    """`values` with each plain string given for a section that has a shorthand key as that key's table: `model =
    "x"` is `model = {name = "x"}` (ModelConfig). Done before sources merge: a file's `model = "x"` and an option's
    `--model.dtype` merged into `{dtype}` alone, and the name was silently lost."""
    if model is None or not isinstance(values, dict):
        return values
    out = dict(values)
    for key, value in values.items():
        field = model.model_fields.get(key)
        sub = section_model(field.annotation) if field is not None else None
        if sub is None:
            continue
        if isinstance(value, str) and not isinstance(value, BareFlag) and getattr(sub, SHORTHAND, None):
            out[key] = {getattr(sub, SHORTHAND): value}
        elif isinstance(value, dict):
            out[key] = expand_shorthands(sub, value)
    return out


def _shorthand_key(model: type[BaseModel] | None, dotted: str) -> str:
    """`--model x` sets `model.name` (the section's shorthand key); any other option its own key."""
    shorthand = getattr(option_type(model, dotted), SHORTHAND, None)
    return f"{dotted}.{shorthand}" if isinstance(shorthand, str) else dotted


def _is_table(model: type[BaseModel] | None, dotted: str) -> bool:
    """Whether option `--dotted` of `model` is a section or table (a file can be its value), not an on/off flag."""
    node = option_type(model, dotted, sections=True)  # gyre rl's `--trainer.optim @ optim.toml` too
    return (isinstance(node, type) and issubclass(node, BaseModel)) or typing.get_origin(node) is dict or node is dict


def _read_table(path: str) -> dict:
    """The table a `--section @ file.toml` option gives: the whole file, or `file.toml#name`'s [name] table."""
    file, _, name = path.partition("#")
    data = read_toml(file)
    if name and not isinstance(data.get(name), dict):
        raise ConfigError(f"{file}: no [{name}] table")
    return data[name] if name else data


def check_bare_flags(model: type[BaseModel], values: dict, prefix: str = "") -> None:
    """A bare `--flag` sets an on/off option, or turns on a section that has `enabled` (`--ckpt`, `--wandb`:
    only the sections whose validator took it did, the others failed with "Input should be a valid dictionary");
    any other option needs a value. Raises ConfigError naming the key."""
    for name, value in list(values.items()):
        field = model.model_fields.get(name)
        if field is None:
            continue  # unknown keys are pydantic's error, with its suggestion
        sub = section_model(field.annotation)
        if sub is not None:
            bare = isinstance(value, BareFlag) or (
                isinstance(value, dict) and isinstance(value.get("enabled"), BareFlag)
            )
            if bare and "enabled" not in sub.model_fields:
                raise ConfigError(f"config key '{prefix}{name}': a section, not an on/off option: set one of its "
                                  "keys instead (`--help` lists them)")  # fmt: skip
            if isinstance(value, dict):
                check_bare_flags(sub, value, f"{prefix}{name}.")
            elif bare:
                values[name] = {"enabled": True}
            continue
        annotation = field.annotation
        if (
            isinstance(value, BareFlag)
            and annotation is not Any
            and bool not in (annotation, *typing.get_args(annotation))
        ):
            raise ConfigError(
                f"config key '{prefix}{name}': the option needs a value ({type_name(annotation)}); a bare "
                "--flag means true only for on/off options"
            )


def load_config(cls: type[T], argv: list[str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from argv (CLI + TOML), the environment and defaults. Raises ConfigError."""
    values = deep_merge(collect(list(argv or []), cls), overrides)
    check_bare_flags(cls, values)
    try:
        return cls(**values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(cls, e)) from None
    except SettingsError as e:  # a GYRE_ variable's table or list that is not JSON: was a traceback
        found = re.search(r'field "([^"]+)"', str(e))
        raise ConfigError(
            f"config key {found.group(1) if found else '<environment>'!r}: cannot parse its GYRE_ environment "
            f"variable as JSON ({e.__cause__ or e}); lists and tables set that way are JSON"
        ) from None
