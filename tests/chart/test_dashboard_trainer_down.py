"""What the shipped trainer dashboard shows an operator once the trainer is down (its pod gone, crash-looping,
pending: no longer scraped), evaluated by Prometheus's own engine (`promtool test rules`, promql_expr_test) on
the panel's query exactly as charts/gyre/dashboards/trainer.json ships it.

"Time since last step" went empty the moment the trainer stopped being scraped (its series stale after 5
minutes), the one moment the panel matters; it now counts on from the last step it saw."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from chart_testlib import CHART

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = pytest.mark.skipif(shutil.which(PROMTOOL) is None, reason="apt-get install prometheus")


def panel_query(dashboard: str, title: str) -> str:
    model = json.loads((CHART / "dashboards" / dashboard).read_text())
    (found,) = [p for p in model["panels"] if p.get("title") == title]
    (target,) = found["targets"]
    # the template variables as "All" selects them
    return target["expr"].replace("$namespace", ".*").replace("$run_id", ".*").replace("$__rate_interval", "2m")


def test_time_since_last_step_counts_on_while_the_trainer_is_down(tmp_path):
    query = panel_query("trainer.json", "Time since last step")
    # Steps published every minute for 10 minutes (the gauge holds the step's unix time: 60, 120, ..., 600),
    # then the trainer is no longer scraped. A healthy run beside it stays at its own last step.
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'gyre_trainer_last_step_timestamp_seconds{namespace="ml", run_id="down"}',
                        "values": "0 60+60x9 _x50",
                    },
                    {
                        "series": 'gyre_trainer_last_step_timestamp_seconds{namespace="ml", run_id="up"}',
                        "values": "0 60+60x59",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "40m",
                        "exp_samples": [
                            {"labels": '{run_id="down"}', "value": 40 * 60 - 600},
                            {"labels": '{run_id="up"}', "value": 0},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, f"{query}\n{result.stdout}{result.stderr}"
