"""Stopped pods get their grace period for what a stop must finish.

A trainer pod that is stopped (helm upgrade, kubectl delete, a drain) gets its whole
`trainer.terminationGracePeriodSeconds` to finish the step and save a checkpoint. torchrun, the container's
first process, forwards SIGTERM to its workers and SIGKILLed them 30 s later (its default --shutdown-timeout),
whatever grace period the pod had: a checkpoint longer than that was cut off. An inference replica lets its
requests in flight finish within its pod's grace period (its own default was 30 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import helm_python
import pytest
from chart_testlib import INIT, load_values, manifests, named, render, service_command

TRAINER = "exp-gyre-trainer"


def trainer_container(values: dict) -> tuple[dict, dict]:
    statefulset = named(manifests(render(values)), "StatefulSet", TRAINER)
    spec = statefulset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def option(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} in {args}"
    return args[args.index(name) + 1]


@pytest.mark.parametrize(
    ("values", "grace"),
    [
        ({}, 120),
        ({"trainer": {"terminationGracePeriodSeconds": 1800}}, 1800),
        ({"trainer": {"nnodes": 2, "gpusPerNode": 8, "terminationGracePeriodSeconds": 900}}, 900),
    ],
    ids=["default", "custom", "multi-node"],
)
def test_torchrun_gives_its_workers_the_pods_grace_period(values, grace):
    spec, container = trainer_container(values)
    assert spec["terminationGracePeriodSeconds"] == grace
    assert container["command"] == [*INIT, "python", "-m", "gyre_trainer.torchrun"]  # torchrun with a clean exit code
    # an option of torchrun itself (before the module it runs), not of the trainer
    args = container["args"]
    assert args.index("--shutdown-timeout") < args.index("-m")
    assert option(args, "--shutdown-timeout") == str(grace)


def test_the_multi_node_example_gives_an_8b_checkpoint_minutes():
    """Qwen3-8B's weights and Adam state are ~100 GB to write to NFS: the default 2 minutes cut it off."""
    spec, container = trainer_container(load_values("values-multi-node.yaml"))
    assert spec["terminationGracePeriodSeconds"] >= 900
    assert option(container["args"], "--shutdown-timeout") == str(spec["terminationGracePeriodSeconds"])


WORKER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(out / "started").write_text("")
while not stop:
    time.sleep(0.1)
time.sleep(float(sys.argv[2]))  # the step in flight and its checkpoint
(out / "saved").write_text("")
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stopped_trainer_pod_saves_a_checkpoint_longer_than_torchruns_default(tmp_path):
    """The rendered torchrun command, its worker replaced by one that takes 35 s to stop (past torchrun's
    default 30 s): SIGTERM to torchrun, as the kubelet sends it to the container, lets the worker finish."""
    _, container = trainer_container({"trainer": {"terminationGracePeriodSeconds": 60}})
    args = container["args"]
    launcher = args[: args.index("-m")]  # torchrun's own options, as rendered
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, *service_command(container)[1:]]  # the image's python is its venv's
    proc = subprocess.Popen([*command, *launcher, str(script), str(tmp_path), "35"])
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "started").exists():
            assert proc.poll() is None, f"torchrun exited with {proc.returncode} before its worker started"
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60 + 15)  # the kubelet's SIGKILL would come at the grace period
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "saved").exists(), "torchrun killed its worker before the checkpoint was saved"


# ---- the same for `gyre inference` (the policy's replicas and `servers`) -----------------------------------


@pytest.mark.parametrize(
    ("values", "grace", "wait", "shutdown"),
    [
        ({}, 60, 5, "45"),
        ({"inference": {"terminationGracePeriodSeconds": 600}}, 600, 5, "585"),
        ({"inference": {"terminationGracePeriodSeconds": 10}}, 10, 5, "2"),
        ({"inference": {"preStopSeconds": 0}}, 60, 0, "50"),
    ],
    ids=["default", "long-generations", "short", "no-wait"],
)
def test_inference_lets_requests_in_flight_finish_within_the_pods_grace_period(values, grace, wait, shutdown):
    """`gyre inference` cut requests in flight after its own server.shutdown_grace_s (30 s) in a pod given 60 s,
    and outlived a grace period under 30 s (SIGKILL mid-shutdown). A server takes the inference's, or its own.
    The preStop wait comes out of the same grace period (the kubelet counts it), before SIGTERM."""
    servers = [{"name": "judge", "model": "/data/judge"}, {"name": "rm", "model": "/data/rm",
                                                            "terminationGracePeriodSeconds": 120}]  # fmt: skip
    docs = manifests(render({**values, "servers": servers}))
    rm = str(120 - wait - 10)
    for name, pod_grace, want in [("exp-gyre-inference", grace, shutdown), ("exp-gyre-server-judge", grace, shutdown),
                                  ("exp-gyre-server-rm", 120, rm)]:  # fmt: skip
        spec = named(docs, "Deployment", name)["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert spec["terminationGracePeriodSeconds"] == pod_grace
        assert option(container["args"], "--server.shutdown-grace-s") == want, name
        pre_stop = container.get("lifecycle", {}).get("preStop")
        assert pre_stop == ({"exec": {"command": ["sleep", str(wait)]}} if wait else None), name
        assert wait + float(want) < pod_grace


def test_a_deleted_replica_serves_until_its_endpoint_is_gone_then_stops_admitting(tmp_path):
    """On a pod's deletion the kubelet's SIGTERM and the endpoints' removal race; `gyre inference` closes its port at
    SIGTERM, so for the seconds kube-proxy took to drop the pod, new connections through the Service (a rolling
    update, a scale-down) were refused. The rendered preStop runs (the image's `sleep`) before SIGTERM; a wait the
    grace period cannot hold is refused naming the key."""
    values = {"inference": {"preStopSeconds": 1}, "servers": [{"name": "judge", "model": "/data/judge"}]}
    docs = manifests(render(values))
    for name in ("exp-gyre-inference", "exp-gyre-server-judge"):
        (container,) = named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert subprocess.run(command, capture_output=True, timeout=30).returncode == 0, command
    for bad, key in [({"inference": {"preStopSeconds": 60}}, "inference"),
                     ({"servers": [{"name": "rm", "model": "/data/rm", "terminationGracePeriodSeconds": 5}]},
                      "servers.rm")]:  # fmt: skip
        with pytest.raises(helm_python.HelmError, match=rf"{key}\.preStopSeconds \(\d+\) must be below its "
                           r"terminationGracePeriodSeconds"):  # fmt: skip
            render(bad)
