"""The built images, and the container smoke catching a wiring mistake that only shows when the pods run
(real Docker, real images).

Each image runs as uid 10001, has no C compiler, carries its OCI labels and imports what its service needs
(the orchestrator's reasoning-gym needs pycosat, which is compiled in the build stage only); it also runs
without the chart, as its own user and as an arbitrary uid, and ships no apt caches. Pods stopped and left
with orphans: last section.

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
import time

import pytest
from chart_testlib import CHART, MONITORING_APIS, ROOT, load_values, named

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
import cluster as C  # noqa: E402
import kube as K  # noqa: E402
import smoke as S  # noqa: E402
from plan import plan  # noqa: E402

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
    assert config["User"] == "10001:10001" and config["Entrypoint"] == ["tini", "-s", "--", "gyre"]
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


WRITE_CACHES = """
import os, pathlib
for var in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR"):
    if var in os.environ:
        path = pathlib.Path(os.environ[var]) / "probe"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(var)
print("caches writable")
"""


@pytest.mark.parametrize("user", [None, "12345:0"])
@pytest.mark.parametrize("component", sorted(IMPORTS))
def test_the_image_runs_without_the_chart_as_any_user_and_carries_no_package_caches(component, user):
    """Outside the chart (`docker run`, no /cache emptyDir), as its own user and as an arbitrary uid in group 0
    (OpenShift's restricted SCC assigns one): every cache directory the image's environment names is writable
    (they were under /cache, which did not exist and which a non-root user cannot create: `gyre model init`
    failed with Permission denied: '/cache'). And apt's package caches are not shipped."""
    as_user = ["--user", user] if user else []
    run = subprocess.run(["docker", "run", "--rm", *as_user, "--entrypoint", "python", f"gyre-{component}:kind", "-c",
                          WRITE_CACHES], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "caches writable" in run.stdout, run.stdout + run.stderr
    apt = ["/var/cache/apt", "/var/lib/apt/lists"]
    du = subprocess.run(["docker", "run", "--rm", "--entrypoint", "du", f"gyre-{component}:kind", "-sk", *apt],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    sizes = {line.split()[1]: int(line.split()[0]) for line in du.stdout.splitlines()}
    assert all(kb < 1024 for kb in sizes.values()), f"apt caches in the image (KB): {sizes}"


# ---- a pod stopped and left with orphans ------------------------------------------------------------------
# Every container of a Gyre image runs its command under tini (the images' entrypoint, and the first words of
# the chart's `command`), PID 1 of its own PID namespace: the pods no longer share one (`shareProcessNamespace`
# was the workaround). The kernel drops a signal sent to a PID 1 that installed no handler for it, and only
# PID 1 inherits orphaned processes. On the kind values planned as the smoke does: the inference pod's
# `wait-for-model` init container (files/init.py's wait loop, no model yet; once a `sh -c` loop) stops at SIGTERM
# at once (as PID 1 the loop ignored it and was SIGKILLed at the end of the grace period); an orphan left in the
# orchestrator's container is reaped (`gyre orchestrator` as PID 1 left it a zombie); the orchestrator still stops
# on SIGTERM with its documented code (0, a clean stop), tini passing it on. Then the same without the chart:
# `docker run` of each image, no `--init`.


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def state(name: str) -> dict:
    return json.loads(C.docker("inspect", name))[0]["State"]


def stop(name: str, grace: int) -> tuple[float, int]:
    """`docker stop -t grace` (SIGTERM, SIGKILL after grace s, as the kubelet does): (seconds, exit code)."""
    started = time.monotonic()
    C.docker("stop", "-t", str(grace), name, timeout=grace + 30)
    return time.monotonic() - started, state(name)["ExitCode"]


@pytest.fixture
def pods():
    """The kind release planned; its orchestrator and inference pods started (nothing else: no Redis, no
    model), torn down afterwards."""
    objects = K.render_chart(CHART, load_values("values-kind.yaml"), release="exp", namespace="rl",
                             api_versions=MONITORING_APIS)  # fmt: skip
    the_plan = plan(objects, namespace="rl", release="exp")
    images, _ = S.resolve_images(the_plan, S.Options().fallbacks)
    cluster = C.Cluster(the_plan, images)
    wanted = {p.name: p for p in the_plan.workload_pods if "orchestrator" in p.name or "inference" in p.name}
    try:
        cluster.create_shared()
        cluster.start(list(wanted.values()))
        yield cluster, wanted
    finally:
        cluster.teardown()


def zombies_after_an_orphan(container: str) -> tuple[list[list[str]], list[str]]:
    """An orphan in the container: the shell exits at once, its `sleep` child is re-parented to PID 1 and exits 1 s
    later. (the zombies left, PID 1's process line)."""
    C.docker("exec", container, "sh", "-c", "sleep 1 & exit 0")
    time.sleep(4)
    processes = [line.split() for line in C.docker("exec", container, "sh", "-c", S.PS).splitlines()]
    return [p for p in processes if p[1] == "Z"], next(p for p in processes if p[0] == "1")


def test_pods_reap_orphans_and_stop_at_sigterm(pods):
    cluster, wanted = pods
    inference = next(p for p in wanted.values() if "inference" in p.name)
    orchestrator = next(p for p in wanted.values() if "orchestrator" in p.name)
    assert not inference.shared_pid and not orchestrator.shared_pid  # each container its own PID 1: tini
    init = cluster.names.container(inference.name, "wait-for-model")
    main = cluster.names.container(orchestrator.name, "orchestrator")
    wait_for(lambda: C.docker("ps", "-q", "--filter", f"name=^{init}$", "--filter", "status=running", check=False)
             .strip(), 120, f"{init} running")  # fmt: skip
    # Its run loop is up (handlers installed): without Redis it retries, saying so.
    wait_for(lambda: any(s in C.tail(main, 50) for s in ("redis unavailable", "starting at step")), 120,
             f"{main} running its loop")  # fmt: skip

    zombies, pid1 = zombies_after_an_orphan(main)
    assert zombies == [], f"zombies in pod {orchestrator.name}: {zombies}"
    assert pid1[3] == "tini", f"PID 1 of pod {orchestrator.name} is not tini: {pid1}"

    # SIGTERM: the init container's wait loop ends at once (killed by the signal: 128 + 15), not at SIGKILL.
    seconds, code = stop(init, 30)
    assert seconds < 10 and code == 143, f"{init}: stopped after {seconds:.1f} s with code {code}"
    seconds, code = stop(main, 30)  # `gyre orchestrator`: 0 after a clean stop on SIGTERM (docs/orchestrator.md)
    assert seconds < 20 and code == 0, f"{main}: stopped after {seconds:.1f} s with code {code}"
    assert not state(main)["OOMKilled"]
    assert "stopped by signal" in C.tail(main, 20)


# The image's own init (its entrypoint's words before `gyre`) with a shell loop as the command: no `gyre` command
# waits for nothing without a config, and the loop shows the signal reaching a child that has no handler.
@pytest.mark.parametrize("component", sorted(IMPORTS))
def test_the_image_alone_reaps_orphans_and_stops_at_sigterm(component):
    """`docker run` of the image without `--init` and without the chart: PID 1 is the image's tini, which reaps an
    orphan and passes SIGTERM on (a `sh` loop as PID 1 ignored it: `docker stop` waited for the SIGKILL)."""
    image = f"gyre-{component}:kind"
    entrypoint = json.loads(C.docker("image", "inspect", image))[0]["Config"]["Entrypoint"]
    assert entrypoint[:3] == ["tini", "-s", "--"], entrypoint
    name = f"gyre-init-test-{component}"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    C.docker("run", "-d", "--name", name, "--read-only", "--entrypoint", entrypoint[0], image, *entrypoint[1:3],
             "sh", "-c", "while :; do sleep 1; done")  # fmt: skip
    try:
        zombies, pid1 = zombies_after_an_orphan(name)
        assert zombies == [] and pid1[3] == "tini", (zombies, pid1)
        seconds, code = stop(name, 30)
        assert seconds < 10 and code == 143, f"{name}: stopped after {seconds:.1f} s with code {code}"
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_the_orchestrator_exits_0_when_sigterm_finds_redis_gone_mid_push():
    """`helm uninstall` SIGTERMs every pod at once and Redis exits first: the container smoke's orchestrator, caught
    pushing a batch, retried the push until its stop grace ran out and exited 143 about 10.7 s after SIGTERM (trainer
    and inference: 0). The kind release with `max_async_level` 50, so the orchestrator keeps generating ahead of the
    trainer and its next push meets the stopped Redis; then `docker stop` of the orchestrator: exit 0, well before
    the grace (the push left to the resume rule)."""
    values = load_values("values-kind.yaml")
    values["experiment"]["orchestrator"]["max_async_level"] = 50
    objects = K.render_chart(CHART, values, release="exp", namespace="rl", api_versions=MONITORING_APIS)
    the_plan = plan(objects, namespace="rl", release="exp")
    images, _ = S.resolve_images(the_plan, S.Options().fallbacks)
    cluster = C.Cluster(the_plan, images)
    orchestrator = next(p for p in the_plan.workload_pods if "orchestrator" in p.name)
    redis = next(p for p in the_plan.workload_pods if "redis" in p.name)
    main = cluster.names.container(orchestrator.name, "orchestrator")
    try:
        cluster.create_shared()
        cluster.start(the_plan.workload_pods)
        cluster.wait_ready(the_plan.workload_pods, time.monotonic() + 600)
        wait_for(lambda: "pushed step 2:" in C.tail(main, 200), 300, f"{main} pushing")
        stop(cluster.names.container(redis.name, "redis"), 30)
        outage = re.compile(r"unavailable during (pushing batch|counting the push|reading redis memory)")
        wait_for(lambda: outage.search(C.tail(main, 50)), 120, f"{main} pushing into the outage")
        seconds, code = stop(main, orchestrator.grace_s)
        assert code == 0, f"{main}: stopped after {seconds:.1f} s with code {code}\n{C.tail(main)}"
        assert "stopped by signal (SIGTERM)" in C.tail(main, 20)
    finally:
        cluster.teardown()
