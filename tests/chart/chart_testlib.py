"""Render the Gyre chart with the real Helm engine (helm_python) and look at what it produced.

Rendering is `helm install --dry-run` without a cluster: `lookup` returns nothing (so the Secret is
freshly generated) and `.Capabilities` are Helm's defaults unless `api_versions` adds some.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gyre"
DEPLOY = ROOT / "deploy"
RELEASE = "exp"
NAMESPACE = "rl"
KUBERNETES_VERSION = "1.30.0"
# What a cluster with the Prometheus operator's CRDs serves (helm --api-versions).
MONITORING_APIS = (
    "monitoring.coreos.com/v1",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)
# What a cluster with KEDA serves (inference.autoscaling renders a ScaledObject).
KEDA_APIS = ("keda.sh/v1alpha1", "keda.sh/v1alpha1/ScaledObject")
GYRE_COMPONENTS = ("inference", "orchestrator", "trainer")


def load_values(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def render(
    values: dict | None = None,
    *,
    api_versions: tuple[str, ...] = (),
    chart: Path = CHART,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """{template path: rendered text}; raises helm_python.HelmError for schema or template failures."""
    with helm_python.Chart.load(chart) as loaded:
        if not api_versions:
            return loaded.render(values or {}, name=name, namespace=namespace, is_install=True)
        # Chart.render() has no parameter for extra capabilities (`helm template --api-versions`), but the
        # native helm_render it wraps accepts them in its options object.
        opts = {"name": name, "namespace": namespace, "is_install": True, "api_versions": list(api_versions)}
        text = _native.call_string("helm_render", loaded._raw(), json.dumps(values or {}), json.dumps(opts))
        return json.loads(text)


LOOKUP = "{{- lookup .apiVersion .kind .root.Release.Namespace .name | default dict | toJson -}}"


def render_live(values: dict, live: dict[str, dict], workdir: Path, **kwargs) -> dict[str, str]:
    """render() as `helm upgrade` sees a cluster holding `live` ({"Kind/name": object}): a copy of the chart
    (under `workdir`) whose one `lookup` (gyre.live) answers from `live` instead of answering nothing."""
    import shutil

    copy = workdir / f"chart-{sum(1 for _ in workdir.glob('chart-*'))}"
    shutil.copytree(CHART, copy)
    helpers = copy / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert text.count(LOOKUP) == 1, "the chart looks objects up through gyre.live alone"
    quoted = json.dumps(json.dumps(live))  # a Go template string literal holding the objects as JSON
    fake = "{{- get (" + quoted + ' | fromJson) (printf "%s/%s" .kind .name) | default dict | toJson -}}'
    helpers.write_text(text.replace(LOOKUP, fake))
    return render(values, chart=copy, **kwargs)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty documents left out)."""
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {[d['metadata']['name'] for d in objects(docs, kind)]}"
    return found[0]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """component -> (metadata, spec) of every pod the release runs: workloads and the helm test pod."""
    pods = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            pods[component(doc)] = doc["spec"]["template"]
        elif doc["kind"] == "Pod":
            pods[component(doc)] = {"metadata": doc["metadata"], "spec": doc["spec"]}
    return pods


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def fullname(release: str = RELEASE) -> str:
    return release if "gyre" in release else f"{release}-gyre"


# ---- what a container sees: Kubernetes' env semantics, resolved offline --------------------------


def secret_data(docs: list[dict]) -> dict[str, dict[str, str]]:
    """Secret name -> decoded data, for the Secrets the release renders."""
    import base64

    return {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
        for s in objects(docs, "Secret")
    }


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes, others stay as is."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and ")" in value[i:]:
            end = value.index(")", i)
            name = value[i + 2 : end]
            out.append(env.get(name, value[i : end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def container_env(container: dict, docs: list[dict], pod_name: str, secrets: dict | None = None) -> dict[str, str]:
    """The environment a container gets: `value`s expanded in order, `valueFrom` resolved.

    `secrets` supplies Secrets the release does not render (an existing one, an external Redis's).
    """
    known = {**secret_data(docs), **(secrets or {})}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = known[ref["name"]][ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = pod_name
        else:
            raise AssertionError(f"unsupported env source in test: {var}")
    return env


def secret_files(pod_spec: dict, container: dict, docs: list[dict], secrets: dict | None = None) -> dict[str, str]:
    """{file path: text} of every Secret key `container` sees as a file (`secret` and `projected` volumes).

    `secrets` supplies Secrets the release does not render (an existing one, an external Redis's).
    """
    known = {**secret_data(docs), **(secrets or {})}
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})  # a StatefulSet's volumeClaimTemplate is not in `volumes`
        sources = [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s]
        sources += [{"name": volume["secret"]["secretName"], **volume["secret"]}] if "secret" in volume else []
        for source in sources:
            data = known[source["name"]]
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                files[f"{mount['mountPath']}/{item['path']}"] = data[item["key"]]
    return files


def experiment_toml(docs: list[dict]) -> str:
    """The experiment file of a render, whatever the release's name."""
    (found,) = [c for c in objects(docs, "ConfigMap") if "experiment.toml" in c.get("data", {})]
    return found["data"]["experiment.toml"]


# What every container of a Gyre image runs as PID 1 before its command (templates/_helpers.tpl, gyre.init).
INIT = ["tini", "-s", "--"]


def service_command(container: dict) -> list[str]:
    """A container's `command` after the init (tini) a Gyre image's container runs first; another image's (Redis's)
    as it is."""
    command = container.get("command", [])
    return command[len(INIT) :] if command[: len(INIT)] == INIT else command


def init_action(container: dict) -> tuple[str, list[str]]:
    """(action, its arguments) of an init container running the chart's files/init.py (gyre.initCommand):
    `fetch` runs `gyre model fetch` with the arguments, `init` and `wait` take none."""
    words = service_command(container) + container.get("args", [])
    assert words[:3] == ["python3", "-c", (CHART / "files" / "init.py").read_text()], words[:2]
    assert words[3] == container["name"], "the records' `service` is the container's name"
    return words[5], words[6:]


def init_containers(docs: list[dict]) -> dict[str, dict]:
    """{workload/container: container} of every init container of a render."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for c in doc["spec"]["template"]["spec"].get("initContainers", []):
                found[f"{doc['metadata']['name']}/{c['name']}"] = c
    return found


def init_process(container: dict, docs: list[dict], pod: str, tmp_path, model_dir=None, offline: bool = True):
    """(argv, environment) of an init container's command (files/init.py) as the kubelet starts it, tini left out:
    the model folder and caches local, nothing inherited but PATH; `offline`: the hub client never goes out."""
    words = service_command(container) + container["args"]
    assert words[:2] == ["python3", "-c"], words
    words = [sys.executable, *[w.replace("/cache/huggingface", str(tmp_path / "hf")) for w in words[1:]]]
    env = container_env(container, docs, pod)
    env = {k: v.replace("/cache", str(tmp_path / "cache")) for k, v in env.items()}
    env.update(PATH=os.environ["PATH"], HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if "MODEL_DIR" in env:
        env["MODEL_DIR"] = str(model_dir)
    return words, env


def gyre_argv(container: dict) -> tuple[str, list[str]]:
    """(service, argv after the service name) of a Gyre main container (`gyre X ...`, or the trainer's torchrun of
    `-m gyre.cli X ...`)."""
    words = service_command(container) + container["args"]
    if words[0] != "gyre" and "gyre.cli" in words:
        words = words[words.index("gyre.cli") :]
    # another image's container (Redis's `sh -c ...`) comes back as it is: callers look up the Gyre services only
    return words[1], words[2:]


def pod_name(docs: list[dict], comp: str) -> str:
    """A plausible name of the first pod of a component (StatefulSets: ordinal 0)."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Pod") and component(doc) == comp:
            name = doc["metadata"]["name"]
            return {"StatefulSet": f"{name}-0", "Deployment": f"{name}-5d9c8b7f6-x2x4k"}.get(doc["kind"], name)
    raise AssertionError(f"no pod for component {comp}")


def service_config(docs, tmp_path, container_name: str, deployment: str):
    """The service config a rendered container loads (its `@ experiment.toml#x` read from the ConfigMap)."""
    from gyre.config import load_config
    from gyre.config.inference import InferenceConfig
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.trainer import TrainerConfig

    toml = tmp_path / "experiment.toml"
    toml.write_text(experiment_toml(docs))
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    workload = next(d for d in workloads if d["metadata"]["name"] == deployment)
    container = next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == container_name)
    service, argv = gyre_argv(container)
    argv = [a.replace("/etc/gyre/experiment.toml", str(toml)) for a in argv]
    cls = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}[service]
    return load_config(cls, argv)
