"""The chart lints clean, renders for every supported shape of values, and every object it renders is
valid Kubernetes 1.30 (strict: unknown fields fail). Monitoring objects appear exactly when the
cluster serves monitoring.coreos.com/v1 (or when forced)."""

from __future__ import annotations

import json
import re
import shutil

import helm_python
import kubernetes_validate
import pytest
from chart_testlib import (
    CHART,
    KUBERNETES_VERSION,
    MONITORING_APIS,
    load_values,
    manifests,
    objects,
    render,
)

EXTERNAL_REDIS = {
    "redis": {
        "external": {"url": "redis://redis.infra.svc.cluster.local:6379/0", "existingSecret": "infra-redis"},
    }
}
EXISTING = {"secrets": {"existingSecret": "my-exp-secrets"}, "persistence": {"existingClaim": "team-volume"}}
# What a cluster admin sets beyond the examples: another DNS domain, a 2-node trainer on a gang
# scheduler, a MIG slice per replica, extra volumes, a GitOps seed, scraping from one namespace only.
ADMIN = {
    "clusterDomain": "corp.internal",
    "secrets": {"seed": "s" * 48},
    "inference": {"gpuResourceName": "nvidia.com/mig-3g.40gb", "priorityClassName": "serving"},
    "trainer": {"nnodes": 2, "gpusPerNode": 8, "priorityClassName": "training", "schedulerName": "volcano",
                "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
                "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
                "cacheSize": "100Gi"},
    "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}],
                      "apiFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}]},
}  # fmt: skip

# Operating a large run (issue 28): a hub model in a shared model-cache volume with a gated-model token,
# images pinned by digest, autoscaled inference replicas found through the Kubernetes API.
DIGEST = "sha256:" + "ab" * 32
OPERATIONS = {
    "experiment": {"model": {"name": "Qwen/Qwen3-8B"}},
    "modelInit": {"enabled": False},
    "modelCache": {"type": "pvc", "size": "40Gi", "tokenSecret": "hf"},
    "inference": {"image": {"digest": DIGEST}, "autoscaling": {"enabled": True, "maxReplicas": 8}},
    # KEDA, named as a GitOps render names it (`helm lint` has no --api-versions)
    "assumeApiVersions": ["keda.sh/v1alpha1"],
    "orchestrator": {"image": {"digest": DIGEST}, "discovery": "kubernetes"},
    "trainer": {"image": {"digest": DIGEST}},
    "redis": {"image": {"digest": DIGEST}},
}
# Judges, a reward model and a teacher beside the policy: a hub model fetched, one on the generated model.
SERVERS = {
    "servers": [{"name": "teacher", "model": "Qwen/Qwen3-8B", "gpus": 1}, {"name": "ref", "model": "/data/model"}],
    "experiment": {"orchestrator": {"teacher": {"url": "server:teacher"}}, "trainer": {"loss": {"distill": 1.0}}},
}
# A Helm operator's day two (chart 0.6.0): labels a policy requires on everything, replicas spread over zones, CPU
# limits for a quota on every container (init containers and the test pod too), a hub mirror for model-fetch, a
# mesh's opt-out on the test pod.
DAY_TWO = {
    "commonLabels": {"team": "rl", "example.com/cost-center": "4711"},
    "experiment": {"model": {"name": "Qwen/Qwen3-8B"}},
    "modelInit": {"enabled": False},
    "inference": {"replicas": 4, "env": [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.example.com"}],
                  "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                 "whenUnsatisfiable": "ScheduleAnyway"}]},
    "initResources": {"modelFetch": {"limits": {"cpu": "1"}}, "waitForModel": {"limits": {"cpu": "100m"}}},
    "tests": {"enabled": True, "resources": {"limits": {"cpu": "200m"}},
              "podAnnotations": {"sidecar.istio.io/inject": "false"}},
    "servers": [{"name": "judge", "model": "Qwen/Qwen3-0.6B"}],
}  # fmt: skip
# The vLLM backend serving LoRA adapters: three replicas, two runs on one base model (an adapter each), and one run
# publishing adapters rather than merged weights (the chart turns the replicas' LoRA on for it).
VLLM_RUNS = {
    "inference": {"replicas": 3},
    "experiment": {"inference": {"backend": "vllm"}, "trainer": {"lora": {"rank": 8}}},
    "runs": [{"name": "math"}, {"name": "code"}],
}
VLLM_ADAPTER = {
    "experiment": {"inference": {"backend": "vllm"}, "trainer": {"lora": {"rank": 8, "publish": "adapter"}}},
}
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}

# name -> (values, capabilities added to the render)
SCENARIOS = {
    "default": ({}, ()),
    "kind": (load_values("values-kind.yaml"), MONITORING_APIS),
    "gpu-single-node": (load_values("values-gpu-single-node.yaml"), ()),
    "multi-node": (load_values("values-multi-node.yaml"), MONITORING_APIS),
    "external-redis": (EXTERNAL_REDIS, ()),
    "existing-secret-and-claim": (EXISTING, ()),
    "monitoring-present": ({}, MONITORING_APIS),
    "monitoring-forced": ({"monitoring": {"enabled": True}, "assumeApiVersions": ["monitoring.coreos.com/v1"]}, ()),
    "admin-knobs": (ADMIN, MONITORING_APIS),
    "operations": (OPERATIONS, MONITORING_APIS),
    "servers": (SERVERS, MONITORING_APIS),
    "day-two": (DAY_TWO, MONITORING_APIS),
    "vllm-runs": (VLLM_RUNS, MONITORING_APIS),
    "vllm-adapter": (VLLM_ADAPTER, ()),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_strict_has_no_errors_or_warnings(scenario):
    values, _ = SCENARIOS[scenario]
    report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rendered_object_is_valid_kubernetes(scenario):
    values, apis = SCENARIOS[scenario]
    docs = manifests(render(values, api_versions=apis))
    assert len(docs) >= 15
    skipped = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            skipped.append(doc["kind"])  # CRDs: kubernetes-validate has no schema for them
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {error.message} at {list(error.path)}")
    assert set(skipped) <= CRD_KINDS, f"only CRD kinds may lack a schema, got {skipped}"


def kinds(values: dict, apis: tuple[str, ...] = ()) -> list[str]:
    return [d["kind"] for d in manifests(render(values, api_versions=apis))]


def test_monitoring_objects_only_when_the_crds_exist():
    assert CRD_KINDS.isdisjoint(kinds({}))  # auto, plain cluster
    present = manifests(render({"monitoring": {"additionalLabels": {"release": "kps"}}}, api_versions=MONITORING_APIS))
    monitors = objects(present, "ServiceMonitor")
    assert sorted(m["metadata"]["name"] for m in monitors) == ["exp-gyre-inference", "exp-gyre-orchestrator",
                                                                "exp-gyre-trainer"]  # fmt: skip
    rules = objects(present, "PrometheusRule")
    assert len(rules) == 1 and "groups" in rules[0]["spec"]
    for obj in monitors + rules:
        assert obj["metadata"]["labels"]["release"] == "kps"  # kube-prometheus-stack's selector
    # `true` requires them (test_optional_apis.py); `false` leaves them out where they are served.
    assert kinds({"monitoring": {"enabled": True}}, MONITORING_APIS).count("ServiceMonitor") == 3
    assert CRD_KINDS.isdisjoint(kinds({"monitoring": {"enabled": False}}, MONITORING_APIS))
    assert "PrometheusRule" not in kinds({"monitoring": {"rules": {"enabled": False}}}, MONITORING_APIS)


def test_service_monitors_scrape_ports_their_services_expose():
    docs = manifests(render({}, api_versions=MONITORING_APIS))
    services = objects(docs, "Service")
    for monitor in objects(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        matching = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert matching, f"{monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in [p["name"] for p in s["spec"]["ports"]] for s in matching)


def test_each_dashboard_file_becomes_a_configmap_for_the_grafana_sidecar(tmp_path):
    chart = tmp_path / "gyre"
    shutil.copytree(CHART, chart)
    dashboard = {"title": "Gyre test dashboard", "panels": [{"type": "timeseries", "title": "reward"}]}
    (chart / "dashboards").mkdir(exist_ok=True)
    (chart / "dashboards" / "test_overview.json").write_text(json.dumps(dashboard))
    files = sorted(p.name for p in (chart / "dashboards").glob("*.json"))

    docs = manifests(render({}, chart=chart))
    maps = [c for c in objects(docs, "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
    assert sorted(name for c in maps for name in c["data"]) == [f"exp-gyre-{f}" for f in files]
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    ours = next(c for c in maps if "exp-gyre-test_overview.json" in c["data"])
    assert ours["metadata"]["name"] == "exp-gyre-dashboard-test-overview"
    shipped = json.loads(ours["data"]["exp-gyre-test_overview.json"])
    assert shipped["panels"] == dashboard["panels"]
    assert shipped["title"] == "Gyre test dashboard (rl/exp)"

    off = manifests(render({"monitoring": {"dashboards": {"enabled": False}}}, chart=chart))
    assert not [c for c in objects(off, "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]


def test_notes_give_the_exact_port_forward_and_curl_commands():
    notes = render({})["gyre/templates/NOTES.txt"]
    assert "kubectl -n rl port-forward svc/exp-gyre-inference 8000:8000" in notes
    assert "kubectl -n rl get secret exp-gyre-secrets -o jsonpath='{.data.api-key}' | base64 -d" in notes
    assert 'curl -s http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $GYRE_API_KEY"' in notes
    runs = {"experiment": {"trainer": {"lora": {"rank": 8}}}, "runs": [{"name": "alpha"}, {"name": "beta"}]}
    for values in ({}, runs):  # every workload NOTES names exists (multi-run: one orchestrator per run)
        rendered = render(values)
        names = {(d["kind"], d["metadata"]["name"]) for d in manifests(rendered)}
        said = re.findall(
            r"\b(Deployments?|StatefulSet) ((?:[-a-z0-9]+(?:, )?)+)", rendered["gyre/templates/NOTES.txt"]
        )
        assert said
        for kind, listed in said:
            for name in listed.split(", "):
                assert (kind.rstrip("s"), name) in names, (kind, name)
    risky = render({"persistence": {"accessMode": "ReadWriteOnce"}, "networkPolicy": {"enabled": False}})
    assert "WARNING: the shared volume is ReadWriteOnce" in risky["gyre/templates/NOTES.txt"]
    assert "WARNING: networkPolicy.enabled=false" in risky["gyre/templates/NOTES.txt"]


def test_notes_name_the_grafana_dashboards_and_how_to_reach_grafana():
    """The operator's next question after the endpoint: where the dashboards are. NOTES names each one as
    Grafana lists it (the title the chart gives its ConfigMap) and how to port-forward to Grafana."""
    rendered = render({})
    notes = rendered["gyre/templates/NOTES.txt"]
    maps = [c for c in objects(manifests(rendered), "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
    titles = [json.loads(next(iter(c["data"].values())))["title"] for c in maps]
    assert len(titles) == len(list((CHART / "dashboards").glob("*.json"))) >= 3
    for title in titles:
        assert f'"{title}"' in notes
    assert "labelled grafana_dashboard=1" in notes
    assert "kubectl get svc -A -l app.kubernetes.io/name=grafana" in notes
    assert "port-forward svc/<its name> 3000:80   # then http://127.0.0.1:3000/dashboards?query=rl/exp" in notes
    off = render({"monitoring": {"dashboards": {"enabled": False}}})["gyre/templates/NOTES.txt"]
    assert "Grafana" not in off


def test_notes_after_an_upgrade_say_what_restarts_and_how_to_roll_back():
    with helm_python.Chart.load(CHART) as chart:
        install = chart.render({}, name="exp", namespace="rl", is_install=True)["gyre/templates/NOTES.txt"]
        upgrade = chart.render({}, name="exp", namespace="rl", is_upgrade=True, revision=4)["gyre/templates/NOTES.txt"]
    assert "installed as release exp in namespace rl" in install and "helm rollback" not in install
    assert "upgraded to revision 4 of release exp in namespace rl" in upgrade
    assert "helm rollback exp -n rl" in upgrade
    assert "kubectl -n rl get pods -l app.kubernetes.io/instance=exp -w" in upgrade


def test_helm_test_pod_calls_v1_models_with_the_api_key():
    docs = manifests(render({}))
    (pod,) = objects(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    script = container["args"][0]
    assert "client.models.list()" in script
    assert 'client.completions.create(model=models[0], prompt="Hello", max_tokens=1)' in script  # it generates
    env = {e["name"]: e for e in container["env"]}
    assert env["GYRE_BASE_URL"]["value"] == "http://exp-gyre-inference.rl.svc.cluster.local:8000/v1"
    assert env["GYRE_API_KEY_FILE"]["value"] == "/run/secrets/gyre/api-key"  # the Secret's key as a file
    (secrets,) = [v for v in pod["spec"]["volumes"] if v["name"] == "secrets"]
    assert secrets["projected"]["sources"] == [
        {"secret": {"name": "exp-gyre-secrets", "items": [{"key": "api-key", "path": "api-key"}]}}
    ]
    assert "Pod" not in kinds({"tests": {"enabled": False}})
