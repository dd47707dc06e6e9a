"""Inference replicas added and removed mid-run (what `inference.autoscaling` does) lose no rollout and train
no step twice.

Real processes, wired as the chart wires them with autoscaling on: a trainer, an orchestrator that finds
replicas through the Kubernetes API (`--inference.discovery kubernetes` and the Service and namespace the
chart renders), and `gyre inference` replicas that all listen on the same ports, each on its own address
(127.0.0.1, 127.0.0.2: pods of one Deployment). The API server is `support.kube_api`'s EndpointSlice
server (no Kubernetes here), reached through a kubeconfig; the test plays the EndpointSlice controller
and the kubelet:

1. replica A alone serves the first steps;
2. scale-up, mid-step: replica B's address joins the Service's EndpointSlice (as when its pod turns
   ready: B was started at the beginning, its model load is not what is tested); the orchestrator
   relays the current weights to it and sends it rollouts;
3. scale-down, mid-step: A's endpoint turns not-ready (terminating) and A gets SIGTERM at the same
   moment, as Kubernetes does both at once; its requests in flight finish or are retried on B.

Then every step 1..STEPS was generated with the full batch (`batch_size` x `rollouts_per_example`
samples: no rollout lost) and trained exactly once, and the trainer and orchestrator exit 0.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from pathlib import Path

import helm_python
import pytest
import yaml
from gyre.events import ORCHESTRATOR_STEPS, TRAINER_STEPS, read_events
from gyre.net import free_port
from gyre.proc import Child
from support.inference import InferenceServer
from support.kube_api import FakeKubeAPI, slice_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHART = Path(__file__).resolve().parents[2] / "charts" / "gyre"

STEPS = 12
BATCH, GROUP = 4, 4
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def chart_discovery() -> list[str]:
    """The orchestrator's discovery options as the chart renders them with autoscaling on."""
    values = {
        "orchestrator": {"discovery": "kubernetes"},
        "inference": {"autoscaling": {"enabled": True}},
        "assumeApiVersions": ["keda.sh/v1alpha1"],  # the cluster has KEDA (the chart refuses autoscaling without it)
    }
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="exp", namespace="rl", is_install=True)
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    assert [d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"] == ["exp-gyre-inference"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "exp-gyre-orchestrator"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    keys = ("--inference.discovery", "--inference.kubernetes-service", "--inference.namespace")
    found = [word for i, word in enumerate(args) if word in keys or (i and args[i - 1] in keys)]
    assert found[:2] == ["--inference.discovery", "kubernetes"] and len(found) == 6, found
    return found


def wait_for(predicate, what: str, timeout: float, *procs: Child) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for proc in procs:
            assert proc.poll() is None, (
                f"{proc.name} exited with {proc.poll()} while waiting for {what}:\n{proc.tail(40)}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "\n".join(p.tail(20) for p in procs)
        time.sleep(0.2)


def steps(path: Path) -> list[int]:
    return [r["step"] for r in read_events(path)]


def served(replica: InferenceServer) -> float:
    """Chat completions this replica answered (its /metrics)."""
    with urllib.request.urlopen(f"{replica.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gyre_inference_requests_total{") and 'outcome="success"' in line)  # fmt: skip


def test_replicas_added_and_removed_mid_step_lose_no_rollout_and_train_no_step_twice(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    discovery = chart_discovery()
    namespace = discovery[discovery.index("--inference.namespace") + 1]
    service = discovery[discovery.index("--inference.kubernetes-service") + 1]
    api = FakeKubeAPI(namespace, service)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    run = tmp_path / "run"
    http, control, grpc_port = free_port(), free_port(), free_port()
    logs = tmp_path / "logs"

    def replica(host: str) -> InferenceServer:
        return InferenceServer(tiny_model, "--server.host", host, "--server.port", str(http), "--control.host", host,
                               "--control.port", str(control), "--run-id", unique_run_id, log_dir=logs)  # fmt: skip

    def endpoints(ready: dict[str, bool]) -> dict:
        return slice_json(f"{service}-abcde", ready, http=http, control=control, service=service)

    common = ["--run-id", unique_run_id, "--output-dir", str(run), "--redis.url", redis_url,
              "--max-steps", str(STEPS), "--metrics.port", "0"]  # fmt: skip
    trainer = Child("trainer", [sys.executable, "-m", "gyre.cli", "trainer", *common, "--model.name", str(tiny_model),
                                "--device", "cpu", "--server.port", "0", "--data.seq-len", "256",
                                "--orchestrator.address", f"127.0.0.1:{grpc_port}"], logs / "trainer.log")  # fmt: skip
    orchestrator = Child("orchestrator", [
        sys.executable, "-m", "gyre.cli", "orchestrator", *common, *discovery,
        "--env.name", "reverse_text", "--batch-size", str(BATCH), "--rollouts-per-example", str(GROUP),
        "--sampling.max-tokens", "32", "--batch.seq-len", "256", "--advantage.drop-zero-signal", "false",
        "--server.port", str(grpc_port), "--inference.health-interval-s", "0.5",
        "--inference.failure-cooldown-s", "1", "--final-weights-timeout-s", "60",
    ], logs / "orchestrator.log")  # fmt: skip
    a = b = None
    try:
        a, b = replica("127.0.0.1"), replica("127.0.0.2")  # B: a pod still starting (not in the Service)
        api.apply(endpoints({"127.0.0.1": True, "127.0.0.2": False}))
        trainer.start(env=ENV, quiet=True)
        orchestrator.start(env={**ENV, "KUBECONFIG": str(kubeconfig)}, quiet=True)
        procs = (trainer, orchestrator)
        wait_for(lambda: len(steps(run / "events" / TRAINER_STEPS)) >= 2, "2 trained steps", 300, *procs)

        # scale-up while a step is generated: B turns ready, its endpoint with it
        assert served(b) == 0
        api.apply(endpoints({"127.0.0.1": True, "127.0.0.2": True}))
        wait_for(lambda: served(b) > 0, "replica B to serve rollouts", 120, *procs)
        added_at = max(steps(run / "events" / ORCHESTRATOR_STEPS), default=0)

        # scale-down while a step is generated: A turns not-ready and gets SIGTERM at once
        a_served = served(a)
        removed_at = max(steps(run / "events" / ORCHESTRATOR_STEPS), default=0)
        api.apply(endpoints({"127.0.0.1": False, "127.0.0.2": True}))
        a_exit: list[int | None] = []
        terminating = threading.Thread(target=lambda: a_exit.append(a.stop()))  # the kubelet's SIGTERM
        terminating.start()

        assert orchestrator.wait(300) == 0, orchestrator.tail(40)
        assert trainer.wait(300) == 0, trainer.tail(40)
        b_served = served(b)
        terminating.join(60)
        assert a_exit == [0], a.tail(30)  # graceful: its requests in flight finished
    finally:
        for proc in (orchestrator, trainer, a, b):
            if proc is not None:
                proc.stop()
        api.close()

    assert api.errors == []  # the orchestrator asked the API only for the Service's EndpointSlices
    assert added_at >= 2 and removed_at < STEPS, (added_at, removed_at)  # both happened mid-run
    assert a_served > 0 and b_served > 0
    generated = read_events(run / "events" / ORCHESTRATOR_STEPS)
    assert [r["step"] for r in generated] == list(range(1, STEPS + 1))  # each batch pushed once, in order
    assert all(r["num_samples"] == BATCH * GROUP for r in generated), [r["num_samples"] for r in generated]
    trained = read_events(run / "events" / TRAINER_STEPS)
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))  # each step trained once, in order
    log = (logs / "orchestrator.log").read_text()
    assert "removed ['http://127.0.0.1:" in log  # the scale-down reached the orchestrator as a removal
