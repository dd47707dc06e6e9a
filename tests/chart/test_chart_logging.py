"""`experiment.log.format` reaches every Gyre container the chart runs (docs/kubernetes.md, "Logs").

Each container's config is loaded as the service loads it: its command line, the experiment file it names
(from the ConfigMap) and the GYRE_ variables of its environment. JSON is the chart's default; `text` and a
level set once apply to every pod, `servers` (which read no experiment file) included.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from chart_testlib import (
    container_env,
    experiment_toml,
    gyre_argv,
    init_containers,
    init_process,
    manifests,
    pod_templates,
    render,
)
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


# ---- the init containers and the `helm test` pod: their own lines in the same format --------------------------
# They ran `sh -c` loops and `gyre model ...` commands that print: bare text lines in a JSON release. Each is run
# here as rendered (its command after tini, its environment), on local folders in place of the pod's volumes.


HUB = {"experiment": {"model": {"name": "Qwen/Qwen3-0.6B"}}, "modelInit": {"enabled": False}}
FIELDS = {"time", "level", "severity", "service", "run_id", "logger", "message"}


def start_init(container: dict, docs: list[dict], pod: str, tmp_path, model_dir=None) -> subprocess.Popen:
    words, env = init_process(container, docs, pod, tmp_path, model_dir, offline=True)
    return subprocess.Popen(words, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def records(output: str, container: str, run_id: str) -> list[dict]:
    """Every line of `output` as a JSON record of Gyre's fields (a line that is not one fails)."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines, f"{container} logged nothing"
    found = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"{container}: a line that is not a JSON record: {line!r}") from None
        assert record.keys() >= FIELDS, record
        assert (record["service"], record["run_id"], record["logger"]) == (container, run_id, "gyre.init"), record
        found.append(record)
    return found


def test_model_init_and_the_model_wait_log_json_records(tmp_path):
    docs = manifests(render({}))
    inits = init_containers(docs)
    assert set(inits) == {"exp-gyre-trainer/model-init", "exp-gyre-inference/wait-for-model"}
    model = tmp_path / "model"

    # trainer pod 0 creates the model: `gyre model init`'s result line is an INFO record
    done = start_init(inits["exp-gyre-trainer/model-init"], docs, "exp-gyre-trainer-0", tmp_path, model)
    out, _ = done.communicate(timeout=240)
    assert done.returncode == 0, out
    logged = records(out, "model-init", "exp")
    assert any(r["message"].startswith("gyre model init: llama") and r["level"] == "INFO" for r in logged), logged
    assert logged[-1]["message"] == f"model ready: {model}"
    assert (model / "config.json").exists()

    # an inference pod waits (a record, not a line per poll) until the model appears, then ends
    (tmp_path / "later").mkdir()
    waiting = start_init(inits["exp-gyre-inference/wait-for-model"], docs, "exp-gyre-inference-x", tmp_path,
                         tmp_path / "later")  # fmt: skip
    first = waiting.stdout.readline()
    assert records(first, "wait-for-model", "exp")[0]["message"].startswith(f"waiting for {tmp_path / 'later'}")
    time.sleep(1)
    (tmp_path / "later" / "config.json").write_text("{}")
    out, _ = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, out
    assert [r["message"] for r in records(out, "wait-for-model", "exp")] == [f"model ready: {tmp_path / 'later'}"]


def test_a_model_fetch_that_fails_is_one_error_record_and_its_exit_code(tmp_path):
    docs = manifests(render({**HUB, "servers": [{"name": "judge", "model": "Qwen/Qwen3-8B"}]}))
    inits = init_containers(docs)
    assert {name for name in inits if name.endswith("/model-fetch")} == {
        "exp-gyre-inference/model-fetch",
        "exp-gyre-trainer/model-fetch",
        "exp-gyre-server-judge/model-fetch",
    }
    for name, run_id in (("exp-gyre-trainer/model-fetch", "exp"), ("exp-gyre-server-judge/model-fetch", "exp-judge")):
        # offline and nothing cached: the hub client's error, as `gyre model fetch` reports it (exit 1)
        fetch = start_init(inits[name], docs, "pod-0", tmp_path)
        out, _ = fetch.communicate(timeout=120)
        assert fetch.returncode == 1, out
        errors = [r for r in records(out, "model-fetch", run_id) if r["level"] == "ERROR"]
        assert len(errors) == 1 and errors[0]["severity"] == "ERROR", out
        assert errors[0]["message"].startswith("gyre model fetch: error: Qwen/Qwen3-"), errors

    # a setting it refuses: `gyre model fetch` prints its own JSON record then (GYRE_LOG__FORMAT=json), which stays
    # one record with its level and message, not a record whose message is another record's JSON text
    bad = {**inits["exp-gyre-trainer/model-fetch"]}
    bad["args"] = [*bad["args"], "--no-such-key", "1"]
    refused = start_init(bad, docs, "pod-0", tmp_path)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2, out
    (error,) = records(out, "model-fetch", "exp")
    assert error["level"] == "ERROR" and error["message"].startswith("gyre model fetch: error: config key"), error


def test_the_model_wait_fits_its_memory_limit_with_room(tmp_path):
    """Python, Gyre's logging and (JSON mode) transformers: the `sh` loop's 64Mi limit would have OOM-killed it."""
    docs = manifests(render({}))
    wait = init_containers(docs)["exp-gyre-inference/wait-for-model"]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    words, env = init_process(wait, docs, "p", tmp_path, tmp_path / "model")
    # the peak resident size of the command alone (KiB on Linux): the children of a process that ran only it
    measure = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " \
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", measure, *words], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[-1]) * 1024
    limit = int(wait["resources"]["limits"]["memory"].removesuffix("Mi")) * 2**20
    assert peak * 2 < limit, (peak, limit)


def test_text_format_is_the_services_text_lines(tmp_path):
    docs = manifests(render({"experiment": {"log": {"format": "text"}}}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    wait = start_init(init_containers(docs)["exp-gyre-inference/wait-for-model"], docs, "p", tmp_path,
                      tmp_path / "model")  # fmt: skip
    out, _ = wait.communicate(timeout=60)
    assert wait.returncode == 0 and out.strip().endswith(
        f" INFO wait-for-model gyre.init: model ready: {tmp_path}/model"
    )


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_every_init_container_and_the_test_pod_get_the_log_settings(fmt):
    values = {**HUB, "servers": [{"name": "judge", "model": "Qwen/Qwen3-8B"}, {"name": "ref", "model": "/data/m"}],
              "experiment": {**HUB["experiment"], "log": {"format": fmt, "level": "DEBUG"}}}  # fmt: skip
    for with_init in (values, {"experiment": {"log": {"format": fmt, "level": "DEBUG"}}}):
        docs = manifests(render(with_init))
        chosen = list(init_containers(docs).items())
        chosen += [(f"{comp}/{c['name']}", c) for comp, pod in pod_templates(docs).items() if comp == "test"
                   for c in pod["spec"]["containers"]]  # fmt: skip
        assert len(chosen) >= 3
        for name, container in chosen:
            env = container_env(container, docs, "pod-0")
            assert (env.get("GYRE_LOG__FORMAT"), env.get("GYRE_LOG__LEVEL")) == (fmt, "DEBUG"), name
