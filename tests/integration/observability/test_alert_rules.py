"""Alert rules: promtool-clean, unit-tested (each alert fires on a failing series and stays silent on
healthy ones), on real metric names, and shipped unchanged by the Helm chart."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from observability_support import (
    ALERTS,
    ALERTS_TEST,
    CHART,
    CHART_RULES,
    OPTIONAL_METRICS,
    PROMTOOL,
    alert_rules,
    catalogue,
    label_problems,
    metric_names,
    series_base,
)

pytestmark = pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="apt-get install prometheus")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_promtool_check_rules_is_clean():
    for path in (ALERTS, CHART_RULES):
        result = promtool("check", "rules", str(path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass():
    result = promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case(tmp_path):
    """Mutation check of alerts_test.yaml: for each alert, a copy of the rules where that alert never
    fires must fail the tests (so some case expects it to fire), and a copy where it always fires
    must fail too (so some case expects silence)."""
    source = yaml.safe_load(ALERTS.read_text())
    tested = yaml.safe_load(ALERTS_TEST.read_text())
    tested_names = {t["alertname"] for case in tested["tests"] for t in case.get("alert_rule_test", [])}
    assert tested_names == {r["alert"] for r in alert_rules()}, "every alert needs promtool test cases"

    def passes_with(alert: str, expr: str, folder: Path) -> bool:
        groups = yaml.safe_load(yaml.safe_dump(source))
        for rule in (r for g in groups["groups"] for r in g["rules"] if r.get("alert") == alert):
            rule["expr"], rule["for"] = expr, "0s"
        folder.mkdir()
        (folder / "alerts.yaml").write_text(yaml.safe_dump(groups))
        (folder / "alerts_test.yaml").write_text(ALERTS_TEST.read_text())
        return promtool("test", "rules", "alerts_test.yaml", cwd=folder).returncode == 0

    cases = [
        (rule["alert"], expr, meaning)
        for rule in alert_rules()
        for expr, meaning in (("vector(1) < 0", "never fires"), ("vector(1)", "always fires"))
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:  # promtool runs are independent processes
        results = list(pool.map(lambda c: passes_with(c[0], c[1], tmp_path / f"{c[0]}-{c[2][:5]}"), cases))
    survivors = [f"{alert} {meaning}" for (alert, _, meaning), passed in zip(cases, results, strict=True) if passed]
    assert not survivors, f"alerts_test.yaml still passes when: {survivors}"


def test_alerts_use_real_metric_names():
    rows = catalogue()
    histograms = {name for name, row in rows.items() if row.kind == "histogram"}
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            base = series_base(name, histograms)
            assert base in rows or base in OPTIONAL_METRICS, f"{rule['alert']}: unknown metric {name}"
        assert not label_problems(rule["expr"], rows), f"{rule['alert']}: {label_problems(rule['expr'], rows)}"
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_chart_ships_the_same_rules():
    assert CHART_RULES.read_bytes() == ALERTS.read_bytes(), (
        f"{CHART_RULES} differs from {ALERTS}: cp {ALERTS.relative_to(CHART.parents[1])} "
        f"{CHART_RULES.relative_to(CHART.parents[1])}"
    )
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        # a cluster with the Prometheus operator's CRDs (the chart refuses monitoring.enabled=true without them)
        values = {"monitoring": {"enabled": True}, "assumeApiVersions": ["monitoring.coreos.com/v1"]}
        rendered = chart.render(values, name="exp", namespace="rl", is_install=True)
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    rules = [d for d in docs if d.get("kind") == "PrometheusRule"]
    assert len(rules) == 1
    assert rules[0]["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
