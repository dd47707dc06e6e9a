"""A startup probe bounds what a pod does before it serves: for inference replicas, servers and trainer pods that
is loading the model (and restoring a checkpoint), which `startupProbe.periodSeconds × failureThreshold` is
documented to bound. Their startup probes called /health, which answers from the moment the HTTP server (the
trainer's health server) is up, before the load: a load that hung was never bounded, the pod stayed unready for
ever. They call /ready now, which answers 200 only once the model is loaded."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from chart_testlib import manifests, named, render
from gyre.net import free_port

GYRE = Path(sys.executable).parent / "gyre"
SERVERS = {"servers": [{"name": "judge", "model": "/data/judge"}]}


def main_container(docs: list[dict], kind: str, name: str) -> dict:
    return named(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Deployment", "exp-gyre-inference"),
        ("Deployment", "exp-gyre-server-judge"),
        ("StatefulSet", "exp-gyre-trainer"),
    ],
)
def test_startup_waits_for_the_model_as_readiness_does(kind, name):
    container = main_container(manifests(render(SERVERS)), kind, name)
    startup, readiness = container["startupProbe"], container["readinessProbe"]
    assert startup["httpGet"] == readiness["httpGet"]
    assert startup["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"  # alive = answers, loaded or not


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.timeout(180)
def test_a_replica_still_loading_its_model_has_not_started(tmp_path):
    """The real `gyre inference`, whose model files never finish reading (named pipes nobody writes): the
    process answers /health, and the rendered startup probe must not count it as started."""
    container = main_container(manifests(render({})), "Deployment", "exp-gyre-inference")
    probe = container["startupProbe"]["httpGet"]
    assert probe["port"] == "http"
    model = tmp_path / "model"
    subprocess.run([str(GYRE), "model", "init", "--output-dir", str(model), "--preset", "tiny"], check=True,
                   capture_output=True)  # fmt: skip
    for name in ("tokenizer_config.json", "tokenizer.json", "model.safetensors"):
        (model / name).unlink()
        os.mkfifo(model / name)  # a read blocks until a writer comes: a load that hangs
    port = free_port()
    args = ["inference", "--model.name", str(model), "--server.port", str(port), "--control.port", "0",
            "--engine.threads", "1"]  # fmt: skip
    log = (tmp_path / "inference.log").open("w")
    proc = subprocess.Popen([str(GYRE), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "inference.log").read_text()
            try:
                if status(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "inference.log").read_text()
            time.sleep(0.2)
        time.sleep(1)  # loading has begun and blocks on the model's files
        assert status(f"http://127.0.0.1:{port}{probe['path']}") != 200, (
            "a replica loading its model counted as started"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the loading thread cannot be interrupted
        proc.wait(30)
        log.close()


@pytest.mark.parametrize(
    ("values", "deadline"),
    [
        ({}, 10 * 180 + 600),  # the startup probe's 30 min + 10 min
        ({"inference": {"startupProbe": {"periodSeconds": 5, "failureThreshold": 120}}}, 600 + 600),
        ({"inference": {"progressDeadlineSeconds": 7200}}, 7200),
    ],
    ids=["default", "kind-like", "set"],
)
def test_a_rollout_waits_for_a_replica_as_long_as_its_startup_probe_does(values, deadline):
    """A Deployment's progress deadline (Kubernetes' default: 10 min) marked a rollout failed while a new replica
    still loaded its model within the startup probe's 30 min: `kubectl rollout status` (NOTES.txt's step 1) and
    kstatus-based waits gave up on a healthy install. A server takes the inference's, or its own."""
    servers = [{"name": "judge", "model": "/data/judge"},
               {"name": "big", "model": "/data/big", "progressDeadlineSeconds": 9000}]  # fmt: skip
    rendered = render({**values, "servers": servers})
    docs = manifests(rendered)
    inference = named(docs, "Deployment", "exp-gyre-inference")
    assert inference["spec"]["progressDeadlineSeconds"] == deadline
    probe = inference["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert deadline > probe["periodSeconds"] * probe["failureThreshold"]
    assert named(docs, "Deployment", "exp-gyre-server-judge")["spec"]["progressDeadlineSeconds"] == deadline
    assert named(docs, "Deployment", "exp-gyre-server-big")["spec"]["progressDeadlineSeconds"] == 9000
    assert f"--timeout={deadline}s" in rendered["gyre/templates/NOTES.txt"]  # waits as long as Kubernetes does


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"servers": [{"name": "big", "model": "/data/big", "progressDeadlineSeconds": 9000}]},
        {"servers": [{"name": "slow", "model": "/data/s", "startupProbe": {"failureThreshold": 600}}]},
        {"trainer": {"startupProbe": {"periodSeconds": 30, "failureThreshold": 240}}},
        {"inference": {"progressDeadlineSeconds": 5000}},
    ],
    ids=["default", "server-deadline", "server-probe", "trainer-probe", "inference-deadline"],
)
def test_notes_give_helm_wait_a_timeout_as_long_as_the_slowest_workload(values):
    """`helm install/upgrade --wait` (and `--atomic`, Flux's HelmRelease) gives up after Helm's 5 min by default while
    a replica may load its model for 30 min: the release failed, and `--atomic` uninstalled it or rolled it back
    (replacing the pods it had just replaced). NOTES.txt prints the --timeout that covers every workload: the
    longest progress deadline of a Deployment of replicas and the trainer's startup budget plus 10 min."""
    rendered = render(values)
    docs = manifests(rendered)
    deadlines = [d["spec"]["progressDeadlineSeconds"] for d in docs if d["kind"] == "Deployment"
                 and "progressDeadlineSeconds" in d["spec"]]  # fmt: skip
    (trainer,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "exp-gyre-trainer"]
    probe = trainer["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    longest = max(*deadlines, probe["periodSeconds"] * probe["failureThreshold"] + 600)
    (line,) = [ln for ln in rendered["gyre/templates/NOTES.txt"].splitlines() if "helm install/upgrade --wait" in ln]
    assert f"pass --timeout={longest}s" in line, line
