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

import difflib
import importlib.util
import inspect
import logging
import os
import sys
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
    "code": "gyre.envs.code:load_environment",
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
    # PRIME-RL's and verifiers' hub ids are spelt with hyphens (reverse-text); a module path without its function
    close = difflib.get_close_matches(name.replace("-", "_"), list(available), n=1, cutoff=0.75)
    if close:
        hint = f"did you mean {close[0]!r}? "
    elif "." in name and name.replace(".", "").replace("_", "").isalnum():
        hint = f"an import path names its function: {name}:load_environment; "
    else:
        hint = ""
    raise EnvironmentLoadError(
        f"unknown environment {name!r}: {hint}available are {', '.join(sorted(available))}; "
        f"or {', '.join(f'{p}:<name>' for p in PREFIXED)}, or an import path 'package.module:load_environment' "
        "(`gyre envs` lists them)"
    )


def _import_hint(target: str, error: ValueError) -> str:
    """What to do about an import path that did not load (the import's own message rarely says)."""
    module_name, _, attr = target.partition(":")
    if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):
        dotted = module_name.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
        return (f"; give the module's import path, not a file: '{dotted}:{attr}', with the folder holding "
                f"{dotted.split('.')[0]!r} on PYTHONPATH (or the package installed)")  # fmt: skip
    cause = error.__cause__
    if isinstance(cause, ModuleNotFoundError) and cause.name == module_name.split(".")[0]:
        return (f"; install the package that holds it, or put the folder that holds {cause.name!r} on PYTHONPATH "
                f"(PYTHONPATH=/path/to/folder gyre ...; the working directory, {os.getcwd()}, has none)")  # fmt: skip
    module = sys.modules.get(module_name)
    if module is not None and attr:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module_name]  # fmt: skip
        close = difflib.get_close_matches(attr, names, n=3)
        if close or names:
            return f"; did you mean {' or '.join(repr(n) for n in close)}?" if close else (
                f"; it defines {', '.join(sorted(names))}")  # fmt: skip
    return ""


def _from_working_directory(target: str) -> bool:
    """Put the working directory on sys.path (last) when it holds the import path's top package: `python -m` and
    `python -c` find a package there, but the `gyre` command does not (its sys.path starts at its own script), so
    `--env.name my_pkg.envs:load_environment` run beside my_pkg failed with "No module named 'my_pkg'" (and
    `verifiers:my_taskset` with "taskset 'my_taskset' not found")."""
    top = target.partition(":")[0].split(".")[0]
    cwd = os.getcwd()
    if not top.isidentifier() or cwd in sys.path or "" in sys.path:
        return False
    if not (os.path.isfile(os.path.join(cwd, top, "__init__.py")) or os.path.isfile(os.path.join(cwd, f"{top}.py"))):
        return False
    sys.path.append(cwd)  # last: an installed package of the same name wins
    log.info("environment %s: %r found in the working directory %s", target, top, cwd)
    return True


#: what to do with an environment written for verifiers 0.1-0.3 (`vf.SingleTurnEnv`, `vf.Rubric`, ...)
VERIFIERS_PORT_HINT = (
    "it is written for verifiers 0.1-0.3 (vf.SingleTurnEnv, vf.Rubric, ...), whose API verifiers 0.4 (the version "
    "Gyre's verifiers extra installs) no longer has: run it through gyre.envs, which has the same names and "
    "arguments (SingleTurnEnv, MultiTurnEnv, ToolEnv, Rubric, RubricGroup, Parser, XMLParser, ThinkParser, "
    "MaybeThinkParser; dataset, eval_dataset, system_prompt, few_shot, parser, rubric): write `import gyre.envs as "
    "vf` for `import verifiers as vf` (docs/environments.md, Porting a verifiers 0.1-0.3 environment)"
)


def _written_for_old_verifiers(exc: BaseException) -> bool:
    """An error that says the environment needs verifiers' pre-0.4 API (or verifiers, not installed)."""
    for error in (exc, exc.__cause__):
        if isinstance(error, AttributeError) and getattr(getattr(error, "obj", None), "__name__", "") == "verifiers":
            return True
        if isinstance(error, ImportError) and (error.name or "").split(".")[0] == "verifiers":
            return True
    return False


def _loader(name: str, target: str):
    try:
        return load_callable(target, f"environment {name!r}")
    except ValueError as exc:
        cause = exc.__cause__
        if isinstance(cause, ModuleNotFoundError) and _from_working_directory(target):
            return _loader(name, target)
        if _written_for_old_verifiers(exc):
            raise EnvironmentLoadError(f"{exc}: {VERIFIERS_PORT_HINT}") from exc
        raise EnvironmentLoadError(f"{exc}{_import_hint(target, exc)}") from exc
    except AttributeError as exc:  # at import: `def load_environment(...) -> vf.Environment` on verifiers 0.4
        if _written_for_old_verifiers(exc):
            raise EnvironmentLoadError(f"environment {name!r}: {exc}: {VERIFIERS_PORT_HINT}") from exc
        raise


def load_environment(name: str, **args: Any) -> Environment:
    target, args = resolve(name, args)
    loader = _loader(name, target)
    module = args.get("taskset_id") if name.startswith("verifiers:") else None
    if module and importlib.util.find_spec(module.split(".")[0]) is None:  # verifiers imports the id itself
        _from_working_directory(module)
    try:
        inspect.signature(loader).bind(**args)
    except TypeError as exc:
        accepted = ", ".join(p for p in inspect.signature(loader).parameters if p not in ("self", "kwargs"))
        raise EnvironmentLoadError(f"environment {name!r}: bad arguments ({exc}); it accepts: {accepted}") from exc
    try:
        env = loader(**args)
    except (AttributeError, ImportError) as exc:  # vf.SingleTurnEnv(...) inside the loader, on verifiers 0.4
        if target != PREFIXED["verifiers"][0] and _written_for_old_verifiers(exc):  # not Gyre's own 0.4 adapter
            raise EnvironmentLoadError(f"environment {name!r}: {exc}: {VERIFIERS_PORT_HINT}") from exc
        raise
    if not isinstance(env, Environment):
        legacy = type(env).__module__.split(".")[0] == "verifiers"
        raise EnvironmentLoadError(f"environment {name!r}: {target} returned {type(env).__name__}, not an Environment"
                                   + (f"; {VERIFIERS_PORT_HINT}" if legacy else ""))  # fmt: skip
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
