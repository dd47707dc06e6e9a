"""Every container's requests stay within its limits. A values file replaces only the keys it sets, so raising
a request (deploy/values-multi-node.yaml: the orchestrator's memory to 16Gi) kept the chart's default limit (4Gi):
`helm install` applied the release until the API server refused that Deployment. The chart now refuses such
values at render, naming the key, and the examples render pods the API server accepts."""

from __future__ import annotations

import sys

import helm_python
import pytest
from chart_testlib import DEPLOY, MONITORING_APIS, ROOT, containers, load_values, manifests, render

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
from kube import quantity  # noqa: E402  (the container smoke's Kubernetes quantities)

EXAMPLES = sorted(p.name for p in DEPLOY.glob("values-*.yaml"))


def containers_of(docs: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Pod"):
            spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
            out += [(f"{doc['metadata']['name']}/{c['name']}", c) for c in containers(spec)]
    return out


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_requests_no_more_than_its_limits(example):
    docs = manifests(render(load_values(example), api_versions=MONITORING_APIS))
    over = []
    for name, container in containers_of(docs):
        requests = container.get("resources", {}).get("requests", {})
        for resource, limit in container.get("resources", {}).get("limits", {}).items():
            if resource in requests and quantity(requests[resource]) > quantity(limit):
                over.append(f"{name}: {resource} request {requests[resource]} > limit {limit}")
    assert not over, over


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"orchestrator": {"resources": {"requests": {"memory": "16Gi"}}}},
         "orchestrator.resources: requests.memory (16Gi) is above limits.memory (4Gi)"),
        ({"trainer": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}},
         "trainer.resources: requests.cpu (2) is above limits.cpu (1500m)"),
        ({"redis": {"resources": {"requests": {"memory": "3Gi"}}}},
         "redis.resources: requests.memory (3Gi) is above limits.memory (2Gi)"),
        ({"inference": {"resources": {"requests": {"memory": "1.5Ti"}}}},
         "inference.resources: requests.memory (1.5Ti) is above limits.memory (24Gi)"),
        ({"servers": [{"name": "rm", "model": "/data/rm", "resources": {"requests": {"memory": "8Gi"},
                                                                          "limits": {"memory": "4Gi"}}}]},
         "servers[0].resources: requests.memory (8Gi) is above limits.memory (4Gi)"),
        # a server without its own resources takes the inference's: that is the key to fix
        ({"servers": [{"name": "rm", "model": "/data/rm"}], "inference": {"resources": {"limits": {"memory": "8Gi"}}}},
         "inference.resources: requests.memory (16Gi) is above limits.memory (8Gi)"),
    ],
    ids=["orchestrator-default-limit", "trainer-cpu", "redis", "inference-decimal", "server-own", "server-inherited"],
)  # fmt: skip
def test_a_request_above_its_limit_is_refused_naming_the_key(values, message):
    with pytest.raises(helm_python.HelmError) as caught:
        render(values)
    assert message in str(caught.value)
    assert "raise the limit or lower the request" in str(caught.value)


def test_requests_equal_to_limits_in_other_units_render():
    values = {"trainer": {"resources": {"requests": {"cpu": "1000m", "memory": 1073741824},
                                        "limits": {"cpu": 1, "memory": "1Gi"}}}}  # fmt: skip
    assert manifests(render(values))


# A namespace whose ResourceQuota covers `limits.cpu` (and has no LimitRange default) admits a pod only when every
# container, init containers included, sets a CPU limit. The components' `resources` could; the chart's init
# containers and the `helm test` pod had fixed resources, so such a namespace refused every pod with one.
QUOTA = {"limits": {"cpu": "2"}}
HUB_AND_INIT = {"experiment": {"model": {"name": "Qwen/Qwen3-0.6B"}}, "modelInit": {"enabled": False},
                "servers": [{"name": "ref", "model": "/data/model"}]}  # fmt: skip


@pytest.mark.parametrize("values", [{}, HUB_AND_INIT], ids=["model-init", "model-fetch"])
def test_every_container_can_get_a_cpu_limit_for_a_quota(values):
    components = {c: {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}}
                  for c in ("inference", "orchestrator", "trainer", "redis")}  # fmt: skip
    aux = {"initResources": {"modelFetch": QUOTA, "modelInit": QUOTA, "waitForModel": QUOTA},
           "tests": {"enabled": True, "resources": QUOTA}}  # fmt: skip
    docs = manifests(render({**values, **components, **aux}))
    found = containers_of(docs)
    assert {name.split("/")[1] for name, _ in found} >= {"models", "inference", "trainer"}
    assert {name.split("/")[1] for name, _ in found} & {"model-fetch", "model-init", "wait-for-model"}
    for name, container in found:
        limits = container["resources"]["limits"]
        assert "cpu" in limits and "memory" in limits, (name, container["resources"])  # merged over the defaults


def test_the_init_containers_and_the_test_pod_keep_their_defaults():
    defaults = {"model-init": ({"cpu": "500m", "memory": "1Gi"}, {"memory": "4Gi"}),
                "wait-for-model": ({"cpu": "10m", "memory": "64Mi"}, {"memory": "256Mi"}),
                "models": ({"cpu": "50m", "memory": "64Mi"}, {"memory": "256Mi"})}  # fmt: skip
    for name, container in containers_of(manifests(render({}))):
        if (short := name.split("/")[1]) in defaults:
            assert (container["resources"]["requests"], container["resources"]["limits"]) == defaults[short], name


def test_an_init_request_above_its_limit_is_refused_naming_the_value():
    with pytest.raises(helm_python.HelmRenderError) as caught:
        render({"initResources": {"modelInit": {"requests": {"memory": "8Gi"}}}})
    assert "initResources.modelInit: requests.memory (8Gi) is above limits.memory (4Gi)" in str(caught.value)
