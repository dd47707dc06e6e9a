"""Config models of every service (torch-free) and the argv/TOML/env loader."""

from gyre.config.loader import ConfigError, GyreSettings, Section, help_text, load_config, parse_or_exit, to_toml

__all__ = ["ConfigError", "GyreSettings", "Section", "help_text", "load_config", "parse_or_exit", "to_toml"]
