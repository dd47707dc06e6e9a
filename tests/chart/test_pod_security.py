"""Every pod the chart can render passes the Kubernetes "restricted" Pod Security Standard (the level the
kind workflow enforces on its namespace), checked field by field as the API server's admission does
(k8s.io/pod-security-admission, policy version 1.30), for every values shape the tests render, every
values file under deploy/ and every values example in docs/kubernetes.md; and each of those examples
lints clean (strict) and renders as written."""

from __future__ import annotations

import functools
import re

import helm_python
import pytest
import yaml
from chart_testlib import CHART, INIT, KEDA_APIS, KUBERNETES_VERSION, MONITORING_APIS, ROOT, manifests, render
from test_render import SCENARIOS as RENDER_SCENARIOS

DOC = ROOT / "docs" / "kubernetes.md"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


class HelmYamlLoader(yaml.SafeLoader):
    """Scalars as Helm's YAML parser reads a values file: `2e-3` is a number (YAML 1.2), not a string
    (PyYAML follows YAML 1.1, whose floats need a dot)."""


HelmYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def doc_examples() -> dict[str, dict]:
    """The ```yaml blocks of docs/kubernetes.md (each a values file), by their first line."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", DOC.read_text(), re.S | re.M)
    return {f"doc:{b.splitlines()[0][:60]}": yaml.load(b, Loader=HelmYamlLoader) for b in blocks}


# Values the docs' examples need from a cluster: the optional APIs (the autoscaling example says KEDA).
DOC_APIS = MONITORING_APIS + KEDA_APIS
DOCS = doc_examples()
# OpenShift's restricted SCC assigns each pod a uid and fsGroup from the namespace's range and refuses others.
PLATFORM_IDS = {"podSecurity": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
                "redis": {"runAsUser": None, "runAsGroup": None}}  # fmt: skip
SCENARIOS = {
    **{k: v for k, v in RENDER_SCENARIOS.items()},
    **{k: (v, DOC_APIS) for k, v in DOCS.items()},
    "platform-assigned-ids": (PLATFORM_IDS, ()),
}


@functools.cache
def pods(scenario: str) -> list[tuple[str, dict]]:
    """(`Kind/name`, pod spec) of every pod the scenario renders: workloads' templates and bare Pods."""
    values, apis = SCENARIOS[scenario]
    out = []
    for doc in manifests(render(values, api_versions=apis)):
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in WORKLOADS:
            out.append((where, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "CronJob":
            out.append((where, doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
        elif doc["kind"] == "Pod":
            out.append((where, doc["spec"]))
    return out


# The restricted profile (policy version 1.30), baseline checks included.
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                   "secret"}  # fmt: skip
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}  # fmt: skip
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(spec: dict) -> list[str]:
    """What the restricted Pod Security Standard forbids in a pod spec, one line per finding."""
    found = []
    psc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"{key}: true")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {v['name']}: type {sorted(kinds - ALLOWED_VOLUMES)} not allowed")
    for s in psc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {s['name']} not allowed")
    pod_types = {"seccomp": (psc.get("seccompProfile") or {}).get("type"),
                 "apparmor": (psc.get("appArmorProfile") or {}).get("type")}  # fmt: skip
    if pod_types["seccomp"] not in (None, "RuntimeDefault", "Localhost"):
        found.append(f"pod seccompProfile {pod_types['seccomp']}")
    if pod_types["apparmor"] == "Unconfined":
        found.append("pod appArmorProfile Unconfined")
    if (psc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
        found.append("pod seLinuxOptions.type")
    if psc.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for c in spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", []):
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities add {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_types["seccomp"]
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container): {seccomp}")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{name}: appArmorProfile Unconfined")
        if (sc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
            found.append(f"{name}: seLinuxOptions.type")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount {sc['procMount']}")
        if [p for p in c.get("ports", []) if p.get("hostPort")]:
            found.append(f"{name}: hostPort")
    return found


def test_the_checker_finds_what_the_standard_forbids():
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}  # fmt: skip
    assert restricted_violations(good) == []
    root = {"runAsUser": 0, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}
    bad = {"hostPID": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "initContainers": [{"name": "i", "securityContext": root}],
           "containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}  # fmt: skip
    found = "\n".join(restricted_violations(bad))
    for needed in ("hostPID", "volume h", "i: capabilities add", "i: runAsUser 0", "i: runAsNonRoot",
                   "c: allowPrivilegeEscalation", "c: capabilities must drop ALL", "c: seccompProfile",
                   "c: hostPort"):  # fmt: skip
        assert needed in found, needed


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_pod_meets_the_restricted_pod_security_standard(scenario):
    rendered = pods(scenario)
    assert rendered, "every scenario renders pods"
    violations = {where: v for where, spec in rendered if (v := restricted_violations(spec))}
    assert violations == {}


@pytest.mark.parametrize("example", sorted(DOCS))
def test_every_values_example_in_the_docs_lints_clean_and_renders(example):
    values = DOCS[example]
    report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]
    assert manifests(render(values, api_versions=DOC_APIS))  # the chart's own checks (`fail`) pass too


def test_the_docs_examples_and_the_shipped_values_files_are_all_covered():
    assert len(DOCS) >= 5
    shipped = sorted(p.name for p in (ROOT / "deploy").glob("values-*.yaml"))
    covered = {name for name, (values, _) in RENDER_SCENARIOS.items()}
    assert shipped and all(f.removeprefix("values-").removesuffix(".yaml") in covered for f in shipped), shipped


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_gyre_container_runs_under_an_init_and_only_redis_shares_its_process_namespace(scenario):
    """Every container of a Gyre image, init containers and the `helm test` pod included, runs its command under
    tini (the images' entrypoint: tests/chart/test_container_smoke_docker.py runs them). As PID 1 it reaps
    orphans and forwards SIGTERM, which a service or `sh -c` loop as PID 1 ignored without a handler. So no
    Gyre pod shares its process namespace (its containers cannot see each other's processes); the Redis pod
    does: its image has no init, and the pause container reaps for redis-server (the orphans of its exec probes).
    Its one container keeps that harmless: a sidecar or init container added to it would see redis-server's
    processes and files (its password's config file), docs/kubernetes.md "Processes and signals"."""
    for where, spec in pods(scenario):
        redis = where.endswith("-redis")
        assert spec.get("shareProcessNamespace", False) is redis, where
        if redis:  # why sharing is harmless there: nothing but redis-server (and the pause container) in it
            assert [c["name"] for c in spec["containers"]] == ["redis"] and not spec.get("initContainers"), where
        for c in spec.get("initContainers", []) + spec["containers"]:
            if not redis:
                assert c["command"][: len(INIT)] == INIT and len(c["command"]) > len(INIT), (where, c["name"])


def test_ids_set_to_null_are_left_to_the_platform():
    """`podSecurity.*` and `redis.runAsUser/runAsGroup` null: no pod names a uid, gid or fsGroup (OpenShift
    refuses a pod whose ids lie outside its namespace's range), and every pod is still runAsNonRoot (the
    images' user is numeric; tests/chart/test_container_smoke_docker.py runs them as an arbitrary uid).
    Before, the schema required all five and `helm install` refused the values."""
    for where, spec in pods("platform-assigned-ids"):
        psc = spec["securityContext"]
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(psc), (where, psc)
        assert psc["runAsNonRoot"] is True
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert not {"runAsUser", "runAsGroup"} & set(c["securityContext"]), (where, c["name"])
    defaults = dict(pods("default"))
    assert all(spec["securityContext"]["runAsUser"] == 10001 for spec in defaults.values())
    assert all(spec["securityContext"]["fsGroup"] == 10001 for spec in defaults.values())
