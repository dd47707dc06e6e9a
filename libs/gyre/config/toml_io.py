"""TOML files in and out: a config file read with its errors named (ConfigError), a resolved config written back
as TOML for a child process to read with `@ file`."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

from gyre.config.mistakes import ConfigError


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
