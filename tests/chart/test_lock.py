"""deploy/docker/lock.txt pins every dependency of the images and of `make install`: the Dockerfiles install
nothing without it, it satisfies pyproject.toml and holds every package its pins pull in, and the tested
environment (this venv, made by `make install`) is exactly the lock, so the tests run on what the images carry."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from chart_testlib import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = ROOT / "deploy" / "docker" / "lock.txt"
DOCKERFILES = ["Dockerfile.inference", "Dockerfile.trainer", "Dockerfile.orchestrator"]
# Extras the lock covers: every one but vllm (CUDA only; the GPU image's base brings it).
UNLOCKED_EXTRAS = {"vllm"}


def lock_lines() -> dict[str, Requirement]:
    """{name: pin} of lock.txt: `name==version`, a few with the marker of the other CPython 3.11 that needs them."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            req = Requirement(line)
            assert re.fullmatch(r"==[^,]+", str(req.specifier)) and not req.extras, f"lock.txt: not a pin: {line}"
            assert canonicalize_name(req.name) not in pins, f"lock.txt: {req.name} twice"
            pins[canonicalize_name(req.name)] = req
    return pins


def lock() -> dict[str, str]:
    return {name: str(req.specifier)[2:] for name, req in lock_lines().items()}


# The images' Pythons are other CPython 3.11 releases than this one (the local base: Debian's 3.11.2): the lock
# must hold what their markers select too (redis: async-timeout below 3.11.3).
PATCH_RELEASES = [{}, {"python_full_version": "3.11.0"}, {"python_full_version": "3.11.99"}]


def selected(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or any(req.marker.evaluate({**env, "extra": extra}) for env in PATCH_RELEASES)


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pyproject_requirements() -> list[Requirement]:
    """The base dependencies and every locked extra's, with gyre's own extras (`gyre[torch,...]`) expanded."""
    p = project()
    reqs = [Requirement(r) for r in p["dependencies"]]
    for extra, deps in p["optional-dependencies"].items():
        if extra not in UNLOCKED_EXTRAS:
            reqs += [r for r in map(Requirement, deps) if canonicalize_name(r.name) != "gyre"]
    return [r for r in reqs if selected(r)]


def pip_installs(dockerfile_text: str) -> list[tuple[str, str]]:
    """(stage, command) of every `pip install` in a Dockerfile's RUN steps."""
    stage, out = "", []
    for line in dockerfile_text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stage = line.split()[-1]
        if line.startswith("RUN "):
            for command in re.split(r"&&|;|\bthen\b|\belse\b", line):
                if re.search(r"\bpip install\b", command):
                    out.append((stage, command.strip()))
    return out


def unlocked(text: str) -> list[str]:
    """The `pip install` commands of a Dockerfile that can install dependencies without the lock."""
    bad = []
    for stage, command in pip_installs(text):
        if "--no-deps" in command:
            continue  # one wheel alone (torch, gyre): its dependencies come from a locked install
        if "-c /tmp/build/lock.txt" in command:
            continue
        if "-c /tmp/build/lock-absent.txt" in command and "/tmp/build/lock.txt > /tmp/build/lock-absent.txt" in text:
            continue  # a GPU stage: the lock less what its base image already has
        bad.append(f"{stage}: {command}")
    return bad


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_dependency_install_of_every_dockerfile_uses_the_lock(dockerfile):
    text = (ROOT / dockerfile).read_text()
    installs = pip_installs(text)
    assert len(installs) >= 2, installs  # the parse finds the installs
    assert unlocked(text) == [], f"{dockerfile}: pip installs dependencies without deploy/docker/lock.txt"
    copies = [ln for ln in text.splitlines() if ln.startswith("COPY ") and "deploy/docker/lock.txt" in ln]
    stages = {stage for stage, command in installs if "--no-deps" not in command}
    assert len(copies) >= len(stages), f"{dockerfile}: each installing stage copies the lock in ({stages})"


def test_the_check_flags_an_install_without_the_lock():
    """The check above reads what pip really gets: the pre-lock orchestrator install is flagged."""
    old = (
        "FROM python:3.11 AS venv\n"
        "RUN python -c 'print()' > /tmp/build/requirements.txt \\\n"
        "    && pip install --no-cache-dir -c /tmp/build/constraints.txt -r /tmp/build/requirements.txt\n"
        "FROM python:3.11 AS runtime\n"
        "RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /tmp/wheels/*.whl\n"
    )
    assert unlocked(old) == [
        "venv: pip install --no-cache-dir -c /tmp/build/constraints.txt -r /tmp/build/requirements.txt"
    ]


def test_lock_pins_torch_as_constraints_txt_does():
    (pin,) = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch==")]
    assert f"torch=={lock()['torch']}" == pin, "deploy/docker/lock.txt and constraints.txt must pin one torch"


def test_lock_satisfies_every_requirement_of_pyproject():
    pins, problems = lock(), []
    for req in pyproject_requirements():
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{req}: the lock pins {version}")
    assert not problems, "deploy/docker/lock.txt drifted from pyproject.toml (re-run `make lock`): " + "; ".join(
        problems
    )


def test_lock_holds_every_package_its_pins_depend_on():
    """Walk the dependency tree from pyproject.toml through the installed packages' metadata (the lock's
    versions: see the next test): a package missing from the lock would float in the images."""
    pins, missing, seen = lock(), set(), set()
    todo = [(req, "pyproject.toml") for req in pyproject_requirements()]
    while todo:
        req, parent = todo.pop()
        name = canonicalize_name(req.name)
        for extra in sorted(req.extras) or [""]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            if name not in pins:
                missing.add(f"{name} (from {parent})")
                continue
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                continue  # another 3.11's package (not installed here), or reported by the next test
            todo += [(dep, name) for dep in map(Requirement, dist.requires or []) if selected(dep, extra)]
    assert not missing, f"not in deploy/docker/lock.txt (re-run `make lock`): {sorted(missing)}"


def test_the_tested_environment_is_the_lock():
    """`make install` installs the lock's versions, so the tests run on what the images carry."""
    drift = []
    for name, req in lock_lines().items():
        if req.marker and not req.marker.evaluate():
            continue  # another CPython 3.11's dependency
        version = str(req.specifier)[2:]
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift.append(f"{name}: not installed")
            continue
        if Version(installed).public != Version(version).public:  # torch's +cpu label
            drift.append(f"{name}: {installed} installed, the lock pins {version}")
    assert not drift, "this environment is not deploy/docker/lock.txt's (run `make install`): " + "; ".join(drift)


def test_make_install_and_the_kind_workflow_install_with_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK \?= deploy/docker/lock.txt$", makefile, re.M)
    assert re.search(r"^\$\(VENV\)/\.installed: .*\$\(LOCK\)", makefile, re.M), "a new lock reinstalls"
    assert "$(PIP) install -q -c $(CONSTRAINTS) -c $(LOCK) -e '.[dev]'" in makefile
    assert re.search(r"^lock: .*##", makefile, re.M) and "deploy/docker/lock.py" in makefile
    workflow = (ROOT / ".github" / "workflows" / "kind-smoke.yml").read_text()
    assert "pip install -c constraints.txt -c deploy/docker/lock.txt" in workflow
