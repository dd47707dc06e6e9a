"""The Kubernetes semantics the container smoke's plan reads: the chart rendered by Helm's own engine, values
merged as Helm merges them, resource quantities, `$(VAR)` expansion, label selectors, ConfigMap/Secret data."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path


def render_chart(
    chart: Path, values: dict, *, release: str, namespace: str, api_versions: tuple[str, ...] = ()
) -> list[dict]:
    """The release's objects as `helm install --dry-run` renders them (Helm's own engine, helm_python).

    `api_versions` adds capabilities (`helm template --api-versions`), e.g. the Prometheus operator's CRDs
    the kind workflow installs, so the same objects render as there."""
    import helm_python
    import yaml
    from helm_python import _native

    with helm_python.Chart.load(chart) as loaded:
        # Chart.render() has no parameter for extra capabilities, the native call it wraps has.
        opts = {"name": release, "namespace": namespace, "is_install": True, "api_versions": list(api_versions)}
        rendered = json.loads(_native.call_string("helm_render", loaded._raw(), json.dumps(values), json.dumps(opts)))
    docs = []
    for path, text in sorted(rendered.items()):
        if not path.endswith("NOTES.txt"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def merge_values(base: dict, override: dict) -> dict:
    """Helm's values merge: maps merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            merge_values(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("4Gi", "500m", "1.5", "2e3") as a number."""
    text = str(value).strip()
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?\d+)?)([A-Za-z]*)", text)
    if not match or match[2] not in ("", *_SUFFIX):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match[1]) * _SUFFIX.get(match[2], 1)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes, others stay as they are."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value
    )


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def kind_name(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def config_data(obj: dict) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys as bytes (Secret `data` is base64; `stringData` as the API merges it)."""
    if obj["kind"] == "Secret":
        out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
        return out
    out = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out
