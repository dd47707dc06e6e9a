"""`load_environment(name, **args)`: environments by name, by `reasoning_gym:<dataset>`, or by import path.

Names come from two places (`available_environments()`; `gyre envs` prints them):
- Gyre's built-ins (`BUILTIN_ENVIRONMENTS`);
- installed packages that register a loader in the `gyre.environments` entry-point group, e.g. in their
  pyproject.toml:

      [project.entry-points."gyre.environments"]
      my_env = "my_pkg.envs:load_environment"

`reasoning_gym:<dataset>` (e.g. `reasoning_gym:chain_sum`) wraps a reasoning-gym dataset (`gyre.envs.reasoning_gym`),
`verifiers:<taskset-id>` a verifiers 0.4 environment (`gyre.envs.verifiers_env`), and any `package.module:function`
import path works without registering. A loader takes keyword arguments and
returns an `Environment`; loaders are imported only when used, so loading one imports only its module.
"""

from __future__ import annotations

import inspect
import logging
from importlib.metadata import entry_points
from typing import Any

from gyre.envs.base import Environment
from gyre.imports import load_callable

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "gyre.environments"
BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "reverse_text": "gyre.envs.reverse_text:load_environment",
    "arithmetic": "gyre.envs.arithmetic:load_environment",
    "alphabet_sort": "gyre.envs.alphabet_sort:load_environment",
    "calculator": "gyre.envs.calculator:load_environment",
    "dataset": "gyre.envs.dataset:load_environment",
}
# `<prefix>:<name>` spellings: the part after the colon becomes the loader's first argument.
PREFIXED: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("gyre.envs.reasoning_gym:load_environment", "dataset"),
    "verifiers": ("gyre.envs.verifiers_env:load_environment", "taskset_id"),
}


class EnvironmentLoadError(ValueError):
    """The environment name, import path or arguments are wrong; the message says which and what would work."""


def available_environments() -> dict[str, str]:
    """Every environment loadable by plain name -> its loader's import path (built-ins win over entry points)."""
    found = dict(BUILTIN_ENVIRONMENTS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name] != ep.value:
            log.warning("environment %r from package entry point %s is shadowed by a built-in", ep.name, ep.value)
        found.setdefault(ep.name, ep.value)
    return found


def resolve(name: str, args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(loader import path, arguments) for an environment name."""
    available = available_environments()
    if name in available:
        return available[name], args
    prefix, _, rest = name.partition(":")
    if prefix in PREFIXED:
        target, arg = PREFIXED[prefix]
        if not rest.strip():  # it read as a malformed import path ("expected 'package.module:attribute'")
            raise EnvironmentLoadError(f"environment {name!r}: name the {arg} after the colon ({prefix}:<{arg}>)")
        return target, {arg: rest, **args}
    if ":" in name:
        return name, args
    raise EnvironmentLoadError(
        f"unknown environment {name!r}: available are {', '.join(sorted(available))}; "
        f"or {', '.join(f'{p}:<name>' for p in PREFIXED)}, or an import path 'package.module:load_environment' "
        "(`gyre envs` lists them)"
    )


def load_environment(name: str, **args: Any) -> Environment:
    target, args = resolve(name, args)
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


def describe(target: str) -> str:
    """First sentence of a loader's module docstring (imports only that module)."""
    try:
        loader = load_callable(target, "environment")
    except ValueError as exc:
        return f"(cannot import: {exc})"
    doc = inspect.getmodule(loader).__doc__ or loader.__doc__ or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".")


def main(argv: list[str]) -> int:
    """`gyre envs`: the environments loadable by name, with where each comes from."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: gyre envs\n\nList environments loadable by name (built-ins, gyre.environments entry points).")
        return 0
    if argv:
        print(f"gyre envs: unexpected arguments {' '.join(argv)!r}")
        return 2
    rows = [(name, "built-in" if BUILTIN_ENVIRONMENTS.get(name) == target else "entry point", target)
            for name, target in sorted(available_environments().items())]  # fmt: skip
    rows += [(f"{prefix}:<{arg}>", "built-in", target) for prefix, (target, arg) in PREFIXED.items()]
    width = max(len(name) for name, _, _ in rows)
    for name, source, target in rows:
        print(f"{name.ljust(width)}  {source:<11}  {describe(target)}  [{target}]")
    print("\nAny 'package.module:function' import path also works as env.name.")
    return 0
