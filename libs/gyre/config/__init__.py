"""Config models of every service (torch-free) and the argv/TOML/env loader."""

from gyre.config.command_line import help_text, parse_or_exit
from gyre.config.loader import GyreSettings, Section, load_config
from gyre.config.mistakes import ConfigError
from gyre.config.toml_io import to_toml

__all__ = ["ConfigError", "GyreSettings", "Section", "help_text", "load_config", "parse_or_exit", "to_toml"]
