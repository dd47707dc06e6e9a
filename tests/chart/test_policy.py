"""Policies the rendered manifests must obey, whatever the values: GPUs and GPU pools only where they
belong, restricted pods, one shared volume at one path, addresses that lead somewhere, no secret in
plain text, and command lines the services' real config models accept."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from chart_testlib import (
    GYRE_COMPONENTS,
    MONITORING_APIS,
    component,
    container_env,
    containers,
    experiment_toml,
    gyre_argv,
    load_values,
    manifests,
    named,
    objects,
    pod_name,
    pod_templates,
    render,
    secret_data,
    secret_files,
    service_config,
)
from gyre.config import load_config
from gyre.config.inference import InferenceConfig
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.trainer import TrainerConfig

EXTERNAL_REDIS = {"redis": {"external": {"url": "rediss://redis.infra:6380/2", "existingSecret": "infra-redis"}}}
SCENARIOS = {
    "default": {},
    "kind": load_values("values-kind.yaml"),
    "gpu-single-node": load_values("values-gpu-single-node.yaml"),
    "multi-node": load_values("values-multi-node.yaml"),
    "external-redis": EXTERNAL_REDIS,
    "existing-secret": {"secrets": {"existingSecret": "my-exp-secrets"}},
}
# Secrets the chart does not create in those scenarios (given by the user), with recognisable values.
USER_SECRETS = {
    "infra-redis": {"redis-password": "external-redis-pw"},
    "my-exp-secrets": {"api-key": "user-api-key", "control-token": "user-token", "redis-password": "user-redis-pw"},
}
CONFIGS = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}


@functools.cache
def docs_for(scenario: str) -> list[dict]:
    """Rendered once per scenario (tests only read them)."""
    return manifests(render(SCENARIOS[scenario], api_versions=MONITORING_APIS))


def gpu_amounts(container: dict, resource_name: str) -> tuple[str | None, str | None]:
    resources = container.get("resources", {})
    return resources.get("requests", {}).get(resource_name), resources.get("limits", {}).get(resource_name)


# ---- GPUs and node pools ---------------------------------------------------------------------------


@pytest.mark.parametrize("resource_name", ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"])
def test_gpus_are_requested_only_by_inference_and_trainer(resource_name):
    values = {"gpu": {"resourceName": resource_name, "runtimeClassName": "nvidia"}, "inference": {"gpus": 1},
              "trainer": {"gpusPerNode": 4}}  # fmt: skip
    pods = pod_templates(manifests(render(values)))
    for comp, pod in pods.items():
        for c in containers(pod["spec"]):
            requests = {**c.get("resources", {}).get("requests", {}), **c.get("resources", {}).get("limits", {})}
            gpu_keys = [k for k in requests if "gpu" in k or k == resource_name]
            if comp in ("inference", "trainer") and c["name"] == comp:
                assert gpu_amounts(c, resource_name) == (("1", "1") if comp == "inference" else ("4", "4"))
                assert gpu_keys == [resource_name]
            else:
                assert gpu_keys == [], f"{comp}/{c['name']} requests {gpu_keys}"
        assert (pod["spec"].get("runtimeClassName") == "nvidia") == (comp in ("inference", "trainer")), comp
    # torchrun starts one process per GPU.
    trainer = pods["trainer"]["spec"]["containers"][0]
    assert trainer["args"][trainer["args"].index("--nproc-per-node") + 1] == "4"


def test_cpu_deployments_request_no_gpu():
    for scenario in ("kind",):
        for comp, pod in pod_templates(docs_for(scenario)).items():
            for c in containers(pod["spec"]):
                assert not [k for k in c.get("resources", {}).get("requests", {}) if "gpu" in k], (comp, c["name"])


@pytest.mark.parametrize("scenario", ["default", "kind", "gpu-single-node"])
def test_gpu_pool_placement_only_on_inference_and_trainer(scenario):
    values = SCENARIOS[scenario]
    pools = {**render_values_pools(), **values.get("nodePools", {})}
    gpu_pool = pools["gpu"]
    pods = pod_templates(docs_for(scenario))
    for comp, pod in pods.items():
        spec = pod["spec"]
        selector = spec.get("nodeSelector", {})
        tolerations = spec.get("tolerations", [])
        on_gpu_pool = gpu_pool["nodeSelector"].items() <= selector.items() and all(
            t in tolerations for t in gpu_pool["tolerations"]
        )
        if comp in ("inference", "trainer"):
            assert on_gpu_pool, f"{comp} must run on the GPU pool"
        elif scenario != "gpu-single-node":  # there the only node is a GPU node, on purpose
            assert not on_gpu_pool, f"{comp} must not be placed on the GPU pool"
            assert not [t for t in tolerations if t in gpu_pool["tolerations"]], comp


def render_values_pools() -> dict:
    import yaml
    from chart_testlib import CHART

    return yaml.safe_load((CHART / "values.yaml").read_text())["nodePools"]


def test_component_placement_adds_to_its_pool():
    values = {"inference": {"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}}
    spec = pod_templates(manifests(render(values)))["inference"]["spec"]
    assert spec["nodeSelector"] == {"zone": "a"}
    assert {"key": "spot", "operator": "Exists"} in spec["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


# ---- security --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_pod_is_non_root_with_a_read_only_root_filesystem(scenario):
    pods = pod_templates(docs_for(scenario))
    assert set(GYRE_COMPONENTS) <= set(pods)
    for comp, pod in pods.items():
        spec = pod["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and isinstance(psc["runAsUser"], int) and psc["runAsUser"] > 0, comp
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, comp
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), comp
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], comp
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (comp, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (comp, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (comp, c["name"])
            assert not sc.get("privileged"), (comp, c["name"])
            assert sc.get("runAsUser", psc["runAsUser"]) > 0
        # A read-only root filesystem needs writable scratch space: /tmp is an emptyDir.
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], (comp, c["name"])


def test_gpu_pods_get_a_memory_backed_dev_shm_and_writable_caches():
    pods = pod_templates(manifests(render({})))
    for comp in GYRE_COMPONENTS:
        spec = pods[comp]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/cache"]]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["HF_HOME"].startswith("/cache/") and env["XDG_CACHE_HOME"] == "/cache"
        if comp in ("inference", "trainer"):
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_only_the_orchestrator_may_talk_to_the_api_server_and_only_for_kubernetes_discovery():
    for discovery in ("dns", "kubernetes"):
        docs = manifests(render({"orchestrator": {"discovery": discovery}}))
        pods = pod_templates(docs)
        for comp, pod in pods.items():
            expected = comp == "orchestrator" and discovery == "kubernetes"
            assert pod["spec"]["automountServiceAccountToken"] is expected, (discovery, comp)
        roles = objects(docs, "Role")
        if discovery == "dns":
            assert roles == [] and objects(docs, "RoleBinding") == []
            continue
        (role,) = roles
        assert role["rules"] == [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
        ]
        (binding,) = objects(docs, "RoleBinding")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": pods["orchestrator"]["spec"]["serviceAccountName"], "namespace": "rl"}
        ]
        assert objects(docs, "ClusterRole") == []


def test_inference_has_a_disruption_budget_and_no_surge():
    docs = manifests(render({"inference": {"replicas": 4}}))
    pdb = named(docs, "PodDisruptionBudget", "exp-gyre-inference")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "inference"
    deployment = named(docs, "Deployment", "exp-gyre-inference")
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    # Never two orchestrators for one run.
    assert named(docs, "Deployment", "exp-gyre-orchestrator")["spec"]["strategy"] == {"type": "Recreate"}


# ---- network policy --------------------------------------------------------------------------------


def allowed(docs: list[dict], source: str, target: str, port_name: str) -> bool:
    """Does the target component's NetworkPolicy admit source pods (same release) on that named port?"""
    policy = next(p for p in objects(docs, "NetworkPolicy") if component(p) == target)
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port_name not in ports:
            continue
        for peer in rule["from"]:
            labels = peer.get("podSelector", {}).get("matchLabels")
            same_namespace = "namespaceSelector" not in peer
            if labels is not None and labels.get("app.kubernetes.io/component") == source and same_namespace:
                return True
    return False


def test_network_policies_admit_exactly_the_designed_flows():
    docs = manifests(render({"networkPolicy": {"metricsFrom": []}}))
    flows = {
        ("orchestrator", "inference", "http"), ("orchestrator", "inference", "control"), ("test", "inference", "http"),
        ("trainer", "orchestrator", "grpc"),
        # trainer <-> trainer on every port: rendezvous and collectives pick ports at run time
        ("trainer", "trainer", "grpc"), ("trainer", "trainer", "metrics"), ("trainer", "trainer", "rdzv"),
        ("orchestrator", "redis", "redis"), ("trainer", "redis", "redis"),  # never inference: it uses no Redis
    }  # fmt: skip
    sources = ("inference", "orchestrator", "trainer", "test")
    ports = {"inference": ("http", "control"), "orchestrator": ("grpc", "metrics"),
             "trainer": ("grpc", "metrics", "rdzv"), "redis": ("redis",)}  # fmt: skip
    for target, names in ports.items():
        for source in sources:
            for port in names:
                assert allowed(docs, source, target, port) == ((source, target, port) in flows), (source, target, port)
    # Metrics ports are open to the configured scrapers, and nothing else is.
    with_scrapers = manifests(render({}))
    policy = next(p for p in objects(with_scrapers, "NetworkPolicy") if component(p) == "orchestrator")
    assert {"from": [{"namespaceSelector": {}}], "ports": [{"port": "metrics"}]} in policy["spec"]["ingress"]
    assert objects(manifests(render({"networkPolicy": {"enabled": False}})), "NetworkPolicy") == []


# ---- one shared volume, addresses that lead somewhere ---------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_shared_volume_is_mounted_at_the_same_path_in_all_three(scenario):
    docs = docs_for(scenario)
    values = SCENARIOS[scenario]
    mount = values.get("persistence", {}).get("mountPath", "/data")
    claims = set()
    for comp in GYRE_COMPONENTS:
        spec = pod_templates(docs)[comp]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        container = spec["containers"][0]
        (data,) = [m for m in container["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]]
        assert data["mountPath"] == mount, comp
        claims.add(volumes[data["name"]]["persistentVolumeClaim"]["claimName"])
        service, argv = gyre_argv(container)
        if service == "inference":  # serving reads models, not the run's folder: it gets no output_dir
            assert "--output-dir" not in argv
        else:
            assert argv[argv.index("--output-dir") + 1] == mount, comp  # the services' output_dir is the volume
    assert len(claims) == 1
    (claim,) = claims
    pvcs = objects(docs, "PersistentVolumeClaim")
    if values.get("persistence", {}).get("existingClaim"):
        assert pvcs == []
    else:
        assert [p["metadata"]["name"] for p in pvcs] == [claim]
        assert pvcs[0]["spec"]["accessModes"] == [values.get("persistence", {}).get("accessMode", "ReadWriteMany")]


def resolve(docs: list[dict], host: str, port: int) -> tuple[str, dict]:
    """Follow an in-cluster address to (component, container port) the way kube-proxy/DNS would."""
    match = re.fullmatch(r"(?:(?P<pod>[a-z0-9-]+)\.)?(?P<svc>[a-z0-9-]+)\.rl\.svc\.cluster\.local", host)
    assert match, f"{host} is not a <service>.rl.svc.cluster.local name"
    service = named(docs, "Service", match["svc"])
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    selector = service["spec"]["selector"]
    pods = pod_templates(docs).items()
    targets = [(comp, pod) for comp, pod in pods if selector.items() <= pod["metadata"]["labels"].items()]
    assert len(targets) == 1, f"Service {service['metadata']['name']} selects {len(targets)} pod templates"
    comp, pod = targets[0]
    if match["pod"]:  # a StatefulSet pod name: needs the StatefulSet's governing Service
        workload = next(d for d in docs if d["kind"] == "StatefulSet" and component(d) == comp)
        assert workload["spec"]["serviceName"] == service["metadata"]["name"]
        assert match["pod"].startswith(workload["metadata"]["name"] + "-")
    (container_port,) = [
        p
        for c in pod["spec"]["containers"]
        for p in c.get("ports", [])
        if service_port["targetPort"] in (p["name"], p["containerPort"])
    ]
    return comp, container_port


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_addresses_in_commands_reach_the_right_ports(scenario):
    docs = docs_for(scenario)
    pods = pod_templates(docs)
    argv = {comp: gyre_argv(pods[comp]["spec"]["containers"][0])[1] for comp in GYRE_COMPONENTS}
    ports = {comp: {p["name"]: p["containerPort"] for p in pods[comp]["spec"]["containers"][0]["ports"]}
             for comp in GYRE_COMPONENTS}  # fmt: skip

    # Each server binds all interfaces on the port its container declares.
    for comp, flag, port_name in [("inference", "--server.port", "http"), ("inference", "--control.port", "control"),
                                  ("orchestrator", "--server.port", "grpc"), ("trainer", "--server.port", "grpc"),
                                  ("orchestrator", "--metrics.port", "metrics"),
                                  ("trainer", "--metrics.port", "metrics"), ("inference", "--metrics.port", "metrics"),
                                  ("trainer", "--server.health-port", "health")]:  # fmt: skip
        assert int(option(argv[comp], flag)) == ports[comp][port_name], (comp, flag)
    for comp in GYRE_COMPONENTS:
        assert option(argv[comp], "--server.host") == "0.0.0.0"
    assert option(argv["inference"], "--control.host") == "0.0.0.0"

    # trainer -> orchestrator NotifyWeights
    host, port = option(argv["trainer"], "--orchestrator.address").rsplit(":", 1)
    grpc = {"name": "grpc", "containerPort": ports["orchestrator"]["grpc"]}
    assert resolve(docs, host, int(port)) == ("orchestrator", grpc)

    # orchestrator -> every ready replica, by per-replica addresses
    orch = argv["orchestrator"]
    if option(orch, "--inference.discovery") == "dns":
        dns_name = option(orch, "--inference.dns-name")
        service = named(docs, "Service", dns_name.split(".")[0])
        assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
    else:
        service = named(docs, "Service", option(orch, "--inference.kubernetes-service"))
        assert service["spec"]["clusterIP"] == "None"
        assert option(orch, "--inference.namespace") == "rl"
    host = f"{service['metadata']['name']}.rl.svc.cluster.local"
    for flag, port_name in [("--inference.http-port", "http"), ("--inference.control-port", "control")]:
        assert resolve(docs, host, int(option(orch, flag)))[1]["name"] == port_name

    # packing matches the trainer's world
    trainer = pods["trainer"]["spec"]["containers"][0]["args"]
    world = int(option(trainer, "--nnodes")) * int(option(trainer, "--nproc-per-node"))
    assert int(option(orch, "--batch.dp-world-size")) == world

    # multi-node rendezvous on pod 0 of the trainer StatefulSet
    if "--rdzv-endpoint" in trainer:
        host, port = option(trainer, "--rdzv-endpoint").rsplit(":", 1)
        assert resolve(docs, host, int(port)) == ("trainer", {"name": "rdzv", "containerPort": int(port)})
        assert host.startswith("exp-gyre-trainer-0.exp-gyre-trainer-headless.")
        assert named(docs, "Service", "exp-gyre-trainer-headless")["spec"]["publishNotReadyAddresses"] is True

    # orchestrator and trainer -> Redis; inference, which serves without Redis, gets no way to it (the pod
    # answering API callers never holds the password of the streams the trainer learns from)
    inference = pods["inference"]["spec"]["containers"][0]
    assert not [k for k in container_env(inference, docs, pod_name(docs, "inference"), USER_SECRETS) if "REDIS" in k]
    assert not [p for p in secret_files(pods["inference"]["spec"], inference, docs, USER_SECRETS) if "redis" in p]
    for comp in ("orchestrator", "trainer"):
        container = pods[comp]["spec"]["containers"][0]
        env = container_env(container, docs, pod_name(docs, comp), USER_SECRETS)
        files = secret_files(pods[comp]["spec"], container, docs, USER_SECRETS)
        url = env["GYRE_REDIS__URL"]
        assert "@" not in url  # the password travels beside the URL (a file), never in it
        password = files[env["GYRE_REDIS__PASSWORD_FILE"]]
        if scenario == "external-redis":
            assert (url, password) == ("rediss://redis.infra:6380/2", "external-redis-pw")
            continue
        assert password
        match = re.fullmatch(r"redis://(?P<host>[^:]+):(?P<port>\d+)/0", url)
        assert match, url
        assert resolve(docs, match["host"], int(match["port"]))[0] == "redis"
    test_env = container_env(pods["test"]["spec"]["containers"][0], docs, "test", USER_SECRETS)
    base = re.fullmatch(r"http://(?P<host>[^:]+):(?P<port>\d+)/v1", test_env["GYRE_BASE_URL"])
    assert resolve(docs, base["host"], int(base["port"])) == ("inference", {"name": "http", "containerPort": 8000})


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_probes_target_declared_ports(scenario):
    for comp, pod in pod_templates(docs_for(scenario)).items():
        for c in pod["spec"]["containers"]:
            names = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    assert comp == "test", f"{comp} has no {kind}"
                    continue
                for handler in ("httpGet", "tcpSocket", "grpc"):
                    if handler in probe:
                        port = probe[handler]["port"]
                        assert port in names or port in names.values(), (comp, kind, port)
                if comp == "orchestrator" and kind == "readinessProbe":
                    assert probe["grpc"]["port"] == names["grpc"]  # native gRPC health probe
                if comp in ("inference", "trainer") and kind == "readinessProbe":
                    assert probe["httpGet"]["path"] == "/ready"


# ---- secrets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_secrets_never_appear_in_plain_text_nor_in_any_environment(scenario):
    """Secrets reach pods only as files (a projected Secret volume): no environment variable of any
    container holds one or refers to a Secret (env vars reach every child process, reward and environment
    code included), no command line names one, and every pod mounts exactly the keys it reads."""
    rendered = render(SCENARIOS[scenario])
    docs = manifests(rendered)
    secret_values = {v for data in secret_data(docs).values() for v in data.values()}
    secret_values |= {v for data in USER_SECRETS.values() for v in data.values()}
    plain = "\n".join(text for path, text in rendered.items() if not path.endswith("secret.yaml"))
    for value in secret_values:
        assert value not in plain
    files_read = {comp: set() for comp in pod_templates(docs)}
    for comp, pod in pod_templates(docs).items():
        for c in containers(pod["spec"]):
            for var in c.get("env", []):
                assert "secretKeyRef" not in var.get("valueFrom", {}), (comp, c["name"], var["name"])
                assert "secretRef" not in str(c.get("envFrom", "")), (comp, c["name"])
                if re.search(r"KEY|TOKEN|PASSWORD|AUTH", var["name"]):
                    assert var["name"].endswith("_FILE") or var["name"] == "HF_TOKEN_PATH", (comp, var["name"])
                    assert var["value"].startswith("/run/secrets/gyre/"), (comp, var["name"])
                    files_read[comp].add(var["value"])
            args = c.get("args", [])
            for flag in args:  # a secret option on a command line may only name a file
                if flag.startswith("--") and re.search(r"(?i)key|token|pass", flag):
                    assert flag.endswith(("-file", "_file")), (comp, flag)
            words = " ".join(c.get("args", []) + c.get("command", [])) + str(c.get("readinessProbe", ""))
            files_read[comp] |= set(re.findall(r"/run/secrets/gyre/[a-z-]+", words))
        mounted = {path for c in containers(pod["spec"]) for path in secret_files(pod["spec"], c, docs, USER_SECRETS)}
        assert files_read[comp] == mounted, comp  # every file read is mounted, and no other
    # and none in the experiment file
    assert not re.search(r"(?i)api_key|control_token|password", experiment_toml(docs))


def test_secrets_are_generated_once_and_user_secrets_are_used_as_given():
    first = secret_data(manifests(render({})))["exp-gyre-secrets"]
    second = secret_data(manifests(render({})))["exp-gyre-secrets"]
    assert set(first) == {"api-key", "control-token", "redis-password"}
    assert all(len(v) == 48 and v.isalnum() for v in first.values())
    assert first != second  # random on install; `lookup` keeps the live values on upgrade
    docs = manifests(render({"secrets": {"existingSecret": "my-exp-secrets"}}))
    assert objects(docs, "Secret") == []
    refs = {
        source["secret"]["name"]
        for pod in pod_templates(docs).values()
        for volume in pod["spec"].get("volumes", [])
        for source in volume.get("projected", {}).get("sources", [])
        if "secret" in source
    }
    assert refs == {"my-exp-secrets"}


# ---- the services accept what the chart gives them -------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_service_configs_accept_the_rendered_commands_and_environment(scenario, tmp_path, monkeypatch):
    """Each container's argv, the rendered experiment file and its environment, through the real
    config models: no unknown key, no bad value, and the wiring lands in the intended fields."""
    docs = docs_for(scenario)
    experiment = tmp_path / "experiment.toml"
    experiment.write_text(experiment_toml(docs))
    pods = pod_templates(docs)
    for comp, config_cls in CONFIGS.items():
        container = pods[comp]["spec"]["containers"][0]
        service, argv = gyre_argv(container)
        assert service == comp
        argv = [a.replace("/etc/gyre/experiment.toml", str(experiment)) for a in argv]
        env = container_env(container, docs, pod_name(docs, comp), USER_SECRETS)
        mounted = tmp_path / comp  # the container's Secret files, where its environment says they are
        for path, text in secret_files(pods[comp]["spec"], container, docs, USER_SECRETS).items():
            (mounted / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (mounted / path.lstrip("/")).write_text(text)
        for name in [k for k in __import__("os").environ if k.startswith("GYRE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, str(mounted) + value if value.startswith("/run/secrets/") else value)
        cfg = load_config(config_cls, argv)
        secrets = USER_SECRETS.get("my-exp-secrets") if scenario == "existing-secret" else secret_data(docs).get(
            "exp-gyre-secrets")  # fmt: skip
        mount = Path(SCENARIOS[scenario].get("persistence", {}).get("mountPath", "/data"))
        if comp != "inference":  # inference reads no output_dir (test_options_read)
            assert cfg.output_dir == mount
        assert cfg.run_id == (SCENARIOS[scenario].get("experiment", {}).get("run_id") or "exp")
        redis_password = "external-redis-pw" if scenario == "external-redis" else secrets["redis-password"]
        if comp == "inference":
            # serving uses no Redis: it has no Redis settings, and no Redis password or URL reaches its pod
            assert "redis" not in type(cfg).model_fields and not any("REDIS" in name for name in env)
        else:
            assert cfg.redis.password.get_secret_value() == redis_password
        if comp == "inference":
            assert cfg.auth.api_key.get_secret_value() == secrets["api-key"]
            assert cfg.auth.control_token.get_secret_value() == secrets["control-token"]
        elif comp == "orchestrator":
            assert cfg.inference.api_key.get_secret_value() == secrets["api-key"]
            assert cfg.inference.control_token.get_secret_value() == secrets["control-token"]
            assert cfg.server.control_token.get_secret_value() == secrets["control-token"]
        else:
            assert cfg.orchestrator.control_token.get_secret_value() == secrets["control-token"]
        if SCENARIOS[scenario].get("modelInit", {}).get("enabled", True) and comp != "orchestrator":
            assert cfg.model.name == f"{mount}/model"
        for key in ("max_steps",):
            expected = SCENARIOS[scenario].get("experiment", {}).get(key)
            if expected is not None and hasattr(cfg, key):
                assert getattr(cfg, key) == expected


def test_no_service_links_in_gyre_pods():
    # Kubernetes would inject GYRE_INFERENCE_PORT=tcp://... for a release named "gyre"; the services
    # read GYRE_* as configuration, so those variables must not exist.
    docs = manifests(render({}, name="gyre"))
    assert named(docs, "Service", "gyre-inference")
    for comp, pod in pod_templates(docs).items():
        assert pod["spec"]["enableServiceLinks"] is False, comp


def test_long_release_names_give_valid_object_names():
    release = "a-very-long-experiment-name-for-qwen3-8b-math-run-42"  # 52 characters
    docs = manifests(render({"inference": {"replicas": 2}}, name=release))
    dns_label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    for doc in docs:
        name = doc["metadata"]["name"]
        limit = 52 if doc["kind"] == "StatefulSet" else 63  # the pods' controller-revision-hash label
        assert len(name) <= limit and dns_label.match(name), (doc["kind"], name)
    for pvc_template in [t for d in objects(docs, "StatefulSet") for t in d["spec"].get("volumeClaimTemplates", [])]:
        assert len(f"{pvc_template['metadata']['name']}-x-0") <= 253


def test_runs_and_servers_of_a_long_release_get_valid_names_the_services_reach(tmp_path):
    """`<fullname>-orchestrator-<run>` and `<fullname>-server-<name>` passed 63 characters with a long release
    (fullname 40) and a long run or server name: the API server refused the Service (before, `helm install`
    failed half-way). Each such name now ends with a hash, and every address the services get uses it."""
    release = "a-very-long-experiment-name-for-qwen3-8b-math-run-42"
    values = {
        "experiment": {"trainer": {"lora": {"rank": 8}, "loss": {"distill": 1.0}},
                       "orchestrator": {"teacher": {"url": "server:teacher-qwen3-32b-bf16"}}},
        "runs": [{"name": "alpha-long-run-name"}, {"name": "alpha-long-run-name-2"}],
        "servers": [{"name": "teacher-qwen3-32b-bf16", "model": "Qwen/Qwen3-32B"}],
    }  # fmt: skip
    docs = manifests(render(values, name=release, api_versions=MONITORING_APIS))
    dns_label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name (RFC 1035 label)
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and dns_label.match(name), (doc["kind"], name)
    services = {s["metadata"]["name"]: s for s in objects(docs, "Service")}
    deployments = {d["metadata"]["name"] for d in objects(docs, "Deployment")}
    orchestrators = sorted(n for n in deployments if "-orchestrator-" in n)
    assert len(orchestrators) == 2 and set(orchestrators) <= set(services)  # two runs, two distinct names

    trainer = next(d for d in objects(docs, "StatefulSet") if component(d) == "trainer")["metadata"]["name"]
    cfg = service_config(docs, tmp_path, "trainer", trainer)
    hosts = sorted(run.orchestrator.address.split(".")[0] for run in cfg.runs)
    assert hosts == orchestrators
    for run in cfg.runs:  # each run's address is its own orchestrator's Service
        deployment = named(docs, "Deployment", run.orchestrator.address.split(".")[0])
        assert deployment["spec"]["template"]["metadata"]["labels"]["gyre.dev/run"] == run.name

    teacher = service_config(docs, tmp_path, "orchestrator", orchestrators[0]).teacher
    host = teacher.url.split("//")[1].split(":")[0]
    assert host in services and host in deployments and "server" in host
    monitors = {m["metadata"]["name"] for m in objects(docs, "ServiceMonitor")}
    assert host in monitors


def test_a_gpu_pool_written_for_a_cloud_selects_only_its_own_labels():
    """docs/kubernetes.md's GKE pool: Helm merges values maps, so a label in the default `nodePools.gpu` stayed
    beside the user's (`nvidia.com/gpu.present`, which only NVIDIA's GPU operator sets: every GPU pod stayed
    Pending on stock GKE). The default pool has no labels; the GPU request is what places the pods."""
    pools = {"gpu": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}}
    pods = pod_templates(manifests(render({"nodePools": pools})))
    for comp in ("inference", "trainer"):
        assert pods[comp]["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pods[comp]["spec"][
            "tolerations"]  # fmt: skip
        assert int(pods[comp]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
