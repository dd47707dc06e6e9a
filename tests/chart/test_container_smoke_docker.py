"""The built images, and the container smoke catching a wiring mistake that only shows when the pods run
(real Docker, real images).

Each image runs as uid 10001, has no C compiler, carries its OCI labels and imports what its service needs
(the orchestrator's reasoning-gym needs pycosat, which is compiled in the build stage only).

The trainer's experiment ConfigMap is mounted at a path its command does not read (a broken mount path in
the rendered StatefulSet): the container starts, cannot find /etc/gyre/experiment.toml and exits, Docker
restarts it as the kubelet would, and the smoke must stop there, name the pod and container, say why, and
leave nothing behind. Needs a Docker daemon and the images of `make images`; runs when GYRE_DOCKER_TESTS=1
(.ci/run sets it after building the images, so stale images from an earlier build are never tested).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
from chart_testlib import CHART, MONITORING_APIS, ROOT, load_values, named

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
import cluster as C  # noqa: E402
import kube as K  # noqa: E402
import smoke as S  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("GYRE_DOCKER_TESTS") != "1", reason="set GYRE_DOCKER_TESTS=1 after `make images`"
    ),
]


def labelled() -> list[str]:
    found = []
    for ls in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        found += subprocess.run(["docker", *ls, "--filter", f"label={C.LABEL}"], capture_output=True, text=True,
                                check=True).stdout.split()  # fmt: skip
    return found


def test_a_broken_mount_path_fails_the_smoke_naming_the_pod_and_why(capsys):
    assert labelled() == [], "leftovers of an earlier smoke: make smoke-clean"
    objects = K.render_chart(CHART, load_values("values-kind.yaml"), release="exp", namespace="rl",
                             api_versions=MONITORING_APIS)  # fmt: skip
    broken = copy.deepcopy(objects)
    trainer = named(broken, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]["containers"][0]
    next(m for m in trainer["volumeMounts"] if m["mountPath"] == "/etc/gyre")["mountPath"] = "/etc/gyre-config"

    with pytest.raises(C.SmokeFailure) as failure:
        S.run(broken, S.Options(namespace="rl", release="exp", timeout=600, max_restarts=1))
    assert failure.value.where == "pod exp-gyre-trainer-0, container trainer"
    # exited, restarted once, exited again: its exit code (torchrun's) and the error line of its own log
    assert re.match(r"exited 2 times \(restarted 1\), last with code [1-9]\d*: ", failure.value.why)
    assert failure.value.why.endswith("error: config file not found: /etc/gyre/experiment.toml")
    assert "nothing left" in capsys.readouterr().out  # torn down on failure too
    assert labelled() == []


IMPORTS = {
    "inference": "import torch, transformers, gyre_inference; assert torch.__version__ == '2.13.0+cpu'",
    "trainer": "import torch, peft, gyre_trainer; assert torch.__version__ == '2.13.0+cpu'",
    "orchestrator": "import pycosat, reasoning_gym, pyarrow, verifiers, gyre_orchestrator",
}


@pytest.mark.parametrize("component", sorted(IMPORTS))
def test_the_built_image_is_non_root_without_a_compiler_and_labelled(component):
    image = f"gyre-{component}:kind"
    config = json.loads(subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True,
                                       check=True).stdout)[0]["Config"]  # fmt: skip
    assert config["User"] == "10001:10001" and config["Entrypoint"] == ["gyre"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["org.opencontainers.image.version"]
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", labels["org.opencontainers.image.revision"])
    no_compiler = "for c in gcc cc c++ x86_64-linux-gnu-gcc; do command -v $c && exit 3; done"
    script = f'id -u; {no_compiler}; python -c "{IMPORTS[component]}"'
    writable = ["--read-only", "--tmpfs", "/tmp", "--tmpfs", "/cache"]  # as the chart mounts them
    run = subprocess.run(["docker", "run", "--rm", *writable, "--entrypoint", "sh", image, "-c", script],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and run.stdout.split()[0] == "10001", run.stdout + run.stderr
