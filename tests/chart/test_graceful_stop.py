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
    ("values", "grace", "shutdown"),
    [
        ({}, 60, "50"),
        ({"inference": {"terminationGracePeriodSeconds": 600}}, 600, "590"),
        ({"inference": {"terminationGracePeriodSeconds": 10}}, 10, "5"),
    ],
    ids=["default", "long-generations", "short"],
)
def test_inference_lets_requests_in_flight_finish_within_the_pods_grace_period(values, grace, shutdown):
    """`gyre inference` cut requests in flight after its own server.shutdown_grace_s (30 s) in a pod given 60 s,
    and outlived a grace period under 30 s (SIGKILL mid-shutdown). A server takes the inference's, or its own."""
    servers = [{"name": "judge", "model": "/data/judge"}, {"name": "rm", "model": "/data/rm",
                                                            "terminationGracePeriodSeconds": 120}]  # fmt: skip
    docs = manifests(render({**values, "servers": servers}))
    for name, pod_grace, want in [("exp-gyre-inference", grace, shutdown), ("exp-gyre-server-judge", grace, shutdown),
                                  ("exp-gyre-server-rm", 120, "110")]:  # fmt: skip
        spec = named(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == pod_grace
        assert option(spec["containers"][0]["args"], "--server.shutdown-grace-s") == want, name
        assert float(want) < pod_grace
