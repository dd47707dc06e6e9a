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

Every error names the offending key; :func:`parse_or_exit` prints it and exits with status 2,
as argparse does for usage errors.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import re
import sys
import tomllib
import types
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


def _number_only(annotation: Any) -> bool:
    """An int or float key (also optional, or one of several number types), never a bool one."""
    annotation = _unannotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [arg for arg in map(_unannotated, typing.get_args(annotation)) if arg is not type(None)]
    else:
        kinds = [annotation]
    return bool(kinds) and all(kind in (int, float) for kind in kinds)


def _no_lax_value(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """Values pydantic read as something else, refused naming the key. A TOML `true`/`false` in a number key: lax
    mode took it as 1 or 0, so `lr = true` trained at a learning rate of 1.0 and `max_steps = true` ran one step
    (options and GYRE_ variables are text, already refused). An empty path key (`--output-dir "$DIR"` with DIR
    unset): Path("") is ".", and the run wrote its weights, checkpoints and logs into the current folder."""
    field = cls.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and _number_only(field.annotation):
        raise ValueError(f"Input should be a number, not {str(value).lower()}")
    if field is not None and _unannotated(field.annotation) is Path and isinstance(value, str) and not value.strip():
        raise ValueError("an empty path (it would be the current folder); give a folder")
    # An empty text key or list entry (`GYRE_TRAINER__LORA__TARGET_MODULES=` is the list [""], `--model.name "$M"`
    # with M unset): it passed validation and the run failed later with a library's traceback (peft, transformers)
    # that named no key. Optional keys are left alone: None is their "unset", and a chart may render one as "".
    annotation = _unannotated(field.annotation) if field is not None else None
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
            if _plain_list(annotation):
                return [value]
            shorthand = getattr(_model_type(annotation), SHORTHAND, None)
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
        sub = _model_type(field.annotation)
        if sub is not None and isinstance(out.get(name), dict) and isinstance(higher.get(name), dict):
            out[name] = _drop_secrets_set_above(sub, out[name], higher[name])
    return out


class ConfigError(ValueError):
    """A config source or value is invalid; the message names the key."""


class HelpRequested(Exception):  # noqa: N818 - control flow, not an error
    pass


def under_section(error: ConfigError, section: str) -> ConfigError:
    """`error` of a section's own config (`gyre rl`'s [trainer], sft.args) with every key it names, the
    suggested ones too, written as the larger config's key (`optim.lr` -> `trainer.optim.lr`)."""
    text = str(error).replace("config key '", f"config key '{section}.")
    text = re.sub(r"(PRIME-RL's [\w.]+ is ')", rf"\g<1>{section}.", text)  # `_prime_rl_key`'s answer
    text = re.sub(
        r"; '([\w.]+)' is one table here, not a list: drop the index \(e.g. '",
        rf"; '{section}.\g<1>' is one table here, not a list: drop the index (e.g. '{section}.",
        text,
    )

    def each(meant: re.Match) -> str:  # every key of "did you mean 'a' or 'b'?" (the second was left unprefixed)
        return "did you mean '" + "' or '".join(f"{section}.{key}" for key in meant.group(1).split("' or '")) + "'?"

    return ConfigError(re.sub(r"did you mean '(.*?)'\?", each, text))


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


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except OSError as e:  # `@ configs` (a folder), a file not readable: a traceback
        raise ConfigError(f"config file {path}: cannot read it: {e.strerror or e}") from e
    except UnicodeDecodeError as e:  # `@ model.safetensors`: a traceback
        raise ConfigError(f"config file {path}: not a TOML file (not UTF-8 text: {e.reason} at byte {e.start})") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


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
            table = _less_keys_of(model, _import_model(other), table)
    # each part's `model = "x"` as {name = "x"} before they merge: the table's replaced the shared [model] (its dtype
    # was lost, silently), as a file's did an option's before ede93f8
    return deep_merge(expand_shorthands(model, shared), expand_shorthands(model, table))


def _import_model(target: str) -> type[BaseModel]:
    from gyre.imports import load_callable  # a config class is a callable: one importer of "module:attribute"

    return load_callable(target, "config model")


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
        sub, other_sub = _model_type(mine.annotation), _model_type(theirs.annotation) if theirs else None
        use = sub is not None and other_sub is not None and isinstance(value, dict)
        out[key] = _less_keys_of(sub, other_sub, value) if use else value
    return out


def _inherited(model: type[BaseModel], shared: dict) -> dict:
    out = {}
    for key, value in shared.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        sub = _model_type(field.annotation)
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
            if isinstance(value, str) and _plain_list(_option_type(model, name, sections=True)):
                # `--inference.urls http://host:8000/v1`, as vLLM and PRIME-RL users write one entry: the list of
                # it. Not split at commas (a URL's query or a path may hold one): several entries are JSON
                value = [value]
            _set_nested(cli, _shorthand_key(model, name), value)
    return deep_merge(deep_merge(files, tables), cli)


def _plain_entries(model: type[BaseModel], values: dict, prefix: str = "") -> dict:
    """`values` with each string set for a list option of plain values (:func:`_plain_list`) as its one entry."""
    out = dict(values)
    for key, value in values.items():
        if isinstance(value, dict):
            out[key] = _plain_entries(model, value, f"{prefix}{key}.")
        elif isinstance(value, str) and _plain_list(_option_type(model, prefix + key, sections=True)):
            out[key] = [value]
    return out


def _plain_list(annotation: Any) -> bool:
    """Whether `annotation` is a list of plain values (`list[str]`, optional or not), not of tables or lists."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            (item,) = typing.get_args(arg) or (Any,)
            nested = {item, typing.get_origin(item)} & {list, dict}
            return _model_type(item) is None and not nested
    return False


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
        sub = _model_type(field.annotation) if field is not None else None
        if sub is None:
            continue
        if isinstance(value, str) and not isinstance(value, BareFlag) and getattr(sub, SHORTHAND, None):
            out[key] = {getattr(sub, SHORTHAND): value}
        elif isinstance(value, dict):
            out[key] = expand_shorthands(sub, value)
    return out


def _option_type(model: type[BaseModel] | None, dotted: str, sections: bool = False) -> Any:
    """The type of option `--dotted` of `model`: its section's model, else its annotation; None for no such key.
    With `sections`, through the models `model`'s free-form sections are validated as (`gyre rl`'s [trainer])."""
    node: Any = model
    walked: list[str] = []
    for part in dotted.replace("-", "_").split("."):
        target = getattr(model, "section_models", {}).get(".".join(walked)) if sections and walked else None
        node = _import_model(target) if target else node
        walked.append(part)
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return None
        node = _model_type(field.annotation) or field.annotation
    return node


def _shorthand_key(model: type[BaseModel] | None, dotted: str) -> str:
    """`--model x` sets `model.name` (the section's shorthand key); any other option its own key."""
    shorthand = getattr(_option_type(model, dotted), SHORTHAND, None)
    return f"{dotted}.{shorthand}" if isinstance(shorthand, str) else dotted


def _is_table(model: type[BaseModel] | None, dotted: str) -> bool:
    """Whether option `--dotted` of `model` is a section or table (a file can be its value), not an on/off flag."""
    node = _option_type(model, dotted, sections=True)  # gyre rl's `--trainer.optim @ optim.toml` too
    return (isinstance(node, type) and issubclass(node, BaseModel)) or typing.get_origin(node) is dict or node is dict


def _read_table(path: str) -> dict:
    """The table a `--section @ file.toml` option gives: the whole file, or `file.toml#name`'s [name] table."""
    file, _, name = path.partition("#")
    data = read_toml(file)
    if name and not isinstance(data.get(name), dict):
        raise ConfigError(f"{file}: no [{name}] table")
    return data[name] if name else data


LIST_INDEX = "#"  # a list entry's index in _all_keys: `runs.#.optim.lr`


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = _model_type(field.annotation)
        if sub is not None:
            keys += _all_keys(sub, prefix + name + ".")
        # a list of tables, or (orchestrator.env) a table or a list of them: `env.name` and `env.#.name`
        if (entry := _list_entry_model(field.annotation)) is not None:
            keys += _all_keys(entry, f"{prefix}{name}.{LIST_INDEX}.")
    return keys


def _unannotated(annotation: Any) -> Any:
    """`annotation` without its `Annotated[...]` metadata (a tagged union's members: `Annotated[Model, Tag(...)]`)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def _model_type(annotation: Any) -> type[BaseModel] | None:
    annotation = _unannotated(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in map(_unannotated, typing.get_args(annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _list_entry_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a `list[Model]` option's entries, also as a union's member (None for any other type)."""
    annotation = _unannotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(filter(None, map(_list_entry_model, typing.get_args(annotation))), None)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        item = _unannotated(item)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def check_bare_flags(model: type[BaseModel], values: dict, prefix: str = "") -> None:
    """A bare `--flag` sets an on/off option, or turns on a section that has `enabled` (`--ckpt`, `--wandb`:
    only the sections whose validator took it did, the others failed with "Input should be a valid dictionary");
    any other option needs a value. Raises ConfigError naming the key."""
    for name, value in list(values.items()):
        field = model.model_fields.get(name)
        if field is None:
            continue  # unknown keys are pydantic's error, with its suggestion
        sub = _model_type(field.annotation)
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
                f"config key '{prefix}{name}': the option needs a value ({_type_name(annotation)}); a bare "
                "--flag means true only for on/off options"
            )


# Names other frameworks (PRIME-RL, verl, TRL) give a key that Gyre names otherwise, in the same section (a tuple: the
# keys it stands for): a near miss by spelling finds the rest (async_level -> max_async_level). A synonym goes before a
# near miss, which can be another key: verl's clip_ratio_low was "did you mean 'loss.clip_ratio_c'?" (the dual clip).
KEY_SYNONYMS: dict[str, str | tuple[str, ...]] = {
    "id": "name", "env_id": "name", "learning_rate": "lr", "max_norm": "max_grad_norm", "num_steps": "max_steps",
    "total_steps": "max_steps", "max_new_tokens": "max_tokens", "max_num_seqs": "max_batch_size",
    # verl's actor keys (docs/trainer.md, "Coming from verl or PRIME-RL")
    "clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high", "clip_ratio": ("eps_low", "eps_high"),
    "loss_agg_mode": "aggregation", "kl_loss_coef": "ref_kl_coef", "kl_loss_type": "ref_kl_estimator",
    "grad_clip": "max_grad_norm", "clip_grad": "max_grad_norm", "lr_warmup_steps": "warmup_steps",
    "warmup_style": "scheduler", "lr_scheduler_type": "scheduler",
}  # fmt: skip


def _synonyms(leaf: str) -> tuple[str, ...]:
    meant = KEY_SYNONYMS.get(leaf, ())
    return (meant,) if isinstance(meant, str) else meant


# PRIME-RL keys that Gyre has in another place or shape (docs/local.md, "Coming from PRIME-RL"), by their dotted tail
# in the config an unknown key was found in: (the key to write, found among the config's keys; what it is).
PRIME_RL_KEYS = {
    "wandb.name": ("run_id", "one W&B run per service, named {run_id}-{service}; wandb.group groups them"),
    "client": ("inference.urls", "client.base_url; the table's other keys are beside it: api_key_file, timeout_s"),
    "client.base_url": ("inference.urls", "the servers' root or /v1 URLs, a list"),
    "client.timeout": ("inference.timeout_s", "one request's timeout"),
    "model.lora": ("lora", "the trainer's LoRA adapter: rank, alpha, dropout, target_modules"),
    "clean": (
        "fresh",
        "it deletes the previous run in output_dir first; without it the same command continues "
        "that run, where PRIME-RL's rl cleaned by default",
    ),
}


# what other tools call their config file option: `--config x.toml` was "unknown key" alone
CONFIG_FILE_KEYS = ("config", "config_file", "config_path", "configs")


def _prime_rl_key(key: str, known: list[str]) -> str | None:
    """What to write for PRIME-RL's `key` (an unknown dotted key of a config whose keys are `known`), or None."""
    parts = key.split(".")
    for start in range(len(parts)):
        tail = ".".join(parts[start:])
        if tail not in PRIME_RL_KEYS:
            continue
        target, what = PRIME_RL_KEYS[tail]
        where = ".".join(parts[:start])
        # the one in the key's own section, else the shallowest anywhere (gyre rl: orchestrator.inference.urls)
        found = sorted((k for k in known if k == target or k.endswith(f".{target}")),
                       key=lambda k: (k != f"{where}.{target}", k.count(".")))  # fmt: skip
        if found:
            return f"PRIME-RL's {tail} is '{found[0]}' here ({what})"
    return None


def _suggestion(key: str, known: list[str]) -> tuple[str | None, str]:
    """(the known key `key` most likely means, else None; else a listing of its section's keys, or ""), for an
    unknown `key`. In order: a near miss in its own section (or a synonym, KEY_SYNONYMS), a near miss of the whole
    dotted key that is not a section holding it (`orchestrator.env.id` was "did you mean 'orchestrator.env'?"), the
    same name in another section (a key set in the wrong place: a top-level `seq_len`), else the section's keys."""
    parent, _, leaf = key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    siblings = [k[len(prefix) :] for k in known if k.startswith(prefix) and "." not in k[len(prefix) :]]
    if leaf.isdigit() and parent and siblings:
        # PRIME-RL's `--orchestrator.env.0.args.x` (its env is always a list) on a single [orchestrator.env] table:
        # "env has: name, args, ..." did not say that the index was the mistake
        return None, (f"; '{parent}' is one table here, not a list: drop the index (e.g. '{parent}.{siblings[0]}'), "
                      "or give it as a list of tables ([[...]] entries) to index them")  # fmt: skip
    meant = [prefix + name for name in _synonyms(leaf) if name in siblings]
    if meant:
        return "' or '".join(meant), ""
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.7)
    if near:
        return prefix + near[0], ""
    # not a sibling (their common prefix made `wandb.name` "mean" 'wandb.mode'), nor a section holding the key
    close = [k for k in difflib.get_close_matches(key, known, n=3)
             if not key.startswith(k + ".") and k.rpartition(".")[0] != parent]  # fmt: skip
    if close:
        return close[0], ""
    if not parent or not siblings:  # a top-level key or one under no section: maybe set in the wrong place
        leaves = {k: k.rpartition(".")[2] for k in known if LIST_INDEX not in k}
        same = [k for k, name in leaves.items() if name in (leaf, *_synonyms(leaf))]
        near = difflib.get_close_matches(leaf, set(leaves.values()), n=1, cutoff=0.8)
        same = same or [k for k, name in leaves.items() if near and name == near[0]]
        if same:
            depth = min(k.count(".") for k in same)  # the shallowest: `server.port` and `metrics.port` for a `port`
            return "' or '".join([k for k in same if k.count(".") == depth][:3]), ""
    if parent and 0 < len(siblings) <= 12:
        return None, f"; {parent} has: {', '.join(siblings)}"
    return None, ""


def _section_keys(cls: type[BaseModel]) -> list[str]:
    """The keys of `cls`'s free-form sections that another model validates (`gyre rl`'s [trainer] is a
    `gyre trainer` config: `section_models`), prefixed: a key set at the wrong level is suggested where it lives."""
    keys = []
    for name, target in getattr(cls, "section_models", {}).items():
        keys += _all_keys(_import_model(target), f"{name}.")
    return keys


def format_validation_error(cls: type[BaseModel], err: ValidationError) -> str:
    lines = []
    known = _all_keys(cls)
    moved: dict[str, str] = getattr(cls, "moved_keys", {})  # old dotted key -> the key that replaced it
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        # a validator's own reason needs no "Value error, " before it (pydantic's wrapping, noise to a user)
        msg = e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" and e["loc"] else e["msg"]
        if e["type"] == "extra_forbidden" and key in moved:
            # "config key" twice: a caller prefixing keys (gyre rl: "inference.") prefixes the new one too
            msg = f"this key was removed; set config key {moved[key]!r} instead"
        elif e["type"] == "extra_forbidden":
            # matched with its list indices as in `known` (`runs.0.optim.lrr` once got 'optim.lr'), then put back
            indices = [str(p) for p in e["loc"] if isinstance(p, int)]
            generic = ".".join(LIST_INDEX if isinstance(p, int) else str(p) for p in e["loc"])
            close, listing = _suggestion(generic, known + _section_keys(cls))
            if close and close.count(LIST_INDEX) == len(indices):
                parts = close.split(LIST_INDEX)
                close = "".join(part + index for part, index in zip(parts, [*indices, ""], strict=True))
            elif close:
                close = None
            msg = "unknown key" + (f" (did you mean '{close}'?)" if close else listing)  # close: "a' or 'b" too
            if not close and (prime := _prime_rl_key(generic, known + _section_keys(cls))):
                msg = f"unknown key; {prime}"  # its listing named no key of it (wandb has: enabled, project...)
            if generic in CONFIG_FILE_KEYS:  # `--config x.toml` (other tools' habit) said no more, or 'log.file'
                msg = "unknown key; a config file is read with '@': @ x.toml (several merge left to right)"
        elif not e["loc"] and e["type"] == "value_error":
            # a check across keys (a model validator) says "some.key: why": name that key as field errors do
            name, sep, why = msg.removeprefix("Value error, ").partition(": ")
            generic = ".".join(LIST_INDEX if part.isdigit() else part for part in name.split("."))
            if sep and (name in known or generic in known):  # a list entry's key too (`env.1.rollouts_per_example`)
                key, msg = name, why
        elif e["type"] == "value_error" and not isinstance(e.get("input"), str | int | float | bool | None):
            msg = msg.removeprefix("Value error, ")  # the reason says it; a list or table input repeated is noise
        elif e["type"] == "list_type" and isinstance(e.get("input"), dict):
            # `--servers.0.model x`: dotted options build tables, never list entries; say how a list is written
            msg += f"; dotted options set table keys, not list entries: set the whole list, --{key} '[...]' (JSON)"
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
            if e["type"] == "list_type" and isinstance(e["input"], str):  # `--inference.urls URL`
                listed = json.dumps([e["input"]])
                msg += f"; write a list: {key.rpartition('.')[2]} = {listed} in TOML, --{key} '{listed}' as an option"
        lines.append(f"config key {key!r}: {msg}")
    return "\n".join(lines)


ENV_PREFIX = "GYRE_"


def check_environment_keys(cls: type[BaseModel], environ: typing.Mapping[str, str]) -> None:
    """ConfigError naming the variable for a `GYRE_...` environment variable that looks like a key of `cls` but
    is none: pydantic-settings reads only the variables that match a field, so `GYRE_MAX_STEPZ=3` or
    `GYRE_TRAINER_OPTIM__LR=1e-4` (one `_` too few) were silently ignored and the run went on with the defaults.
    Looks like a key: it has the nested delimiter `__` (only config keys have it) or is a near miss of a
    top-level key. Other `GYRE_` variables (`GYRE_CACHE_DIR`, a user's `GYRE_API_KEY`) are not config keys."""
    fields = list(cls.model_fields)
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        head = key.split("__")[0]
        if head in fields:
            continue  # a key (a typo below it is the section's own "unknown key" error)
        near = difflib.get_close_matches(head, fields, n=1, cutoff=0.85)
        if "__" not in key and not near:
            # gyre rl: a key of one of its sections set at top level (GYRE_SEQ_LEN, as PRIME-RL's shared seq_len) was
            # not a config key, and ignored; an exact name only (GYRE_CACHE_DIR is no key anywhere), and no secret (a
            # user's own GYRE_API_KEY is not inference.auth.api_key)
            keys = _section_keys(cls)
            placed = [k for k in keys if k.rpartition(".")[2] == key and LIST_INDEX not in k]
            placed = [k for k in placed if f"{k}_file" not in keys]
            if placed:
                where = min(placed, key=lambda k: k.count("."))
                raise ConfigError(
                    f"config key {key!r}: unknown key, set by the environment variable {name} (did you mean "
                    f"{ENV_PREFIX}{where.upper().replace('.', '__')}?); nested keys are written "
                    f"{ENV_PREFIX}SECTION__KEY"
                )
            continue
        # the nearest top-level key, else `trainer_optim__lr`: a key's `__` written as `_`
        split = next((f for f in fields if head.startswith(f + "_")), None)
        guess = near[0] + key[len(head) :] if near else f"{split}__{key[len(split) + 1 :]}" if split else None
        hint = f" (did you mean {ENV_PREFIX}{guess.upper()}?)" if guess else ""
        dotted = key.replace("__", ".")
        raise ConfigError(
            f"config key {dotted!r}: unknown key, set by the environment variable {name}{hint}; nested keys are "
            f"written {ENV_PREFIX}SECTION__KEY"
        )


def name_environment_variables(message: str, environ: typing.Mapping[str, str]) -> str:
    """`message` with each `config key 'a.b'` line that an environment variable `GYRE_A__B` sets saying so: a typo
    below a section (`GYRE_TRAINER__OPTIM__LRR`) is the section's own "unknown key" error, which named the key alone,
    and the user looked for it in their command line and files."""
    names = {name.upper(): name for name in environ if name.upper().startswith(ENV_PREFIX)}

    def named(line: str) -> str:
        found = re.match(r"config key '([\w.]+)'", line)
        var = names.get(ENV_PREFIX + found.group(1).replace(".", "__").upper()) if found else None
        return f"{line} (set by the environment variable {var})" if var and var not in line else line

    return "\n".join(named(line) for line in message.split("\n"))


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


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    # module paths are noise in --help: `pydantic.types.SecretStr | None`, `list[gyre.config.endpoint.JudgeConfig]`
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Z])", "", text).replace("NoneType", "None")


def _default_repr(value: Any) -> str:
    if isinstance(value, SecretStr):
        return "<secret>"
    if isinstance(value, BaseModel):
        return ""
    return json.dumps(value, default=str)


def _section_defaults(field: Any, sub: type[BaseModel]) -> dict:
    """The keys a section's own default sets unlike its class does (`gyre sft`'s optim is
    `OptimConfig(lr=1e-3)`): --help shows the default a run gets, not the class's."""
    try:
        default, plain = field.get_default(call_default_factory=True), sub()
    except (ValidationError, TypeError):  # a section with required keys (unset by default)
        return {}
    if not isinstance(default, sub):
        return {}
    return {name: getattr(default, name) for name in sub.model_fields if getattr(default, name) != getattr(plain, name)}


def help_text(cls: type[BaseModel], prog: str, summary: str = "") -> str:
    """Every option with its type, default and description (what `--help` prints)."""
    out = [f"usage: {prog} [@ config.toml ...] [--key value ...]", ""]
    if summary or cls.__doc__:
        out += [inspect.cleandoc(summary or cls.__doc__ or ""), ""]  # a docstring's further lines: not indented
    out += [
        "Sources (highest first): --options > @ TOML files (merged left to right) > env GYRE_A__B > defaults.",
        'Options accept kebab or snake case; a bare --flag means true; lists/tables as JSON ([1,2], {"a": 1});',
        "a list of plain values also takes one value as its one entry (--key x is --key '[\"x\"]'), never split.",
        "'@ experiment.toml#name' reads the [name] table of an experiment file plus its shared top-level keys;",
        "'--section @ file.toml' reads a file as one section's table (gyre rl --trainer @ trainer.toml).",
        "",
    ]

    def walk(model: type[BaseModel], prefix: str, depth: int, flag: str = "--", defaults: dict | None = None) -> None:
        for name, field in model.model_fields.items():
            sub = _model_type(field.annotation)
            desc = (field.description or "").strip()
            if sub is not None:
                # an optional section (trainer.lora, orchestrator.teacher) is unset until one of its keys is set: its
                # "(required)" keys (teacher.url) are required only then
                off = "(optional, unset by default) " if field.default is None else ""
                if isinstance(short := getattr(sub, SHORTHAND, None), str):  # `--model X`: said nowhere
                    given = f"--{prefix}{name} X" if flag else f'{name} = "X"'
                    desc = f"{desc.rstrip('.')} ({given} sets {prefix}{name}.{short}).".lstrip()
                out.append(f"{'  ' * depth}[{prefix}{name}] {off}{desc}")
                walk(sub, prefix + name + ".", depth + 1, flag, _section_defaults(field, sub))
                continue
            opt = f"{'  ' * depth}{flag}{prefix}{name} {_type_name(field.annotation)}"
            if field.is_required():
                out.append(f"{opt}  (required)")
            else:
                default = (defaults or {}).get(name, field.get_default(call_default_factory=True))
                out.append(f"{opt}  (default: {_default_repr(default)})")
            if desc:
                out.append(f"{'  ' * depth}      {desc}")
            entry = _list_entry_model(field.annotation)
            if entry is not None:  # e.g. [[orchestrator.judges]]: the keys of one entry (set as JSON or in TOML)
                out.append(f"{'  ' * (depth + 1)}each entry ([[{prefix}{name}]] in TOML) has:")
                walk(entry, "", depth + 2, flag="")

    walk(cls, "", 0)
    return "\n".join(out)


def parse_or_exit(cls: type[T], argv: list[str] | None, prog: str, summary: str = "") -> T:
    """CLI front end: print help and exit 0, or print the error naming the key and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = load_config(cls, argv)
        if getattr(cls, "check_environment", False):
            check_environment_keys(cls, os.environ)  # a misspelt GYRE_ variable was silently ignored
        return config
    except HelpRequested:
        try:
            print(help_text(cls, prog, summary), flush=True)
        except BrokenPipeError:  # `gyre x --help | head`
            sys.stdout = None
        raise SystemExit(0) from None
    except ConfigError as e:
        message = name_environment_variables(str(e), os.environ)
        json_as = None if getattr(cls, "console_errors", False) else startup_log_format(argv, cls, os.environ)
        print_startup_error(prog, message, json_as=json_as)
        raise SystemExit(2) from None


def print_startup_error(prog: str, message: str, config: Any = None, json_as: str | None = None) -> None:
    """`{prog}: error: {message}` on stderr, for an error before logging is set up (a bad config, a missing model):
    as gyre.logging's JSON record when the command's logs are JSON (the chart's default), so a collector gets a
    record, not a line it cannot parse. JSON: `config`'s log.format (a validated config), else `json_as` (the run_id
    `startup_log_format` found, "" unset; None = text)."""
    if config is not None and getattr(getattr(config, "log", None), "format", "text") == "json":
        json_as = getattr(config, "run_id", None) or ""
    if json_as is None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return
    from gyre.logging import json_record

    print(json_record(_service_name(prog), f"{prog}: error: {message}", logger="gyre.config", run_id=json_as),
          file=sys.stderr)  # fmt: skip


def startup_log_format(argv: list[str], cls: type[BaseModel] | None, environ: typing.Mapping[str, str]) -> str | None:
    """The run_id ("" when unset) when the command's log.format is json, else None: what a start-up error is printed
    as, before logging is set up. log.format as the config would have it, from the arguments (`--log.format json`,
    an `@ file`'s [log] table) over the environment (GYRE_LOG__FORMAT, which the chart sets), read also from a
    config that fails to validate; an argument list that cannot be read at all is scanned for `--log.format`."""
    try:
        given = collect(list(argv), cls)
    except Exception:  # a missing file, a bad option: the error being printed; the options may still say json
        given = {}
        for i, arg in enumerate(argv):
            name, eq, raw = arg.partition("=")
            if name == "--log.format":
                given = {"log": {"format": raw if eq else (argv[i + 1] if i + 1 < len(argv) else "")}}
    env = {name.upper(): value for name, value in environ.items()}
    log = given.get("log") if isinstance(given.get("log"), dict) else {}
    fmt = log.get("format", env.get(ENV_PREFIX + "LOG__FORMAT", "text"))
    if str(fmt).strip().lower() != "json":
        return None
    run_id = given.get("run_id", env.get(ENV_PREFIX + "RUN_ID", ""))
    return run_id if isinstance(run_id, str) else ""


def _service_name(prog: str) -> str:
    """The service field of a command's records: `gyre trainer` -> trainer, `gyre bench inference` -> bench-inference,
    `python -m gyre_trainer.export` -> export (setup_logging's names for the services)."""
    words = prog.split()
    if words and words[0] == "gyre":
        command = [w for w in words[1:3] if w.isidentifier() and w.islower()]
        return "-".join(command) or "gyre"
    return words[-1].rsplit(".", 1)[-1] if words else "gyre"


def to_toml(model: BaseModel) -> str:
    """Serialise a resolved config back to TOML so a child process can reload it with ``@ file``.

    Secrets are written in clear (pydantic's SecretStr is revealed): the file is for that child.
    """
    return dump_toml(_plain(model.model_dump(exclude_none=True)))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value") and not isinstance(value, int | float | str | bool):  # enums
        return value.value
    return value


def dump_toml(data: dict) -> str:
    """TOML text of `data` (tomli-w: arrays of tables, nested inline tables and escapes are all right)."""
    import tomli_w

    return tomli_w.dumps(data)
