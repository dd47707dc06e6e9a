"""The three Dockerfiles are hadolint clean and follow the house rules; the kind smoke workflow is a
valid GitHub workflow with least permissions that runs the smoke script's steps."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from chart_testlib import ROOT

DOCKERFILES = ["Dockerfile.inference", "Dockerfile.trainer", "Dockerfile.orchestrator"]
WORKFLOW = ROOT / ".github" / "workflows" / "kind-smoke.yml"
RELEASE_WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed (it comes with the dev extras: pip install -e '.[dev]')"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile):
    result = subprocess.run([tool("hadolint"), "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nCMD python app.py\n")
    result = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout  # `latest` is flagged: the tool really runs


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_rules(dockerfile):
    steps = instructions(dockerfile)
    text = (ROOT / dockerfile).read_text()
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)
    froms = [rest for word, rest in steps if word == "FROM"]
    stages = [rest.split()[-1] for rest in froms if " AS " in rest]
    assert len(froms) >= 3, "multi-stage: wheel, dependencies, runtime"
    for base in froms:
        image = base.split()[0]
        if image in stages:
            continue  # a previous stage
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), image)
        assert ":" in resolved and not resolved.endswith(":latest"), f"{dockerfile}: unpinned base {resolved}"
        assert re.search(r":\S*\d", resolved), f"{dockerfile}: base {resolved} has no version tag"
    # every runtime stage: non-root numeric user, exec-form entrypoint, OCI labels, no health check
    runtimes = ["cpu", "gpu"] if dockerfile != "Dockerfile.orchestrator" else ["runtime"]
    assert stages[-len(runtimes) :] == runtimes, "runtime stages last (the legacy builder builds up to --target)"
    for stage in runtimes:
        body = stage_steps(steps, stage)
        users = [rest for word, rest in body if word == "USER"]
        assert users and re.fullmatch(r"\d+(:\d+)?", users[-1]) and not users[-1].startswith("0"), users
        # exec form, `gyre` under tini as PID 1 (reaps orphans, forwards SIGTERM), installed in this stage
        assert [rest for word, rest in body if word == "ENTRYPOINT"] == ['["tini", "-s", "--", "gyre"]'], stage
        assert any(word == "RUN" and "apt-get install -y --no-install-recommends tini" in rest for word, rest in body)
        labels = " ".join(rest for word, rest in body if word == "LABEL")
        for key in ("source", "revision", "version"):
            assert f"org.opencontainers.image.{key}=" in labels, (stage, key)
        assert not any(word in ("COPY", "RUN") and "gcc" in rest for word, rest in body), "no compiler at run time"
    assert "HEALTHCHECK" not in [word for word, _ in steps], "Kubernetes probes do the health checks"
    assert "# syntax=" not in text, "the legacy builder must not need BuildKit's frontend image"
    if dockerfile != "Dockerfile.orchestrator":
        assert "-c /tmp/build/constraints.txt" in text and "ARG TORCH_INDEX=https://" in text
        assert "COPY deploy/docker/wheels/ /tmp/torch/" in text, "the torch wheel build.sh stages"
        assert args["VLLM_IMAGE" if "inference" in dockerfile else "TORCH_IMAGE"]
    else:
        assert "torch" not in text.replace("no torch", "")


def stage_steps(steps: list[tuple[str, str]], stage: str) -> list[tuple[str, str]]:
    """The instructions of one build stage (from its FROM to the next FROM)."""
    start = next(i for i, (word, rest) in enumerate(steps) if word == "FROM" and rest.endswith(f" AS {stage}"))
    end = next((i for i in range(start + 1, len(steps)) if steps[i][0] == "FROM"), len(steps))
    return steps[start:end]


def test_cpu_images_share_their_dependency_layers():
    """The build stage of the CPU venv is the same text in both torch images, so the second build reuses the
    first one's torch and dependency layers (the legacy builder caches by instruction and parent); the gyre
    wheel comes last, in the runtime stage, so a source change rebuilds one small layer per image."""
    inference, trainer = (stage_steps(instructions(f"Dockerfile.{c}"), "cpu-venv") for c in ("inference", "trainer"))
    assert inference == trainer
    words = [word for word, _ in inference]
    torch_step = next(i for i, (w, r) in enumerate(inference) if w == "RUN" and "torch" in r and "-r /tmp" not in r)
    deps_step = next(i for i, (w, r) in enumerate(inference) if w == "RUN" and "requirements.txt" in r)
    assert torch_step < deps_step, "torch, then the dependencies"
    assert "COPY" in words[:torch_step] and ("COPY", "pyproject.toml /tmp/build/") not in inference[:torch_step]
    for dockerfile, stage in [("Dockerfile.inference", "cpu"), ("Dockerfile.trainer", "cpu"),
                              ("Dockerfile.orchestrator", "runtime")]:  # fmt: skip
        body = stage_steps(instructions(dockerfile), stage)
        venv = next(i for i, (w, r) in enumerate(body) if w == "COPY" and r.endswith("/opt/venv /opt/venv"))
        gyre = next(i for i, (w, r) in enumerate(body) if w == "RUN" and "/tmp/wheels/*.whl" in r)
        assert venv < gyre, dockerfile


def test_the_chart_runs_as_the_images_user():
    values = yaml.safe_load((ROOT / "charts" / "gyre" / "values.yaml").read_text())
    for dockerfile in DOCKERFILES:
        for user in [rest for word, rest in instructions(dockerfile) if word == "USER"]:
            assert user == f"{values['podSecurity']['runAsUser']}:{values['podSecurity']['runAsGroup']}"


def test_dockerignore_keeps_the_build_context_to_the_sources():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()]
    entries = [ln for ln in lines if not ln.startswith("#")]
    assert entries[0] == "*", "allow-list: everything is excluded unless listed"
    allowed = {ln[1:].rstrip("/") for ln in entries if ln.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "constraints.txt", "deploy/docker/lock.txt", "libs", "services",
                       "deploy/docker/wheels"}  # fmt: skip
    # every COPY source of every Dockerfile is in the context
    for dockerfile in DOCKERFILES:
        for word, rest in instructions(dockerfile):
            if word == "COPY" and not rest.startswith("--from"):
                for source in rest.split()[:-1]:
                    assert source.rstrip("/") in allowed, f"{dockerfile}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("workflow", [WORKFLOW, RELEASE_WORKFLOW], ids=lambda p: p.name)
def test_workflow_validates_against_the_github_schema(workflow):
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(workflow)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_has_least_permissions_and_runs_the_smoke_steps():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow["permissions"] == {"contents": "read"}
    (job,) = workflow["jobs"].values()
    assert "permissions" not in job or job["permissions"] == {"contents": "read"}
    runs = [step.get("run", "") for step in job["steps"]]
    for step in ("build", "cluster", "install", "check", "test"):
        assert f"deploy/kind/smoke.sh {step}" in runs, step
    dump = next(s for s in job["steps"] if s.get("run") == "deploy/kind/smoke.sh dump")
    assert dump["if"] == "failure()"
    checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout"))
    assert checkout["with"]["persist-credentials"] is False


def test_smoke_script_is_valid_bash_and_uses_the_kind_values():
    script = ROOT / "deploy" / "kind" / "smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "-f deploy/values-kind.yaml" in text and "deploy/docker/build.sh" in text
    assert "pod-security.kubernetes.io/enforce=restricted" in text
    cluster = yaml.safe_load((ROOT / "deploy" / "kind" / "cluster.yaml").read_text())
    assert [n["role"] for n in cluster["nodes"]] == ["control-plane", "worker", "worker"]
    pools = [n.get("labels", {}).get("gyre.dev/pool") for n in cluster["nodes"]]
    assert pools == [None, "cpu", "gpu"]
    kind_values = yaml.safe_load((ROOT / "deploy" / "values-kind.yaml").read_text())
    assert kind_values["nodePools"]["gpu"]["nodeSelector"] == {"gyre.dev/pool": "gpu"}
    assert kind_values["inference"]["gpus"] == 0 and kind_values["trainer"]["gpusPerNode"] == 0


def test_release_workflow_builds_both_variants_and_only_its_image_job_writes_packages():
    workflow = yaml.safe_load(RELEASE_WORKFLOW.read_text())
    assert workflow["permissions"] == {"contents": "read"}
    jobs = workflow["jobs"]
    assert jobs["images"]["permissions"] == {"contents": "read", "packages": "write"}
    assert "permissions" not in jobs["check-version"]
    builds = {(m["component"], m["variant"]) for m in jobs["images"]["strategy"]["matrix"]["include"]}
    assert builds == {("inference", "gpu"), ("inference", "cpu"), ("trainer", "gpu"), ("trainer", "cpu"),
                      ("orchestrator", "")}  # fmt: skip
    for job in jobs.values():
        checkout = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout"))
        assert checkout["with"]["persist-credentials"] is False
    # the version check really compares the tag with Chart.yaml's appVersion
    check = jobs["check-version"]["steps"][-1]["run"]
    env = {"GITHUB_REF_NAME": "v0.1.0", "PATH": "/usr/bin:/bin"}
    assert subprocess.run(["bash", "-c", check], cwd=ROOT, env=env).returncode == 0
    env["GITHUB_REF_NAME"] = "v9.9.9"
    assert subprocess.run(["bash", "-c", check], cwd=ROOT, env=env, capture_output=True).returncode == 1


def test_local_base_dockerfile_is_hadolint_clean_and_build_script_is_valid_bash():
    base = ROOT / "deploy" / "docker" / "Dockerfile.python"
    result = subprocess.run([tool("hadolint"), "--no-color", str(base)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    script = ROOT / "deploy" / "docker" / "build.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "DOCKER_BUILDKIT=0" in text and "debootstrap --variant=minbase bookworm" in text
    # the folder the Dockerfiles COPY exists in a clean clone, its wheels are never committed
    assert (ROOT / "deploy" / "docker" / "wheels" / "README.md").exists()
    assert "deploy/docker/wheels/*.whl" in (ROOT / ".gitignore").read_text()


def test_ci_builds_the_images_and_runs_the_container_smoke_after_the_suite():
    run = (ROOT / ".ci" / "run").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
    order = [run.index(step) for step in ("make test", "make images", "make smoke", "GYRE_DOCKER_TESTS=1")]
    assert order == sorted(order)
    assert "docker.io debootstrap" in run and "trap stop_dockerd EXIT" in run
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^smoke: install images ##", makefile, re.M) and "deploy/docker/smoke.py" in makefile
