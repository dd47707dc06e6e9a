"""Dashboards: up to date with their generator, filtered by experiment, with units, on real metric names
used the way their type allows, covering every catalogued metric, and parsed by a real Prometheus.
(That every query returns data from a real run is test_observability_e2e.py.)"""

from __future__ import annotations

import pytest
import yaml
from gyre.local.prometheus import PROMETHEUS, LocalPrometheus, PrometheusError
from observability_support import (
    ALERTS,
    DASHBOARD_DIR,
    OPTIONAL_METRICS,
    PanelQuery,
    catalogue,
    dashboards,
    label_problems,
    load_build_dashboards,
    metric_names,
    panel_queries,
    panels,
    query_variables,
    rated_metrics,
    selectors,
    series_base,
    substitute,
)

EXPECTED = {"overview.json", "inference.json", "trainer.json"}
SERVING = 'and on (namespace, instance) gyre_inference_policy_version{namespace=~"$namespace", run_id=~"$run_id"}'


def test_committed_json_is_what_the_generator_builds(tmp_path):
    build = load_build_dashboards()
    assert build.main(["--out-dir", str(tmp_path)]) == 0
    for name in EXPECTED:
        assert (tmp_path / name).read_text() == (DASHBOARD_DIR / name).read_text(), (
            f"{DASHBOARD_DIR / name} is stale: run .venv/bin/python deploy/grafana/build_dashboards.py"
        )
    assert build.main(["--check", "--out-dir", str(tmp_path)]) == 0
    (tmp_path / "trainer.json").write_text("{}")
    assert build.main(["--check", "--out-dir", str(tmp_path)]) == 1


def test_structure_variables_units_and_layout():
    models = dashboards()
    assert set(models) == EXPECTED
    assert len({m["uid"] for m in models.values()}) == len(models)
    for name, model in models.items():
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert {"datasource", "namespace", "run_id"} <= set(variables), name
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert [v.name for v in query_variables(model)] == ["namespace", "run_id"], name
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in panels(model):
            where = f"{name} / {panel['title']}"
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel.get("targets"), f"{where}: no query"
            assert panel.get("description"), f"{where}: no description"
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, f"{where}: off the grid {grid}"


def query_problems(q: PanelQuery, rows: dict) -> list[str]:
    """What is wrong with one panel query: unfiltered selectors, unknown metrics, rate() of a gauge,
    buckets of a non-histogram, quantiles that aggregate `le` away, label names no series of it carries."""
    problems = []
    histograms = {n for n, r in rows.items() if r.kind == "histogram"}
    found = selectors(q.expr)
    if not found:
        problems.append("no gyre_ metric")
    for metric, matchers in found:
        # a replica-wide inference series carries the replica's run_id (multi-run: not a run's): shown for the
        # replicas serving the chosen runs instead
        replica_wide = metric.startswith("gyre_inference_") and SERVING in q.expr
        if 'namespace=~"$namespace"' not in matchers or ('run_id=~"$run_id"' not in matchers and not replica_wide):
            problems.append(f"{metric} not filtered by $namespace and $run_id")
    for name in metric_names(q.expr):
        base = series_base(name, histograms)
        if base not in rows and base not in OPTIONAL_METRICS:
            problems.append(f"unknown metric {name}")
        elif name.endswith("_bucket") and base not in histograms:
            problems.append(f"{name} is not a histogram's buckets")
    for name in rated_metrics(q.expr):
        if not (name.endswith("_total") or series_base(name, histograms) in histograms):
            problems.append(f"rate() of gauge {name}")
    if "histogram_quantile" in q.expr and "le)" not in q.expr:
        problems.append("histogram_quantile without `le` in the aggregation")
    return problems + label_problems(q.expr, rows)


def test_every_query_is_filtered_on_real_metrics_used_as_their_type_allows():
    rows = catalogue()
    problems = [f"{q}: {p}" for q in panel_queries() for p in query_problems(q, rows)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "expr, problem",
    [
        ("gyre_trainer_loss", "not filtered"),
        ('gyre_inference_kv_cache_usage_ratio{namespace=~"$namespace"}', "not filtered"),  # replica-wide, unlimited
        ('gyre_trainer_lost{namespace=~"$namespace", run_id=~"$run_id"}', "unknown metric"),
        ('rate(gyre_trainer_loss{namespace=~"$namespace", run_id=~"$run_id"}[1m])', "rate() of gauge"),
        ('gyre_trainer_loss_bucket{namespace=~"$namespace", run_id=~"$run_id"}', "unknown metric"),
        (
            'histogram_quantile(0.9, sum(rate(gyre_trainer_step_duration_seconds_bucket{namespace=~"$namespace", '
            'run_id=~"$run_id"}[1m])))',
            "without `le`",
        ),
        # labels the metric does not carry: valid PromQL, an empty panel or one line instead of several
        ('gyre_trainer_loss{namespace=~"$namespace", run_id=~"$run_id", env="math"}', "has no label env"),
        ('sum by (run_id, rank) (gyre_trainer_loss{namespace=~"$namespace", run_id=~"$run_id"})', "by (rank)"),
        (
            "histogram_quantile(0.9, sum by (run_id, env, le) (rate(gyre_inference_request_latency_seconds_bucket"
            '{namespace=~"$namespace", run_id=~"$run_id"}[1m])))',
            "by (env)",
        ),
        ('gyre_trainer_loss{namespace=~"$namespace", run_id=~"$run_id", le="1"}', "has no label le"),
        ('count by (run_id, replica) ({__name__=~"gyre_trainer_.+", namespace=~"$namespace"})', "by (replica)"),
    ],
)
def test_query_checks_catch_broken_queries(expr, problem):
    problems = query_problems(PanelQuery("x.json", "panel", "A", expr), catalogue())
    assert any(problem in p for p in problems), problems


def test_every_catalogued_metric_is_on_a_dashboard():
    rows = catalogue()
    histograms = {n for n, r in rows.items() if r.kind == "histogram"}
    used = {series_base(name, histograms) for q in panel_queries() for name in metric_names(q.expr)}
    assert not sorted(set(rows) - used), f"metrics on no dashboard: {sorted(set(rows) - used)}"


def test_every_learning_alert_has_a_panel_in_the_overviews_learning_health_row():
    """A firing gyre-learning alert can be read off one panel that queries every metric of its rule."""
    flat = dashboards()["overview.json"]["panels"]
    (start,) = [i for i, p in enumerate(flat) if p.get("type") == "row" and p["title"] == "Learning health"]
    row = []
    for panel in flat[start + 1 :]:
        if panel.get("type") == "row":
            break
        row.append({name for t in panel["targets"] for name in metric_names(t["expr"])})
    (group,) = [g for g in yaml.safe_load(ALERTS.read_text())["groups"] if g["name"] == "gyre-learning"]
    for rule in group["rules"]:
        assert any(metric_names(rule["expr"]) <= queried for queried in row), f"{rule['alert']}: no panel"


@pytest.mark.skipif(not PROMETHEUS.exists(), reason="apt-get install prometheus")
def test_every_query_and_variable_parses_in_prometheus(tmp_path):
    values = {"namespace": ["local"], "run_id": ["exp-a", "exp.b"]}
    with LocalPrometheus(tmp_path / "prom", {}, run_id="parse-check", rule_files=()) as prom:
        errors = []
        for q in panel_queries():
            try:
                prom.query(substitute(q.expr, values, "1m"))
            except PrometheusError as e:
                errors.append(f"{q}: {e}")
        for model in dashboards().values():
            for var in query_variables(model):
                prom.label_values(var.label, substitute(var.match, values, "1m"))
        assert not errors, "\n".join(errors)
        with pytest.raises(PrometheusError):  # the check can fail: a broken query is reported
            prom.query(substitute('rate(gyre_trainer_tokens_total{run_id=~"$run_id"}[$__rate_interval]', values, "1m"))
