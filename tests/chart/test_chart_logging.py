"""`experiment.log.format` reaches every Gyre service container the chart runs (docs/kubernetes.md, "Logs").

Each container's config is loaded as the service loads it: its command line, the experiment file it names
(from the ConfigMap) and the GYRE_ variables of its environment. JSON is the chart's default; `text` and a
level set once apply to every pod, `servers` (which read no experiment file) included.
"""

from __future__ import annotations

import pytest
from chart_testlib import container_env, experiment_toml, gyre_argv, manifests, render
from gyre.config import load_config
from gyre.config.inference import InferenceConfig
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.trainer import TrainerConfig

CONFIGS = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}
BASE = {
    "runs": [{"name": "alpha"}, {"name": "beta"}],  # one orchestrator Deployment per run
    "servers": [{"name": "judge", "model": "Qwen/Qwen3-0.6B"}],
}


def service_logs(values: dict, tmp_path, monkeypatch) -> dict[str, tuple[str, str]]:
    """{workload/container: (log.level, log.format)} of every Gyre service container of a render."""
    experiment = {"trainer": {"lora": {"rank": 8}}, **values.get("experiment", {})}  # lora: runs need it
    docs = manifests(render({**BASE, **values, "experiment": experiment}))
    toml = tmp_path / "experiment.toml"
    toml.write_text(experiment_toml(docs))
    found = {}
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            service, argv = gyre_argv(container)
            if service not in CONFIGS:
                continue  # Redis
            with monkeypatch.context() as patch:
                for name, value in container_env(container, docs, "pod-0").items():
                    if name.startswith("GYRE_LOG__"):
                        patch.setenv(name, value)
                argv = [a.replace("/etc/gyre/experiment.toml", str(toml)) for a in argv]
                cfg = load_config(CONFIGS[service], argv)
            found[f"{workload['metadata']['name']}/{container['name']}"] = (cfg.log.level, cfg.log.format)
    return found


@pytest.fixture(autouse=True)
def no_outside_log_settings(monkeypatch):
    for name in ("GYRE_LOG__FORMAT", "GYRE_LOG__LEVEL"):
        monkeypatch.delenv(name, raising=False)


def test_json_by_default_in_every_service_container(tmp_path, monkeypatch):
    logs = service_logs({}, tmp_path, monkeypatch)
    assert {name.split("/")[0] for name in logs} == {"exp-gyre-inference", "exp-gyre-orchestrator-alpha",
                                                    "exp-gyre-orchestrator-beta", "exp-gyre-trainer",
                                                    "exp-gyre-server-judge"}  # fmt: skip
    assert set(logs.values()) == {("INFO", "json")}, logs


def test_text_and_level_set_once_apply_to_every_pod(tmp_path, monkeypatch):
    logs = service_logs({"experiment": {"log": {"format": "text", "level": "DEBUG"}}}, tmp_path, monkeypatch)
    assert len(logs) == 5 and set(logs.values()) == {("DEBUG", "text")}, logs
