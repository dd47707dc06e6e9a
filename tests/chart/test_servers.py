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
from chart_testlib import KUBERNETES_VERSION, fullname, manifests, named, objects, render
from test_multirun import service_config

SERVERS = [
    {"name": "teacher", "model": "Qwen/Qwen3-8B", "gpus": 2, "nodePool": "gpu-large",
     "resources": {"requests": {"cpu": "4", "memory": "64Gi"}}},
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
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["memory"] == "64Gi"
    assert teacher["nodeSelector"]["pool"] == "h200"  # its own GPU pool
    assert container["image"] == named(docs, "Deployment", f"{base}-inference")["spec"]["template"]["spec"][
        "containers"][0]["image"]  # fmt: skip
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
        ({"servers": [{"name": "Bad_Name", "model": "m"}]}, "servers"),
        ({"servers": [{"name": "x"}]}, "model"),
    ],
)  # fmt: skip
def test_mistakes_fail_the_install_with_the_reason(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render({**VALUES, **values})
