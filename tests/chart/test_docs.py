"""docs/kubernetes.md covers what the issue asks and only refers to things that exist."""

from __future__ import annotations

import re

import helm_python
from chart_testlib import CHART, KEDA_APIS, MONITORING_APIS, ROOT, render

DOC = ROOT / "docs" / "kubernetes.md"


def test_kubernetes_doc_has_the_required_sections():
    headings = [line.lstrip("#").strip().lower() for line in DOC.read_text().splitlines() if line.startswith("#")]
    for needed in ("install", "port-forward", "node pools", "storage", "multi-node", "upgrading an experiment",
                   "uninstall and what is kept"):  # fmt: skip
        assert any(needed in h for h in headings), needed


def test_paths_the_doc_mentions_exist():
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:charts|deploy|docs|\.github)/[\w./-]+|Dockerfile\.\w+|\.dockerignore)`", text))
    assert len(paths) >= 10
    missing = [p for p in paths if "*" not in p and not (ROOT / p).exists()]
    assert missing == []


def test_doc_commands_match_what_the_chart_prints():
    notes = render({}, name="my-exp", namespace="rl")["gyre/templates/NOTES.txt"]
    text = DOC.read_text()
    for command in ("kubectl -n rl port-forward svc/my-exp-gyre-inference 8000:8000",
                    "kubectl -n rl get secret my-exp-gyre-secrets -o jsonpath='{.data.api-key}' | base64 -d",
                    'curl -s http://127.0.0.1:8000/v1/models -H "Authorization: Bearer $GYRE_API_KEY"'):  # fmt: skip
        assert command in notes and command in text, command


def test_doc_mentions_every_top_level_value():
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = DOC.read_text()
    self_explanatory = {"nameOverride", "fullnameOverride", "imagePullSecrets", "podSecurity", "tests"}
    undocumented = [k for k in values if k not in self_explanatory and k not in text]
    assert undocumented == []


def test_every_values_example_of_the_doc_renders():
    """A user copies the doc's YAML examples into `-f my-exp.yaml`: each one passes the schema and renders, read as
    Helm reads a values file (`2e-3` is a number there), on a cluster with the optional APIs it names."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    examples = [v for v in map(helm_python.values_from_yaml, blocks) if isinstance(v, dict)]
    assert len(examples) >= 5
    for values in examples:
        assert render(values, name="my-exp", api_versions=MONITORING_APIS + KEDA_APIS), values
