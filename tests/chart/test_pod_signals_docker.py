"""A pod of the chart as the kubelet runs it, stopped and left with orphans: real Docker, the built images.

Every pod shares its process namespace (`shareProcessNamespace`): the pause container, not the service, is
PID 1. The kernel drops a signal sent to a PID 1 that installed no handler for it, and only PID 1 inherits
orphaned processes. So, on the kind values rendered and planned as the container smoke does (the sandbox's
init stands in for the pause container):
- the inference pod's `wait-for-model` init container (`sh -c` loop; no model yet) stops at SIGTERM at once,
  where as PID 1 it ignored it and was SIGKILLed at the end of the grace period;
- an orphan left in the orchestrator's container is reaped, where `gyre orchestrator` as PID 1 left it a zombie;
- the orchestrator still stops on SIGTERM with its documented code (143).
Needs a Docker daemon and the images of `make images`; runs when GYRE_DOCKER_TESTS=1, as
test_container_smoke_docker.py does.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from chart_testlib import CHART, MONITORING_APIS, ROOT, load_values

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
import cluster as C  # noqa: E402
import kube as K  # noqa: E402
import smoke as S  # noqa: E402
from plan import plan  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("GYRE_DOCKER_TESTS") != "1", reason="set GYRE_DOCKER_TESTS=1 after `make images`"
    ),
]


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


def test_pods_reap_orphans_and_stop_at_sigterm(pods):
    cluster, wanted = pods
    inference = next(p for p in wanted.values() if "inference" in p.name)
    orchestrator = next(p for p in wanted.values() if "orchestrator" in p.name)
    assert inference.shared_pid and orchestrator.shared_pid
    init = cluster.names.container(inference.name, "wait-for-model")
    main = cluster.names.container(orchestrator.name, "orchestrator")
    wait_for(lambda: C.docker("ps", "-q", "--filter", f"name=^{init}$", "--filter", "status=running", check=False)
             .strip(), 120, f"{init} running")  # fmt: skip
    # Its run loop is up (handlers installed): without Redis it retries, saying so.
    wait_for(lambda: any(s in C.tail(main, 50) for s in ("redis unavailable", "starting at step")), 120,
             f"{main} running its loop")  # fmt: skip

    # An orphan: the shell exits at once, its `sleep` child is re-parented to PID 1 and exits 1 s later.
    C.docker("exec", main, "sh", "-c", "sleep 1 & exit 0")
    time.sleep(4)
    processes = [line.split() for line in C.docker("exec", main, "sh", "-c", S.PS).splitlines()]
    zombies = [p for p in processes if p[1] == "Z"]
    assert zombies == [], f"zombies in pod {orchestrator.name}: {processes}"
    pid1 = next(p for p in processes if p[0] == "1")
    assert pid1[3] != "gyre", f"the service is PID 1 of pod {orchestrator.name}: {processes}"

    # SIGTERM: the init container's wait loop ends at once (killed by the signal: 128 + 15), not at SIGKILL.
    seconds, code = stop(init, 30)
    assert seconds < 10 and code == 143, f"{init}: stopped after {seconds:.1f} s with code {code}"
    seconds, code = stop(main, 30)  # `gyre orchestrator`: 143 on SIGTERM (its --help, docs/orchestrator.md)
    assert seconds < 20 and code == 143, f"{main}: stopped after {seconds:.1f} s with code {code}"
    assert not state(main)["OOMKilled"]
    assert "stopped by signal" in C.tail(main, 20)
