"""Values that need another project's API (KEDA's ScaledObject, the Prometheus operator's ServiceMonitor and
PrometheusRule) fail the render, naming the value and what to install, where the cluster does not serve it:
`helm install` used to apply part of the release and then stop on the API server's "no matches for kind".
`helm template` (no cluster to ask) renders them with `--api-versions` or `assumeApiVersions`."""

from __future__ import annotations

import helm_python
import pytest
from chart_testlib import KEDA_APIS, MONITORING_APIS, manifests, objects, render

AUTOSCALED = {"inference": {"autoscaling": {"enabled": True}}}
SERVICE_MONITOR_ONLY = ("monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor")


def kinds(values: dict, apis: tuple[str, ...] = ()) -> list[str]:
    return [d["kind"] for d in manifests(render(values, api_versions=apis))]


def refusal(values: dict, apis: tuple[str, ...] = ()) -> str:
    with pytest.raises(helm_python.HelmError) as caught:
        render(values, api_versions=apis)
    return str(caught.value)


def test_autoscaling_without_keda_is_refused_at_render_naming_the_value_and_keda():
    message = refusal(AUTOSCALED, MONITORING_APIS)
    assert "inference.autoscaling.enabled=true renders a KEDA ScaledObject (keda.sh/v1alpha1/ScaledObject)" in message
    assert "which this cluster does not serve: install KEDA" in message
    assert "or set inference.autoscaling.enabled=false" in message
    # what a `helm template` user does instead
    assert "--api-versions keda.sh/v1alpha1/ScaledObject" in message
    assert "assumeApiVersions: [keda.sh/v1alpha1]" in message
    # a cluster whose discovery lists KEDA's group/version with other kinds only is refused as well
    assert "install KEDA" in refusal(AUTOSCALED, ("keda.sh/v1alpha1", "keda.sh/v1alpha1/ScaledJob"))


@pytest.mark.parametrize(
    ("values", "apis"),
    [
        ({}, KEDA_APIS),  # helm install on a cluster with KEDA (or helm template --api-versions)
        ({}, ("keda.sh/v1alpha1",)),  # --api-versions with the group/version only (Argo CD's older releases)
        ({"assumeApiVersions": ["keda.sh/v1alpha1"]}, ()),  # helm template, the group/version named
        ({"assumeApiVersions": ["keda.sh/v1alpha1/ScaledObject"]}, ()),  # ... or the kind
    ],
    ids=["served", "served-group-version", "assumed-group-version", "assumed-kind"],
)
def test_autoscaling_renders_its_scaled_object_where_keda_is_served_or_assumed(values, apis):
    assert kinds({**AUTOSCALED, **values}, apis).count("ScaledObject") == 1


def test_monitoring_forced_on_without_the_operator_crds_is_refused():
    message = refusal({"monitoring": {"enabled": True}})
    assert "monitoring.enabled=true renders ServiceMonitors (monitoring.coreos.com/v1/ServiceMonitor)" in message
    assert "install the Prometheus operator's CRDs" in message
    assert "or set monitoring.enabled=auto" in message
    assert "assumeApiVersions: [monitoring.coreos.com/v1]" in message
    # ServiceMonitor served, PrometheusRule not: the rules are what is missing
    message = refusal({"monitoring": {"enabled": True}}, SERVICE_MONITOR_ONLY)
    assert "monitoring.rules.enabled=true renders PrometheusRules" in message
    assert "set monitoring.rules.enabled=false" in message
    ok = kinds({"monitoring": {"enabled": True, "rules": {"enabled": False}}}, SERVICE_MONITOR_ONLY)
    assert ok.count("ServiceMonitor") == 3 and "PrometheusRule" not in ok


def test_monitoring_auto_never_fails_and_follows_what_is_served_or_assumed():
    assert {"ServiceMonitor", "PrometheusRule"}.isdisjoint(kinds({}))
    partial = kinds({}, SERVICE_MONITOR_ONLY)
    assert partial.count("ServiceMonitor") == 3 and "PrometheusRule" not in partial
    assumed = kinds({"assumeApiVersions": ["monitoring.coreos.com/v1"]})
    assert assumed.count("ServiceMonitor") == 3 and assumed.count("PrometheusRule") == 1
    forced = kinds({"monitoring": {"enabled": True}, "assumeApiVersions": ["monitoring.coreos.com/v1"]})
    assert forced == assumed


def test_only_the_optional_objects_depend_on_the_apis():
    """The refusal is about the optional objects: with them off, no API of another project is needed."""
    docs = manifests(render({"monitoring": {"enabled": False}}))
    assert objects(docs, "ScaledObject") == [] and objects(docs, "ServiceMonitor") == []
    assert {d["apiVersion"].split("/")[0] for d in docs} <= {"v1", "apps", "policy", "networking.k8s.io",
                                                             "rbac.authorization.k8s.io"}  # fmt: skip
