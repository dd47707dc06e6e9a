"""Generate charts/gyre/values.schema.json: the chart's own keys plus the parts that must not drift.

    .venv/bin/python charts/gyre/schema/generate.py          # write values.schema.json
    .venv/bin/python charts/gyre/schema/generate.py --check  # exit 1 if it is stale (the tests do this)

Sources:
- `values.schema.yaml` (next to this file): the chart's keys, hand-written, every object closed.
- The experiment (`experiment.*`): the services' pydantic config models (`gyre.config`), so a typo such
  as `experiment.trainer.optim.lrr` fails at `helm install` instead of in a crash-looping pod. Keys the
  chart sets on the command line (`CHART_OWNED`) are removed: setting them in values would be silently
  overridden, so the schema rejects them instead.
- Kubernetes types the values embed (affinity, tolerations, resources, env, NetworkPolicy peers): the
  strict 1.30 schemas bundled with kubernetes-validate, copied with their dependencies.

The output is draft-07 (what Helm's validator and editors expect); pydantic's draft-2020 constructs
are translated (`$defs` -> `definitions`, `prefixItems` -> `items` array).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from gyre.config.packing import ORCHESTRATOR_KEYS as PACKING_KEYS

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "values.schema.yaml"
TARGET = HERE.parent / "values.schema.json"
KUBERNETES_VERSION = "1.30.0"
# A container's resource names beside cpu, memory and ephemeral-storage (what the API server accepts in
# requests/limits): huge pages of a size, and extended resources, always domain-qualified.
EXTENDED_RESOURCE_NAMES = (
    r"^hugepages-[0-9]+[A-Za-z]*$",
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
)

# apimachinery's resource.Quantity grammar: a signed decimal, then a binary (Ki..Ei) or decimal (n u m k M G T P E)
# suffix or a decimal exponent
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?$"

# Keys of each service's table that the chart passes on the command line (dotted paths). The chart
# decides them from its own values: bind addresses and ports (they must match the Services and probes),
# the shared volume, Redis (URL + password from a Secret), replica discovery, secrets, and the
# orchestrator's packing shape (`gyre.config.packing`: derived from the trainer's world size and seq_len, in
# templates/orchestrator.yaml).
CHART_OWNED: dict[str, tuple[str, ...]] = {
    "inference": ("run_id", "output_dir", "metrics", "server", "control", "auth"),
    "orchestrator": (
        "run_id", "output_dir", "redis", "metrics", "server",
        "inference.urls", "inference.discovery", "inference.dns_name", "inference.kubernetes_service",
        "inference.namespace", "inference.http_port", "inference.control_port", "inference.control_urls",
        "inference.api_key", "inference.control_token", "inference.api_key_file", "inference.control_token_file",
        *PACKING_KEYS,
    ),
    "trainer": ("run_id", "output_dir", "redis", "metrics", "server", "orchestrator.address",
                "orchestrator.control_token", "orchestrator.control_token_file"),
}  # fmt: skip
# Keys the chart derives from another service's table (one knob, never two kept in sync by hand): dotted path ->
# what to set instead. A value fails `helm install` with that message.
CHART_DERIVED: dict[str, dict[str, str]] = {
    "orchestrator": {
        "resume_step": "experiment.trainer.ckpt.resume_step (runs[].trainer.resume_step for one run): "
        "the chart rewinds the orchestrator with the trainer",
    },
}
# Top-level keys of the experiment file that every service inherits (`@ experiment.toml#name`).
SHARED_KEYS = ("run_id", "max_steps", "model", "log")
_DROP = ("title", "secret_file_for")


def service_models() -> dict[str, type]:
    from gyre.config.inference import InferenceConfig
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.trainer import TrainerConfig

    return {"inference": InferenceConfig, "trainer": TrainerConfig, "orchestrator": OrchestratorConfig}


def _walk(node: Any, fn) -> Any:
    """Rebuild a JSON tree bottom-up, letting `fn` rewrite every dict."""
    if isinstance(node, dict):
        return fn({k: _walk(v, fn) for k, v in node.items()})
    if isinstance(node, list):
        return [_walk(v, fn) for v in node]
    return node


def _to_draft7(node: dict) -> dict:
    node = {k: v for k, v in node.items() if k not in _DROP}
    if "prefixItems" in node:  # tuple[float, float]
        node["items"] = node.pop("prefixItems")
    if node.get("format") == "path":  # pathlib.Path: just a string to a validator
        del node["format"]
    if isinstance(node.get("$ref"), str):
        node["$ref"] = node["$ref"].replace("#/$defs/", "#/definitions/gyre.")
    return node


# Text that is empty or blank: the services' loader refuses it in a key typed `str` or `list[str]` (None is an
# optional key's "unset"), so `helm install` refuses it too, instead of a pod that crash-loops naming the key.
NOT_BLANK = r"\S"


def _plain_text(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "string" and not {"enum", "const", "pattern"} & set(node)


def _refuse_blank_text(definition: dict) -> None:
    """Give every `str` and `list[str]` property of a definition the loader's not-blank rule."""
    for prop in definition.get("properties", {}).values():
        if _plain_text(prop):
            prop["pattern"] = NOT_BLANK
        elif prop.get("type") == "array" and _plain_text(prop.get("items")):
            prop["items"]["pattern"] = NOT_BLANK


def _refs(node: Any) -> list[str]:
    return re.findall(r'"\$ref": "#/definitions/([^"]+)"', json.dumps(node))


def experiment_definitions() -> dict[str, Any]:
    """`gyre.experiment` and the `gyre.*` definitions it references."""
    from pydantic.json_schema import models_json_schema

    models = service_models()
    _, schema = models_json_schema([(m, "validation") for m in models.values()], ref_template="#/$defs/{model}")
    defs = {f"gyre.{name}": _walk(body, _to_draft7) for name, body in schema["$defs"].items()}
    for definition in defs.values():
        _refuse_blank_text(definition)

    # Remove the chart-owned keys. A definition is edited in place only if no other one refers to it,
    # so removing e.g. `server` from the inference table cannot change another service's table.
    for service, owned in CHART_OWNED.items():
        table = defs[f"gyre.{models[service].__name__}"]
        for dotted in owned:
            *parents, leaf = dotted.split(".")
            node = table
            for part in parents:
                target = node["properties"][part]
                ref = target.get("$ref") or next(a["$ref"] for a in target.get("anyOf", []) if "$ref" in a)
                name = ref.rsplit("/", 1)[1]
                users = sum(_refs(body).count(name) for body in defs.values())
                if users != 1:
                    raise SystemExit(f"{service}.{dotted}: {name} is shared by {users} places; cannot remove a key")
                node = defs[name]
            if leaf not in node["properties"]:
                raise SystemExit(f"{service}.{dotted}: no such key in the config model (update CHART_OWNED)")
            del node["properties"][leaf]
            if leaf in node.get("required", []):
                node["required"].remove(leaf)

    # Keys that moved (a model's `moved_keys`): kept as properties no value satisfies, so Helm's error
    # names where the key went instead of only "additional properties not allowed".
    for service, model in models.items():
        for dotted, new in getattr(model, "moved_keys", {}).items():
            *parents, leaf = dotted.split(".")
            node = defs[f"gyre.{model.__name__}"]
            for part in parents:
                target = node["properties"][part]
                ref = target.get("$ref") or next(a["$ref"] for a in target.get("anyOf", []) if "$ref" in a)
                node = defs[ref.rsplit("/", 1)[1]]
            message = f"removed: set experiment.{service}.{new} instead"
            node["properties"][leaf] = {"description": message.capitalize(), "const": message}

    for service, derived in CHART_DERIVED.items():
        table = defs[f"gyre.{models[service].__name__}"]
        for leaf, instead in derived.items():
            message = f"set by the chart: set {instead}"
            table["properties"][leaf] = {"description": message[0].upper() + message[1:], "const": message}

    service_config = defs["gyre.TrainerConfig"]["properties"]
    run_id = service_config_field("run_id")
    shared = {
        "run_id": {
            "type": "string",
            "pattern": f"^$|{run_id['pattern']}",
            "description": run_id["description"] + " Empty: the release name.",
        },
        "max_steps": service_config["max_steps"],
        "model": service_config["model"],
        "log": service_config["log"],
    }
    assert set(shared) == set(SHARED_KEYS)
    defs["gyre.experiment"] = {
        "description": "The experiment file (`gyre rl` TOML) as YAML: shared keys and one table per service.",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            **shared,
            **{
                name: {"$ref": f"#/definitions/gyre.{model.__name__}", "description": f"The [{name}] table."}
                for name, model in models.items()
            },
        },
    }
    return _reachable(defs, ["gyre.experiment"])


def service_config_field(name: str) -> dict:
    from gyre.config.shared import ServiceConfig

    return _walk(ServiceConfig.model_json_schema()["properties"][name], _to_draft7)


def kubernetes_definitions(names: list[str]) -> dict[str, Any]:
    """The named Kubernetes definitions and their dependencies, refs rewritten to `#/definitions/`."""
    import kubernetes_validate

    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = path / f"v{KUBERNETES_VERSION}-local-strict" / "_definitions.json"
    source = json.loads(path.read_text())["$defs"]

    def rewrite(node: dict) -> dict:
        node = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if isinstance(node.get("$ref"), str):
            node["$ref"] = "#/definitions/" + node["$ref"].rsplit("/", 1)[1]
        return node

    defs = {name: _walk(body, rewrite) for name, body in source.items()}
    # Resource names: Kubernetes' schema takes any key, and the API server refuses a pod with `memroy: 8Gi` only
    # after `helm install` or `helm upgrade` applied the objects before it (a half-done upgrade). Here a typo fails
    # the render with the key named. Container resources are cpu, memory, ephemeral-storage, hugepages-<size>, or
    # an extended resource, always domain-qualified (nvidia.com/gpu, a MIG slice, rdma/hca).
    # (Closed properties, not propertyNames: Helm's message then names the key's path.)
    for field in ("requests", "limits"):
        node = defs["io.k8s.api.core.v1.ResourceRequirements"]["properties"][field]
        quantity = node.pop("additionalProperties")
        node["properties"] = {name: quantity for name in ("cpu", "memory", "ephemeral-storage")}
        node["patternProperties"] = {pattern: quantity for pattern in EXTENDED_RESOURCE_NAMES}
        node["additionalProperties"] = False
    # Quantities: Kubernetes' schema takes any string, so `cpu: 2cores` or `memory: 16GB` (a limit-less request the
    # chart's requests-vs-limits check never reads, an emptyDir sizeLimit) reached the API server, which refuses
    # the pod after the objects before it were applied. Here the render fails naming the key (a pattern applies to
    # strings only: numbers stay numbers).
    defs["io.k8s.apimachinery.pkg.api.resource.Quantity"] = {
        "description": "A Kubernetes quantity: 500m, 2, 1.5, 16Gi, 1G, 1e3 (not 16GB, 2cores or 48 Gi).",
        "type": ["string", "number", "null"],
        "pattern": QUANTITY,
    }
    return _reachable(defs, names)


def _reachable(defs: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in out:
            continue
        if name not in defs:
            raise SystemExit(f"definition {name!r} is referenced but does not exist")
        out[name] = defs[name]
        stack += _refs(defs[name])
    return dict(sorted(out.items()))


def build() -> dict[str, Any]:
    schema = yaml.safe_load(SOURCE.read_text())
    own = schema.setdefault("definitions", {})
    wanted = sorted({r for r in _refs(schema) if r.startswith("io.k8s.")})
    generated = {**kubernetes_definitions(wanted), **experiment_definitions()}
    clash = set(own) & set(generated)
    if clash:
        raise SystemExit(f"{SOURCE.name} defines generated definitions: {sorted(clash)}")
    schema["definitions"] = {**own, **generated}
    missing = set(_refs(schema)) - set(schema["definitions"])
    if missing:
        raise SystemExit(f"undefined $ref targets: {sorted(missing)}")
    return schema


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is stale: run .venv/bin/python {Path(__file__)}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
