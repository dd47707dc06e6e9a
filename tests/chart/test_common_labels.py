"""`commonLabels`: labels on every object and pod of a release (docs/kubernetes.md, "Labels on every object").

A cluster whose admission policy requires labels (`team`, `cost-center`) on every workload and pod refused the
release, and a cost report could not group its GPUs by team: each component's `podLabels` reached its pods only,
never the Deployments, Services, volumes or the `helm test` pod. The labels never enter a selector or a
StatefulSet's claim template, which an upgrade cannot change.
"""

from __future__ import annotations

import copy

import helm_python
import pytest
from chart_testlib import KEDA_APIS, MONITORING_APIS, manifests, render

COMMON = {"team": "rl", "example.com/cost-center": "1234"}
# every kind of object the chart makes: servers, runs, kubernetes discovery (RBAC), autoscaling, monitoring
FULL = {
    "experiment": {"trainer": {"lora": {"rank": 8}}},
    "runs": [{"name": "alpha"}, {"name": "beta"}],
    "servers": [{"name": "judge", "model": "Qwen/Qwen3-0.6B"}],
    "orchestrator": {"discovery": "kubernetes"},
    "inference": {"autoscaling": {"enabled": True}},
    "modelCache": {"type": "pvc"},
}
APIS = MONITORING_APIS + KEDA_APIS


def full(values: dict) -> list[dict]:
    return manifests(render({**FULL, **values}, api_versions=APIS))


def pod_labels(doc: dict) -> dict | None:
    if doc["kind"] == "Pod":
        return doc["metadata"]["labels"]
    template = doc.get("spec", {}).get("template")
    return template["metadata"]["labels"] if template else None


def immutable(doc: dict) -> dict:
    """What selects pods or makes volumes: what a label change must leave alone."""
    spec = doc.get("spec", {})
    return {k: spec[k] for k in ("selector", "podSelector", "volumeClaimTemplates", "scaleTargetRef") if k in spec}


def test_every_object_and_pod_carries_the_common_labels():
    docs = full({"commonLabels": COMMON})
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "ConfigMap", "Secret", "Pod",
            "ServiceMonitor", "PrometheusRule", "ScaledObject", "Role", "NetworkPolicy"} <= kinds  # fmt: skip
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        assert COMMON.items() <= doc["metadata"]["labels"].items(), where
        if (labels := pod_labels(doc)) is not None:
            assert COMMON.items() <= labels.items(), f"pods of {where}"


def test_selectors_and_claim_templates_stay_as_they_were():
    """So `helm upgrade --set commonLabels...` on a running release changes no immutable field (it replaces the pods
    once, for their labels)."""
    before = {(d["kind"], d["metadata"]["name"]): immutable(d) for d in full({})}
    after = {(d["kind"], d["metadata"]["name"]): immutable(d) for d in full({"commonLabels": COMMON})}
    assert before == after


def test_a_components_pod_labels_and_the_monitoring_labels_win():
    values = {
        "commonLabels": {"team": "rl", "tier": "batch"},
        "inference": {**FULL["inference"], "podLabels": {"team": "serving"}},
        "monitoring": {"additionalLabels": {"team": "observability"}, "dashboards": {"labels": {"tier": "ui"}}},
    }
    docs = full(values)  # one key twice in a labels map would be a YAML error
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert pod_labels(by_name[("Deployment", "exp-gyre-inference")])["team"] == "serving"
    assert by_name[("Deployment", "exp-gyre-inference")]["metadata"]["labels"]["team"] == "rl"  # the object's own
    assert pod_labels(by_name[("StatefulSet", "exp-gyre-trainer")])["team"] == "rl"
    assert all(d["metadata"]["labels"]["team"] == "observability" for d in docs if d["kind"] == "ServiceMonitor")
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    assert dashboards and all(d["metadata"]["labels"]["tier"] == "ui" for d in dashboards)


@pytest.mark.parametrize(
    "labels",
    [
        {"app.kubernetes.io/instance": "other"},  # would move the pods out of their own selectors
        {"helm.sh/chart": "x"},
        {"gyre.dev/run": "x"},
        {"team": 7},
        {"team": "not a label value"},
        {"bad key!": "x"},
    ],
    ids=["selector-key", "helm-key", "gyre-key", "number", "bad-value", "bad-key"],
)
def test_a_label_that_cannot_work_is_refused_naming_common_labels(labels):
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as caught:
        render({"commonLabels": copy.deepcopy(labels)})
    assert "commonLabels" in str(caught.value), str(caught.value)
    key = next(iter(labels))
    if "/" in key:
        assert f"commonLabels: {key!r}".replace("'", '"') + " is a label of the chart's own" in str(caught.value)


def test_the_helm_test_pod_takes_its_own_annotations_and_labels():
    """A service mesh's sidecar never exits, so an injected `helm test` pod never finished (`helm test` waited for its
    timeout): the components had `podAnnotations` for the mesh's opt-out, the test pod none. Its hook annotations stay
    the chart's."""
    values = {
        "commonLabels": {"team": "rl"},
        "tests": {"podAnnotations": {"sidecar.istio.io/inject": "false", "helm.sh/hook": "pre-install"},
                  "podLabels": {"team": "qa", "suite": "smoke"}},
    }  # fmt: skip
    (pod,) = [d for d in manifests(render(values)) if d["kind"] == "Pod"]
    annotations, labels = pod["metadata"]["annotations"], pod["metadata"]["labels"]
    assert annotations["sidecar.istio.io/inject"] == "false"
    assert annotations["helm.sh/hook"] == "test"  # still a test hook, never run at install
    assert (labels["team"], labels["suite"], labels["app.kubernetes.io/component"]) == ("qa", "smoke", "test")
