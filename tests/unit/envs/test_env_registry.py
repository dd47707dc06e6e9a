"""`load_environment`: built-ins by name, external environments by import path, clear errors otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gyre.envs import BUILTIN_ENVIRONMENTS, Environment, EnvironmentLoadError, load_environment
from gyre.envs.registry import ENTRY_POINT_GROUP, available_environments

# Built-ins that cannot load without arguments, and the ones they need.
REQUIRED_ARGS = {"dataset": {"path": str(Path(__file__).parent / "data" / "reverse_words.jsonl")}}

EXTERNAL = """
import random
from gyre.envs import Rubric, SingleTurnEnv, Task


def shout(completion, answer, parser) -> float:
    return float(parser.parse_answer(completion) == answer)


class ShoutEnv(SingleTurnEnv):
    name = "shout"

    def __init__(self, word_count=1, **kwargs):
        super().__init__(rubric=Rubric([shout]), **kwargs)
        self.word_count = word_count

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        words = " ".join(rng.choice(["hi", "yo", "hey"]) for _ in range(self.word_count))
        return Task(id=task_id, prompt=self.format_prompt(words), answer=words.upper())


def load_environment(word_count: int = 1, num_eval: int = 4) -> ShoutEnv:
    return ShoutEnv(word_count=word_count, num_eval=num_eval, system_prompt="Shout it.")


def not_an_env():
    return 42
"""


@pytest.fixture
def external_module(tmp_path, monkeypatch):
    name = f"gyre_test_external_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(EXTERNAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_builtins_load_by_name(name):
    env = load_environment(name, **REQUIRED_ARGS.get(name, {}))
    assert isinstance(env, Environment) and env.name == name


def test_external_environment_by_import_path(external_module):
    env = load_environment(f"{external_module}:load_environment", word_count=3)
    assert env.name == "shout"
    task = env.tasks("train", 0)[0]
    assert len(task.answer.split()) == 3 and task.answer == task.prompt[-1]["content"].upper()
    assert len(env.tasks("eval")) == 4


def test_unknown_name_lists_the_builtins():
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment("reverse")
    message = str(info.value)
    assert all(name in message for name in BUILTIN_ENVIRONMENTS) and "package.module:load_environment" in message


def test_bad_arguments_name_what_is_accepted(external_module):
    with pytest.raises(EnvironmentLoadError, match="min_length") as info:
        load_environment("reverse_text", min_lenght=3)
    assert "min_lenght" in str(info.value)
    with pytest.raises(EnvironmentLoadError, match="word_count"):
        load_environment(f"{external_module}:load_environment", words=2)


def test_bad_import_paths(external_module):
    with pytest.raises(EnvironmentLoadError, match="cannot import"):
        load_environment("no_such_package_xyz.envs:load_environment")
    with pytest.raises(EnvironmentLoadError, match="no callable 'missing'"):
        load_environment(f"{external_module}:missing")
    with pytest.raises(EnvironmentLoadError, match="not an Environment"):
        load_environment(f"{external_module}:not_an_env")


def test_a_bad_import_path_says_what_would_work(external_module):
    """The import's own message ("No module named 'my_pkg'", "no callable 'load_enviroment'") left a user guessing
    what to change: the error now says it."""
    with pytest.raises(EnvironmentLoadError, match="no callable 'load_enviroment'; did you mean 'load_environment'"):
        load_environment(f"{external_module}:load_enviroment")
    with pytest.raises(EnvironmentLoadError, match="no callable 'shot'; did you mean 'shout'"):
        load_environment(f"{external_module}:shot")
    with pytest.raises(EnvironmentLoadError, match="put the folder that holds 'no_such_package_xyz' on PYTHONPATH"):
        load_environment("no_such_package_xyz.envs:load_environment")
    hint = "give the module's import path, not a file: 'my_pkg.envs:load_environment', with the folder holding 'my_pkg'"
    with pytest.raises(EnvironmentLoadError, match=re.escape(hint)):
        load_environment("my_pkg/envs.py:load_environment")


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("reverse-text", "did you mean 'reverse_text'?"),  # PRIME-RL's spelling of the id
        ("alphabet_srot", "did you mean 'alphabet_sort'?"),
        ("my_pkg.envs", "an import path names its function: my_pkg.envs:load_environment"),
    ],
)
def test_an_unknown_name_says_what_was_probably_meant(name, hint):
    with pytest.raises(EnvironmentLoadError, match=f"^unknown environment '{name}': {re.escape(hint)}"):
        load_environment(name)


def test_a_package_in_the_working_directory_is_found(tmp_path, monkeypatch):
    """`gyre eval --env.name my_pkg.envs:load_environment` run beside my_pkg failed with "No module named
    'my_pkg'": the gyre command's sys.path starts at its script, not at the working directory (python -m and -c
    start there). The working directory is now looked in, after everything else."""
    package = f"gyre_test_cwd_pkg_{tmp_path.name.replace('-', '_')}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "envs.py").write_text(EXTERNAL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), ".")])
    try:
        env = load_environment(f"{package}.envs:load_environment", num_eval=2)
        assert env.name == "shout" and sys.path[-1] == str(tmp_path)
    finally:
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


@pytest.mark.parametrize(("name", "arg"), [("reasoning_gym:", "dataset"), ("verifiers: ", "taskset_id")])
def test_a_prefix_without_a_name_says_what_to_add(name, arg):
    with pytest.raises(EnvironmentLoadError, match=f"name the {arg} after the colon"):
        load_environment(name)


@pytest.mark.parametrize(
    ("name", "module", "install"),
    [("reasoning_gym:chain_sum", "reasoning_gym", "gyre[reasoning-gym]"), ("verifiers:x", "verifiers.v1",
                                                                            "gyre[verifiers]")],
)  # fmt: skip
def test_a_missing_optional_package_says_what_to_install(monkeypatch, name, module, install):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=re.escape(f"pip install '{install}'")):
        load_environment(name)


def test_loading_environments_never_imports_torch():
    code = textwrap.dedent(
        """
        import sys
        from gyre.envs import load_environment
        for name in ["reverse_text", "arithmetic", "alphabet_sort", "calculator"]:
            env = load_environment(name)
            env.tasks("eval")[0]
        load_environment("dataset", path=DATASET).tasks("train")[0]
        try:
            import reasoning_gym  # optional extra
        except ImportError:
            pass
        else:
            load_environment("reasoning_gym:chain_sum", num_eval=2).tasks("train")[0]
        from gyre.envs.scoring import math_equal
        assert math_equal("7", "7")
        assert "torch" not in sys.modules, "gyre.envs imported torch"
        """
    ).replace("DATASET", repr(REQUIRED_ARGS["dataset"]["path"]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A package 'installed' on sys.path with a dist-info that registers `shout` in the entry-point group."""
    name = f"gyre_test_pkg_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(EXTERNAL)
    dist = tmp_path / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nshout = {name}:load_environment\nreverse_text = {name}:load_environment\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, name
    sys.modules.pop(name, None)


def test_installed_packages_register_environments_by_name(installed_package):
    _, module = installed_package
    assert available_environments()["shout"] == f"{module}:load_environment"
    env = load_environment("shout", word_count=2)
    assert env.name == "shout" and len(env.tasks("train")[0].answer.split()) == 2
    # a package cannot take over a built-in's name
    assert load_environment("reverse_text").name == "reverse_text"
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment("shoutt")
    assert "shout" in str(info.value) and "reverse_text" in str(info.value)


def test_gyre_envs_lists_builtins_and_entry_points(installed_package):
    folder, module = installed_package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}
    result = subprocess.run([sys.executable, "-m", "gyre.cli", "envs"], capture_output=True, text=True, env=env,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in BUILTIN_ENVIRONMENTS:
        assert "built-in" in lines[name]
    assert "entry point" in lines["shout"] and f"{module}:load_environment" in lines["shout"]
    assert "reasoning_gym:<dataset>" in lines
