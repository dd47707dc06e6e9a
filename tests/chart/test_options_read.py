"""Every Gyre setting the chart hands a container is one its service reads.

The config models accept more keys than each service uses (`output_dir` is a key of every Gyre process,
yet `gyre inference` never opens the shared volume): an option the chart passes that its service ignores
looks like wiring while doing nothing, and hides what really configures the pod. So each rendered option
(`--a.b-c` on a command line, `GYRE_A__B_C` in the environment, a key the chart writes into the experiment
file) must name a top-level setting that the service's own code reads (`config.a`, an attribute access in
services/<service>/), and a leaf that the service or the shared library reads. A `<key>_file` setting counts
as its secret `<key>` (the config loader reads the file into it).
"""

from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

import pytest
from chart_testlib import ROOT, experiment_toml, gyre_argv, load_values, manifests, render, service_command
from gyre.config.inference import InferenceConfig
from gyre.config.loader import SECRET_FILE_FOR
from gyre.config.orchestrator import OrchestratorConfig
from gyre.config.trainer import TrainerConfig
from pydantic import BaseModel
from test_render import VLLM_ADAPTER, VLLM_RUNS

CONFIGS = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}
SCENARIOS = {
    "default": {},
    "kind": load_values("values-kind.yaml"),
    "gpu-single-node": load_values("values-gpu-single-node.yaml"),
    "multi-node": load_values("values-multi-node.yaml"),
    "external-redis": {"redis": {"external": {"url": "redis://redis.infra:6379/0", "existingSecret": "infra"}}},
    "kubernetes-discovery": {"orchestrator": {"discovery": "kubernetes"}},
    "runs-and-servers": {
        "experiment": {"trainer": {"lora": {"rank": 8}}},
        "runs": [{"name": "alpha", "maxSteps": 5}, {"name": "beta", "orchestrator": {"seed": 1}}],
        "servers": [{"name": "judge", "model": "Qwen/Qwen3-0.6B"}],
    },
    "vllm-runs": VLLM_RUNS,
    "vllm-adapter": VLLM_ADAPTER,
}


def _attributes(paths: list[Path]) -> frozenset[str]:
    """Every `x.name` the code under `paths` accesses (tests left out)."""
    names = set()
    for path in paths:
        for file in path.rglob("*.py") if path.is_dir() else [path]:
            if "tests" in file.parts or file.name.startswith("test_"):
                continue
            names |= {n.attr for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.Attribute)}
    return frozenset(names)


@functools.cache
def service_reads(service: str) -> frozenset[str]:
    return _attributes([ROOT / "services" / service])


@functools.cache
def library_reads() -> frozenset[str]:
    # the shared library, not the local launcher (it reads every key to start the services)
    lib = ROOT / "libs" / "gyre"
    return _attributes([p for p in lib.iterdir() if p.name != "local" and (p.is_dir() or p.suffix == ".py")])


def setting(cls: type[BaseModel], path: list[str]) -> list[str]:
    """`path` with a `<key>_file` leaf replaced by the secret it fills (what the service reads)."""
    model: type[BaseModel] | None = cls
    for i, key in enumerate(path):
        field = model.model_fields.get(key) if model else None
        assert field is not None, f"{'.'.join(path)}: no such key of {cls.__name__}"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if i == len(path) - 1 and SECRET_FILE_FOR in extra:
            return [*path[:-1], extra[SECRET_FILE_FOR]]
        annotation = field.annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return path


def toml_paths(table: dict, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict) and value:
            out += toml_paths(value, (*prefix, key))
        else:
            out.append([*prefix, key])
    return out


def passed_settings(values: dict) -> list[tuple[str, str, list[str]]]:
    """(workload, service, key path) of every Gyre setting the chart gives a service container."""
    docs = manifests(render(values))
    experiment = tomllib.loads(experiment_toml(docs))
    user = values.get("experiment", {})
    found = []
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if service_command(container)[0] != "gyre" and "gyre.cli" not in container.get("args", []):
                continue
            service, argv = gyre_argv(container)
            name = doc["metadata"]["name"]
            paths = [a[2:].replace("-", "_").split(".") for a in argv if a.startswith("--")]
            paths += [e["name"][len("GYRE_") :].lower().split("__") for e in container.get("env", [])
                      if e["name"].startswith("GYRE_")]  # fmt: skip
            if f"/etc/gyre/experiment.toml#{service}" in argv:
                # what the chart writes into the service's table itself (the user's own keys are the user's)
                chart_keys = [p for p in toml_paths(experiment.get(service, {}))
                              if not _has(user.get(service, {}), p)]  # fmt: skip
                paths += chart_keys
            found += [(name, service, path) for path in paths]
    return found


def _has(table: dict, path: list[str]) -> bool:
    for key in path:
        if not isinstance(table, dict) or key not in table:
            return False
        table = table[key]
    return True


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_setting_the_chart_passes_is_read_by_its_service(scenario):
    unread = []
    for workload, service, path in passed_settings(SCENARIOS[scenario]):
        read = setting(CONFIGS[service], path)
        if read[0] not in service_reads(service):
            unread.append(f"{workload}: {'.'.join(path)} ({service} never reads `{read[0]}`)")
        elif read[-1] not in service_reads(service) | library_reads():
            unread.append(f"{workload}: {'.'.join(path)} (nothing reads `{read[-1]}`)")
    assert not unread, "options the chart passes that the service ignores:\n" + "\n".join(unread)


def test_the_check_sees_an_option_no_service_reads():
    # the check itself: inference has an output_dir key (every process does) but never reads it
    assert "output_dir" in InferenceConfig.model_fields
    assert "output_dir" not in service_reads("inference")
    assert "output_dir" in service_reads("trainer") and "output_dir" in service_reads("orchestrator")


# Library settings in the environment, and what must run in the container for them to be read.
TORCH_CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")  # torch.compile: the inference and trainer services
VLLM_CACHES = ("VLLM_CACHE_ROOT",)  # vLLM: `gyre inference`


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_library_caches_are_set_only_where_that_library_runs(scenario):
    """The orchestrator image has no torch and the trainer no vLLM: their compiler caches were set in every pod."""
    docs = manifests(render(SCENARIOS[scenario]))
    wrong = []
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Pod"):
            continue
        spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            words = service_command(container) + container.get("args", [])
            service = gyre_argv(container)[0] if words[0] == "gyre" or "gyre.cli" in words else None
            for var in container.get("env", []):
                torch_ok = var["name"] in TORCH_CACHES and service in ("inference", "trainer")
                vllm_ok = var["name"] in VLLM_CACHES and service == "inference"
                if var["name"] in TORCH_CACHES + VLLM_CACHES and not (torch_ok or vllm_ok):
                    wrong.append(f"{doc['metadata']['name']}/{container['name']}: {var['name']}")
    assert not wrong, "cache settings nothing in the container reads:\n" + "\n".join(sorted(set(wrong)))


def test_torch_and_vllm_caches_reach_the_services_that_compile():
    docs = manifests(render({}))
    env = {
        doc["metadata"]["name"]: {v["name"] for v in doc["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet")
    }
    assert set(TORCH_CACHES + VLLM_CACHES) <= env["exp-gyre-inference"]
    assert set(TORCH_CACHES) <= env["exp-gyre-trainer"] and not set(VLLM_CACHES) & env["exp-gyre-trainer"]
    assert not set(TORCH_CACHES + VLLM_CACHES) & env["exp-gyre-orchestrator"]
