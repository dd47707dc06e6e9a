"""The chart's `servers` value: judges, reward models and a teacher as Deployments of their own beside the policy.

Each server gets its own Deployment (its model, replicas, GPUs and node pool; unset keys from `inference`) and
Service; `url = "server:<name>"` in the orchestrator's judges, reward models and teacher becomes that Service; the
rendered commands load as real service configs; a name no server has, or loss.distill without a teacher, fails
the install with the reason.
"""

from __future__ import annotations

import contextlib

import helm_python
import kubernetes_validate
import pytest
from chart_testlib import (
    KUBERNETES_VERSION,
    MONITORING_APIS,
    container_env,
    containers,
    fullname,
    init_action,
    manifests,
    named,
    objects,
    pod_templates,
    render,
    secret_files,
    service_config,
)

SERVERS = [
    {"name": "teacher", "model": "Qwen/Qwen3-8B", "gpus": 1, "nodePool": "gpu-large",
     "resources": {"requests": {"cpu": "4", "memory": "64Gi"}},
     "args": {"model": {"dtype": "bfloat16"}}},  # a [model] table of its own keeps the entry's model
    {"name": "rm", "model": "/data/models/rm", "gpus": 0, "replicas": 2, "args": {"runner": "pooling",
     "engine": {"max_batch_size": 8}}},
    {"name": "judge", "model": "/data/models/judge"},
]  # fmt: skip
EXPERIMENT = {
    "model": {"name": "/data/models/student"},
    "trainer": {"loss": {"distill": 1.0, "reward_weight": 0.0}},
    "orchestrator": {
        "teacher": {"url": "server:teacher"},
        "judges": [{"name": "judge", "url": "server:judge", "weight": 0.0},
                   {"name": "hosted", "url": "https://api.example.com/v1", "api_key_file": "/run/secrets/judge"}],
        "reward_models": [{"name": "rm", "url": "server:rm"}],
    },
}  # fmt: skip
LARGE = {"nodeSelector": {"pool": "h200"}, "tolerations": [], "affinity": {}}
VALUES = {"modelInit": {"enabled": False}, "experiment": EXPERIMENT, "servers": SERVERS,
          "nodePools": {"gpu-large": LARGE}}  # fmt: skip


def test_each_server_is_a_deployment_of_its_own_wired_to_the_orchestrator(tmp_path):
    docs = manifests(render(VALUES))
    base = fullname()
    for server in SERVERS:
        name = f"{base}-server-{server['name']}"
        deployment, service = named(docs, "Deployment", name), named(docs, "Service", name)
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert deployment["spec"]["replicas"] == server.get("replicas", 1)
        cfg = service_config(docs, tmp_path, "inference", name)
        assert cfg.model.name == server["model"] and cfg.run_id.endswith(f"-{server['name']}")
    teacher = named(docs, "Deployment", f"{base}-server-teacher")["spec"]["template"]["spec"]
    container = teacher["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["memory"] == "64Gi"
    assert teacher["nodeSelector"]["pool"] == "h200"  # its own GPU pool
    assert container["image"] == named(docs, "Deployment", f"{base}-inference")["spec"]["template"]["spec"][
        "containers"][0]["image"]  # fmt: skip
    assert service_config(docs, tmp_path, "inference", f"{base}-server-teacher").model.dtype == "bfloat16"
    rm = service_config(docs, tmp_path, "inference", f"{base}-server-rm")
    assert rm.runner == "pooling" and rm.engine.max_batch_size == 8
    policy = service_config(docs, tmp_path, "inference", f"{base}-inference")
    assert policy.model.name == "/data/models/student" and policy.runner == "generate"

    orchestrator = service_config(docs, tmp_path, "orchestrator", f"{base}-orchestrator")
    assert orchestrator.teacher.url == f"http://{base}-server-teacher:8000"
    assert [j.url for j in orchestrator.judges] == [f"http://{base}-server-judge:8000", "https://api.example.com/v1"]
    assert orchestrator.reward_models[0].url == f"http://{base}-server-rm:8000"
    trainer = service_config(docs, tmp_path, "trainer", f"{base}-trainer")
    assert trainer.loss.distill == 1.0

    policies = {p["metadata"]["name"]: p for p in objects(docs, "NetworkPolicy")}
    servers_policy = policies[f"{base}-servers"]["spec"]
    assert servers_policy["podSelector"]["matchExpressions"] == [{"key": "gyre.dev/server", "operator": "Exists"}]
    for doc in docs:
        with contextlib.suppress(kubernetes_validate.SchemaNotFoundError):  # CRDs (ServiceMonitor...)
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_without_servers_nothing_changes():
    docs = manifests(render({}))
    assert not [d for d in docs if "-server-" in d["metadata"]["name"]]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"experiment": {**EXPERIMENT, "orchestrator": {"teacher": {"url": "server:nobody"}}}},
         'no entry of `servers` is named "nobody"'),
        ({"experiment": {**EXPERIMENT, "orchestrator": {}}}, "distill > 0 needs experiment.orchestrator.teacher"),
        # a teacher without distill trained nothing from it and kept every group of equal rewards (gyre rl refuses)
        ({"experiment": {**EXPERIMENT, "trainer": {}}}, r"distill is 0 but a teacher is set \(experiment\)"),
        ({"experiment": {**EXPERIMENT, "trainer": {}, "orchestrator": {}},
          "runs": [{"name": "a"}, {"name": "b", "orchestrator": {"teacher": {"url": "server:teacher"}}}]},
         r"distill is 0 but a teacher is set \(runs b\)"),
        ({"servers": [{"name": "Bad_Name", "model": "m"}]}, "servers"),
        ({"servers": [{"name": "x"}]}, "model"),
    ],
)  # fmt: skip
def test_mistakes_fail_the_install_with_the_reason(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render({**VALUES, **values})


# ---- parity with the policy's inference pods ------------------------------------------------------------

API_KEY_FILE = "/run/secrets/gyre/api-key"


def server_pod(docs: list[dict], name: str) -> dict:
    return named(docs, "Deployment", f"{fullname()}-server-{name}")["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "values",
    [VALUES, {**VALUES, "modelCache": {"tokenSecret": "hf"}},
     {**VALUES, "redis": {"external": {"url": "redis://r:6379/0"}}}, {**VALUES, "secrets": {"existingSecret": "s"}}],
    ids=["plain", "hub-token", "external-redis-no-password", "existing-secret"],
)  # fmt: skip
def test_every_projected_volume_has_sources_and_every_mount_a_volume(values):
    """A projected volume with no sources (`sources: null`) is rejected by the API server; a pod whose
    secret keys have no source gets neither the volume nor its mount."""
    for workload in manifests(render(values)):
        if workload["kind"] not in ("Deployment", "StatefulSet", "Job", "Pod"):
            continue
        comp, pod = workload["metadata"]["name"], workload["spec"].get("template", workload)
        claims = [{"name": c["metadata"]["name"]} for c in workload["spec"].get("volumeClaimTemplates", [])]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", []) + claims}
        for volume in volumes.values():
            if "projected" in volume:
                assert volume["projected"].get("sources"), (comp, volume["name"])
        for c in containers(pod["spec"]):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (comp, c["name"], mount["name"])


def test_a_hub_model_server_fetches_it_first_and_one_on_the_policys_model_waits_for_it():
    docs = manifests(render(VALUES))
    teacher = server_pod(docs, "teacher")
    (fetch,) = teacher["initContainers"]
    assert fetch["name"] == "model-fetch"
    assert init_action(fetch)[0] == "fetch" and init_action(fetch)[1][:2] == ["--name", "Qwen/Qwen3-8B"]  # its own
    mounts = {m["mountPath"]: m["name"] for m in fetch["volumeMounts"]}
    assert mounts["/cache/huggingface"] == "model-cache"
    (main,) = teacher["containers"]
    assert {m["mountPath"]: m["name"] for m in main["volumeMounts"]}["/cache/huggingface"] == "model-cache"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"  # the fetched copy only
    assert "model-cache" in {v["name"] for v in teacher["volumes"]}
    # a model on the shared volume: nothing to fetch or wait for
    assert "initContainers" not in server_pod(docs, "judge")

    # modelInit: a server on the policy's generated model waits for trainer pod 0 to create it
    servers = [{"name": "ref", "model": "/data/model"}, {"name": "judge", "model": "/data/models/j"}]
    generated = {**VALUES, "modelInit": {"enabled": True}, "experiment": {}, "servers": servers}
    docs = manifests(render(generated))
    (wait,) = server_pod(docs, "ref")["initContainers"]
    policy_wait = next(
        c for c in named(docs, "Deployment", f"{fullname()}-inference")["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "wait-for-model"
    )  # fmt: skip
    # the same container, but for the run id of its records: the server's, as its service logs it
    assert init_action(wait) == init_action(policy_wait) == ("wait", [])
    assert wait["args"][2] == "exp-ref" and policy_wait["args"][2] == "exp"
    assert {**wait, "args": []} == {**policy_wait, "args": []}
    assert "initContainers" not in server_pod(docs, "judge")


def test_servers_are_scraped_and_have_a_disruption_budget():
    more = [{"name": "off", "model": "/m", "replicas": 0}, {"name": "solo", "model": "/m", "pdb": {"enabled": False}},
            {"name": "wide", "model": "/m", "replicas": 4, "pdb": {"maxUnavailable": 2}}]  # fmt: skip
    values = {**VALUES, "servers": [*SERVERS, *more]}
    docs = manifests(render(values, api_versions=MONITORING_APIS))
    services = objects(docs, "Service")
    base = fullname()
    for server in values["servers"]:
        name = f"{base}-server-{server['name']}"
        monitor = named(docs, "ServiceMonitor", name)
        selector = monitor["spec"]["selector"]["matchLabels"]
        # exactly the server's Service: its replicas are scraped once, on its metrics port
        assert [s["metadata"]["name"] for s in services if selector.items() <= s["metadata"]["labels"].items()] == [
            name]  # fmt: skip
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
        assert "metrics" in [p["name"] for p in named(docs, "Service", name)["spec"]["ports"]]
        pdbs = [p for p in objects(docs, "PodDisruptionBudget") if p["metadata"]["name"] == name]
        if server["name"] in ("off", "solo"):
            assert pdbs == []
            continue
        (pdb,) = pdbs
        assert pdb["spec"]["maxUnavailable"] == (2 if server["name"] == "wide" else 1)
        pod_labels = named(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # the policy's inference ServiceMonitor still selects only its own Service
    selector = named(docs, "ServiceMonitor", f"{base}-inference")["spec"]["selector"]["matchLabels"]
    assert [s["metadata"]["name"] for s in services if selector.items() <= s["metadata"]["labels"].items()] == [
        f"{base}-inference-headless"]  # fmt: skip


def test_a_server_url_carries_the_release_api_key_the_server_requires(tmp_path):
    docs = manifests(render(VALUES))
    base = fullname()
    orchestrator = service_config(docs, tmp_path, "orchestrator", f"{base}-orchestrator")
    assert str(orchestrator.teacher.api_key_file) == API_KEY_FILE
    assert [j.api_key_file for j in orchestrator.judges] == [API_KEY_FILE, "/run/secrets/judge"]  # hosted: its own
    assert str(orchestrator.reward_models[0].api_key_file) == API_KEY_FILE
    pods = pod_templates(docs)
    (orch,) = pods["orchestrator"]["spec"]["containers"]
    key = secret_files(pods["orchestrator"]["spec"], orch, docs)[API_KEY_FILE]
    for server in SERVERS:
        pod = pods[f"server-{server['name']}"]["spec"]
        (main,) = pod["containers"]
        env = container_env(main, docs, "pod")
        files = secret_files(pod, main, docs)
        assert files[env["GYRE_AUTH__API_KEY_FILE"]] == key  # the server checks the key the orchestrator sends
        assert env["GYRE_AUTH__CONTROL_TOKEN_FILE"] in files


@pytest.mark.parametrize("own", ["api_key_env", "api_key_file"])
def test_a_server_url_with_a_key_of_ones_own_fails_naming_the_key(own):
    judges = [{"name": "judge", "url": "server:judge", own: "X"}]
    values = {**VALUES, "experiment": {**EXPERIMENT, "orchestrator": {**EXPERIMENT["orchestrator"], "judges": judges}}}
    with pytest.raises(helm_python.HelmError, match=rf"experiment\.orchestrator\.judges\.0\.{own}"):
        render(values)


def test_a_runs_own_server_urls_are_resolved_like_the_experiments(tmp_path):
    """`runs[i].orchestrator` takes the same keys as `[orchestrator]`: a run's own judge or teacher named
    `server:<name>` reaches that server with the release's API key (before, the run's orchestrator got the
    literal "server:judge" as its url, and a name no server has passed the install)."""
    runs = [{"name": "alpha", "orchestrator": {"judges": [{"name": "judge", "url": "server:judge"}],
                                               "teacher": {"url": "server:teacher"}}},
            {"name": "beta"}]  # fmt: skip
    values = {**VALUES, "experiment": {**EXPERIMENT, "trainer": {**EXPERIMENT["trainer"], "lora": {"rank": 8}}},
              "runs": runs}  # fmt: skip
    docs = manifests(render(values))
    alpha = service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator-alpha")
    assert [(j.url, j.api_key_file) for j in alpha.judges] == [(f"http://{fullname()}-server-judge:8000", API_KEY_FILE)]
    assert (alpha.teacher.url, alpha.teacher.api_key_file) == (f"http://{fullname()}-server-teacher:8000", API_KEY_FILE)
    beta = service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator-beta")
    assert beta.judges[0].url == f"http://{fullname()}-server-judge:8000"  # the experiment's own, resolved as before
    bad = [{"name": "alpha", "orchestrator": {"judges": [{"name": "j", "url": "server:nobody"}]}}]
    with pytest.raises(helm_python.HelmError, match=r'runs\[0\]\.orchestrator\.judges\.0\.url = "server:nobody"'):
        render({**values, "runs": bad})


def test_distillation_with_runs_takes_each_runs_own_teacher():
    """loss.distill > 0 needs a teacher for every run: the experiment's, or each run's own (before, a multi-run
    release whose runs each named their own teacher was refused, asking for experiment.orchestrator.teacher)."""
    experiment = {**EXPERIMENT, "trainer": {**EXPERIMENT["trainer"], "lora": {"rank": 8}},
                  "orchestrator": {k: v for k, v in EXPERIMENT["orchestrator"].items() if k != "teacher"}}  # fmt: skip
    teacher = {"teacher": {"url": "server:teacher"}}
    own = [{"name": "alpha", "orchestrator": teacher}, {"name": "beta", "orchestrator": teacher}]
    docs = manifests(render({**VALUES, "experiment": experiment, "runs": own}))
    assert {d["metadata"]["name"] for d in objects(docs, "Deployment")} >= {f"{fullname()}-orchestrator-beta"}
    one_without = [own[0], {"name": "beta"}]
    with pytest.raises(helm_python.HelmError, match="runs\\[\\].orchestrator.teacher for runs beta"):
        render({**VALUES, "experiment": experiment, "runs": one_without})
