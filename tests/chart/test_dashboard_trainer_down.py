"""What the shipped trainer dashboard shows an operator, once the trainer is down (its pod gone, crash-looping,
pending: no longer scraped) and from the step records' values, evaluated by Prometheus's own engine
(`promtool test rules`, promql_expr_test) on the panel's query exactly as charts/gyre/dashboards/trainer.json ships it.

"Time since last step" went empty the moment the trainer stopped being scraped (its series stale after 5
minutes), the one moment the panel matters; it now counts on from the last step it saw. And the overview's
experiment list came from the trainer's series alone: a run whose trainer never came up (pending on GPUs) was
not listed, its rollouts and rewards out of reach."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from chart_testlib import CHART

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = pytest.mark.skipif(shutil.which(PROMTOOL) is None, reason="apt-get install prometheus")


def panel_queries(dashboard: str, title: str) -> dict[str, str]:
    """{legend: PromQL} of a shipped panel, its template variables as "All" selects them."""
    model = json.loads((CHART / "dashboards" / dashboard).read_text())
    (found,) = [p for p in model["panels"] if p.get("title") == title]
    return {
        t["legendFormat"]: t["expr"]
        .replace("$namespace", ".*")
        .replace("$run_id", ".*")
        .replace("$__rate_interval", "2m")
        for t in found["targets"]
    }


def panel_query(dashboard: str, title: str) -> str:
    (query,) = panel_queries(dashboard, title).values()
    return query


def run_id_selector(dashboard: str) -> str:
    """The series the dashboard's run_id variable lists its values from (`label_values(SELECTOR, run_id)`)."""
    model = json.loads((CHART / "dashboards" / dashboard).read_text())
    (var,) = [v for v in model["templating"]["list"] if v["name"] == "run_id"]
    query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
    assert query.startswith("label_values(") and query.endswith(", run_id)"), query
    return query.removeprefix("label_values(").removesuffix(", run_id)").replace("$namespace", ".*")


def promtool_test(tmp_path, test: dict) -> subprocess.CompletedProcess:
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"evaluation_interval": "1m", "tests": [test]}))
    return subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_overview_lists_a_run_whose_trainer_never_came_up(tmp_path):
    """label_values(SELECTOR, run_id) lists the run_id of every series SELECTOR matches in the time range: the
    same as `count by (run_id) (SELECTOR)` while they are scraped."""
    selector = run_id_selector("overview.json")
    result = promtool_test(tmp_path, {
        "interval": "1m",
        "input_series": [
            {"series": 'gyre_orchestrator_step{namespace="ml", run_id="pending"}', "values": "0x30"},
            {"series": 'gyre_orchestrator_step{namespace="ml", run_id="running"}', "values": "0+1x30"},
            {"series": 'gyre_trainer_step{namespace="ml", run_id="running"}', "values": "0+1x30"},
        ],
        "promql_expr_test": [{
            "expr": f"count by (run_id) ({selector})",
            "eval_time": "20m",
            "exp_samples": [{"labels": '{run_id="pending"}', "value": 1}, {"labels": '{run_id="running"}', "value": 2}],
        }],
    })  # fmt: skip
    assert result.returncode == 0, f"{selector}\n{result.stdout}{result.stderr}"


def test_time_since_last_step_counts_on_while_the_trainer_is_down(tmp_path):
    query = panel_query("trainer.json", "Time since last step")
    # Steps published every minute for 10 minutes (the gauge holds the step's unix time: 60, 120, ..., 600),
    # then the trainer is no longer scraped. A healthy run beside it stays at its own last step.
    down = 'gyre_trainer_last_step_timestamp_seconds{namespace="ml", run_id="down"}'
    up = 'gyre_trainer_last_step_timestamp_seconds{namespace="ml", run_id="up"}'
    result = promtool_test(tmp_path, {
        "interval": "1m",
        "input_series": [{"series": down, "values": "0 60+60x9 _x50"}, {"series": up, "values": "0 60+60x59"}],
        "promql_expr_test": [{
            "expr": query,
            "eval_time": "40m",
            "exp_samples": [{"labels": '{run_id="down"}', "value": 40 * 60 - 600},
                            {"labels": '{run_id="up"}', "value": 0}],
        }],
    })  # fmt: skip
    assert result.returncode == 0, f"{query}\n{result.stdout}{result.stderr}"


def test_probability_ratio_panel_shows_each_runs_mean_min_and_max(tmp_path):
    """The step record's ratio_mean/min/max (r = π_θ/μ of the sampled tokens) are on the trainer dashboard, per run."""
    queries = panel_queries("trainer.json", "Trainer/inference probability ratio")
    assert set(queries) == {"mean {{run_id}}", "min {{run_id}}", "max {{run_id}}"}
    values = {"mean": 0.97, "min": 0.02, "max": 40.0}
    series = [{"series": f'gyre_trainer_ratio_{stat}{{namespace="ml", run_id="a"}}', "values": f"{v}x10"}
              for stat, v in values.items()]  # fmt: skip
    result = promtool_test(tmp_path, {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [{"expr": queries[f"{stat} {{{{run_id}}}}"], "eval_time": "5m",
                              "exp_samples": [{"labels": '{run_id="a"}', "value": v}]} for stat, v in values.items()],
    })  # fmt: skip
    assert result.returncode == 0, f"{queries}\n{result.stdout}{result.stderr}"


def test_tokens_per_second_shows_wall_and_compute_throughput(tmp_path):
    """Wall throughput is rate(tokens); compute throughput (the step records' tokens_per_second) divides the
    same tokens by the steps' compute seconds, so a trainer waiting half the time for batches shows twice as much."""
    queries = panel_queries("trainer.json", "Tokens/s")
    assert set(queries) == {"wall {{run_id}}", "compute {{run_id}}"}
    # 600 tokens a minute, of which 30 s are the step's own compute
    result = promtool_test(tmp_path, {
        "interval": "1m",
        "input_series": [
            {"series": 'gyre_trainer_tokens_total{namespace="ml", run_id="a"}', "values": "0+600x20"},
            {"series": 'gyre_trainer_step_duration_seconds_sum{namespace="ml", run_id="a"}', "values": "0+30x20"},
        ],
        "promql_expr_test": [
            {"expr": queries["wall {{run_id}}"], "eval_time": "10m",
             "exp_samples": [{"labels": '{run_id="a"}', "value": 10}]},
            {"expr": queries["compute {{run_id}}"], "eval_time": "10m",
             "exp_samples": [{"labels": '{run_id="a"}', "value": 20}]},
        ],
    })  # fmt: skip
    assert result.returncode == 0, f"{queries}\n{result.stdout}{result.stderr}"
