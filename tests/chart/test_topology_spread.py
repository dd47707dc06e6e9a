"""`<component>.topologySpreadConstraints` (docs/kubernetes.md, "Node pools and GPUs"): spreading a component's pods
over zones or nodes had no value (nodeSelector, tolerations and affinity did). A constraint without a
`labelSelector` counts the pods of its own workload, the selector of its Deployment or StatefulSet, so a replica is
never spread against the pods of another component or another run."""

from __future__ import annotations

import helm_python
import kubernetes_validate
import pytest
from chart_testlib import KUBERNETES_VERSION, manifests, pod_templates, render

ZONES = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
NODES = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": {"matchLabels": {"pool": "rl"}}}  # fmt: skip
VALUES = {
    "inference": {"replicas": 4, "topologySpreadConstraints": [ZONES, NODES]},
    "orchestrator": {"topologySpreadConstraints": [ZONES]},
    "trainer": {"nnodes": 2, "topologySpreadConstraints": [ZONES]},
    "redis": {"topologySpreadConstraints": [ZONES]},
    "servers": [{"name": "judge", "model": "/data/judge"}],  # takes the inference's, with its own pods
    "runs": [{"name": "alpha"}, {"name": "beta"}],
    "experiment": {"trainer": {"lora": {"rank": 8}}},
}


def test_each_workload_spreads_its_own_pods():
    docs = manifests(render(VALUES))
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 6  # inference, judge, two orchestrators, trainer, redis
    for workload in workloads:
        spec = workload["spec"]["template"]["spec"]
        own = workload["spec"]["selector"]["matchLabels"]
        constraints = spec["topologySpreadConstraints"]
        assert constraints[0] == {**ZONES, "labelSelector": {"matchLabels": own}}, workload["metadata"]["name"]
        # the pods it counts are the workload's own: its template carries every selected label
        assert own.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        if "inference" in workload["metadata"]["name"] or "server" in workload["metadata"]["name"]:
            assert constraints[1] == NODES  # a labelSelector of its own is kept as written
    # two runs' orchestrators each spread their own run's pods, not the other's
    orchestrators = [w for w in workloads if "orchestrator" in w["metadata"]["name"]]
    assert {w["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
            ["gyre.dev/run"] for w in orchestrators} == {"alpha", "beta"}  # fmt: skip
    # the `helm test` pod runs once: no spread (the orchestrator's constraints would count the wrong pods)
    assert "topologySpreadConstraints" not in pod_templates(docs)["test"]["spec"]
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Pod"):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_none_by_default():
    for spec in (p["spec"] for p in pod_templates(manifests(render({}))).values()):
        assert "topologySpreadConstraints" not in spec


def test_a_constraint_without_its_topology_key_is_refused_naming_the_value():
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render({"inference": {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}})
    assert "/inference/topologySpreadConstraints/0" in str(caught.value) and "topologyKey" in str(caught.value)
