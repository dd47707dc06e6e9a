"""`load_environment(name, **args)`: a built-in by name, or any `package.module:function` import path.

An external environment is a module with a function that takes keyword arguments and returns an
`Environment`, e.g. `my_pkg.envs:load_environment`; `gyre orchestrator --env.name my_pkg.envs:load_environment
--env.args '{"difficulty": 2}'` runs it. Built-ins are imported lazily, so loading one imports only its module.
"""

from __future__ import annotations

import inspect
from typing import Any

from gyre.envs.base import Environment
from gyre.imports import load_callable

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "reverse_text": "gyre.envs.reverse_text:load_environment",
    "arithmetic": "gyre.envs.arithmetic:load_environment",
    "alphabet_sort": "gyre.envs.alphabet_sort:load_environment",
    "calculator": "gyre.envs.calculator:load_environment",
}


class EnvironmentLoadError(ValueError):
    """The environment name, import path or arguments are wrong; the message says which and what would work."""


def load_environment(name: str, **args: Any) -> Environment:
    target = BUILTIN_ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise EnvironmentLoadError(
            f"unknown environment {name!r}: built-ins are {', '.join(sorted(BUILTIN_ENVIRONMENTS))}, "
            "or give an import path 'package.module:load_environment'"
        )
    try:
        loader = load_callable(target, f"environment {name!r}")
    except ValueError as exc:
        raise EnvironmentLoadError(str(exc)) from exc
    try:
        inspect.signature(loader).bind(**args)
    except TypeError as exc:
        accepted = ", ".join(p for p in inspect.signature(loader).parameters if p not in ("self", "kwargs"))
        raise EnvironmentLoadError(f"environment {name!r}: bad arguments ({exc}); it accepts: {accepted}") from exc
    env = loader(**args)
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(f"environment {name!r}: {target} returned {type(env).__name__}, not an Environment")
    return env
