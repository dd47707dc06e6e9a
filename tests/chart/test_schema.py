"""values.schema.json: generated from its sources and fresh, closed everywhere, and it (or the
templates) reject bad values with a message naming the key. values.yaml documents every value."""

from __future__ import annotations

import importlib.util
import json
import re

import helm_python
import pytest
from chart_testlib import CHART, gyre_argv, manifests, render


def load_generator():
    spec = importlib.util.spec_from_file_location("gyre_chart_schema", CHART / "schema" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schema_is_fresh():
    generator = load_generator()
    assert (CHART / "values.schema.json").read_text() == generator.render(), (
        "charts/gyre/values.schema.json is stale: run .venv/bin/python charts/gyre/schema/generate.py"
    )


def walk(node, path="#"):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}/{i}")


# Free-form by nature: an environment's keyword arguments are defined by the environment.
# The environment's own arguments; Kubernetes' FieldsV1 (managedFields, reached through extraVolumes'
# ephemeral volume claim templates) is open in the Kubernetes schema itself.
OPEN_BY_DESIGN = {
    "#/definitions/gyre.EnvConfig/properties/args",
    # a chat template's own variables (enable_thinking, ...): whatever the model's template reads
    "#/definitions/gyre.SamplingConfig/properties/chat_template_kwargs",
    "#/definitions/gyre.EnvSamplingConfig/properties/chat_template_kwargs/anyOf/0",
    "#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.FieldsV1",
}


def test_schema_is_draft7_and_every_object_is_closed():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    open_objects = []
    for path, node in walk(schema):
        types = node.get("type")
        is_object = types == "object" or (isinstance(types, list) and "object" in types)
        if is_object and node.get("additionalProperties", True) is True and path not in OPEN_BY_DESIGN:
            open_objects.append(path)
        assert "$defs" not in node and "prefixItems" not in node, f"{path}: not draft-07"
    assert open_objects == []


def test_chart_owned_keys_are_not_settable_in_the_experiment():
    generator = load_generator()
    schema = json.loads((CHART / "values.schema.json").read_text())
    defs = schema["definitions"]
    tables = {"inference": "gyre.InferenceConfig", "orchestrator": "gyre.OrchestratorConfig",
              "trainer": "gyre.TrainerConfig"}  # fmt: skip
    for service, owned in generator.CHART_OWNED.items():
        for dotted in owned:
            node = defs[tables[service]]
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = defs[node["properties"][part]["$ref"].rsplit("/", 1)[1]]
            assert leaf not in node["properties"], f"{service}.{dotted}"


def schema_error(values: dict) -> str:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    return str(caught.value)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"replicaCount": 2}, ["replicaCount"]),
        ({"inference": {"replica": 2}}, ["replica"]),
        ({"inference": {"replicas": -1}}, ["/inference/replicas", "minimum"]),
        ({"trainer": {"nnodes": 0}}, ["/trainer/nnodes", "minimum"]),
        ({"inference": {"gpus": -1}}, ["/inference/gpus"]),
        ({"experiment": {"trainer": {"optim": {"lrr": 1e-3}}}}, ["/experiment/trainer/optim", "lrr"]),
        ({"experiment": {"trainer": {"optim": {"lr": -1}}}}, ["/experiment/trainer/optim/lr"]),
        ({"experiment": {"orchestrator": {"batch_size": "many"}}}, ["/experiment/orchestrator/batch_size"]),
        ({"experiment": {"inference": {"backend": "tgi"}}}, ["/experiment/inference/backend"]),
        # keys that moved say where to (InferenceConfig.moved_keys)
        (
            {"experiment": {"inference": {"engine": {"max_lora_rank": 16}}}},
            ["/experiment/inference/engine/max_lora_rank", "set experiment.inference.lora.max_rank instead"],
        ),
        (
            {"experiment": {"inference": {"lora": {"max_adapters": 2}}}},
            ["/experiment/inference/lora/max_adapters", "set experiment.inference.lora.max_loras instead"],
        ),
        ({"experiment": {"inference": {"server": {"port": 9000}}}}, ["/experiment/inference", "server"]),
        ({"experiment": {"inference": {"auth": {"api_key": "plain"}}}}, ["/experiment/inference", "auth"]),
        ({"experiment": {"run_id": "has spaces"}}, ["/experiment/run_id"]),
        ({"orchestrator": {"discovery": "static"}}, ["/orchestrator/discovery"]),
        ({"redis": {"external": {"url": "redis://:hunter2@redis.infra:6379/0"}}}, ["/redis/external/url"]),
        ({"secrets": {"apiKey": "plain"}}, ["apiKey"]),
        ({"nodePools": {"gpu": {"nodeselector": {}}}}, ["nodeselector"]),
        ({"inference": {"tolerations": [{"key": "a", "operater": "Exists"}]}}, ["operater"]),
        ({"persistence": {"size": "lots"}}, ["/persistence/size"]),
        ({"podSecurity": {"runAsUser": 0}}, ["/podSecurity/runAsUser"]),
        ({"monitoring": {"enabled": "yes"}}, ["/monitoring/enabled"]),
        ({"assumeApiVersions": ["keda"]}, ["/assumeApiVersions/0"]),
        # a replica runs on one GPU (no tensor parallelism): a second one was requested and left idle
        ({"inference": {"gpus": 2}}, ["/inference/gpus"]),
        ({"servers": [{"name": "teacher", "model": "Qwen/Qwen3-8B", "gpus": 2}]}, ["/servers/0/gpus"]),
        # a resource name the API server refuses (after applying the objects before the pod: a half-done upgrade)
        ({"trainer": {"resources": {"requests": {"memroy": "8Gi"}}}}, ["/trainer/resources/requests", "memroy"]),
        ({"inference": {"resources": {"limits": {"gpu": 1}}}}, ["/inference/resources/limits", "gpu"]),
        ({"redis": {"resources": {"limits": {"Memory": "1Gi"}}}}, ["/redis/resources/limits", "Memory"]),
        # a quantity the API server cannot parse, on a request without a limit (no requests-vs-limits check reads it)
        ({"orchestrator": {"resources": {"requests": {"cpu": "2cores"}}}}, ["/orchestrator/resources/requests/cpu"]),
        ({"trainer": {"resources": {"requests": {"memory": "16GB"}}}}, ["/trainer/resources/requests/memory", "16GB"]),
        # one pod at a time: the other pods sharing the claim (inference, orchestrator, trainer) stay Pending for good
        ({"persistence": {"accessMode": "ReadWriteOncePod"}}, ["/persistence/accessMode", "ReadWriteOnce'"]),
        ({"modelCache": {"type": "pvc", "accessMode": "ReadWriteOncePod"}}, ["/modelCache/accessMode"]),
        # empty or blank text the services' loader refuses: helm install refused nothing and the pod crash-looped
        ({"experiment": {"trainer": {"lora": {"target_modules": ["q_proj", ""]}}}}, ["/experiment/trainer/lora"]),
        ({"experiment": {"model": {"name": " "}}}, ["/experiment/model/name"]),
        ({"experiment": {"trainer": {"wandb": {"project": ""}}}}, ["/experiment/trainer/wandb/project"]),
    ],
)
def test_bad_values_are_rejected_naming_the_key(values, names):
    message = schema_error(values)
    for name in names:
        assert name in message, message


def test_every_text_key_the_loader_refuses_blank_the_schema_refuses_blank():
    """Each `str` / `list[str]` key of the services' config models (what `gyre.config.loader` refuses empty or
    blank) has the not-blank pattern in its schema definition, so no such key is forgotten by hand."""
    import typing

    from gyre.config.fields import unannotated
    from pydantic import BaseModel

    generator = load_generator()
    definitions = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    seen: set[type] = set()
    checked = 0

    def visit(model: type[BaseModel]) -> None:
        nonlocal checked
        if model in seen:
            return
        seen.add(model)
        properties = definitions.get(f"gyre.{model.__name__}", {}).get("properties", {})
        for name, field in model.model_fields.items():
            annotation = unannotated(field.annotation)
            for arg in (annotation, *typing.get_args(annotation)):
                arg = unannotated(arg)
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    visit(arg)
            if name not in properties or "const" in properties[name]:  # chart-owned or moved keys
                continue
            prop = properties[name]
            if annotation is str:  # the not-blank rule, or a stricter pattern or choice of its own
                assert {"pattern", "enum"} & set(prop), f"{model.__name__}.{name} takes blank text: {prop}"
                checked += 1
            elif typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,):
                assert prop["items"].get("pattern") == generator.NOT_BLANK, (model, name, prop)
                checked += 1

    for model in generator.service_models().values():
        visit(model)
    assert checked >= 10


def test_every_container_resource_name_kubernetes_takes_passes_the_schema():
    resources = {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi", "hugepages-2Mi": "1Gi",
                 "nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1, "rdma/hca": 1}  # fmt: skip
    values = {"orchestrator": {"resources": {"requests": resources, "limits": resources}}}
    (orchestrator,) = [m for m in manifests(render(values)) if m["metadata"]["name"] == "exp-gyre-orchestrator"
                       and m["kind"] == "Deployment"]  # fmt: skip
    assert orchestrator["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == resources


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"experiment": {"model": {"name": "Qwen/Qwen3-0.6B"}}}, "experiment.model.name must stay unset"),
        ({"modelInit": {"enabled": False}}, "set experiment.model.name"),
        ({"inference": {"nodePool": "a100"}}, 'nodePool "a100" is not defined in nodePools'),
    ],
)
def test_inconsistent_values_fail_with_a_clear_message(values, needle):
    with pytest.raises(helm_python.HelmRenderError) as caught:
        render(values)
    assert needle in str(caught.value)


def test_good_experiment_values_render_into_the_experiment_file():
    import tomllib

    from chart_testlib import experiment_toml, manifests

    experiment = {
        "max_steps": 12,
        "log": {"level": "DEBUG"},
        "trainer": {"optim": {"lr": 3e-6, "betas": [0.9, 0.95]}, "data": {"seq_len": 512}},
        "orchestrator": {
            "batch_size": 4,
            "env": {"name": "reverse_text", "args": {"min_len": 3, "tag": "a b"}},
            "sampling": {"temperature": 0.7},
        },  # fmt: skip
    }
    docs = manifests(render({"experiment": experiment}))
    parsed = tomllib.loads(experiment_toml(docs))
    assert parsed["run_id"] == "exp" and parsed["max_steps"] == 12 and isinstance(parsed["max_steps"], int)
    assert parsed["log"] == {"level": "DEBUG", "format": "json"}  # the chart's format kept beside it
    assert parsed["trainer"] == {"optim": {"lr": 3e-6, "betas": [0.9, 0.95]}, "data": {"seq_len": 512}}
    # Integers stay integers (Helm reads every number as a float; the file must say 4, not 4.0).
    assert parsed["orchestrator"]["batch_size"] == 4 and isinstance(parsed["orchestrator"]["batch_size"], int)
    assert parsed["orchestrator"]["env"] == {"name": "reverse_text", "args": {"min_len": 3, "tag": "a b"}}
    assert parsed["orchestrator"]["sampling"] == {"temperature": 0.7}
    # The orchestrator packs rows of the trainer's length (chart-owned, derived).
    orchestrator = next(d for d in docs if d["kind"] == "Deployment" and "orchestrator" in d["metadata"]["name"])
    args = orchestrator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--batch.seq-len") + 1] == "512"


@pytest.mark.parametrize("trainer", [{}, {"data": {"seq_len": 300}}], ids=["default", "seq_len"])
@pytest.mark.parametrize(
    "shape", [{"nnodes": 1, "nprocPerNode": 1}, {"nnodes": 2, "nprocPerNode": 4}], ids=["1x1", "2x4"]
)
def test_the_orchestrator_packs_to_the_shape_gyre_config_derives(trainer, shape):
    """The chart derives the orchestrator's packing shape as `gyre rl` does (`gyre.config.packing.PackingShape`):
    rows of the trainer's data.seq_len (its default included), split over every trainer process."""
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.packing import PackingShape

    docs = manifests(render({"experiment": {"trainer": trainer}, "trainer": shape}))
    argv = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            service, args = gyre_argv(doc["spec"]["template"]["spec"]["containers"][0])
            argv[service] = args
    orchestrator = argv["orchestrator"]
    seq_len = OrchestratorConfig().batch.seq_len  # what the orchestrator packs to when no flag is passed
    if "--batch.seq-len" in orchestrator:
        seq_len = int(orchestrator[orchestrator.index("--batch.seq-len") + 1])
    dp = int(orchestrator[orchestrator.index("--batch.dp-world-size") + 1])
    expected = PackingShape.derive(trainer, {}, shape["nnodes"] * shape["nprocPerNode"])
    assert PackingShape(seq_len, dp) == expected


def documented_value_lines() -> list[tuple[int, str, bool]]:
    """(line number, dotted key, documented?) for every leaf value of values.yaml.

    A key is documented when the comment block right above it contains a `# --` line; as in helm-docs,
    a documented map (resources, probes, labels) documents its entries. Keys inside list items
    (examples such as tolerations) belong to that list's value and are not leaves.
    """
    lines = (CHART / "values.yaml").read_text().splitlines()
    out, stack, list_indent = [], [], None
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and indent > list_indent:
            continue
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent
            continue
        match = re.match(r"([A-Za-z0-9_.\-/]+):(.*)$", stripped)
        assert match, f"values.yaml:{number + 1}: cannot parse {line!r}"
        key, rest = match[1], match[2].strip()
        comments = []
        for previous in reversed(lines[:number]):
            if not previous.strip().startswith("#"):
                break
            comments.append(previous.strip())
        stack = [entry for entry in stack if entry[0] < indent]
        documented = any(c.startswith("# --") for c in comments) or any(d for _, _, d in stack)
        stack.append((indent, key, documented))
        following = next((ln for ln in lines[number + 1 :] if ln.strip() and not ln.strip().startswith("#")), "")
        deeper = len(following) - len(following.lstrip()) > indent
        is_parent = not rest and deeper and not following.strip().startswith("- ")
        if not is_parent:
            out.append((number + 1, ".".join(k for _, k, _ in stack), documented))
    return out


def test_every_value_is_documented():
    leaves = documented_value_lines()
    assert len(leaves) > 80
    assert [f"line {n}: {key}" for n, key, documented in leaves if not documented] == []


@pytest.mark.parametrize(
    ("values", "replicas", "batch"),
    [
        ({}, 1, None),
        ({"experiment": {"inference": {"engine": {"max_batch_size": 256}}}, "inference": {"replicas": 2}}, 2, 256),
        ({"experiment": {"inference": {"engine": {"max_batch_size": 128}}},
          "inference": {"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 3}},
          "assumeApiVersions": ["keda.sh/v1alpha1"]}, 3, 128),
    ],
    ids=["default", "two-replicas-of-256", "autoscaled-to-3"],
)  # fmt: skip
def test_requests_in_flight_fill_every_replicas_batch(values, replicas, batch, tmp_path):
    """As `gyre rl` derives it: max_concurrency = the fleet's rows (with KEDA, the largest fleet's, so demand
    can grow the pool). The orchestrator's own default (64) left a 256-row engine three quarters idle."""
    from chart_testlib import fullname, service_config
    from gyre.config.inference import EngineConfig

    docs = manifests(render(values))
    orchestrator = service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator")
    rows = EngineConfig(**({"max_batch_size": batch} if batch else {})).max_batch_size
    assert orchestrator.inference.max_concurrency == replicas * rows
    inference = service_config(docs, tmp_path, "inference", f"{fullname()}-inference")
    assert inference.engine.max_batch_size == rows  # the replicas really run batches of that size


def test_a_max_concurrency_the_user_sets_wins(tmp_path):
    from chart_testlib import fullname, service_config

    fleet = {"inference": {"replicas": 4}, "experiment": {"inference": {"engine": {"max_batch_size": 256}}}}
    own = {**fleet, "experiment": {**fleet["experiment"], "orchestrator": {"inference": {"max_concurrency": 100}}}}
    docs = manifests(render(own))
    assert service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator").inference.max_concurrency == 100
    runs = {
        **fleet,
        "runs": [{"name": "run-a"}, {"name": "run-b", "orchestrator": {"inference": {"max_concurrency": 7}}}],
    }
    docs = manifests(render(runs))
    derived = service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator-run-a").inference
    assert derived.max_concurrency == 4 * 256
    assert (
        service_config(docs, tmp_path, "orchestrator", f"{fullname()}-orchestrator-run-b").inference.max_concurrency
        == 7
    )
