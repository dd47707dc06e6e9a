"""A command's face: `--help` (every option with its type, default and description), `parse_or_exit` (the config, or
the error naming the key and exit status 2, as argparse does for usage errors) and a start-up error printed before
logging is set up, as text or as the JSON record the command's logs would be."""

from __future__ import annotations

import inspect
import json
import os
import sys
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, SecretStr, ValidationError

from gyre.config.fields import list_entry_model, section_model, type_name
from gyre.config.loader import SHORTHAND, HelpRequested, collect, load_config
from gyre.config.mistakes import ENV_PREFIX, ConfigError, check_environment_keys, name_environment_variables

T = TypeVar("T", bound=BaseModel)


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
            sub = section_model(field.annotation)
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
            opt = f"{'  ' * depth}{flag}{prefix}{name} {type_name(field.annotation)}"
            if field.is_required():
                out.append(f"{opt}  (required)")
            else:
                default = (defaults or {}).get(name, field.get_default(call_default_factory=True))
                out.append(f"{opt}  (default: {_default_repr(default)})")
            if desc:
                out.append(f"{'  ' * depth}      {desc}")
            entry = list_entry_model(field.annotation)
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
