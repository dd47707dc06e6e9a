"""What a cluster admin's review of the chart found (issue 15), one test per finding: each renders the
case that failed and checks what the admin checks. Every render here is also strictly valid Kubernetes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart_testlib import (
    DEPLOY,
    KUBERNETES_VERSION,
    MONITORING_APIS,
    ROOT,
    containers,
    gyre_argv,
    load_values,
    manifests,
    named,
    objects,
    pod_templates,
    render,
    secret_data,
)

MULTI_NODE = {"trainer": {"nnodes": 2, "gpusPerNode": 0}}


def valid(docs: list[dict]) -> list[dict]:
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in {"ServiceMonitor", "PrometheusRule"}
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {error.message} at {list(error.path)}")
    return docs


def trainer_container(docs: list[dict]) -> dict:
    return named(docs, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]["containers"][0]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def selects(service: dict, labels: dict) -> bool:
    return service["spec"]["selector"].items() <= labels.items()


# 1. Every trainer pod becomes healthy: its probes call the health port every node serves; gRPC and
#    metrics (rank 0 only) are reached through a Service that selects pod 0 alone.
def test_multi_node_trainer_probes_the_health_port_every_pod_serves():
    docs = valid(manifests(render(MULTI_NODE)))
    trainer = trainer_container(docs)
    ports = {p["name"]: p["containerPort"] for p in trainer["ports"]}
    _, argv = gyre_argv(trainer)
    assert int(option(argv, "--server.health-port")) == ports["health"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert trainer[kind]["httpGet"]["port"] == "health", kind  # not grpc: rank > 0 serves no gRPC
    assert trainer["readinessProbe"]["httpGet"]["path"] == "/ready"

    pod_labels = named(docs, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["metadata"]["labels"]
    status = named(docs, "Service", "exp-gyre-trainer")
    assert {p["name"] for p in status["spec"]["ports"]} == {"grpc", "metrics"}
    for ordinal in (0, 1):
        labels = {**pod_labels, "statefulset.kubernetes.io/pod-name": f"exp-gyre-trainer-{ordinal}"}
        assert selects(status, labels) == (ordinal == 0), ordinal
    headless = named(docs, "Service", "exp-gyre-trainer-headless")
    assert headless["spec"]["clusterIP"] == "None" and selects(headless, pod_labels)
    # Pod 0 is global rank 0: the rendezvous ranks nodes by --local-addr, and pod 0's sorts first.
    local_addr = option(trainer["args"], "--local-addr")
    assert local_addr == "$(POD_NAME).exp-gyre-trainer-headless.rl.svc.cluster.local"
    assert sorted(local_addr.replace("$(POD_NAME)", f"exp-gyre-trainer-{i}") for i in (1, 10, 2, 0))[0].startswith(
        "exp-gyre-trainer-0."
    )


# 2. Upgrades never mix configurations inside one torchrun job.
def test_multi_node_trainer_is_replaced_as_a_whole():
    docs = manifests(render(MULTI_NODE))
    sts = named(docs, "StatefulSet", "exp-gyre-trainer")
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    rdzv = option(trainer_container(docs)["args"], "--rdzv-id")
    job = sts["spec"]["template"]["metadata"]["annotations"]["gyre.dev/trainer-job"]
    assert rdzv == f"exp-{job}"
    # Another experiment, other trainer values, another node count: another rendezvous, never a shared one.
    others = [
        {**MULTI_NODE, "experiment": {"trainer": {"optim": {"lr": 0.5}}}},
        {"trainer": {**MULTI_NODE["trainer"], "shmSize": "1Gi"}},
        {"trainer": {**MULTI_NODE["trainer"], "nnodes": 3}},
    ]
    ids = {option(trainer_container(manifests(render(v)))["args"], "--rdzv-id") for v in others}
    assert len(ids) == 3 and rdzv not in ids
    assert option(trainer_container(manifests(render(MULTI_NODE)))["args"], "--rdzv-id") == rdzv  # stable
    notes = render(MULTI_NODE)["gyre/templates/NOTES.txt"]
    assert "kubectl -n rl delete pod -l app.kubernetes.io/instance=exp,app.kubernetes.io/component=trainer" in notes
    # a rollback updates the StatefulSet's template alone too: its pods keep the bad revision's job until deleted
    assert "After a `helm upgrade` or `helm rollback` that changes the experiment or the trainer" in notes
    # One node: the StatefulSet stops the old pod before starting the new one; nothing to do by hand.
    single = named(manifests(render({})), "StatefulSet", "exp-gyre-trainer")
    assert single["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    assert "delete pod" not in render({})["gyre/templates/NOTES.txt"]


# 3. Each scrape target is scraped once: one Service per ServiceMonitor.
@pytest.mark.parametrize(
    "values", [{}, MULTI_NODE, load_values("values-multi-node.yaml")], ids=["default", "2-node", "multi-node"]
)
def test_each_service_monitor_selects_exactly_one_service(values):
    docs = manifests(render(values, api_versions=MONITORING_APIS))
    services = objects(docs, "Service")
    for monitor in objects(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        matching = [s["metadata"]["name"] for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert len(matching) == 1, (monitor["metadata"]["name"], matching)
        (service,) = [s for s in services if s["metadata"]["name"] == matching[0]]
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        assert "metrics" in [p["name"] for p in service["spec"]["ports"]]


# 4. Long release names: truncated, with a hash, so two releases never share an object name.
def test_long_release_names_that_differ_late_get_different_names():
    a, b = "rl-experiment-qwen3-8b-grpo-math-ablation-01", "rl-experiment-qwen3-8b-grpo-math-ablation-02"
    assert len(a) > 40 and a[:40] == b[:40]
    names = []
    for release in (a, b):
        docs = valid(manifests(render({}, name=release)))
        names.append({(d["kind"], d["metadata"]["name"]) for d in docs})
        for doc in docs:
            name = doc["metadata"]["name"]
            assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert names[0].isdisjoint(names[1])
    short = {d["metadata"]["name"] for d in manifests(render({}, name="exp"))}
    assert "exp-gyre-inference" in short  # short names are untouched


# 5. The API allow-list guards the API port alone; scrapers get the metrics port only.
def test_metrics_peers_never_reach_the_inference_api():
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ingress = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    docs = valid(manifests(render({"networkPolicy": {"metricsFrom": [monitoring], "apiFrom": [ingress]}})))
    rules = named(docs, "NetworkPolicy", "exp-gyre-inference")["spec"]["ingress"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in rules}
    assert monitoring not in by_port["http"] and ingress in by_port["http"]
    assert by_port["metrics"] == [monitoring]
    assert ingress not in by_port["metrics"] and ingress not in by_port["control"]
    # Default: no namespace-wide peer on the API port (metricsFrom's default is every namespace).
    default_rules = named(manifests(render({})), "NetworkPolicy", "exp-gyre-inference")["spec"]["ingress"]
    http = next(r for r in default_rules if r["ports"] == [{"port": "http"}])
    assert all("podSelector" in peer and "namespaceSelector" not in peer for peer in http["from"])
    inference = named(docs, "Deployment", "exp-gyre-inference")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in inference["ports"]}
    assert int(option(inference["args"], "--metrics.port")) == ports["metrics"] != ports["http"]


# 6. Every container has a memory limit by default (policy engines reject pods without one).
def test_every_container_has_a_memory_limit_by_default():
    for comp, pod in pod_templates(manifests(render({}))).items():
        for c in containers(pod["spec"]):
            assert c.get("resources", {}).get("limits", {}).get("memory"), f"{comp}/{c['name']}"


# 7. The multi-node example runs on stock GKE: no RuntimeClass that GKE does not have.
def test_multi_node_example_sets_no_runtime_class():
    values = load_values("values-multi-node.yaml")
    assert "runtimeClassName" not in values.get("gpu", {})
    assert "cloud.google.com/gke-accelerator" in (DEPLOY / "values-multi-node.yaml").read_text()
    for comp, pod in pod_templates(manifests(render(values))).items():
        assert "runtimeClassName" not in pod["spec"], comp


# 8a. clusterDomain: no hard-coded cluster.local.
def test_cluster_domain_is_used_for_every_address():
    rendered = render({"clusterDomain": "corp.internal", **MULTI_NODE})
    text = "\n".join(rendered.values())
    assert "cluster.local" not in text
    assert "exp-gyre-orchestrator.rl.svc.corp.internal:50061" in text
    assert "exp-gyre-trainer-0.exp-gyre-trainer-headless.rl.svc.corp.internal:29500" in text


# 8b. A MIG slice for inference beside full GPUs for training.
def test_gpu_resource_name_per_component():
    values = {"inference": {"gpuResourceName": "nvidia.com/mig-3g.40gb"}, "trainer": {"gpusPerNode": 8}}
    pods = pod_templates(valid(manifests(render(values))))
    inference = pods["inference"]["spec"]["containers"][0]["resources"]
    trainer = pods["trainer"]["spec"]["containers"][0]["resources"]
    assert inference["limits"]["nvidia.com/mig-3g.40gb"] == "1" and "nvidia.com/gpu" not in inference["limits"]
    assert trainer["limits"]["nvidia.com/gpu"] == "8" and "nvidia.com/mig-3g.40gb" not in trainer["limits"]


# 8c. Gang scheduling of the trainer: priorityClassName and schedulerName.
def test_priority_class_and_scheduler_per_component():
    values = {"trainer": {"priorityClassName": "training-high", "schedulerName": "volcano"},
              "redis": {"priorityClassName": "infra"}}  # fmt: skip
    pods = pod_templates(valid(manifests(render(values))))
    assert pods["trainer"]["spec"]["priorityClassName"] == "training-high"
    assert pods["trainer"]["spec"]["schedulerName"] == "volcano"
    assert pods["redis"]["spec"]["priorityClassName"] == "infra"
    assert "priorityClassName" not in pods["inference"]["spec"] and "schedulerName" not in pods["inference"]["spec"]


# 8d. Extra volumes (a dataset, a CA bundle) in the pod and the main container.
def test_extra_volumes_and_mounts():
    volume = {"name": "datasets", "persistentVolumeClaim": {"claimName": "team-datasets", "readOnly": True}}
    mount = {"name": "datasets", "mountPath": "/datasets", "readOnly": True}
    extra = {"extraVolumes": [volume], "extraVolumeMounts": [mount]}
    values = {c: extra for c in ("inference", "orchestrator", "trainer")}
    for comp, pod in pod_templates(valid(manifests(render(values)))).items():
        if comp in ("inference", "orchestrator", "trainer"):
            assert volume in pod["spec"]["volumes"], comp
            assert mount in pod["spec"]["containers"][0]["volumeMounts"], comp


# 8e. /cache cannot fill the node's disk.
def test_cache_volume_has_a_size_limit():
    for comp, pod in pod_templates(manifests(render({}))).items():
        for volume in pod["spec"].get("volumes", []):
            if volume["name"] == "cache":
                assert volume["emptyDir"].get("sizeLimit"), comp
    docs = valid(manifests(render({"trainer": {"cacheSize": "50Gi"}})))
    volumes = named(docs, "StatefulSet", "exp-gyre-trainer")["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "cache")["emptyDir"] == {"sizeLimit": "50Gi"}


# 8f. Dashboards of two experiments never replace each other in Grafana.
def test_dashboards_are_per_release():
    def dashboards(release: str) -> dict[str, dict]:
        maps = objects(manifests(render({}, name=release)), "ConfigMap")
        maps = [c for c in maps if "-dashboard-" in c["metadata"]["name"]]
        return {key: json.loads(text) for cm in maps for key, text in cm["data"].items()}

    a, b = dashboards("exp-a"), dashboards("exp-b")
    assert a and set(a).isdisjoint(b)  # the sidecar's file names
    assert {d["uid"] for d in a.values()}.isdisjoint({d["uid"] for d in b.values()})
    assert {d["title"] for d in a.values()}.isdisjoint({d["title"] for d in b.values()})
    assert all(len(d["uid"]) <= 40 for d in [*a.values(), *b.values()])


def test_a_releases_dashboards_open_on_its_namespace_and_runs():
    """`Gyre / Experiment overview (rl/exp-a)` opened on the first namespace Grafana listed and every run of it (no
    variable had a default): another namespace's, or another release's experiments. Each copy now chooses its own
    namespace and the run_ids its services export (the experiment's, each run's, each server's)."""
    values = {
        "runs": [{"name": "math"}, {"name": "code"}],
        "experiment": {"trainer": {"lora": {"rank": 8}}},
        "servers": [{"name": "judge", "model": "/data/model"}],
    }
    cases = (("exp-a", {}, ["exp-a"]), ("exp-b", values, ["exp-b", "math", "code", "exp-b-judge"]))
    for release, vals, run_ids in cases:
        docs = manifests(render(vals, name=release, namespace="team-rl"))
        maps = [c for c in objects(docs, "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
        models = [json.loads(text) for cm in maps for text in cm["data"].values()]
        assert len(models) == 3
        for model in models:
            chosen = {v["name"]: v.get("current") for v in model["templating"]["list"]}
            assert chosen["namespace"] == {"selected": True, "text": "team-rl", "value": "team-rl"}, model["title"]
            assert chosen["run_id"] == {"selected": True, "text": run_ids, "value": run_ids}, model["title"]
    # what every release's copy is made from chooses nothing: the choice is the release's
    committed = json.loads((ROOT / "charts" / "gyre" / "dashboards" / "overview.json").read_text())
    assert all("current" not in v for v in committed["templating"]["list"])


# 8g. Inference readiness is an HTTP GET of /ready, not a Python process every 10 s.
def test_inference_readiness_uses_ready_endpoint():
    for comp, pod in pod_templates(manifests(render({}))).items():
        for c in pod["spec"]["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert "python" not in json.dumps(c.get(kind, {})), (comp, kind)
    inference = pod_templates(manifests(render({})))["inference"]["spec"]["containers"][0]
    assert inference["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


# 8h. Redis: no password on its command line; its StatefulSet's serviceName is a headless Service.
def test_redis_password_is_not_on_the_command_line_and_service_name_is_headless():
    docs = valid(manifests(render({})))
    sts = named(docs, "StatefulSet", "exp-gyre-redis")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    password = secret_data(docs)["exp-gyre-secrets"]["redis-password"]
    words = redis["command"] + redis["args"]
    assert not any("$(REDIS_PASSWORD)" in w or password in w for w in words)  # Kubernetes expands nothing in
    exec_line = next(line for line in redis["args"][-1].splitlines() if "exec redis-server" in line)
    assert "requirepass" not in exec_line and "PASSWORD" not in exec_line  # what `ps` shows
    assert named(docs, "Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    auth = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth")
    assert auth["emptyDir"]["medium"] == "Memory"  # the password file never reaches a disk


# 8i. A Secret that does not rotate under `helm template` (GitOps): derived from secrets.seed.
def test_secret_is_stable_across_renders_with_a_seed():
    seed = {"secrets": {"seed": "x" * 48}}
    first, second = (secret_data(manifests(render(seed)))["exp-gyre-secrets"] for _ in range(2))
    assert first == second and set(first) == {"api-key", "control-token", "redis-password"}
    assert len(set(first.values())) == 3 and all(len(v) == 64 for v in first.values())
    other = secret_data(manifests(render(seed, name="exp2")))["exp2-gyre-secrets"]
    assert set(other.values()).isdisjoint(first.values())  # per release
    assert "x" * 48 not in "\n".join(render(seed).values())  # the seed itself is never rendered


# 7'. The default images exist: a release workflow builds and pushes them on tags.
def test_release_workflow_publishes_the_default_images():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "gyre" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "gyre" / "values.yaml").read_text())
    on = workflow.get("on", workflow.get(True))
    assert on["push"]["tags"] == ["v*"]
    text = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    built = {m["component"] for m in workflow["jobs"]["images"]["strategy"]["matrix"]["include"]}
    assert built == {"inference", "orchestrator", "trainer"}
    for comp in built:
        assert values[comp]["image"]["repository"] == f"ghcr.io/gyre-project/gyre-{comp}"
        assert (ROOT / f"Dockerfile.{comp}").exists()
    assert "Dockerfile.${{ matrix.component }}" in text
    assert "ghcr.io/gyre-project/gyre-${{ matrix.component }}:${GITHUB_REF_NAME#v}" in text
    # The chart's appVersion is the tag without its v: `helm install` pulls exactly what a tag pushed.
    assert "${GITHUB_REF_NAME#v}" in text and re.fullmatch(r"\d+\.\d+\.\d+", chart["appVersion"])


# 8j. Any password works: quotes and backslashes in Redis's config file, @ / % : in what the services
# dial (a password spliced into a URL broke both). The rendered redis-server script runs on a real
# redis-server with the Secret's file where the chart mounts it; each service's config, loaded from its
# rendered environment and that file, authenticates to it, and so does the rendered readiness probe.
def test_any_redis_password_reaches_redis_and_every_service(tmp_path, monkeypatch):
    import os
    import shutil
    import subprocess
    import time

    from chart_testlib import container_env, pod_name, secret_files
    from gyre.config.loader import load_config
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.trainer import TrainerConfig
    from gyre.net import free_port

    server = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")
    if not server:
        pytest.skip("needs a redis-server binary (apt install redis-server)")
    password = "p@ss\"w\\rd %/:#?'x"
    secrets = {"mine": {"api-key": "k", "control-token": "t", "redis-password": password + "\n"}}  # --from-file
    docs = valid(manifests(render({"secrets": {"existingSecret": "mine"}})))
    pods = pod_templates(docs)
    mounted = tmp_path / "secrets"

    def local(text: str) -> str:  # the Secret's mount path -> the folder holding its files here
        return text.replace("/run/secrets/gyre", str(mounted))

    redis = pods["redis"]["spec"]["containers"][0]
    for pod in pods.values():  # every pod mounts the same files (each the keys it reads)
        for path, text in secret_files(pod["spec"], pod["spec"]["containers"][0], docs, secrets).items():
            Path(local(path)).parent.mkdir(parents=True, exist_ok=True)
            Path(local(path)).write_text(text)
    port = free_port()
    script = local(redis["args"][-1]).replace("/run/redis", str(tmp_path)).replace("/data", str(tmp_path))
    script = re.sub(r"--port \d+", f"--port {port}", script)
    env = container_env(redis, docs, "exp-gyre-redis-0", secrets)
    env["PATH"] = f"{os.path.dirname(server)}:/usr/bin:/bin"
    proc = subprocess.Popen(["sh", "-c", script], env=env, cwd=tmp_path)
    try:
        configs = {"orchestrator": OrchestratorConfig, "trainer": TrainerConfig}  # inference uses no Redis
        for comp, config_cls in configs.items():
            container = pods[comp]["spec"]["containers"][0]
            assert {local(p) for p in secret_files(pods[comp]["spec"], container, docs, secrets)} >= {
                str(mounted / "redis-password")}  # fmt: skip
            rendered = container_env(container, docs, pod_name(docs, comp), secrets)
            assert password not in "".join(rendered.values())  # neither in the URL nor in any variable
            for name in [k for k in os.environ if k.startswith("GYRE_")]:
                monkeypatch.delenv(name)
            for name, value in rendered.items():
                if name.startswith("GYRE_"):
                    monkeypatch.setenv(name, local(value))
            monkeypatch.setenv(
                "GYRE_REDIS__URL", re.sub(r"//[^/]+/", f"//127.0.0.1:{port}/", rendered["GYRE_REDIS__URL"])
            )
            cfg = load_config(config_cls, [])
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert cfg.redis.client(socket_timeout=2).ping(), comp
                    break
                except Exception:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)
        probe = local(redis["readinessProbe"]["exec"]["command"][-1]).replace("-p 6379", f"-p {port}")
        assert subprocess.run(["sh", "-c", probe], env=env, timeout=10).returncode == 0
        (mounted / "redis-password").write_text("wrong")
        with pytest.raises(Exception, match="(?i)auth|password"):
            load_config(OrchestratorConfig, []).redis.client(socket_timeout=2).ping()
        assert subprocess.run(["sh", "-c", probe], env=env, timeout=10).returncode != 0
    finally:
        proc.terminate()
        proc.wait(10)
