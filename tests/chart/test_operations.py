"""Operating a run (issue 28): a big model has room the scheduler knows of, a drain never kills a training
job, a chart upgrade alone restarts nothing, secrets stay out of environments, Redis runs as a high
non-root user, and images can be pinned by digest. Each test renders what failed before and checks it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml
from chart_testlib import (
    CHART,
    KEDA_APIS,
    KUBERNETES_VERSION,
    component,
    container_env,
    containers,
    fullname,
    init_action,
    manifests,
    named,
    objects,
    pod_name,
    pod_templates,
    render,
    service_config,
)
from gyre.config.loader import load_config
from gyre.model_source import ModelFetchConfig

HUB = {"experiment": {"model": {"name": "Qwen/Qwen3-8B"}}, "modelInit": {"enabled": False}}
DIGEST = "sha256:" + "0123456789abcdef" * 4
GIB = 2**30


def valid(docs: list[dict]) -> list[dict]:
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
    return docs


def main(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


def volume(pod: dict, name: str) -> dict:
    (found,) = [v for v in pod["spec"]["volumes"] if v["name"] == name]
    return found


def mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


# ---- 1. the model cache is on a volume the scheduler accounts for ------------------------------------


def test_model_cache_emptydir_is_limited_and_requested_as_ephemeral_storage():
    docs = valid(manifests(render({**HUB, "modelCache": {"size": "40Gi"}, "trainer": {"cacheSize": "5Gi"}})))
    pods = pod_templates(docs)
    for comp, compile_cache in (("inference", 10), ("trainer", 5)):
        pod = pods[comp]
        assert volume(pod, "model-cache")["emptyDir"] == {"sizeLimit": "40Gi"}
        assert mounts(main(pod))["/cache/huggingface"] == "model-cache"  # HF_HOME: where hub models land
        # the scheduler places the pod only where its emptyDirs fit: the model cache plus /cache
        assert main(pod)["resources"]["requests"]["ephemeral-storage"] == f"{40 + compile_cache}Gi", comp
    orchestrator = main(pods["orchestrator"])
    assert orchestrator["resources"]["requests"]["ephemeral-storage"] == "2Gi"  # its /cache only
    assert "/cache/huggingface" not in mounts(orchestrator)
    # the generated tiny model lives on the shared volume: no model cache, /cache alone is requested
    tiny = pod_templates(manifests(render({})))
    assert "/cache/huggingface" not in mounts(main(tiny["inference"]))
    assert main(tiny["trainer"])["resources"]["requests"]["ephemeral-storage"] == "10Gi"
    # a request set by hand wins
    own = {**HUB, "inference": {"resources": {"requests": {"cpu": "1", "ephemeral-storage": "300Gi"}}}}
    assert main(pod_templates(manifests(render(own)))["inference"])["resources"]["requests"]["ephemeral-storage"] == (
        "300Gi"
    )


def test_model_cache_pvc_is_one_claim_shared_by_inference_and_trainer():
    values = {**HUB, "modelCache": {"type": "pvc", "size": "200Gi", "storageClass": "filestore"}}
    docs = valid(manifests(render(values)))
    claim = named(docs, "PersistentVolumeClaim", "exp-gyre-model-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["spec"]["storageClassName"] == "filestore"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pods = pod_templates(docs)
    for comp in ("inference", "trainer"):
        assert volume(pods[comp], "model-cache") == {
            "name": "model-cache", "persistentVolumeClaim": {"claimName": "exp-gyre-model-cache"}}  # fmt: skip
        # the PVC is accounted by the volume's own size: only /cache is ephemeral
        assert main(pods[comp])["resources"]["requests"]["ephemeral-storage"] == "10Gi"
    existing = manifests(render({**values, "modelCache": {"type": "pvc", "size": "1Ti", "existingClaim": "models"}}))
    assert [c["metadata"]["name"] for c in objects(existing, "PersistentVolumeClaim")] == ["exp-gyre-data"]
    assert volume(pod_templates(existing)["trainer"], "model-cache")["persistentVolumeClaim"] == {"claimName": "models"}


def test_a_hub_model_is_fetched_first_and_a_model_that_cannot_fit_stops_with_its_sizes():
    docs = valid(manifests(render({**HUB, "modelCache": {"size": "20Gi"}})))
    for comp, pod in pod_templates(docs).items():
        if comp not in ("inference", "trainer"):
            continue
        (fetch,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "model-fetch"]
        action, args = init_action(fetch)
        words = ["gyre", "model", action, *args]  # files/init.py runs `gyre model fetch` with the arguments
        assert words[:5] == ["gyre", "model", "fetch", "--name", "Qwen/Qwen3-8B"]
        assert words[words.index("--cache-dir") + 1] == "/cache/huggingface"
        assert int(words[words.index("--max-size") + 1]) == 20 * GIB  # the emptyDir's limit, in bytes
        assert words[words.index("--size-setting") + 1] == "modelCache.size"  # what the message tells to raise
        fetch_config = load_config(ModelFetchConfig, words[3:])  # the real command accepts them
        assert (fetch_config.name, str(fetch_config.cache_dir)) == ("Qwen/Qwen3-8B", "/cache/huggingface")
        # a failure's last log lines become the pod's termination message (`kubectl describe pod`)
        assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert mounts(fetch)["/cache/huggingface"] == "model-cache"
        env = {e["name"]: e.get("value") for e in main(pod)["env"]}
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/cache/huggingface"  # the fetched copy only
    # no fetch for the generated tiny model or a model folder on the shared volume
    for values in ({}, {"experiment": {"model": {"name": "/data/models/mine"}}, "modelInit": {"enabled": False}}):
        for pod in pod_templates(manifests(render(values))).values():
            assert "model-fetch" not in [c["name"] for c in pod["spec"].get("initContainers", [])]


MIRROR_ENV = [
    {"name": "HF_ENDPOINT", "value": "http://hub-mirror.internal"},
    {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}},
    {"name": "REQUESTS_CA_BUNDLE", "value": "/etc/ca/bundle.pem"},
]
CA = {"extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
      "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ca", "readOnly": True}]}  # fmt: skip


def test_model_fetch_gets_the_components_env_and_mounts_to_reach_the_hub():
    """`model-fetch` is the one container that downloads (the services load offline), yet it got none of the
    component's `env` nor `extraVolumeMounts`: a hub mirror (HF_ENDPOINT), a proxy and its CA bundle reached the
    main container only, and the fetch went to huggingface.co (or failed behind the proxy)."""
    servers = [{"name": "judge", "model": "Qwen/Qwen3-0.6B", "env": MIRROR_ENV[:1]}]
    values = {**HUB, "inference": {"env": MIRROR_ENV, **CA}, "trainer": {"env": MIRROR_ENV, **CA}, "servers": servers}
    docs = valid(manifests(render(values)))
    for comp, pod in pod_templates(docs).items():
        if comp not in ("inference", "trainer", "server-judge"):
            continue
        (fetch,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "model-fetch"]
        env = {e["name"]: e for e in fetch["env"]}
        for var in main(pod)["env"]:
            if var["name"] in ("HF_ENDPOINT", "HTTPS_PROXY", "REQUESTS_CA_BUNDLE"):
                assert env.get(var["name"]) == var, (comp, var)  # the same value, or the same Secret's key
        assert "HF_ENDPOINT" in env, comp
        if comp != "server-judge":  # its own env replaces the inference's; no extra volumes of its own
            assert mounts(fetch)["/etc/ca"] == "ca" and mounts(main(pod))["/etc/ca"] == "ca", comp


def test_model_fetch_downloads_from_the_mirror_its_env_names(tmp_path):
    """The rendered `model-fetch`, run as the kubelet would (files/init.py, its environment), asks the hub mirror
    that `inference.env` names: a local HTTP server here, which answers 404 for the model (one error, exit 1)."""
    import http.server
    import threading

    from chart_testlib import init_process

    asked = []

    class Mirror(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (stdlib API)
            asked.append(self.path)
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "Repository not found"}')

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = [{"name": "HF_ENDPOINT", "value": f"http://127.0.0.1:{server.server_port}"}]
        docs = manifests(render({**HUB, "inference": {"env": env}}))
        (fetch,) = [c for c in pod_templates(docs)["inference"]["spec"]["initContainers"] if c["name"] == "model-fetch"]
        words, environment = init_process(fetch, docs, "pod-0", tmp_path, offline=False)
        done = subprocess.run(words, env=environment, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr
    assert any(path.startswith("/api/models/Qwen/Qwen3-8B") for path in asked), asked
    assert "gyre model fetch: error: Qwen/Qwen3-8B" in done.stderr


def test_gated_models_read_the_hub_token_from_a_file():
    docs = valid(manifests(render({**HUB, "modelCache": {"size": "20Gi", "tokenSecret": "hf", "tokenKey": "t"}})))
    pod = pod_templates(docs)["inference"]
    sources = volume(pod, "secrets")["projected"]["sources"]
    assert {"secret": {"name": "hf", "items": [{"key": "t", "path": "hf-token"}]}} in sources
    for container in containers(pod["spec"])[:1] + [main(pod)]:
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN_PATH"] == {"name": "HF_TOKEN_PATH", "value": "/run/secrets/gyre/hf-token"}


# ---- 2. trainer protection ---------------------------------------------------------------------------


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_running_trainer_is_never_evicted_by_a_drain_or_the_cluster_autoscaler(nnodes):
    docs = valid(manifests(render({"trainer": {"nnodes": nnodes, "gpusPerNode": 8}})))
    pdb = named(docs, "PodDisruptionBudget", "exp-gyre-trainer")
    assert pdb["spec"]["maxUnavailable"] == 0  # every eviction of a running trainer pod is refused
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pending/crashing one never blocks
    trainer = named(docs, "StatefulSet", "exp-gyre-trainer")
    template_labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    annotations = trainer["spec"]["template"]["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    # no other component's pods are held: inference keeps its own budget, the orchestrator and Redis none
    held = {component(p) for p in objects(docs, "PodDisruptionBudget")}
    assert held == {"inference", "trainer"}
    off = manifests(render({"trainer": {"pdb": {"enabled": False}}}))
    assert [component(p) for p in objects(off, "PodDisruptionBudget")] == ["inference"]


def chart_copy(tmp_path: Path, name: str, **fields) -> Path:
    copy = tmp_path / name / "gyre"
    shutil.copytree(CHART, copy)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    (copy / "Chart.yaml").write_text(yaml.safe_dump({**meta, **fields}, sort_keys=False))
    return copy


def workloads(values: dict, chart: Path = CHART) -> dict[str, dict]:
    """The pod templates of the Deployments and StatefulSets (the `helm test` pod is made anew each run)."""
    return {comp: pod for comp, pod in pod_templates(manifests(render(values, chart=chart))).items() if comp != "test"}


def test_a_chart_upgrade_alone_changes_no_pod_template(tmp_path):
    """Pod template labels hold nothing that follows the chart (helm.sh/chart, app.kubernetes.io/version):
    a new chart version with the same images and values leaves every pod as it is; only a changed pod
    spec (here the image a new appVersion defaults to) replaces pods."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    # the seed stands for the live Secret an upgrade keeps (offline, each render would generate new keys)
    values = {"trainer": {"nnodes": 2}, "inference": {"replicas": 2}, "secrets": {"seed": "s" * 40}}
    before = workloads(values)
    assert set(before) == {"inference", "orchestrator", "trainer", "redis"}
    bumped = chart_copy(tmp_path, "bumped", version="99.0.0")
    assert workloads(values, bumped) == before
    app = chart_copy(tmp_path, "app", version="99.0.0", appVersion="99.0.0")
    pinned = {**values, **{c: {**values.get(c, {}), "image": {"repository": f"r/{c}", "tag": meta["appVersion"]}}
                           for c in ("inference", "orchestrator", "trainer")}}  # fmt: skip
    assert workloads(pinned, app) == workloads(pinned)
    changed = workloads(values, app)
    for comp in ("inference", "orchestrator", "trainer"):
        assert changed[comp]["metadata"] == before[comp]["metadata"], comp  # labels and annotations equal
        assert main(changed[comp])["image"].endswith(":99.0.0") and main(changed[comp]) != main(before[comp])
    # the objects themselves still say which chart made them
    docs = manifests(render(values, chart=bumped))
    assert named(docs, "StatefulSet", "exp-gyre-trainer")["metadata"]["labels"]["helm.sh/chart"] == "gyre-99.0.0"


# ---- 3. secrets, users, digests ----------------------------------------------------------------------


def test_redis_runs_as_a_high_non_root_user_like_every_pod():
    for comp, pod in pod_templates(valid(manifests(render({})))).items():
        ctx = pod["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert min(ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) >= 10000, (comp, ctx)
    redis = pod_templates(manifests(render({"redis": {"runAsUser": 20000, "runAsGroup": 20001}})))["redis"]
    ctx = redis["spec"]["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (20000, 20001, 20001)


def redis_flags(values: dict) -> list[str]:
    """The rendered `exec redis-server <config file> <flags...>` line's flags."""
    redis = main(pod_templates(valid(manifests(render(values))))["redis"])
    (line,) = [line for line in redis["args"][-1].splitlines() if "exec redis-server" in line]
    return shlex.split(line)[3:]


def test_redis_maxmemory_follows_the_memory_limit_with_noeviction():
    def setting(values: dict) -> tuple[str, str] | None:
        flags = redis_flags(values)
        if "--maxmemory" not in flags:
            return None
        return flags[flags.index("--maxmemory") + 1], flags[flags.index("--maxmemory-policy") + 1]

    assert setting({}) == (str(int(2 * GIB * 0.75)), "noeviction")  # the default limit, 2Gi
    small = {"requests": {"memory": "256Mi"}, "limits": {"memory": "512Mi"}}  # a request within the limit
    assert setting({"redis": {"resources": small}}) == (str(384 * 2**20), "noeviction")
    assert setting({"redis": {"resources": {"limits": {"memory": "1.5G"}}}}) == ("1125000000", "noeviction")
    assert setting({"redis": {"maxmemory": "3gb"}}) == ("3gb", "noeviction")
    assert setting({"redis": {"resources": {"limits": {"memory": None}}}}) is None  # no limit: none
    with pytest.raises(helm_python.HelmError, match="redis.resources.limits.memory"):
        render({"redis": {"resources": {"limits": {"memory": "2 gigs"}}}})
    with pytest.raises(helm_python.HelmError, match="maxmemory"):
        render({"redis": {"maxmemory": "lots"}})


@pytest.mark.skipif(not Path("/usr/bin/redis-server").exists(), reason="apt-get install redis-server")
def test_full_redis_refuses_a_batch_loudly_and_keeps_every_batch(tmp_path):
    """The rendered flags on a real redis-server with a small limit: past `maxmemory` a push of untrained batches
    fails with Redis's OOM error (the orchestrator retries it while the trainer frees room:
    tests/unit/test_streams.py) and no batch is evicted; without the flags Redis would grow until the kernel
    kills the pod."""
    import redis as redis_py
    from gyre.net import free_port
    from gyre.redis_retry import call_with_retry
    from gyre.streams import BatchStream

    flags = redis_flags({"redis": {"resources": {"requests": {"memory": "8Mi"}, "limits": {"memory": "8Mi"}}}})
    flags = [f if f != "/data" else str(tmp_path) for f in flags]
    port = free_port()
    flags[flags.index("--port") + 1] = str(port)
    server = subprocess.Popen(["/usr/bin/redis-server", *flags], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        client = redis_py.Redis(port=port)
        call_with_retry(client.ping, deadline_s=10, initial_s=0.05)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        stream = BatchStream(client, "full", maxlen=64)
        stream.ensure_group()
        pushed = 0
        with pytest.raises(redis_py.OutOfMemoryError, match="maxmemory"):
            while pushed < 64:  # 64 x 256 KiB = 16 MiB: more than the 6 MiB limit
                stream.push(pushed, bytes(256 << 10))
                pushed += 1
        assert 0 < pushed < 64
        assert [e.step for e in stream.read("trainer", block_ms=10, count=100)] == list(range(pushed))
    finally:
        server.terminate()
        server.wait(10)


def test_image_digests_pin_every_component_and_redis():
    values = {c: {"image": {"repository": f"registry.example.com/{c}", "tag": "1.2.3", "digest": DIGEST}}
              for c in ("inference", "orchestrator", "trainer", "redis")}  # fmt: skip
    docs = valid(manifests(render({**values, **HUB})))
    pods = pod_templates(docs)
    for comp in ("inference", "orchestrator", "trainer", "redis"):
        for container in containers(pods[comp]["spec"]):  # init containers run the same image
            assert container["image"] == f"registry.example.com/{comp}@{DIGEST}", (comp, container["name"])
    assert main(pods["test"])["image"] == f"registry.example.com/orchestrator@{DIGEST}"
    # without a digest: by tag, as before
    assert main(pod_templates(manifests(render({})))["redis"])["image"] == "docker.io/library/redis:7.4.2-alpine"


@pytest.mark.parametrize(
    "image",
    [{"digest": "sha256:abc"}, {"digest": "md5:" + "0" * 32}, {"tag": "1.0@" + DIGEST}],
    ids=["short-digest", "not-sha256", "digest-in-tag"],
)
def test_malformed_digests_are_rejected_before_anything_renders(image):
    with pytest.raises(helm_python.HelmError, match=r"(?i)digest|tag|pattern"):
        render({"trainer": {"image": {"repository": "r/t", **image}}})


# ---- 4. autoscaling inference from the orchestrator's demand -----------------------------------------


def test_inference_autoscaling_is_a_keda_scaled_object_on_the_orchestrators_demand():
    assert objects(manifests(render({})), "ScaledObject") == []  # off by default: `replicas` replicas
    values = {"inference": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                                            "targetRequestsPerReplica": 48}}}  # fmt: skip
    docs = valid(manifests(render(values, api_versions=KEDA_APIS)))
    (scaled,) = objects(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"name": "exp-gyre-inference"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "48"
    # the demand of this release's orchestrators (every run of a multi-run release), in flight and queued
    assert trigger["metadata"]["query"] == 'sum(gyre_orchestrator_model_requests{namespace="rl", gyre_release="exp"})'
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert behavior["stabilizationWindowSeconds"] == 300  # a pause in generation does not shrink the pool
    deployment = named(docs, "Deployment", "exp-gyre-inference")
    assert "replicas" not in deployment["spec"]  # helm upgrades leave the count to the autoscaler
    assert named(docs, "PodDisruptionBudget", "exp-gyre-inference")["spec"]["maxUnavailable"] == 1
    with pytest.raises(helm_python.HelmError, match="minReplicas .* is above maxReplicas"):
        inverted = {"inference": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}
        render(inverted, api_versions=KEDA_APIS)


def test_releases_of_one_name_on_one_external_redis_claim_their_run_id_apart(tmp_path, monkeypatch):
    # two releases named `exp` in two namespaces on one shared Redis have one run id (the release name): their
    # orchestrators pushed into one stream and their trainers, in one consumer group, trained each other's batches.
    # Every pod that reads or writes the stream names its release as the run id's owner, which the service claims
    external = {"redis": {"external": {"url": "redis://redis.infra:6379/0", "existingSecret": "infra"}}}
    owners = {}
    for namespace in ("team-a", "team-b"):
        docs = manifests(render(external, namespace=namespace))
        for workload, container in (
            (f"{fullname()}-orchestrator", "orchestrator"),
            (f"{fullname()}-trainer", "trainer"),
        ):
            pod = next(
                d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == workload
            )
            pod = pod["spec"]["template"]["spec"]
            spec = next(c for c in pod["containers"] if c["name"] == container)
            env = container_env(spec, docs, pod_name(docs, container))
            with monkeypatch.context() as m:
                for name, value in env.items():
                    if name.startswith("GYRE_REDIS__") and not name.endswith("_FILE"):
                        m.setenv(name, value)
                cfg = service_config(docs, tmp_path, container, workload)
            assert cfg.redis.url == "redis://redis.infra:6379/0"
            owners[(namespace, container)] = cfg.redis.owner
    assert owners == {("team-a", "orchestrator"): "team-a/exp", ("team-a", "trainer"): "team-a/exp",
                      ("team-b", "orchestrator"): "team-b/exp", ("team-b", "trainer"): "team-b/exp"}  # fmt: skip
